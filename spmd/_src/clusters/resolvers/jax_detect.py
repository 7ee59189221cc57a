"""The cluster JAX's own detection finds: Slurm, Open MPI, Kubernetes (jax[k8s]), Cloud TPU."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from spmd._src.clusters.spec import ClusterInfo, worker_info
from spmd._src.errors import ClusterError, message, received

__all__ = ["JaxResolver", "detected_join"]


class JaxResolver:
    """JAX's own cluster detection: Slurm, Open MPI, Kubernetes, Cloud TPU.

    `initialize()` then calls `jax.distributed.initialize()` without arguments and
    lets JAX pick the coordinator address.
    """

    def __init__(self) -> None:
        self._env: Any = None

    @property
    def source(self) -> str:
        """The detected environment's JAX name, e.g. "slurm"."""
        return (self._env.name or self._env.__name__) if self._env else "jax auto"

    def is_present(self) -> bool:
        """Whether one of JAX's (non opt-in) cluster environments is present."""
        try:
            from jax._src import clusters  # private: guarded, JAX may move it
        except ImportError:
            return False
        envs = getattr(clusters.ClusterEnv, "_cluster_types", [])
        present = (e for e in envs if not getattr(e, "opt_in_only_method", False))
        self._env = next((e for e in present if e.is_env_present()), None)
        return self._env is not None

    def resolve(self) -> ClusterInfo:
        """Asks the detected environment for the process count and index."""
        try:
            count, index = self._env.get_process_count(), self._env.get_process_id()
        except (KeyError, ValueError, RuntimeError) as e:
            raise ClusterError(
                message(
                    f"JAX detected a {self.source} cluster but could not read its process "
                    "count and index.",
                    received(error=str(e)),
                    "pass num_processes, process_id and coordinator_address to "
                    "spmd.initialize() instead.",
                )
            ) from e
        return worker_info(index, count, None, self.source)


def detected_join(count: int, index: int, timeout: int) -> tuple[str, list[int] | None] | None:
    """What `jax.distributed.initialize()` with no arguments would join with: the
    coordinator's "host:port" and this process's local device ids (None: all of them).

    JAX's own detection (`auto_detect_unset_distributed_params`, with the
    JAX_COORDINATOR_ADDRESS, JAX_COORDINATOR_PORT and JAX_LOCAL_DEVICE_IDS it
    reads), asked once before the join so that spmd can hold its roll call at
    that address; None where JAX finds no address here (it then fails the join
    itself, with its own error).

    Args:
      count: the process count the resolver read.
      index: this process's index.
      timeout: seconds an environment may take to find the address (Cloud TPU's
        metadata server).
    """
    try:
        from jax._src import clusters  # private: guarded, JAX may move it
    except ImportError:
        return None
    ids = os.environ.get("JAX_LOCAL_DEVICE_IDS")
    local = [int(i) for i in ids.split(",")] if ids else None
    with contextlib.suppress(Exception):
        address, _, _, local = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            os.environ.get("JAX_COORDINATOR_ADDRESS"), count, index, local, None, timeout
        )
        if isinstance(address, str) and address.rpartition(":")[2].isdigit():
            return address, None if local is None else list(local)
    return None
