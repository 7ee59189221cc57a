"""spmd: pick a strategy (a device mesh plus sharding rules), keep your training code.

The public names are imported when first used (PEP 562), so that `import spmd` and the
`spmd` command's `--help` do not import jax; `spmd.X` and `from spmd import X` work as usual.
As soon as jax is imported, by whoever (spmd's own modules on any import path:
`import spmd.checkpoint`, `from spmd.trainer.trainer import Trainer`; or the program, using
jax or flax directly after `import spmd`), JAX's TPU backend is kept from starting on a host
with no TPU chip (spmd/clusters/tpu_backend.py: libtpu's noise on every CPU program): an
import hook, removed once it has run, finishes jax's import with that.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spmd import callbacks as callbacks
    from spmd import losses as losses
    from spmd import partitioners as partitioners
    from spmd.checkpoint.manager import CheckpointManager as CheckpointManager
    from spmd.checkpoint.preemption import Preempted as Preempted
    from spmd.clusters.initialize import cluster as cluster
    from spmd.clusters.initialize import initialize as initialize
    from spmd.clusters.spec import ClusterInfo as ClusterInfo
    from spmd.data.grain_source import grain_shard_options as grain_shard_options
    from spmd.data.input_context import AutoShardPolicy as AutoShardPolicy
    from spmd.data.input_context import InputContext as InputContext
    from spmd.data.input_context import InputOptions as InputOptions
    from spmd.data.iterator import DistributedDataset as DistributedDataset
    from spmd.data.iterator import DistributedIterator as DistributedIterator
    from spmd.data.sources import FileDataset as FileDataset
    from spmd.data.sources import NumpyDataset as NumpyDataset
    from spmd.data.sources import PaddedBatch as PaddedBatch
    from spmd.errors import ArgumentTypeError as ArgumentTypeError
    from spmd.errors import BatchError as BatchError
    from spmd.errors import CheckpointError as CheckpointError
    from spmd.errors import ClusterError as ClusterError
    from spmd.errors import ConfigurationError as ConfigurationError
    from spmd.errors import ContextError as ContextError
    from spmd.errors import InitializationError as InitializationError
    from spmd.errors import LaunchError as LaunchError
    from spmd.errors import OutOfRangeError as OutOfRangeError
    from spmd.errors import ScopeError as ScopeError
    from spmd.errors import SpmdError as SpmdError
    from spmd.explain import Collective as Collective
    from spmd.explain import Explanation as Explanation
    from spmd.mesh import make_mesh as make_mesh
    from spmd.planning import auto_strategy as auto_strategy
    from spmd.strategy.base import Strategy as Strategy
    from spmd.strategy.base import get_strategy as get_strategy
    from spmd.strategy.base import has_strategy as has_strategy
    from spmd.strategy.coordinator import ClusterCoordinator as ClusterCoordinator
    from spmd.strategy.coordinator import RemoteValue as RemoteValue
    from spmd.strategy.diloco import DiLoCo as DiLoCo
    from spmd.strategy.replica import PerReplica as PerReplica
    from spmd.strategy.replica import ReduceOp as ReduceOp
    from spmd.strategy.replica import ReplicaContext as ReplicaContext
    from spmd.strategy.replica import compute_average_loss as compute_average_loss
    from spmd.strategy.replica import get_replica_context as get_replica_context
    from spmd.strategy.replica import in_cross_replica_context as in_cross_replica_context
    from spmd.strategy.replica import scale_regularization_loss as scale_regularization_loss
    from spmd.strategy.step import Step as Step
    from spmd.strategy.strategies import CentralStorageStrategy as CentralStorageStrategy
    from spmd.strategy.strategies import CommunicationImplementation as CommunicationImplementation
    from spmd.strategy.strategies import CommunicationOptions as CommunicationOptions
    from spmd.strategy.strategies import MirroredStrategy as MirroredStrategy
    from spmd.strategy.strategies import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
    from spmd.strategy.strategies import OneDeviceStrategy as OneDeviceStrategy
    from spmd.strategy.strategies import ParameterServerStrategy as ParameterServerStrategy
    from spmd.strategy.strategies import TPUStrategy as TPUStrategy
    from spmd.topologies import Topology as Topology
    from spmd.topologies import topology as topology
    from spmd.trainer.sidecar import SidecarEvaluator as SidecarEvaluator
    from spmd.trainer.trainer import NonFiniteLossError as NonFiniteLossError
    from spmd.trainer.trainer import Trainer as Trainer

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "AutoShardPolicy",
    "BatchError",
    "CentralStorageStrategy",
    "CheckpointError",
    "CheckpointManager",
    "ClusterCoordinator",
    "ClusterError",
    "ClusterInfo",
    "Collective",
    "CommunicationImplementation",
    "CommunicationOptions",
    "ConfigurationError",
    "ContextError",
    "DiLoCo",
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
    "OutOfRangeError",
    "PaddedBatch",
    "ParameterServerStrategy",
    "PerReplica",
    "Preempted",
    "ReduceOp",
    "RemoteValue",
    "ReplicaContext",
    "ScopeError",
    "SidecarEvaluator",
    "SpmdError",
    "Step",
    "Strategy",
    "TPUStrategy",
    "Topology",
    "Trainer",
    "auto_strategy",
    "callbacks",
    "cluster",
    "compute_average_loss",
    "get_replica_context",
    "get_strategy",
    "grain_shard_options",
    "has_strategy",
    "in_cross_replica_context",
    "initialize",
    "losses",
    "make_mesh",
    "partitioners",
    "scale_regularization_loss",
    "topology",
]

# Where each public name lives: the module `spmd.X` imports on first use.
_WHERE = {
    "AutoShardPolicy": "spmd.data.input_context",
    "auto_strategy": "spmd.planning",
    "BatchError": "spmd.errors",
    "callbacks": "spmd.callbacks",
    "CentralStorageStrategy": "spmd.strategy.strategies",
    "ArgumentTypeError": "spmd.errors",
    "CheckpointError": "spmd.errors",
    "CheckpointManager": "spmd.checkpoint.manager",
    "cluster": "spmd.clusters.initialize",
    "ClusterCoordinator": "spmd.strategy.coordinator",
    "ClusterError": "spmd.errors",
    "ClusterInfo": "spmd.clusters.spec",
    "Collective": "spmd.explain",
    "CommunicationImplementation": "spmd.strategy.strategies",
    "CommunicationOptions": "spmd.strategy.strategies",
    "compute_average_loss": "spmd.strategy.replica",
    "ConfigurationError": "spmd.errors",
    "ContextError": "spmd.errors",
    "OutOfRangeError": "spmd.errors",
    "DiLoCo": "spmd.strategy.diloco",
    "DistributedDataset": "spmd.data.iterator",
    "DistributedIterator": "spmd.data.iterator",
    "Explanation": "spmd.explain",
    "FileDataset": "spmd.data.sources",
    "get_replica_context": "spmd.strategy.replica",
    "get_strategy": "spmd.strategy.base",
    "grain_shard_options": "spmd.data.grain_source",
    "has_strategy": "spmd.strategy.base",
    "in_cross_replica_context": "spmd.strategy.replica",
    "InitializationError": "spmd.errors",
    "initialize": "spmd.clusters.initialize",
    "InputContext": "spmd.data.input_context",
    "InputOptions": "spmd.data.input_context",
    "LaunchError": "spmd.errors",
    "losses": "spmd.losses",
    "make_mesh": "spmd.mesh",
    "MirroredStrategy": "spmd.strategy.strategies",
    "MultiWorkerMirroredStrategy": "spmd.strategy.strategies",
    "NonFiniteLossError": "spmd.trainer.trainer",
    "NumpyDataset": "spmd.data.sources",
    "OneDeviceStrategy": "spmd.strategy.strategies",
    "PaddedBatch": "spmd.data.sources",
    "ParameterServerStrategy": "spmd.strategy.strategies",
    "partitioners": "spmd.partitioners",
    "PerReplica": "spmd.strategy.replica",
    "Preempted": "spmd.checkpoint.preemption",
    "ReduceOp": "spmd.strategy.replica",
    "RemoteValue": "spmd.strategy.coordinator",
    "ReplicaContext": "spmd.strategy.replica",
    "scale_regularization_loss": "spmd.strategy.replica",
    "ScopeError": "spmd.errors",
    "SidecarEvaluator": "spmd.trainer.sidecar",
    "SpmdError": "spmd.errors",
    "Step": "spmd.strategy.step",
    "Strategy": "spmd.strategy.base",
    "TPUStrategy": "spmd.strategy.strategies",
    "topology": "spmd.topologies",
    "Topology": "spmd.topologies",
    "Trainer": "spmd.trainer.trainer",
}


def __getattr__(name: str) -> Any:
    """Imports a public name on first use and keeps it (PEP 562)."""
    module = _WHERE.get(name)
    if module is None:
        dotted = not name.isidentifier()  # getattr(spmd, "x.y"): no attribute, not an import
        if name.startswith("_") or dotted or importlib.util.find_spec(f"spmd.{name}") is None:
            raise AttributeError(f"module 'spmd' has no attribute {name!r}")
        module = f"spmd.{name}"  # a submodule, imported on first use as it always was
    if module == f"spmd.{name}":  # a public module: spmd.callbacks, spmd.partitioners
        value = importlib.import_module(module)
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    _no_tpu_backend_without_chips()
    return value


def _no_tpu_backend_without_chips() -> None:
    """Once jax is imported: JAX's TPU backend does not start where no TPU chip is."""
    if "jax" in sys.modules:
        from spmd.clusters.tpu_backend import skip_without_chips

        skip_without_chips()


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


class _AfterJax(importlib.abc.MetaPathFinder):
    """Finds jax as the other finders do, and has its import end with
    `_no_tpu_backend_without_chips()`; then leaves `sys.meta_path`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "jax":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec("jax")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenNoTpuBackend(spec.loader)
        return spec


class _ThenNoTpuBackend(importlib.abc.Loader):
    """jax's own loader, then the TPU backend's guard; the module keeps jax's loader."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _no_tpu_backend_without_chips()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


if "jax" in sys.modules:
    _no_tpu_backend_without_chips()  # jax imported before spmd
elif not any(isinstance(f, _AfterJax) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterJax())
