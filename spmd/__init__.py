"""spmd: pick a strategy (a device mesh plus sharding rules), keep your training code."""

from spmd import callbacks as callbacks
from spmd import partitioners as partitioners
from spmd.checkpoint import CheckpointManager as CheckpointManager
from spmd.cluster import ClusterInfo as ClusterInfo
from spmd.cluster import cluster as cluster
from spmd.cluster import initialize as initialize
from spmd.data import AutoShardPolicy as AutoShardPolicy
from spmd.data import DistributedDataset as DistributedDataset
from spmd.data import DistributedIterator as DistributedIterator
from spmd.data import FileDataset as FileDataset
from spmd.data import InputContext as InputContext
from spmd.data import InputOptions as InputOptions
from spmd.data import NumpyDataset as NumpyDataset
from spmd.data import grain_shard_options as grain_shard_options
from spmd.errors import BatchError as BatchError
from spmd.errors import CheckpointError as CheckpointError
from spmd.errors import ClusterError as ClusterError
from spmd.errors import ConfigurationError as ConfigurationError
from spmd.errors import ContextError as ContextError
from spmd.errors import InitializationError as InitializationError
from spmd.errors import LaunchError as LaunchError
from spmd.errors import ScopeError as ScopeError
from spmd.errors import SpmdError as SpmdError
from spmd.explain import Collective as Collective
from spmd.explain import Explanation as Explanation
from spmd.mesh import make_mesh as make_mesh
from spmd.preemption import Preempted as Preempted
from spmd.replica import PerReplica as PerReplica
from spmd.replica import ReduceOp as ReduceOp
from spmd.replica import ReplicaContext as ReplicaContext
from spmd.replica import compute_average_loss as compute_average_loss
from spmd.replica import get_replica_context as get_replica_context
from spmd.replica import scale_regularization_loss as scale_regularization_loss
from spmd.sources import PaddedBatch as PaddedBatch
from spmd.strategies import CentralStorageStrategy as CentralStorageStrategy
from spmd.strategies import CommunicationImplementation as CommunicationImplementation
from spmd.strategies import CommunicationOptions as CommunicationOptions
from spmd.strategies import MirroredStrategy as MirroredStrategy
from spmd.strategies import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from spmd.strategies import OneDeviceStrategy as OneDeviceStrategy
from spmd.strategies import ParameterServerStrategy as ParameterServerStrategy
from spmd.strategies import TPUStrategy as TPUStrategy
from spmd.strategy import Step as Step
from spmd.strategy import Strategy as Strategy
from spmd.strategy import get_strategy as get_strategy
from spmd.strategy import has_strategy as has_strategy
from spmd.strategy import in_cross_replica_context as in_cross_replica_context
from spmd.trainer import NonFiniteLossError as NonFiniteLossError
from spmd.trainer import Trainer as Trainer

__version__ = "0.1.0"

__all__ = [
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
    "grain_shard_options",
    "has_strategy",
    "in_cross_replica_context",
    "initialize",
    "make_mesh",
    "partitioners",
]
