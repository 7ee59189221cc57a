"""Device meshes: local, multi-host (hosts outermost) and TPU topology order."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from spmd._src.errors import ConfigurationError, message, received
from spmd._src.topologies import is_name
from spmd._src.validate import is_integer

__all__ = ["dividing_devices", "make_mesh", "order_devices", "prime_factors", "resolve_devices"]

_DEVICE_STRING = re.compile(
    r"^(?:/job:(?P<job>[a-z_]+))?(?:/replica:(?P<replica>\d+))?(?:/task:(?P<task>\d+))?"
    r"/?(?:device:)?(?P<kind>cpu|gpu|tpu):(?P<index>\d+)$",
    re.IGNORECASE,
)
_PLATFORMS = {"cpu": ("cpu",), "gpu": ("gpu", "cuda", "rocm"), "tpu": ("tpu",)}


def _resolve_shape(axes: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
    """Replaces a single -1 by what the device count implies, then checks the product."""
    sizes = list(axes.values())
    inferred = [i for i, s in enumerate(sizes) if s == -1]
    bad = [s for s in sizes if not is_integer(s) or (s < 1 and s != -1)]
    if bad or len(inferred) > 1:
        raise ConfigurationError(
            message(
                "Mesh axis sizes must be positive integers, with at most one -1 to infer.",
                received(axes=dict(axes)),
                'give each axis a size, e.g. {"data": -1, "model": 2}.',
            )
        )
    known = math.prod(s for s in sizes if s != -1)
    if inferred:
        if num_devices % known:
            raise ConfigurationError(
                message(
                    f"The known axis sizes (product {known}) must divide the device count "
                    f"({num_devices}) so that the -1 axis can be inferred.",
                    received(axes=dict(axes), num_devices=num_devices),
                    "pick axis sizes whose product divides the number of devices.",
                )
            )
        sizes[inferred[0]] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ConfigurationError(
            message(
                f"The mesh axis sizes must multiply to the number of devices ({num_devices}).",
                received(axes=dict(axes), product=math.prod(sizes), num_devices=num_devices),
                "use -1 for one axis to infer it, or pass `devices=` with that many devices.",
            )
        )
    return tuple(sizes)


def resolve_devices(devices: Sequence[Any]) -> list[Any]:
    """Devices given as `jax.Device`s, integer device ids or TF device strings, as `jax.Device`s.

    TF strings name a device of this process ("/gpu:0", "/cpu:1", "GPU:0") or of
    a task ("/job:worker/replica:0/task:1/device:GPU:0"): the index counts that
    process's devices of that kind, in id order.

    Raises:
      ConfigurationError: a device is none of those, names no device, or is repeated.
    """
    devices = [devices] if isinstance(devices, str) else list(devices)
    out = [_resolve_device(d) for d in devices]
    repeated = sorted({str(d) for d in out if out.count(d) > 1})
    if repeated:
        raise ConfigurationError(
            message(
                "Each device appears once in a strategy's device list.",
                received(devices=list(devices), repeated=repeated),
                "list every device once (e.g. jax.local_devices(), or ['/gpu:0', '/gpu:1']).",
            )
        )
    return out


def _resolve_device(device: Any) -> Any:
    if hasattr(device, "platform") and hasattr(device, "id"):
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        found = [d for d in jax.devices() if d.id == device]
        if found:
            return found[0]
    elif isinstance(device, str) and (match := _DEVICE_STRING.match(device.strip())):
        task = int(match["task"]) if match["task"] else jax.process_index()
        platforms = _PLATFORMS[match["kind"].lower()]
        kind = sorted(
            (d for d in jax.devices() if d.process_index == task and d.platform in platforms),
            key=lambda d: d.id,
        )
        if int(match["index"]) < len(kind):
            return kind[int(match["index"])]
    raise ConfigurationError(
        message(
            "A device is a jax.Device, an integer device id of jax.devices(), or a TF device "
            'string such as "/gpu:0" or "/job:worker/replica:0/task:1/device:GPU:0" naming '
            "an existing device.",
            received(device=device, available=[str(d) for d in jax.devices()][:16]),
            f"for the TPU slice {device!r}, pass its devices: spmd.topology({device!r}) (or "
            f"TPUStrategy(topology={device!r}))."
            if is_name(device)
            else "pick from jax.devices() (or jax.local_devices() for this process's), or "
            "pass devices=None for all of them.",
        )
    )


def order_devices(devices: Sequence[Any]) -> list[Any]:
    """Orders devices hosts outermost: by process index, then by device id.

    Collectives along the inner mesh axes then stay inside one host (ICI, NVLink),
    and only the outermost axis crosses hosts (DCN).
    """
    return sorted(devices, key=lambda d: (d.process_index, getattr(d, "slice_index", 0), d.id))


def dividing_devices(devices: Sequence[Any], global_batch_size: int) -> list[Any]:
    """The most of `devices` whose count divides `global_batch_size`, spread evenly over
    their processes (the first processes take one more where it does not divide), each
    process's lowest ids first, ordered hosts outermost.

    Every replica of a strategy over them gets the same whole rows of the global
    batch, nothing padded; the devices left out stay idle.

    Raises:
      ConfigurationError: the largest such count is smaller than the number of
        processes, so a process would hold no device of the mesh (in JAX's
        multi-controller model every process runs each step on its own devices).
    """
    by_process: dict[int, list[Any]] = {}
    for device in order_devices(devices):
        by_process.setdefault(device.process_index, []).append(device)
    count = max(n for n in range(1, len(devices) + 1) if global_batch_size % n == 0)
    processes = len(by_process)
    if count < processes:
        raise ConfigurationError(
            message(
                "A strategy over the most devices that divide the global batch gives every "
                "process at least one of them: each process runs every step on its own devices.",
                received(
                    global_batch_size=global_batch_size,
                    largest_dividing_count=count,
                    num_processes=processes,
                    num_devices=len(devices),
                ),
                f"use a global batch size with a divisor from {processes} to {len(devices)}, or "
                "leave the batch as it is and let spmd pad it (the Trainer does; a custom loop "
                'passes InputOptions(uneven_batch="pad")).',
            )
        )
    share, extra = divmod(count, processes)
    chosen = []
    for i, own in enumerate(by_process.values()):
        chosen += own[: share + (1 if i < extra else 0)]
    return chosen


def _check_one_kind(devices: Sequence[Any]) -> None:
    """TPU devices of a mesh are one generation: XLA compiles one program for one chip."""
    kinds = sorted({(d.platform, str(getattr(d, "device_kind", ""))) for d in devices})
    if len(kinds) > 1 and any(platform == "tpu" for platform, _ in kinds):
        raise ConfigurationError(
            message(
                "A mesh's devices are of one kind: XLA compiles one program, for one TPU "
                "generation.",
                received(device_kinds=[f"{p}: {k}" for p, k in kinds], num_devices=len(devices)),
                "use the devices of one topology (spmd.topology(...), several slices of it "
                "with slices=) or of one TPU job.",
            )
        )


def _is_tpu(devices: Sequence[Any]) -> bool:
    return bool(devices) and all(getattr(d, "platform", "") == "tpu" for d in devices)


def _tpu_device_array(shape: tuple[int, ...], devices: Sequence[Any]) -> np.ndarray:
    """Lays TPU devices out in physical order; several slices as a hybrid mesh, slices outermost."""
    slices: dict[int, list[Any]] = {}
    for device in devices:
        slices.setdefault(getattr(device, "slice_index", 0), []).append(device)
    granules = [slices[k] for k in sorted(slices)]
    dcn = _dcn_shape(shape, granules)
    ici = tuple(s // d for s, d in zip(shape, dcn, strict=True))
    if len(granules) == 1:
        return _slice_array(ici, granules[0])
    blocks = np.empty(dcn, dtype=object)
    for index, granule in zip(np.ndindex(*dcn), granules, strict=True):
        blocks[index] = _slice_array(ici, granule)
    return np.block(blocks.tolist())


def _dcn_shape(shape: tuple[int, ...], granules: list[list[Any]]) -> tuple[int, ...]:
    """How many slices each axis spans: the slices fill the outermost axes they divide."""
    sizes = sorted({len(g) for g in granules})
    if len(sizes) > 1:
        raise ConfigurationError(
            message(
                "A mesh over several TPU slices takes slices of equal size: its outermost "
                "axes span the slices (DCN), the rest stay inside one slice (ICI).",
                received(axes=shape, slices=len(granules), devices_per_slice=sizes),
                "pass every device of each slice (e.g. the whole spmd.topology(...)), or "
                "the devices of one slice.",
            )
        )
    dcn, left = [], len(granules)
    for size in shape:  # the product is the device count: the slices always fit
        dcn.append(math.gcd(size, left))
        left //= dcn[-1]
    return tuple(dcn)


def _slice_array(shape: tuple[int, ...], devices: Sequence[Any]) -> np.ndarray:
    """One slice's devices as an array of `shape`, the inner axes on the nearest chips.

    `mesh_utils` first (its ring orders for small slices; a physical axis split
    between logical axes where the sizes ask for it), then the torus mapped
    here for what it refuses (v4 per TensorCore, two devices a chip); devices that are
    no whole slice (a subset of it) keep their id order.
    """
    from jax.experimental import mesh_utils

    try:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (NotImplementedError, AssertionError, ValueError):
        grid = _torus(devices)
    if grid is None:
        return np.asarray(order_devices(devices), dtype=object).reshape(shape)
    return _on_torus(grid, shape)


def _torus(devices: Sequence[Any]) -> np.ndarray | None:
    """The devices at their (x, y, z, core) coordinates; None unless they fill a cuboid."""
    try:
        coords = np.array([(*d.coords, d.core_on_chip) for d in devices], dtype=np.int64)
    except (AttributeError, TypeError):
        return None
    coords -= coords.min(axis=0)
    grid = np.empty(tuple(coords.max(axis=0) + 1), dtype=object)
    if grid.size != len(devices):
        return None
    for device, at in zip(devices, coords, strict=True):
        grid[tuple(at)] = device
    return None if any(d is None for d in grid.flat) else grid


def _on_torus(grid: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Logical axes onto a torus: the innermost (busiest) axis onto the nearest devices.

    Every physical dimension is cut into its prime factors, the minor factor
    being the nearest neighbours. Each logical axis, innermost first, takes
    the nearest factors it needs: a chip's cores, then z, y, x, minor first.
    """
    factors = [(dim, p) for dim, size in enumerate(grid.shape) for p in prime_factors(size)]
    split = grid.reshape([p for _, p in factors] or [1])
    nearest = sorted(range(len(factors)), key=lambda j: (-factors[j][0], -j))
    taken: list[list[int]] = [[] for _ in shape]
    for axis in reversed(range(len(shape))):
        need = shape[axis]
        for j in nearest:
            if need > 1 and need % factors[j][1] == 0:
                taken[axis].append(j)
                need //= factors[j][1]
        nearest = [j for j in nearest if j not in taken[axis]]
    order = [j for axis in taken for j in sorted(axis)]
    return split.transpose(order).reshape(shape) if order else split.reshape(shape)


def make_mesh(
    axes: Mapping[str, int],
    devices: Sequence[Any] | None = None,
    *,
    axis_types: AxisType | Sequence[AxisType] = AxisType.Auto,
) -> Mesh:
    """Builds a named device mesh.

    Devices are placed hosts outermost (the first axis crosses hosts, the inner
    axes stay inside one). TPU devices follow the chips' physical topology for
    any axis sizes, the innermost axis on the nearest chips, and several TPU
    slices form a hybrid mesh whose outermost axes span the slices.

    Args:
      axes: axis name to size, outermost first; one size may be -1 to infer it.
      devices: the devices to use; all devices of every process by default.
      axis_types: `AxisType.Auto` by default, so model code needs no sharding
        annotations and XLA propagates shardings; one type or one per axis.

    Returns:
      A `jax.sharding.Mesh`.

    Raises:
      ConfigurationError: an axis name is not a string identifier, the axis
        sizes do not multiply to the device count, TPU slices of different
        sizes are given, or TPU devices of different kinds (generations).

    Example:
      >>> mesh = spmd.make_mesh({"data": -1, "model": 2})
    """
    if not axes:
        raise ConfigurationError(
            message(
                "A mesh needs at least one named axis.",
                received(axes=axes),
                'pass e.g. {"data": -1}.',
            )
        )
    names = [name for name in axes if not isinstance(name, str) or not name.isidentifier()]
    if names:
        raise ConfigurationError(
            message(
                "Mesh axes are named by strings (identifiers such as 'data'), mapped to sizes.",
                received(axes=dict(axes), bad_names=names),
                'name each axis, e.g. {"data": 8} rather than {1: 8}.',
            )
        )
    devices = jax.devices() if devices is None else resolve_devices(devices)
    shape = _resolve_shape(axes, len(devices))
    if isinstance(axis_types, AxisType):
        axis_types = (axis_types,) * len(shape)
    _check_one_kind(devices)
    if _is_tpu(devices):
        array = _tpu_device_array(shape, devices)
    else:
        array = np.asarray(order_devices(devices), dtype=object).reshape(shape)
    return Mesh(array, tuple(axes), axis_types=tuple(axis_types))


def prime_factors(n: int) -> list[int]:
    """The prime factors of `n`, largest first (8 -> [2, 2, 2], 12 -> [3, 2, 2])."""
    factors, p = [], 2
    while n > 1 and p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    if n > 1:
        factors.append(n)
    return sorted(factors, reverse=True)
