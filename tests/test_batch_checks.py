"""A bad batch is a clear spmd error at the batch that is bad, after good batches too.

distribute_dataset flattens each batch once, checks it in one pass over its
leaves and places it by a plan per batch signature. These tests feed good
batches first (so every per-signature plan and fast path is warm), then the bad
one, and compare the error, where one applies, with the one the plain checks
raise on the same batch. `input_strategy` (tests/conftest.py) runs each on one
device, eight replicas and a 4x2 mesh.
"""

import jax
import numpy as np
import pytest

import spmd
from spmd._src.data.host_batches import _check_numeric, leading_size

N, FEATURES = 16, 4  # rows a batch, features a row


# -- each check fires after good batches ----------------------------------------


def _batch(i, size=N):
    x = np.arange(size * FEATURES, dtype=np.float32).reshape(size, FEATURES) + 1000 * i
    return x, np.arange(size, dtype=np.int32) + 100 * i


def _rows(i, n=N, dtype=np.float64):
    return (np.arange(n * 3, dtype=np.float64).reshape(n, 3) + 100 * i).astype(dtype)


def _raised_from(dist):
    """The spmd error reading `dist` raises, and how many batches came before it."""
    seen = 0
    with pytest.raises((spmd.BatchError, spmd.ConfigurationError)) as info:
        for _ in dist:
            seen += 1
    return info.value, seen


def _raised(strategy, batches, options=None):
    return _raised_from(strategy.distribute_dataset(batches, options))


def _raised_at(strategy, bad, index=2):
    """The error of `bad` fed after `index` good batches (and before one more)."""
    good = (_rows(0, dtype=np.float32),)
    return _raised(strategy, [good] * index + [bad, good])


def test_a_str_leaf_after_good_batches_is_refused_naming_it(input_strategy):
    x, y = _batch(2)
    bad = (x, y.astype(str))
    error, seen = _raised(input_strategy, [_batch(0), _batch(1), bad, _batch(3)])
    assert isinstance(error, spmd.BatchError) and seen == 2
    assert "Every leaf of a batch is numeric or bool" in str(error)
    assert "leaf='[1]'" in str(error) and "(str)" in str(error) and "batch_index=2" in str(error)
    with pytest.raises(spmd.BatchError) as oracle:
        _check_numeric(bad, 2)
    assert str(error) == str(oracle.value)


def test_an_object_leaf_and_a_ragged_leaf_the_numeric_error_comes_first(input_strategy):
    x, y = _batch(1)
    bad = {"x": x[:3], "name": np.array(["a"] * N, dtype=object), "y": y}
    good = {"x": x, "name": y, "y": y}
    error, seen = _raised(input_strategy, [good, good, bad])
    assert seen == 2 and "(object)" in str(error) and "leaf=\"['name']\"" in str(error)


def test_a_ragged_batch_after_good_batches_is_refused(input_strategy):
    x, y = _batch(1)
    bad = (x, y[:8])
    error, seen = _raised(input_strategy, [_batch(0), _batch(1), bad, _batch(3)])
    assert isinstance(error, spmd.BatchError) and seen == 2
    assert "must have the same leading (batch) size" in str(error)
    assert "leading_sizes=[8, 16]" in str(error) and "batch_index=2" in str(error)
    with pytest.raises(spmd.BatchError) as oracle:
        leading_size(bad, what="batch", index=2)
    assert str(error) == str(oracle.value)


def test_a_batch_without_a_batch_axis_after_good_ones_is_refused(input_strategy):
    bad = (np.float32(1.0), np.int32(2))
    error, seen = _raised(input_strategy, [_batch(0), bad])
    assert seen == 1 and "has a leading (batch) axis" in str(error)
    with pytest.raises(spmd.BatchError) as oracle:
        leading_size(jax.tree.map(np.array, bad), what="batch", index=1)
    assert str(error) == str(oracle.value)


def test_an_empty_batch_after_good_ones_is_refused(input_strategy):
    error, seen = _raised(input_strategy, [_batch(0), _batch(1, size=0), _batch(2)])
    assert seen == 1 and "Every batch of a dataset has rows" in str(error)
    assert "batch_index=1" in str(error)


def test_a_batch_of_another_size_that_is_not_the_last_is_refused(input_strategy):
    error, seen = _raised(input_strategy, [_batch(0), _batch(1), _batch(2, size=8), _batch(3)])
    assert isinstance(error, spmd.BatchError) and seen == 2
    assert "Every batch but the last must have the same size" in str(error)
    assert "batch_size=8" in str(error) and "first_batch_size=16" in str(error)


def test_a_bigger_last_batch_is_refused(input_strategy):
    error, seen = _raised(input_strategy, [_batch(0), _batch(1, size=24)])
    assert seen == 1 and "and the last no more" in str(error)


def test_a_smaller_last_batch_without_a_remainder_is_refused(input_strategy):
    error, seen = _raised(input_strategy, [_batch(0), _batch(1), _batch(2, size=8)])
    assert seen == 2 and "The last batch is smaller than the others" in str(error)


def test_an_empty_dataset_is_refused(input_strategy):
    error, seen = _raised(input_strategy, [])
    assert seen == 0 and "A dataset yields at least one batch a pass" in str(error)


@pytest.mark.cpu_mesh
def test_a_batch_that_does_not_split_over_the_replicas_is_refused():
    strategy = spmd.MirroredStrategy()
    error, seen = _raised(strategy, [_batch(0, size=12), _batch(1, size=12)])
    assert seen == 0 and "must split evenly over the 8 replicas" in str(error)
    assert "global_batch_size=12" in str(error)


def test_a_saved_position_of_another_global_batch_size_is_refused(input_strategy):
    first = input_strategy.distribute_dataset([_batch(i) for i in range(3)])
    iterator = iter(first)
    next(iterator)
    state = iterator.get_state()
    other = input_strategy.distribute_dataset([_batch(i, size=32) for i in range(3)])
    other.set_state(state)
    error, seen = _raised_from(other)
    assert isinstance(error, spmd.ConfigurationError) and seen == 0
    assert "the same global_batch_size" in str(error) and "16 saved, 32 now" in str(error)


# -- what jax cannot hold, and leaves without rows ------------------------------


def test_a_leaf_without_a_batch_axis_of_its_own_size_is_a_batch_error_at_its_batch(input_strategy):
    good = {"x": _rows(0), "table": np.zeros((N, 4))}
    bad = {"x": _rows(1), "table": np.zeros((5, 4))}  # a side table, not rows
    dist = iter(input_strategy.distribute_dataset([good, good, bad]))
    next(dist), next(dist)
    with pytest.raises(spmd.BatchError, match=r"batch_index=2.*leading_sizes=\[5, 16\]"):
        next(dist)


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(np.dtype(np.longdouble), id="longdouble"),
        pytest.param(np.dtype("datetime64[s]"), id="datetime64"),
        pytest.param(np.dtype("timedelta64[s]"), id="timedelta64"),
    ],
)
def test_a_leaf_jax_cannot_hold_is_a_batch_error_naming_it(input_strategy, dtype):
    error, seen = _raised_at(input_strategy, (np.arange(N * 3).reshape(N, 3).astype(dtype),))
    assert seen == 2
    assert isinstance(error, spmd.BatchError), repr(error)
    assert "batch_index=2" in str(error) and str(dtype) in str(error)


def test_a_batch_of_prng_keys(input_strategy):
    keys = jax.random.split(jax.random.key(0), N)
    error, seen = _raised_at(input_strategy, (keys,))
    assert isinstance(error, spmd.BatchError), repr(error)


def test_ragged_text_and_object_leaves_are_batch_errors_at_their_batch(input_strategy):
    for bad, words in [
        ((_rows(0, n=N - 1, dtype=np.float32),), "every batch but the last"),
        ((np.array(["a"] * N),), "numeric or bool"),
        (({"x": _rows(0), "y": np.arange(N - 1)},), "same leading"),
        ((np.float32(1.0),), "leading (batch) axis"),
    ]:
        error, seen = _raised_at(input_strategy, bad)
        assert isinstance(error, spmd.BatchError), repr(error)
        assert seen == 2 and "batch_index=2" in str(error)
        assert words.lower() in str(error).lower()


@pytest.mark.parametrize("dtype", ["<U1", "datetime64[s]", np.longdouble])
def test_a_numpy_dataset_of_an_array_jax_cannot_hold_is_an_spmd_error(input_strategy, dtype):
    x = _rows(0, n=64, dtype=np.float32)
    bad = np.arange(64).astype(dtype)
    with pytest.raises((spmd.BatchError, spmd.ConfigurationError), match="dtype"):
        list(input_strategy.distribute_dataset(input_strategy.make_numpy_dataset((x, bad), N)))
