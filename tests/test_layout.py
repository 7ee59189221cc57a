"""The package layout: the public names `import spmd` gives stay exactly these."""

import importlib

import spmd

PUBLIC = [
    "AutoShardPolicy",
    "BatchError",
    "CentralStorageStrategy",
    "CheckpointError",
    "CheckpointManager",
    "ClusterError",
    "ClusterInfo",
    "Collective",
    "CommunicationImplementation",
    "CommunicationOptions",
    "ConfigurationError",
    "ContextError",
    "DistributedDataset",
    "DistributedIterator",
    "Explanation",
    "FileDataset",
    "InitializationError",
    "InputContext",
    "InputOptions",
    "LaunchError",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NonFiniteLossError",
    "NumpyDataset",
    "OneDeviceStrategy",
    "PaddedBatch",
    "ParameterServerStrategy",
    "PerReplica",
    "Preempted",
    "ReduceOp",
    "ReplicaContext",
    "ScopeError",
    "SpmdError",
    "Step",
    "Strategy",
    "TPUStrategy",
    "Trainer",
    "callbacks",
    "cluster",
    "compute_average_loss",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "initialize",
    "make_mesh",
    "partitioners",
]


def test_the_public_names_are_pinned():
    assert spmd.__all__ == PUBLIC
    missing = [name for name in PUBLIC if getattr(spmd, name, None) is None]
    assert not missing, missing


def test_the_public_modules_keep_their_names():
    """The modules the docs name: `spmd.callbacks`, `spmd.losses`, `spmd.partitioners`, ..."""
    assert spmd.callbacks.BackupAndRestore.__module__ == "spmd.trainer.callbacks"
    assert importlib.import_module("spmd.losses").Metric.__name__ == "Metric"
    assert spmd.partitioners.MinSizePartitioner.__name__ == "MinSizePartitioner"
    assert importlib.import_module("spmd.errors").ConfigurationError is spmd.ConfigurationError
    assert callable(importlib.import_module("spmd.testing").run_processes)
    assert importlib.import_module("spmd.data").PaddedBatch is spmd.PaddedBatch
    assert importlib.import_module("spmd.rules").LeafLayout.__name__ == "LeafLayout"


def test_cluster_is_the_function_not_the_package():
    """The cluster family is `spmd.clusters`, so `spmd.cluster` stays the public function."""
    importlib.import_module("spmd.clusters.initialize")
    assert callable(spmd.cluster) and spmd.cluster.__module__ == "spmd.clusters.initialize"
