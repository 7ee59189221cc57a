"""TF's `cluster_resolver` argument of ParameterServerStrategy, read against spmd's cluster."""

from __future__ import annotations

import json
from typing import Any

from spmd._src.clusters.initialize import cluster
from spmd._src.clusters.spec import parse_tf_config
from spmd._src.errors import ConfigurationError, message, received

__all__ = ["resolver_and_partitioner"]


def resolver_and_partitioner(cluster_resolver: Any, variable_partitioner: Any) -> Any:
    """The variable partitioner of `ParameterServerStrategy(cluster_resolver, variable_partitioner)`.

    TF's first argument is a cluster resolver; spmd's cluster is the one
    `spmd.initialize()` joined, so a resolver is accepted where it describes
    that cluster (its spec parsed as TF_CONFIG is, with the same process count
    and this process's index) and None always. A partitioner given first (spmd's
    positional spelling, `ParameterServerStrategy(FixedShardsPartitioner(4))`)
    is the partitioner.

    Raises:
      ClusterError: a resolver whose cluster lists 'ps' tasks (spmd runs none) or
        is malformed (as TF_CONFIG would be).
      ConfigurationError: a resolver of another cluster than the one joined; two
        partitioners; a first argument that is neither.
    """
    if cluster_resolver is None:
        return variable_partitioner
    if not callable(getattr(cluster_resolver, "cluster_spec", None)):
        if variable_partitioner is None and callable(cluster_resolver):
            return cluster_resolver
        raise ConfigurationError(
            message(
                "ParameterServerStrategy's first argument is TF's cluster_resolver (an object "
                "with cluster_spec(), or None) or, in spmd's spelling, the variable "
                "partitioner; not both partitioners.",
                received(
                    cluster_resolver=cluster_resolver, variable_partitioner=variable_partitioner
                ),
                "pass ParameterServerStrategy(variable_partitioner=...) alone.",
            )
        )
    _check_same_cluster(cluster_resolver)
    return variable_partitioner


def _check_same_cluster(resolver: Any) -> None:
    """Raises unless `resolver` describes the cluster `spmd.initialize()` joined."""
    config = {
        "cluster": resolver.cluster_spec().as_dict(),
        "task": {
            "type": getattr(resolver, "task_type", None) or "worker",
            "index": getattr(resolver, "task_id", None) or 0,
        },
    }
    described, joined = parse_tf_config(json.dumps(config)), cluster()
    if (described.process_count, described.process_index) == (
        joined.process_count,
        joined.process_index,
    ):
        return
    raise ConfigurationError(
        message(
            "ParameterServerStrategy trains on the cluster spmd.initialize() joined (from "
            "explicit arguments, TF_CONFIG, spmd launch, or Slurm / Kubernetes / Cloud TPU); a "
            "cluster_resolver passed as in TF must describe that cluster: every process a "
            "chief or worker task, running the same program.",
            received(
                resolver_processes=described.process_count,
                resolver_process_index=described.process_index,
                joined_processes=joined.process_count,
                joined_process_index=joined.process_index,
            ),
            "call spmd.initialize() first (it reads TF_CONFIG, as TFConfigClusterResolver "
            "does) and pass ParameterServerStrategy(variable_partitioner=...) without a "
            "resolver, or one that describes the same job.",
        )
    )
