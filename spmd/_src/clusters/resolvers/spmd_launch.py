"""The cluster `spmd launch` describes to each process it starts (SPMD_* variables)."""

from __future__ import annotations

import os

from spmd._src.clusters.resolvers.base import group
from spmd._src.clusters.spec import (
    ENV_COORDINATOR_ADDRESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ClusterInfo,
)

__all__ = ["LaunchResolver"]


class LaunchResolver:
    """The environment `spmd launch` gives each process (SPMD_* variables)."""

    source = "spmd launch"
    names = (ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_COORDINATOR_ADDRESS)

    def is_present(self) -> bool:
        """Whether any of SPMD_NUM_PROCESSES, SPMD_PROCESS_ID, SPMD_COORDINATOR_ADDRESS is set."""
        return any(name in os.environ for name in self.names)

    def resolve(self) -> ClusterInfo:
        """Reads and checks the SPMD_* variables."""
        return group(*(os.environ.get(name) for name in self.names), self.names, self.source)
