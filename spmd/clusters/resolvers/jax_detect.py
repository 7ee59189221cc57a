"""The cluster JAX's own detection finds: Slurm, Open MPI, Kubernetes (jax[k8s]), Cloud TPU."""

from __future__ import annotations

from typing import Any

from spmd.clusters.spec import ClusterInfo, worker_info
from spmd.errors import ClusterError, message, received

__all__ = ["JaxResolver"]


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
