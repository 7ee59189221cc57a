"""Hostile input to the fed paths' fast code: host transfers, the step's fast path, the
Trainer's hooks and NaN flag, each against a one-device oracle or Keras' semantics."""

import numpy as np
import pytest

import spmd

ROWS = 1024  # 128 rows a device: shards whose views of the host buffer can be aliased


def _aligned(n: int) -> np.ndarray:
    """A float32 buffer of `n` starting on a 64-byte boundary (as XLA:CPU aliases them)."""
    raw = np.zeros(n + 16, np.float32)
    skip = (-raw.ctypes.data % 64) // 4
    return raw[skip : skip + n]


def _reused_buffer(batches: int):
    """A loader that fills one buffer for every batch (as hand-written loaders do)."""
    buf = _aligned(ROWS)
    for i in range(batches):
        buf[:] = i
        yield buf


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_loader_reusing_its_buffer_gives_each_batch_its_own_values(prefetch):
    strategy = spmd.MirroredStrategy()
    options = spmd.InputOptions(prefetch=prefetch)
    seen = [np.asarray(b).copy() for b in strategy.distribute_dataset(_reused_buffer(6), options)]
    np.testing.assert_array_equal([s.mean() for s in seen], np.arange(6, dtype=np.float32))
