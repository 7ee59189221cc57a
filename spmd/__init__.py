"""spmd: pick a strategy (a device mesh plus sharding rules), keep your training code.

The public names are imported when first used (PEP 562), so that `import spmd` and the
`spmd` command's `--help` do not import jax; `spmd.X` and `from spmd import X` work as usual.
As soon as jax is imported, by whoever (spmd's own modules, on any import path, or the
program, using jax or flax directly after `import spmd`), JAX's TPU backend is kept from
starting on a host with no TPU chip (spmd/_src/clusters/tpu_backend.py: libtpu's noise on
every CPU program): an import hook, removed once it has run, finishes jax's import with that.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

# fmt: off
if TYPE_CHECKING:  # generated from _WHERE by `python -m spmd._src.exports`; do not edit
    from spmd import callbacks as callbacks
    from spmd import logical as logical
    from spmd import losses as losses
    from spmd import partitioners as partitioners
    from spmd import testing as testing
    from spmd._src.attention import attention as attention
    from spmd._src.checkpoint.manager import CheckpointManager as CheckpointManager
    from spmd._src.checkpoint.preemption import Preempted as Preempted
    from spmd._src.clusters.initialize import cluster as cluster
    from spmd._src.clusters.initialize import initialize as initialize
    from spmd._src.clusters.launch import restart_count as restart_count
    from spmd._src.clusters.spec import ClusterInfo as ClusterInfo
    from spmd._src.data.grain_source import grain_shard_options as grain_shard_options
    from spmd._src.data.input_context import AutoShardPolicy as AutoShardPolicy
    from spmd._src.data.input_context import InputContext as InputContext
    from spmd._src.data.input_context import InputOptions as InputOptions
    from spmd._src.data.iterator import DistributedDataset as DistributedDataset
    from spmd._src.data.iterator import DistributedIterator as DistributedIterator
    from spmd._src.data.sources import FileDataset as FileDataset
    from spmd._src.data.sources import NumpyDataset as NumpyDataset
    from spmd._src.data.sources import PaddedBatch as PaddedBatch
    from spmd._src.errors import ArgumentTypeError as ArgumentTypeError
    from spmd._src.errors import BatchError as BatchError
    from spmd._src.errors import CheckpointError as CheckpointError
    from spmd._src.errors import ClusterError as ClusterError
    from spmd._src.errors import ConfigurationError as ConfigurationError
    from spmd._src.errors import ContextError as ContextError
    from spmd._src.errors import InitializationError as InitializationError
    from spmd._src.errors import LaunchError as LaunchError
    from spmd._src.errors import OutOfRangeError as OutOfRangeError
    from spmd._src.errors import ScopeError as ScopeError
    from spmd._src.errors import SpmdError as SpmdError
    from spmd._src.explain import Collective as Collective
    from spmd._src.explain import Explanation as Explanation
    from spmd._src.mesh import make_mesh as make_mesh
    from spmd._src.pipeline import PipelineSchedule as PipelineSchedule
    from spmd._src.pipeline import pipeline as pipeline
    from spmd._src.planning import Plan as Plan
    from spmd._src.planning import auto_strategy as auto_strategy
    from spmd._src.roofline import Roofline as Roofline
    from spmd._src.roofline import Traffic as Traffic
    from spmd._src.rules import LayoutConflictWarning as LayoutConflictWarning
    from spmd._src.rules import LeafLayout as LeafLayout
    from spmd._src.strategy.base import Strategy as Strategy
    from spmd._src.strategy.base import get_strategy as get_strategy
    from spmd._src.strategy.base import has_strategy as has_strategy
    from spmd._src.strategy.coordinator import ClusterCoordinator as ClusterCoordinator
    from spmd._src.strategy.coordinator import RemoteValue as RemoteValue
    from spmd._src.strategy.diloco import DiLoCo as DiLoCo
    from spmd._src.strategy.replica import PerReplica as PerReplica
    from spmd._src.strategy.replica import ReduceOp as ReduceOp
    from spmd._src.strategy.replica import ReplicaContext as ReplicaContext
    from spmd._src.strategy.replica import compute_average_loss as compute_average_loss
    from spmd._src.strategy.replica import get_replica_context as get_replica_context
    from spmd._src.strategy.replica import in_cross_replica_context as in_cross_replica_context
    from spmd._src.strategy.replica import scale_regularization_loss as scale_regularization_loss
    from spmd._src.strategy.step import Step as Step
    from spmd._src.strategy.strategies import CentralStorageStrategy as CentralStorageStrategy
    from spmd._src.strategy.strategies import (
        CommunicationImplementation as CommunicationImplementation,
    )
    from spmd._src.strategy.strategies import CommunicationOptions as CommunicationOptions
    from spmd._src.strategy.strategies import MirroredStrategy as MirroredStrategy
    from spmd._src.strategy.strategies import (
        MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
    )
    from spmd._src.strategy.strategies import OneDeviceStrategy as OneDeviceStrategy
    from spmd._src.strategy.strategies import ParameterServerStrategy as ParameterServerStrategy
    from spmd._src.strategy.strategies import TPUStrategy as TPUStrategy
    from spmd._src.topologies import Topology as Topology
    from spmd._src.topologies import topology as topology
    from spmd._src.trainer.sidecar import SidecarEvaluator as SidecarEvaluator
    from spmd._src.trainer.trainer import NonFiniteLossError as NonFiniteLossError
    from spmd._src.trainer.trainer import Trainer as Trainer
# fmt: on

__version__ = "0.1.0"


# The public API, one entry a name: the module `spmd.X` imports it from on first use (the
# module that defines it), or the name itself for a public submodule. `__all__` and the
# TYPE_CHECKING imports above come from it.
_WHERE = {
    "attention": "spmd._src.attention",
    "AutoShardPolicy": "spmd._src.data.input_context",
    "auto_strategy": "spmd._src.planning",
    "BatchError": "spmd._src.errors",
    "callbacks": "spmd.callbacks",
    "CentralStorageStrategy": "spmd._src.strategy.strategies",
    "ArgumentTypeError": "spmd._src.errors",
    "CheckpointError": "spmd._src.errors",
    "CheckpointManager": "spmd._src.checkpoint.manager",
    "cluster": "spmd._src.clusters.initialize",
    "ClusterCoordinator": "spmd._src.strategy.coordinator",
    "ClusterError": "spmd._src.errors",
    "ClusterInfo": "spmd._src.clusters.spec",
    "Collective": "spmd._src.explain",
    "CommunicationImplementation": "spmd._src.strategy.strategies",
    "CommunicationOptions": "spmd._src.strategy.strategies",
    "compute_average_loss": "spmd._src.strategy.replica",
    "ConfigurationError": "spmd._src.errors",
    "ContextError": "spmd._src.errors",
    "DiLoCo": "spmd._src.strategy.diloco",
    "DistributedDataset": "spmd._src.data.iterator",
    "DistributedIterator": "spmd._src.data.iterator",
    "Explanation": "spmd._src.explain",
    "FileDataset": "spmd._src.data.sources",
    "get_replica_context": "spmd._src.strategy.replica",
    "get_strategy": "spmd._src.strategy.base",
    "grain_shard_options": "spmd._src.data.grain_source",
    "has_strategy": "spmd._src.strategy.base",
    "in_cross_replica_context": "spmd._src.strategy.replica",
    "InitializationError": "spmd._src.errors",
    "initialize": "spmd._src.clusters.initialize",
    "InputContext": "spmd._src.data.input_context",
    "InputOptions": "spmd._src.data.input_context",
    "LaunchError": "spmd._src.errors",
    "LayoutConflictWarning": "spmd._src.rules",
    "LeafLayout": "spmd._src.rules",
    "logical": "spmd.logical",
    "losses": "spmd.losses",
    "make_mesh": "spmd._src.mesh",
    "MirroredStrategy": "spmd._src.strategy.strategies",
    "MultiWorkerMirroredStrategy": "spmd._src.strategy.strategies",
    "NonFiniteLossError": "spmd._src.trainer.trainer",
    "NumpyDataset": "spmd._src.data.sources",
    "OneDeviceStrategy": "spmd._src.strategy.strategies",
    "OutOfRangeError": "spmd._src.errors",
    "PaddedBatch": "spmd._src.data.sources",
    "ParameterServerStrategy": "spmd._src.strategy.strategies",
    "partitioners": "spmd.partitioners",
    "PerReplica": "spmd._src.strategy.replica",
    "pipeline": "spmd._src.pipeline",
    "PipelineSchedule": "spmd._src.pipeline",
    "Plan": "spmd._src.planning",
    "Preempted": "spmd._src.checkpoint.preemption",
    "ReduceOp": "spmd._src.strategy.replica",
    "RemoteValue": "spmd._src.strategy.coordinator",
    "ReplicaContext": "spmd._src.strategy.replica",
    "restart_count": "spmd._src.clusters.launch",
    "Roofline": "spmd._src.roofline",
    "scale_regularization_loss": "spmd._src.strategy.replica",
    "ScopeError": "spmd._src.errors",
    "SidecarEvaluator": "spmd._src.trainer.sidecar",
    "SpmdError": "spmd._src.errors",
    "Step": "spmd._src.strategy.step",
    "Strategy": "spmd._src.strategy.base",
    "testing": "spmd.testing",
    "TPUStrategy": "spmd._src.strategy.strategies",
    "topology": "spmd._src.topologies",
    "Topology": "spmd._src.topologies",
    "Trainer": "spmd._src.trainer.trainer",
    "Traffic": "spmd._src.roofline",
}


__all__ = sorted(_WHERE)


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
        from spmd._src.clusters.tpu_backend import skip_without_chips

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
