"""No cluster described anywhere: this process alone."""

from __future__ import annotations

from spmd._src.clusters.spec import ClusterInfo, worker_info

__all__ = ["SingleProcessResolver"]


class SingleProcessResolver:
    """No cluster anywhere: this process alone."""

    source = "single process"

    def is_present(self) -> bool:
        """Always: the last resort."""
        return True

    def resolve(self) -> ClusterInfo:
        """Process 0 of 1."""
        return worker_info(0, 1, None, self.source)
