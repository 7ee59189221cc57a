"""Host arrays to the devices in one batched transfer: the input pipeline's hot path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["host_put", "put_plans", "put_planned"]

try:  # private: guarded, JAX may move them; jax.device_put is the fallback
    from jax._src import core as _core
    from jax._src import dtypes as _dtypes
    from jax._src.lib import xla_client as _xc

    _batched_device_put = _xc.batched_device_put
    _canonical = _dtypes.canonicalize_dtype
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX version
    _batched_device_put = None

# (sharding, shape, dtype) -> (abstract value, devices, index of each device's shard
# or None when every device holds the whole array). Bounded: cleared when full.
_PLANS: dict[tuple, tuple[Any, list, tuple | None]] = {}
_MAX_PLANS = 256


def host_put(leaves: Sequence[np.ndarray], shardings: Sequence[Any]) -> list[jax.Array]:
    """Each numpy array in its sharding, as `jax.device_put(leaves, shardings)` gives.

    `jax.device_put` spends most of a small batch's transfer in Python (pytree
    broadcast, abstract values, device indices, per-leaf dispatch). This
    computes a leaf's abstract value, devices and shard indices once per
    sharding, shape and dtype, and hands the shards straight to the batched
    transfer device_put ends in, after the same dtype canonicalization (a
    float64 leaf becomes float32 unless x64 is on). Only for one process,
    whose rows are the whole batch.

    Args:
      leaves: numpy arrays, each the whole global value.
      shardings: the sharding of each leaf.

    Returns:
      The placed arrays, in order.
    """
    plans = put_plans(leaves, shardings)
    if plans is None:
        return jax.device_put(list(leaves), list(shardings))
    return put_planned(leaves, plans)


def put_plans(leaves: Sequence[np.ndarray], shardings: Sequence[Any]) -> list[tuple] | None:
    """What `put_planned` needs to place leaves of these shapes and dtypes, or None.

    Computed once per signature (shardings, shapes, dtypes) by the caller
    that keeps it; None where the batched transfer is not available or a leaf
    is not a plain numpy array (then `host_put` places them).

    Returns:
      For each leaf: (abstract value, sharding, devices, shard indices or
      None, the canonical dtype when it differs from the leaf's, else None).
    """
    if _batched_device_put is None or not all(type(x) is np.ndarray for x in leaves):
        return None
    plans = []
    for x, sharding in zip(leaves, shardings, strict=True):
        dtype = _canonical(x.dtype)
        aval, devices, indices = _PLANS.get((sharding, x.shape, dtype)) or _plan(
            sharding, x.shape, dtype
        )
        plans.append((aval, sharding, devices, indices, None if dtype == x.dtype else dtype))
    return plans


def put_planned(leaves: Sequence[np.ndarray], plans: Sequence[tuple]) -> list[jax.Array]:
    """`host_put(leaves, shardings)` with the plans `put_plans` made for their signature.

    Every leaf must be a plain numpy array of the shape and dtype it was planned for.
    """
    placed = []
    for x, (aval, sharding, devices, indices, dtype) in zip(leaves, plans, strict=True):
        if dtype is not None:
            x = np.asarray(x, dtype)
        shards = [x] * len(devices) if indices is None else [x[i] for i in indices]
        placed.append(_batched_device_put(aval, sharding, shards, devices, True))
    return placed


def _plan(sharding: Any, shape: tuple, dtype: np.dtype) -> tuple[Any, list, tuple | None]:
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _dtypes.check_valid_dtype(dtype)
    aval = _core.update_aval_with_sharding(_core.ShapedArray(shape, dtype), sharding)
    devices = list(sharding._addressable_device_assignment)
    if sharding.is_fully_replicated:
        indices = None
    else:
        indices = tuple(sharding.addressable_devices_indices_map(shape).values())
    plan = _PLANS[(sharding, shape, dtype)] = (aval, devices, indices)
    return plan
