"""The cluster `initialize(coordinator_address, num_processes, process_id)` describes."""

from __future__ import annotations

import dataclasses

from spmd._src.clusters.resolvers.base import group
from spmd._src.clusters.spec import ClusterInfo

__all__ = ["ExplicitResolver"]


@dataclasses.dataclass(frozen=True)
class ExplicitResolver:
    """The arguments of `initialize(coordinator_address, num_processes, process_id)`."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    source: str = "explicit"

    def is_present(self) -> bool:
        """Whether any of the three arguments was given."""
        values = (self.coordinator_address, self.num_processes, self.process_id)
        return any(v is not None for v in values)

    def resolve(self) -> ClusterInfo:
        """Checks the arguments together."""
        values = (self.num_processes, self.process_id, self.coordinator_address)
        names = ("num_processes", "process_id", "coordinator_address")
        return group(*values, names, self.source)
