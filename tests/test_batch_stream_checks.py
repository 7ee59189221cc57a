"""The lean fed path: each check still fires after good batches, and the values are the rows.

The batch stream flattens each batch once, checks it in one pass over its
leaves and places it by a plan per batch signature. These tests feed good
batches first (so every per-signature plan and fast path is warm), then the
bad one, and compare each error with the one the unchanged slow checks raise
on the same batch; and they compare every placed value with numpy's rows.
"""

import jax
import numpy as np
import pytest

import spmd
from spmd.data.host_batches import HostBatch, _check_numeric, leading_size
from spmd.data.iterator import _describe
from spmd.trainer.data import as_dataset

BATCH, FEATURES = 16, 4


@pytest.fixture(scope="module", params=[1, 8], ids=["1dev", "8dev"])
def strategy(request):
    if request.param == 1:
        return spmd.OneDeviceStrategy(jax.devices()[0])
    return spmd.MirroredStrategy()


def _batch(i, size=BATCH):
    x = np.arange(size * FEATURES, dtype=np.float32).reshape(size, FEATURES) + 1000 * i
    return x, np.arange(size, dtype=np.int32) + 100 * i


def _read(dist):
    return [jax.tree.map(np.asarray, b) for b in dist]


def _raised(strategy, batches, options=None):
    dist = strategy.distribute_dataset(batches, options)
    seen = []
    with pytest.raises((spmd.BatchError, spmd.ConfigurationError)) as info:
        for b in dist:
            seen.append(b)
    return info.value, len(seen)


# -- every check still fires after good batches --------------------------------


def test_a_str_leaf_after_good_batches_is_refused_naming_it(strategy):
    x, y = _batch(2)
    bad = (x, y.astype(str))
    error, seen = _raised(strategy, [_batch(0), _batch(1), bad, _batch(3)])
    assert isinstance(error, spmd.BatchError) and seen == 2
    assert "Every leaf of a batch is numeric or bool" in str(error)
    assert "leaf='[1]'" in str(error) and "(str)" in str(error) and "batch_index=2" in str(error)
    with pytest.raises(spmd.BatchError) as oracle:
        _check_numeric(bad, 2)
    assert str(error) == str(oracle.value)


def test_an_object_leaf_and_a_ragged_leaf_the_numeric_error_comes_first(strategy):
    x, y = _batch(1)
    bad = {"x": x[:3], "name": np.array(["a"] * BATCH, dtype=object), "y": y}
    good = {"x": x, "name": y, "y": y}
    error, seen = _raised(strategy, [good, good, bad])
    assert seen == 2 and "(object)" in str(error) and "leaf=\"['name']\"" in str(error)


def test_a_ragged_batch_after_good_batches_is_refused(strategy):
    x, y = _batch(1)
    bad = (x, y[:8])
    error, seen = _raised(strategy, [_batch(0), _batch(1), bad, _batch(3)])
    assert isinstance(error, spmd.BatchError) and seen == 2
    assert "must have the same leading (batch) size" in str(error)
    assert "leading_sizes=[8, 16]" in str(error) and "batch_index=2" in str(error)
    with pytest.raises(spmd.BatchError) as oracle:
        leading_size(bad, what="batch", index=2)
    assert str(error) == str(oracle.value)


def test_a_batch_without_a_batch_axis_after_good_ones_is_refused(strategy):
    bad = (np.float32(1.0), np.int32(2))
    error, seen = _raised(strategy, [_batch(0), bad])
    assert seen == 1 and "has a leading (batch) axis" in str(error)
    with pytest.raises(spmd.BatchError) as oracle:
        leading_size(jax.tree.map(np.array, bad), what="batch", index=1)
    assert str(error) == str(oracle.value)


def test_an_empty_batch_after_good_ones_is_refused(strategy):
    error, seen = _raised(strategy, [_batch(0), _batch(1, size=0), _batch(2)])
    assert seen == 1 and "Every batch of a dataset has rows" in str(error)
    assert "batch_index=1" in str(error)


def test_a_batch_of_another_size_that_is_not_the_last_is_refused(strategy):
    error, seen = _raised(strategy, [_batch(0), _batch(1), _batch(2, size=8), _batch(3)])
    assert isinstance(error, spmd.BatchError) and seen == 2
    assert "Every batch but the last must have the same size" in str(error)
    assert "batch_size=8" in str(error) and "first_batch_size=16" in str(error)


def test_a_bigger_last_batch_is_refused(strategy):
    error, seen = _raised(strategy, [_batch(0), _batch(1, size=24)])
    assert seen == 1 and "and the last no more" in str(error)


def test_a_smaller_last_batch_without_a_remainder_is_refused(strategy):
    error, seen = _raised(strategy, [_batch(0), _batch(1), _batch(2, size=8)])
    assert seen == 2 and "The last batch is smaller than the others" in str(error)


def test_a_smaller_last_batch_is_dropped_under_drop(strategy):
    options = spmd.InputOptions(remainder="drop")
    got = _read(strategy.distribute_dataset([_batch(0), _batch(1, size=8)], options))
    assert len(got) == 1 and np.array_equal(got[0][0], _batch(0)[0])


def test_an_empty_dataset_is_refused(strategy):
    error, seen = _raised(strategy, [])
    assert seen == 0 and "A dataset yields at least one batch a pass" in str(error)


def test_a_batch_that_does_not_split_over_the_replicas_is_refused():
    strategy = spmd.MirroredStrategy()
    error, seen = _raised(strategy, [_batch(0, size=12), _batch(1, size=12)])
    assert seen == 0 and "must split evenly over the 8 replicas" in str(error)
    assert "global_batch_size=12" in str(error)


def test_a_saved_position_of_another_global_batch_size_is_refused(strategy):
    first = strategy.distribute_dataset([_batch(i) for i in range(3)])
    iterator = iter(first)
    next(iterator)
    state = iterator.get_state()
    other = strategy.distribute_dataset([_batch(i, size=32) for i in range(3)])
    other.set_state(state)
    error, seen = _raised_from(other)
    assert isinstance(error, spmd.ConfigurationError) and seen == 0
    assert "the same global_batch_size" in str(error) and "16 saved, 32 now" in str(error)


def _raised_from(dist):
    seen = 0
    with pytest.raises(spmd.ConfigurationError) as info:
        for _ in dist:
            seen += 1
    return info.value, seen


# -- a batch whose signature changes mid-stream is placed by its own plan -------


def test_a_batch_whose_structure_changes_mid_stream_keeps_its_own_structure(strategy):
    x, y = _batch(1)
    batches = [_batch(0), {"x": x, "y": y}, (x, y, y.astype(np.float32)), _batch(3)]
    got = _read(strategy.distribute_dataset(batches))
    assert len(got) == 4
    for want, have in zip(batches, got, strict=True):
        assert jax.tree.structure(have) == jax.tree.structure(want)
        for w, h in zip(jax.tree.leaves(want), jax.tree.leaves(have), strict=True):
            assert h.dtype == w.dtype and np.array_equal(h, w)


def test_a_batch_whose_dtypes_and_feature_shapes_change_mid_stream_is_placed_as_is(strategy):
    x, y = _batch(1)
    batches = [_batch(0), (x[:, :2], y.astype(np.int8)), (x.astype(np.float64), y), _batch(3)]
    got = _read(strategy.distribute_dataset(batches))
    for want, have in zip(batches, got, strict=True):
        for w, h in zip(want, have, strict=True):
            expected = jax.dtypes.canonicalize_dtype(w.dtype)  # float64 -> float32 without x64
            assert h.dtype == expected and h.shape == w.shape
            assert np.array_equal(h, w.astype(expected))


def test_the_shapes_record_processes_compare_names_global_shapes():
    """Processes may hold unequal parts of one global batch (a mesh over the devices that
    divide it): what they compare is each leaf's global shape, and the padding."""
    x, y = _batch(0)
    batch = HostBatch({"x": x, "y": y}, np.ones(BATCH, np.float32), 32)
    treedef = jax.tree.structure({"x": x, "y": y})
    assert _describe(batch) == f"{treedef}: float32[32, 4], int32[32] + mask of global 32"
    padded = HostBatch({"x": x, "y": y}, np.ones(BATCH, np.float32), 32, batch_size=30)
    assert _describe(padded).endswith("+ mask of global 32 (30 padded)")
    assert jax.tree.all(jax.tree.map(np.array_equal, batch.tree, {"x": x, "y": y}))


# -- the values are the input rows ----------------------------------------------


@pytest.mark.parametrize("last", [BATCH, 5])
def test_the_placed_values_are_the_rows_with_and_without_padding(strategy, last):
    batches = [_batch(0), _batch(1), _batch(2, size=last)]
    options = spmd.InputOptions(remainder="pad")
    for opts in (None, options) if last == BATCH else (options,):
        got = _read(strategy.distribute_dataset(batches, opts))
        assert len(got) == 3
        for i, (want, have) in enumerate(zip(batches, got, strict=True)):
            real = len(want[1])
            fill = np.r_[np.arange(real), np.full(BATCH - real, real - 1)]
            if opts is None:
                assert type(have) is tuple and len(have) == 2
            else:
                assert isinstance(have, spmd.PaddedBatch), i
                np.testing.assert_array_equal(have.mask, (np.arange(BATCH) < real) * 1.0)
            for w, h in zip(want, have[:2], strict=True):
                assert h.dtype == w.dtype and np.array_equal(h, w[fill])


def test_a_yielded_batch_keeps_its_values_when_the_loader_refills_its_buffer(strategy):
    x, y = _batch(0)

    def refilling():
        for i in range(3):
            x[:] = i
            y[:] = i
            yield x, y

    got = _read(strategy.distribute_dataset(refilling()))
    assert [int(b[0][0, 0]) for b in got] == [0, 1, 2]
    assert [int(b[1][-1]) for b in got] == [0, 1, 2]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("pad", [False, True])
def test_fits_dataset_of_arrays_gives_the_rows_numpy_orders(strategy, shuffle, pad):
    n, seed = 75, 3
    x = np.random.default_rng(0).normal(size=(n, FEATURES)).astype(np.float32)
    y = np.arange(n, dtype=np.int32)
    what = "evaluate" if pad else "fit"
    dist = as_dataset(strategy, (x, y), BATCH, shuffle=shuffle, pad=pad, seed=seed, what=what)
    for epoch in range(2):
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        got = _read(dist)
        count = -(-n // BATCH) if pad else n // BATCH
        assert len(got) == count
        for b, have in enumerate(got):
            rows = order[b * BATCH : (b + 1) * BATCH]
            real = len(rows)
            rows = np.r_[rows, np.full(BATCH - real, rows[-1])]
            assert np.array_equal(have[0], x[rows]) and np.array_equal(have[1], y[rows])
            if pad:
                assert isinstance(have, spmd.PaddedBatch)
                np.testing.assert_array_equal(have.mask, (np.arange(BATCH) < real) * 1.0)


def test_an_unshuffled_batch_is_a_copy_not_a_view_of_the_callers_arrays(strategy):
    x, y = np.zeros((64, FEATURES), np.float32), np.zeros(64, np.int32)
    dist = strategy.distribute_dataset(strategy.make_numpy_dataset((x, y), BATCH))
    host = dist._plan.batches(0, 0)
    first = next(host)
    x[:] = 7
    assert not np.shares_memory(first.leaves[0], x) and not first.leaves[0].any()
    placed = _read(dist)
    assert all(np.array_equal(b[0], np.full((BATCH, FEATURES), 7)) for b in placed)
