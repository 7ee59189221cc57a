"""The named strategies of tf.distribute, each a small constructor of `Strategy`."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from spmd._src.clusters.initialize import check_initialized_under_launcher
from spmd._src.errors import ConfigurationError, message, received
from spmd._src.logical import LogicalRules
from spmd._src.mesh import (
    dividing_devices,
    make_mesh,
    order_devices,
    prime_factors,
    resolve_devices,
)
from spmd._src.rules import MinSizePartitioner, Partitioner
from spmd._src.strategy.base import Strategy, _default_strategy
from spmd._src.strategy.cluster_resolver import resolver_and_partitioner
from spmd._src.topologies import topology as spmd_topology
from spmd._src.validate import positive_int

__all__ = [
    "CentralStorageStrategy",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "TPUStrategy",
    "by_name",
    "constructor_name",
]

logger = logging.getLogger("spmd.strategy")
_IDLE = (
    "MultiWorkerMirroredStrategy(global_batch_size=%d) uses %d of the %d devices, the most "
    "whose count divides the batch (every replica gets whole rows, nothing padded); %d stay "
    "idle. To use them all, pass a global batch size that is a multiple of the device count, "
    "or global_batch_size=None and let spmd pad the batch (the Trainer does; a custom loop "
    'passes InputOptions(uneven_batch="pad")).'
)


class CommunicationImplementation(enum.Enum):
    """The all-reduce implementation, as tf.distribute names it.

    XLA picks the transport per platform: NCCL on GPU, ICI on TPU. On CPU
    `AUTO` and `RING` use gloo's ring all-reduce and `MPI` uses MPI; the choice
    is made by `spmd.initialize()` before JAX starts its backend.
    """

    AUTO = "auto"
    RING = "ring"
    NCCL = "nccl"
    MPI = "mpi"


@dataclass(frozen=True)
class CommunicationOptions:
    """Collective options of `MultiWorkerMirroredStrategy` (tf.distribute's fields).

    Attributes:
      implementation: which all-reduce to ask for. It is checked against what
        the platform and `spmd.initialize(cpu_collectives=...)` set up, since
        the choice is made before JAX starts, not by the strategy.
      timeout_seconds: accepted for compatibility. How long the job waits on a
        dead peer is `spmd.initialize(heartbeat_timeout=...)`.
      bytes_per_pack: accepted for compatibility; XLA combines collectives itself.
    """

    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    timeout_seconds: float | None = None
    bytes_per_pack: int = 0


def _local_devices(devices: Sequence[Any] | None) -> list[Any]:
    """The devices a strategy is given, as `jax.Device`s.

    One device (a `jax.Device`, an id or a TF string) is a list of one, and
    numpy integer ids are ids.
    """
    if devices is None:
        return order_devices(jax.local_devices())
    if _one_device(devices):
        devices = [devices]
    if not isinstance(devices, Iterable):
        raise ConfigurationError(
            message(
                "devices is a list of jax.Devices, integer ids or TF device strings.",
                received(devices=devices, type=type(devices).__name__),
                'pass e.g. devices=jax.local_devices()[:2], [0, 1] or ["/gpu:0", "/gpu:1"].',
            )
        )
    devices = [int(d) if isinstance(d, np.integer) else d for d in devices]
    if not devices:
        raise ConfigurationError(
            message(
                "A strategy needs at least one device.",
                received(devices=devices),
                "pass devices=None for all of this process's devices.",
            )
        )
    return resolve_devices(devices)


def _one_device(device: Any) -> bool:
    is_device = hasattr(device, "platform") and hasattr(device, "id")
    return is_device or isinstance(device, int | np.integer | str)


def MirroredStrategy(  # noqa: N802
    devices: Sequence[Any] | None = None, *, logical_axis_rules: LogicalRules = ()
) -> Strategy:
    """Synchronous data parallelism over this process's devices.

    The state is replicated on every device; each device takes a slice of the
    batch; gradients are all-reduced (XLA inserts it). Mesh axis: `replica`.

    Args:
      devices: the devices to use, as `jax.Device`s, integer ids or TF device
        strings ("/gpu:0", "/cpu:0"); all of this process's devices by default.
      logical_axis_rules: maps flax annotation names to mesh axes;
        names it leaves unmapped are replicated.
    """
    check_initialized_under_launcher()
    devices = _local_devices(devices)
    mesh = make_mesh({"replica": len(devices)}, devices)
    return _named(mesh, logical_axis_rules, batch_axes=("replica",), name="MirroredStrategy")


def MultiWorkerMirroredStrategy(  # noqa: N802
    communication_options: CommunicationOptions | None = None,
    *,
    logical_axis_rules: LogicalRules = (),
    topology: Sequence[Any] | None = None,
    global_batch_size: int | None = None,
) -> Strategy:
    """Synchronous data parallelism over every device of every process.

    Mesh axes `(host, replica)`: hosts outermost, so only the outer axis of the
    all-reduce crosses the network. Call `spmd.initialize()` first in every
    process.

    With `global_batch_size`, the mesh takes the most devices whose count
    divides it, spread evenly over the processes, so every replica gets the
    same whole rows and nothing is padded; the devices left out stay idle.
    E.g. a global batch of 6 on 2 processes of 2 devices: 3 replicas, 2 in
    process 0 and 1 in process 1. Where the processes then hold unequal
    numbers of replicas, the mesh is one `replica` axis, and input must be
    DATA-sharded (every process reads each global batch and keeps its rows).

    Args:
      communication_options: which all-reduce to use (see `CommunicationOptions`).
      logical_axis_rules: maps flax annotation names to mesh axes;
        names it leaves unmapped are replicated.
      topology: an `spmd.topology(...)`, or its name ("v5p-256"), to compile
        for instead of this job's devices: its hosts and their chips make the
        mesh (the strategy compiles and explains steps; it cannot run them).
      global_batch_size: use the most devices whose count divides it (an
        elastic job keeps its global batch, unpadded, at any process count);
        not with `topology`.

    Raises:
      ConfigurationError: processes have different device counts, NCCL is
        asked for on a platform without it, the largest count of devices
        that divides `global_batch_size` leaves a process without one, or
        both `topology` and `global_batch_size` are given.
    """
    check_initialized_under_launcher()
    options = communication_options or CommunicationOptions()
    if topology is not None:
        if global_batch_size is not None:
            raise ConfigurationError(
                message(
                    "A topology's strategy compiles for all its chips; global_batch_size "
                    "picks devices of this job to run on.",
                    received(topology=topology, global_batch_size=global_batch_size),
                    "pass one of them.",
                )
            )
        devices = resolve_devices(_topology(topology))
        hosts = len({d.process_index for d in devices})
        mesh = make_mesh({"host": hosts, "replica": len(devices) // hosts}, devices)
        return _named(
            mesh,
            logical_axis_rules,
            batch_axes=("host", "replica"),
            name="MultiWorkerMirroredStrategy",
        )
    platform = jax.devices()[0].platform
    if options.implementation == CommunicationImplementation.NCCL and platform != "gpu":
        raise ConfigurationError(
            message(
                "NCCL all-reduce needs GPUs.",
                received(implementation="NCCL", platform=platform),
                "use CommunicationImplementation.AUTO, which picks the platform's own.",
            )
        )
    _check_cpu_collectives(options.implementation, platform)
    hosts = jax.process_count()
    per_host = jax.local_device_count()
    if per_host * hosts != jax.device_count():
        raise ConfigurationError(
            message(
                "Every process must have the same number of devices.",
                received(device_count=jax.device_count(), process_count=hosts),
                "start every worker with the same devices per process.",
            )
        )
    if global_batch_size is None:
        mesh = make_mesh({"host": hosts, "replica": per_host})
    else:
        size = positive_int(global_batch_size, "global_batch_size", fix="pass e.g. 64, or None.")
        mesh = _dividing_mesh(size)
    return _named(
        mesh,
        logical_axis_rules,
        batch_axes=mesh.axis_names,
        name="MultiWorkerMirroredStrategy",
    )


def _topology(topology: Any) -> Any:
    """A `topology=` argument: a Cloud TPU name is `spmd.topology(name)`; a `Topology`
    (or a list of its devices) as it is.

    Raises:
      ConfigurationError: anything else (a number, a shape, a list of other things).
    """
    if isinstance(topology, str):
        return spmd_topology(topology)
    if isinstance(topology, Sequence) and topology and all(_is_device(d) for d in topology):
        return topology
    raise ConfigurationError(
        message(
            "topology is an spmd.topology(...) (the abstract devices of a TPU slice), its "
            'name ("v5p-8"), or a list of its devices.',
            received(topology=topology, type=type(topology).__name__),
            'pass topology=spmd.topology("v5p-8") (or "v5p-8"); for the devices you have, '
            "leave topology out.",
        )
    )


def _is_device(device: Any) -> bool:
    """A jax device, real or abstract (a topology's): what has an id and a platform."""
    return hasattr(device, "platform") and hasattr(device, "id")


def _dividing_mesh(global_batch_size: int) -> Any:
    """`(host, replica)` over the most devices that divide the batch, or one `replica`
    axis where the processes hold unequal numbers of them."""
    devices = dividing_devices(jax.devices(), global_batch_size)
    idle = jax.device_count() - len(devices)
    if idle and jax.process_index() == 0:
        logger.warning(_IDLE, global_batch_size, len(devices), jax.device_count(), idle)
    counts = {p: 0 for p in range(jax.process_count())}
    for device in devices:
        counts[device.process_index] += 1
    if len(set(counts.values())) == 1:
        return make_mesh({"host": len(counts), "replica": len(devices) // len(counts)}, devices)
    return make_mesh({"replica": len(devices)}, devices)


def _check_cpu_collectives(implementation: CommunicationImplementation, platform: str) -> None:
    """MPI (or gloo's RING) on CPU must be what initialize() configured."""
    if platform != "cpu" or jax.process_count() == 1:
        return
    configured = jax.config.jax_cpu_collectives_implementation
    wanted = {CommunicationImplementation.MPI: "mpi", CommunicationImplementation.RING: "gloo"}
    if implementation in wanted and configured != wanted[implementation]:
        raise ConfigurationError(
            message(
                f"{implementation.name} all-reduce on CPU needs the '{wanted[implementation]}' "
                "collectives, chosen when the cluster starts.",
                received(implementation=implementation.name, cpu_collectives=configured),
                f"call spmd.initialize(cpu_collectives='{wanted[implementation]}') first thing.",
            )
        )


def TPUStrategy(  # noqa: N802
    devices: Sequence[Any] | None = None,
    *,
    logical_axis_rules: LogicalRules = (),
    topology: Sequence[Any] | None = None,
) -> Strategy:
    """Synchronous data parallelism over TPU cores, laid out in topology order.

    Several slices form a hybrid mesh, slices on the outer `host` axis.

    Args:
      devices: TPU devices; every TPU device of every process by default.
      logical_axis_rules: maps flax annotation names to mesh axes;
        names it leaves unmapped are replicated.
      topology: an `spmd.topology("v5p-256")`, or its name "v5p-256", to
        compile for without a TPU: the strategy lays out its mesh, computes
        abstract states and compiles and explains steps, but cannot run them.

    Raises:
      ConfigurationError: there are no TPU devices, both devices and
        topology are given, or topology is neither a topology, its name nor
        a list of its devices.
    """
    check_initialized_under_launcher()
    if topology is not None and devices is not None:
        raise ConfigurationError(
            message(
                "TPUStrategy takes devices or a topology, not both.",
                received(devices=devices, topology=topology),
                "pass topology=spmd.topology(...) alone to compile for a slice you do not have.",
            )
        )
    devices = _topology(topology) if topology is not None else devices
    devices = jax.devices() if devices is None else resolve_devices(devices)
    platforms = sorted({getattr(d, "platform", "?") for d in devices})
    if platforms != ["tpu"]:
        raise ConfigurationError(
            message(
                "TPUStrategy needs TPU devices.",
                received(platforms=platforms),
                "run on a Cloud TPU VM, or use MirroredStrategy / MultiWorkerMirroredStrategy "
                "elsewhere (the same program otherwise).",
            )
        )
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    mesh = make_mesh({"host": slices, "replica": len(devices) // slices}, devices)
    return _named(mesh, logical_axis_rules, batch_axes=("host", "replica"), name="TPUStrategy")


def CentralStorageStrategy(  # noqa: N802
    compute_devices: Sequence[Any] | None = None,
    *,
    logical_axis_rules: LogicalRules = (),
) -> Strategy:
    """Data parallelism with the state kept in host memory between steps.

    The state lives in `pinned_host` memory; each step moves it to the devices,
    computes replicated over them with the batch split, and writes the update
    back to host memory. Device memory holds the state only during the step.

    Args:
      compute_devices: the devices that compute; this process's by default.
      logical_axis_rules: maps flax annotation names to mesh axes;
        names it leaves unmapped are replicated.
    """
    check_initialized_under_launcher()
    devices = _local_devices(compute_devices)
    mesh = make_mesh({"replica": len(devices)}, devices)
    return _named(
        mesh,
        logical_axis_rules,
        batch_axes=("replica",),
        placement="host",
        name="CentralStorageStrategy",
    )


def OneDeviceStrategy(  # noqa: N802
    device: Any | None = None, *, logical_axis_rules: LogicalRules = ()
) -> Strategy:
    """Everything on one device: the state, the batch and the step.

    Args:
      device: a `jax.Device`, an integer id or a TF device string ("/gpu:0");
        this process's first device by default.
      logical_axis_rules: maps flax annotation names to mesh axes;
        names it leaves unmapped are replicated.
    """
    check_initialized_under_launcher()
    device = jax.local_devices()[0] if device is None else resolve_devices([device])[0]
    mesh = make_mesh({"replica": 1}, [device])
    return _named(mesh, logical_axis_rules, batch_axes=("replica",), name="OneDeviceStrategy")


def ParameterServerStrategy(  # noqa: N802
    cluster_resolver: Any = None,
    variable_partitioner: Partitioner | None = None,
    devices: Sequence[Any] | None = None,
    *,
    logical_axis_rules: LogicalRules = (),
) -> Strategy:
    """Variables sharded over the replicas by a partitioner, trained synchronously.

    `devices` may be an `spmd.topology(...)`: the strategy then compiles and
    explains steps for that TPU slice without running them.

    tf.distribute's parameter servers hold shards of large variables; here the
    shards live on the workers' own devices (ZeRO-3 / FSDP) and XLA gathers a
    variable where a step uses it and reduce-scatters its gradient. Training is
    synchronous: there is no coordinator and no stale update.

    The devices form one mesh axis per prime factor of their count (8 devices:
    `ps0, ps1, ps2` of 2 each), all of them batch axes. A variable split into
    k shards uses the innermost axes whose sizes multiply to k; a count the
    mesh cannot make is rounded down (up for `MaxSizePartitioner`).

    Args:
      cluster_resolver: TF's first argument: None, or a resolver (e.g. TF's
        `TFConfigClusterResolver()`) describing the cluster `spmd.initialize()`
        joined (checked; a cluster with 'ps' tasks is an error: spmd runs none).
        A partitioner given here (spmd's positional spelling,
        `ParameterServerStrategy(FixedShardsPartitioner(4))`) is the partitioner.
      variable_partitioner: from `spmd.partitioners`, or any callable
        `(shape, dtype) -> shard count per axis` (tf.distribute's protocol;
        only the first axis may be split); None keeps every variable whole.
      devices: every device of every process by default.
      logical_axis_rules: maps flax annotation names to mesh axes;
        names it leaves unmapped are replicated. A leaf whose annotation
        shards nothing on this mesh is split by the partitioner.
    """
    check_initialized_under_launcher()
    variable_partitioner = resolver_and_partitioner(cluster_resolver, variable_partitioner)
    devices = order_devices(jax.devices() if devices is None else resolve_devices(devices))
    factors = prime_factors(len(devices)) or [1]
    mesh = make_mesh({f"ps{i}": f for i, f in enumerate(factors)}, devices)
    rules = [] if variable_partitioner is None else [(".*", _checked(variable_partitioner))]
    return _named(
        mesh,
        logical_axis_rules,
        rules=rules,
        batch_axes=tuple(mesh.axis_names),
        name="ParameterServerStrategy",
    )


def _named(mesh, logical_axis_rules: LogicalRules, **fields: Any) -> Strategy:
    """A named strategy: annotation names it does not map are replicated."""
    return Strategy(mesh, logical_axis_rules=logical_axis_rules, _replicate_unmapped=True, **fields)


@dataclass(frozen=True)
class _CheckedPartitioner:
    """A variable partitioner whose every answer is checked: one positive int per axis."""

    fn: Callable[[Sequence[int], Any], Sequence[int]]
    round_up: bool = False

    def __call__(self, shape: Sequence[int], dtype: Any) -> list[int]:
        counts = self.fn(tuple(shape), dtype)
        ok = (
            isinstance(counts, Sequence)
            and len(counts) == len(shape)
            and all(isinstance(c, int | np.integer) and c >= 1 for c in counts)
        )
        if ok and all(c == 1 for c in counts[1:]):
            return [int(c) for c in counts]
        raise ConfigurationError(
            message(
                "variable_partitioner(shape, dtype) returns one positive int per axis of the "
                "variable, the shard count, with only the first axis split (spmd shards a "
                "variable along its first axis).",
                received(variable_partitioner=self.fn, shape=tuple(shape), returned=counts),
                "return e.g. [num_shards] + [1] * (len(shape) - 1), or use a partitioner from "
                "spmd.partitioners (FixedShardsPartitioner, MinSizePartitioner, ...).",
            )
        )


def _checked(partitioner: Any) -> _CheckedPartitioner:
    if not callable(partitioner):
        raise ConfigurationError(
            message(
                "variable_partitioner is a callable (shape, dtype) -> shard count per axis.",
                received(variable_partitioner=partitioner),
                "pass e.g. spmd.partitioners.FixedShardsPartitioner(2), or None to replicate.",
            )
        )
    return _CheckedPartitioner(partitioner, bool(getattr(partitioner, "round_up", False)))


_BY_NAME: dict[str, Callable[[], Strategy]] = {
    "default": _default_strategy,
    "mirrored": MirroredStrategy,
    "multi_worker_mirrored": MultiWorkerMirroredStrategy,
    "tpu": TPUStrategy,
    "central_storage": CentralStorageStrategy,
    "one_device": OneDeviceStrategy,
    "parameter_server": lambda: ParameterServerStrategy(MinSizePartitioner()),
}


def by_name(name: str) -> Strategy:
    """Builds a named strategy with its defaults: "mirrored", "parameter_server", ...

    Raises:
      ConfigurationError: the name is unknown (the message lists the known ones).
    """
    key = _NAMES_BY_KEY.get(_key(name)) if isinstance(name, str) else None
    if key is None:
        raise ConfigurationError(
            message(
                f"A strategy name is one of {sorted(_BY_NAME)}.",
                received(name=name),
                "pick one of those names.",
            )
        )
    return _BY_NAME[key]()


def constructor_name(name: str) -> str | None:
    """The named strategy a name stands for, in any spelling ("mirrored",
    "OneDeviceStrategy", "one-device" -> "OneDeviceStrategy"); None where it names none."""
    return next((c.__name__ for c in _CONSTRUCTORS if _key(c.__name__) == _key(name)), None)


def _key(name: str) -> str:
    """A strategy's name in any spelling, reduced to compare: "One-Device_Strategy" ->
    "onedevice"."""
    return "".join(c for c in name.lower() if c.isalnum()).removesuffix("strategy")


_CONSTRUCTORS = (
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    TPUStrategy,
    CentralStorageStrategy,
    OneDeviceStrategy,
    ParameterServerStrategy,
)

_NAMES_BY_KEY = {_key(name): name for name in _BY_NAME}
NAMES: tuple[str, ...] = tuple(_BY_NAME)
