"""What every cluster resolver is (`Resolver`), and the check of a (count, index,
coordinator) triple that several of them read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from spmd._src.clusters.spec import ClusterInfo, check_address, check_int, worker_info
from spmd._src.errors import ClusterError, message, received

__all__ = ["Resolver", "group"]


class Resolver(Protocol):
    """One place a cluster description can come from (STYLE guideline 10).

    `resolve()` tries the resolvers in a fixed order; the first present one answers.
    """

    @property
    def source(self) -> str:
        """The name ClusterInfo.source reports, e.g. "TF_CONFIG"."""
        ...

    def is_present(self) -> bool:
        """Whether this environment describes the cluster."""
        ...

    def resolve(self) -> ClusterInfo:
        """Reads the description; raises ClusterError naming a malformed field."""
        ...


def group(
    count: Any, index: Any, coordinator: Any, names: Sequence[str], source: str
) -> ClusterInfo:
    """Checks (count, index, coordinator) given under `names` and builds the worker's info."""
    n_name, i_name, c_name = names
    fix = f"give {n_name} and {i_name} (and {c_name} with several processes), or none of them."
    count = check_int(count, n_name, 1, None, fix)
    index = 0 if index is None and count == 1 else index
    index = check_int(index, i_name, 0, count, f"number the processes 0 .. {count - 1}.")
    if coordinator is None and count > 1:
        raise ClusterError(
            message(
                f"{c_name} is needed with several processes: process 0 hosts the coordinator.",
                received(**{c_name: None, n_name: count}),
                f'set {c_name} to process 0\'s "host:port", e.g. "10.0.0.1:1234".',
            )
        )
    if coordinator is not None:
        coordinator = check_address(coordinator, c_name)
    return worker_info(index, count, coordinator if count > 1 else None, source)
