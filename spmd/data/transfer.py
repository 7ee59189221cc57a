"""Host arrays to the devices in one batched transfer: the input pipeline's hot path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["host_put"]

try:  # private: guarded, JAX may move it; jax.device_put is the fallback
    from jax._src.interpreters.pxla import shard_args as _shard_args
    from jax._src.lib import xla_client as _xc

    _COPY = _xc.ArrayCopySemantics.ALWAYS_COPY
except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX version
    _shard_args = None


def host_put(leaves: Sequence[np.ndarray], shardings: Sequence[Any]) -> list[jax.Array]:
    """Each numpy array in its sharding, as `jax.device_put(leaves, shardings)` gives.

    `jax.device_put` spends most of a small batch's transfer in Python (pytree
    broadcast, abstract values, per-leaf dispatch); this goes straight to the
    batched transfer it ends in (`shard_args`, which also canonicalizes dtypes
    as device_put does). Only for one process, whose rows are the whole batch.

    Args:
      leaves: numpy arrays, each the whole global value.
      shardings: the sharding of each leaf.

    Returns:
      The placed arrays, in order.
    """
    if _shard_args is None or not all(type(x) is np.ndarray for x in leaves):
        return jax.device_put(list(leaves), list(shardings))
    return list(_shard_args(list(shardings), [None] * len(leaves), [_COPY] * len(leaves), leaves))
