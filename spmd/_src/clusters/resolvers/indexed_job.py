"""A Kubernetes Indexed Job pod nothing else describes: an error, not a job of one."""

from __future__ import annotations

import os

from spmd._src.clusters.spec import (
    ENV_COORDINATOR_ADDRESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ClusterInfo,
)
from spmd._src.errors import ClusterError, message, received

__all__ = ["IndexedJobResolver"]


class IndexedJobResolver:
    """A Kubernetes Indexed Job pod that no other resolver described: an error.

    Each pod would otherwise train alone as process 0 of 1, every one a chief:
    as many independent jobs as pods, silently. JAX's Kubernetes detection
    needs `jax[k8s]`; without it the pod must say how many processes there are.
    """

    source = "Kubernetes Indexed Job"
    names = ("JOB_COMPLETION_INDEX", "KUBERNETES_SERVICE_HOST")

    def is_present(self) -> bool:
        """Whether JOB_COMPLETION_INDEX, which Indexed Job pods get, is set."""
        return self.names[0] in os.environ

    def resolve(self) -> ClusterInfo:
        """Raises ClusterError naming the variables that would join the pods."""
        got = {name: os.environ.get(name) for name in self.names}
        raise ClusterError(
            message(
                "this is a pod of a Kubernetes Indexed Job, but nothing says how many "
                "processes the job has, so each pod would train alone as its chief.",
                received(**got),
                f"set {ENV_COORDINATOR_ADDRESS}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} in "
                "the pod template (docs/multihost.md, Kubernetes), or install jax[k8s] for "
                f"JAX's detection; for pods that train alone, set {ENV_NUM_PROCESSES}=1.",
            )
        )
