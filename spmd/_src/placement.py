"""Moving batches and states to where a program takes them, with the one cache of those moves."""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = [
    "CACHE",
    "Cache",
    "batch_sharding",
    "conform",
    "conform_all",
    "from_host",
    "in_device_memory",
    "on_device",
    "placed",
    "put_batch",
    "put_host",
    "put_leaf",
    "put_rows",
    "to_memory",
]

try:  # private: guarded, JAX may move them; jax.device_put is the fallback
    from jax._src import core as _core
    from jax._src import dtypes as _dtypes
    from jax._src.lib import xla_client as _xc

    _batched_device_put = _xc.batched_device_put
    _canonical = _dtypes.canonicalize_dtype
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX version
    _batched_device_put = None

_SHARDING = operator.attrgetter("sharding")
_NO_PLAN = None  # a signature whose leaves jax.device_put places (not all plain numpy)


class Cache:
    """The shardings and transfer plans of every batch and state move, each table bounded.

    `shardings`: (mesh, batch axes, whether the leaf has the batch axis, axis) ->
    the one `NamedSharding` object; placed batches carry it and the step's fast
    path recognises it by identity. `plans`: (sharding, shape, dtype) -> the
    abstract value, devices and shard indices of one leaf's batched transfer.
    `batches`: (mesh, batch axes, axis, each leaf's shape and dtype) -> the
    plans of a whole batch, so that a steady input pipeline pays one lookup a
    batch. A full table drops its oldest entry.
    """

    def __init__(self, size: int = 1024):
        self.size = size
        self.shardings: dict[tuple, NamedSharding] = {}
        self.plans: dict[tuple, tuple] = {}
        self.batches: dict[tuple, list | None] = {}
        self._lock = threading.Lock()

    def add(self, table: dict, key: Any, value: Any) -> Any:
        """Stores `value` under `key` in `table`, dropping the oldest entry when full.

        Under a lock: the prefetch thread places batches while the main thread
        compiles a step. Lookups take none (a dict read is atomic)."""
        with self._lock:
            if len(table) >= self.size:
                table.pop(next(iter(table)))
            return table.setdefault(key, value)

    def clear(self) -> None:
        """Forgets every entry (a sharding made after it is a new object)."""
        with self._lock:
            self.shardings.clear()
            self.plans.clear()
            self.batches.clear()


CACHE = Cache()


def batch_sharding(
    mesh: Mesh, batch_axes: Sequence[str], ndim: int = 1, axis: int = 0
) -> NamedSharding:
    """The sharding of a batch leaf of rank `ndim`: its `axis` split over `batch_axes`.

    One object per (mesh, batch axes, ndim > axis, axis), shared by every
    strategy on that mesh: the placed batches carry the very sharding the
    step's program was compiled with, which its fast path checks by identity.
    """
    key = (mesh, tuple(batch_axes), ndim > axis, axis)
    sharding = CACHE.shardings.get(key)
    if sharding is None:
        spec = PartitionSpec(*(None,) * axis, key[1]) if key[2] and key[1] else PartitionSpec()
        sharding = CACHE.add(CACHE.shardings, key, NamedSharding(mesh, spec))
    return sharding


# -- batches ------------------------------------------------------------------


def put_rows(
    mesh: Mesh, batch_axes: Sequence[str], leaves: list, global_size: int
) -> list[jax.Array]:
    """This process's rows of a batch's leaves as global arrays split over `batch_axes`.

    With one process the rows are the whole batch: every leaf goes to its
    devices in one batched transfer planned once per batch signature (see
    `put_host`). With several, each leaf is this process's rows of a global
    array of `global_size` rows.
    """
    if jax.process_count() == 1:
        key = (mesh, batch_axes, 0, *[(x.shape, x.dtype) for x in leaves])
        plans = CACHE.batches.get(key, False)
        if plans is False:
            shardings = [batch_sharding(mesh, batch_axes, x.ndim) for x in leaves]
            plans = CACHE.add(CACHE.batches, key, _plans(leaves, shardings))
        if plans is not _NO_PLAN:
            return _put_planned(leaves, plans)
        return jax.device_put(leaves, [batch_sharding(mesh, batch_axes, x.ndim) for x in leaves])
    return [
        jax.make_array_from_process_local_data(
            batch_sharding(mesh, batch_axes, x.ndim),
            x,
            (global_size, *x.shape[1:]) if x.ndim else (),
        )
        for x in leaves
    ]


def put_batch(mesh: Mesh, batch_axes: Sequence[str], batch: Any, axis: int = 0) -> Any:
    """A global batch (numpy or jax) as global arrays, its `axis` split over `batch_axes`.

    With several processes every process passes the same global batch and
    each places only the rows its devices hold.
    """
    return jax.tree.map(
        lambda x: put_leaf(x, batch_sharding(mesh, batch_axes, np.ndim(x), axis)), batch
    )


def conform_all(leaves: list, shardings: list) -> list:
    """`conform` over flat leaves, without the pytree machinery (the step's hot path)."""
    try:  # batches the input pipeline placed carry these very shardings
        if len(leaves) == len(shardings) and all(
            map(operator.is_, map(_SHARDING, leaves), shardings)
        ):
            return leaves
    except AttributeError:  # a leaf that is not an array
        pass
    out = leaves
    for i, (x, sharding) in enumerate(zip(leaves, shardings, strict=True)):
        current = getattr(x, "sharding", None)
        if current is not None and current is not sharding and current != sharding:
            if out is leaves:
                out = list(leaves)
            out[i] = conform(x, sharding)
    return out


def conform(x: Any, sharding: NamedSharding) -> Any:
    """`x` in `sharding`: concrete arrays laid out otherwise are moved; the rest pass."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.sharding != sharding:
        return jax.device_put(x, sharding)
    return x


# -- states -------------------------------------------------------------------


def put_leaf(x: Any, sharding: NamedSharding) -> jax.Array:
    """Places one leaf; with several processes, host data is taken as the global value."""
    if isinstance(x, jax.Array) or jax.process_count() == 1:
        return jax.device_put(x, sharding)
    return from_host(np.asarray(x), sharding)


def from_host(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """The global array of a value this process holds whole: it fills only its own shards."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def placed(leaves: list, shardings: list) -> list:
    """The state's leaves, those that are arrays laid out otherwise moved to `shardings`.

    `step_layout.check_layout` has refused another layout on the same mesh;
    what is left to move is an array on one device (put there by `jnp`, or
    committed to a device) or in another memory kind (a fresh array in a
    host-placed state), which jit would move itself or refuse with its own
    error. An array on the mesh's only device is moved too: jit would trace
    the program again for its single-device sharding.
    """
    out = leaves
    for i, (x, sharding) in enumerate(zip(leaves, shardings, strict=True)):
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or x.is_deleted():
            continue
        current = x.sharding
        if current is sharding or (
            isinstance(current, NamedSharding)  # one device's array is retraced, not placed
            and current.mesh == sharding.mesh
            and current.memory_kind == sharding.memory_kind
            and current.is_equivalent_to(sharding, x.ndim)
        ):
            continue
        if out is leaves:
            out = list(leaves)
        out[i] = jax.device_put(x, sharding)
    return out


def to_memory(tree: Any, shardings: Any, kind: str) -> Any:
    """Moves to memory `kind` the leaves a host placement keeps in `pinned_host`.

    The leaves the placement keeps on the devices (PRNG keys) are left as
    they are: a transfer of a key array inside the program fails to lower on
    GPU (its sharding has the key's rank, its buffer one more).
    """

    def move(leaf, sharding):
        if sharding.memory_kind != "pinned_host":
            return leaf
        return jax.device_put(leaf, sharding.with_memory_kind(kind))

    return jax.tree.map(move, tree, shardings)


def on_device(shardings: Any) -> Any:
    """The shardings in device memory: where the step computes on host-placed state."""
    return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)


def in_device_memory(x: jax.Array) -> jax.Array:
    """`x` in device memory (a host-placed leaf copied there, where eager code reads it)."""
    if x.sharding.memory_kind in (None, "device"):
        return x
    return jax.device_put(x, x.sharding.with_memory_kind("device"))


# -- the batched host transfer ------------------------------------------------


def put_host(leaves: Sequence[np.ndarray], shardings: Sequence[Any]) -> list[jax.Array]:
    """Each numpy array in its sharding, as `jax.device_put(leaves, shardings)` gives.

    `jax.device_put` spends most of a small batch's transfer in Python (pytree
    broadcast, abstract values, device indices, per-leaf dispatch). This
    takes a leaf's abstract value, devices and shard indices from the cache
    (planned once per sharding, shape and dtype) and hands the shards straight
    to the batched transfer device_put ends in, after the same dtype
    canonicalization (a float64 leaf becomes float32 unless x64 is on). Only
    for one process, whose rows are the whole batch.

    Args:
      leaves: numpy arrays, each the whole global value.
      shardings: the sharding of each leaf.

    Returns:
      The placed arrays, in order.
    """
    plans = _plans(leaves, shardings)
    if plans is _NO_PLAN:
        return jax.device_put(list(leaves), list(shardings))
    return _put_planned(leaves, plans)


def _plans(leaves: Sequence[np.ndarray], shardings: Sequence[Any]) -> list[tuple] | None:
    """What `_put_planned` needs to place leaves of these shapes and dtypes, or None where
    the batched transfer is not available or a leaf is not a plain numpy array.

    Returns:
      For each leaf: (abstract value, sharding, devices, shard indices or
      None, the canonical dtype when it differs from the leaf's, else None).
    """
    if _batched_device_put is None or not all(type(x) is np.ndarray for x in leaves):
        return _NO_PLAN
    plans = []
    for x, sharding in zip(leaves, shardings, strict=True):
        dtype = _canonical(x.dtype)
        key = (sharding, x.shape, dtype)
        aval, devices, indices = CACHE.plans.get(key) or CACHE.add(
            CACHE.plans, key, _plan(sharding, x.shape, dtype)
        )
        plans.append((aval, sharding, devices, indices, None if dtype == x.dtype else dtype))
    return plans


def _put_planned(leaves: Sequence[np.ndarray], plans: Sequence[tuple]) -> list[jax.Array]:
    """The leaves placed by the plans `_plans` made for their signature."""
    out = []
    for x, (aval, sharding, devices, indices, dtype) in zip(leaves, plans, strict=True):
        if dtype is not None:
            x = np.asarray(x, dtype)
        shards = [x] * len(devices) if indices is None else [x[i] for i in indices]
        out.append(_batched_device_put(aval, sharding, shards, devices, True))
    return out


def _plan(sharding: Any, shape: tuple, dtype: np.dtype) -> tuple[Any, list, tuple | None]:
    """(abstract value, devices, each device's shard index or None when every device
    holds the whole array) of one leaf's transfer."""
    _dtypes.check_valid_dtype(dtype)
    aval = _core.update_aval_with_sharding(_core.ShapedArray(shape, dtype), sharding)
    devices = list(sharding._addressable_device_assignment)
    if sharding.is_fully_replicated:
        return aval, devices, None
    return aval, devices, tuple(sharding.addressable_devices_indices_map(shape).values())
