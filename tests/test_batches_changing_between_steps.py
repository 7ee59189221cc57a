"""The single-process fed path: batches that change between steps.

Every batch is flattened once, its leaves copied, checked in one pass and
placed by a plan cached per (structure, shapes, dtypes). Each test feeds a
pipeline whose batches change as real ones do and checks every placed value,
dtype and sharding against the numpy rows it must hold (the oracle is
`jnp.asarray` of the batch as read: what `jax.jit` would be given).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import spmd

N = 16


def _two_d():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    return spmd.Strategy(mesh, batch_axes=["data"])


@pytest.fixture(scope="module", params=["1dev", "8dev", "2d"])
def strategy(request):
    if request.param == "1dev":
        return spmd.OneDeviceStrategy(jax.devices()[0])
    if request.param == "8dev":
        return spmd.MirroredStrategy()
    return _two_d()


def _expected(batch):
    """What jax.jit would be given: each leaf as jnp.asarray makes it, read as numpy."""
    return jax.tree.map(lambda a: np.asarray(jnp.asarray(a)), batch)


def _check(strategy, placed, oracle):
    """Same structure, dtypes, values and the batch sharding for every leaf."""
    assert jax.tree.structure(placed) == jax.tree.structure(oracle)
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(oracle), strict=True):
        assert isinstance(got, jax.Array)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.sharding.is_equivalent_to(strategy.batch_sharding(got.ndim), got.ndim)


def _feed(strategy, batches, options=None):
    """Reads every placed batch, and the oracles taken before the pipeline reads the next one."""
    oracles, placed = [], []

    def source():
        for b in batches:
            oracles.append(_expected(b))
            yield b

    for b in strategy.distribute_dataset(source(), options):
        placed.append(b)
    return placed, oracles


def _rows(i, n=N, dtype=np.float64):
    return (np.arange(n * 3, dtype=np.float64).reshape(n, 3) + 100 * i).astype(dtype)


# -- dtype changes mid-stream --------------------------------------------------


def test_dtype_changes_between_batches_with_the_same_shapes(strategy):
    dtypes = [np.float64, np.float32, np.float16, np.bool_, np.int64, np.int32, np.uint8]
    dtypes += [np.float64, np.int64]  # back to signatures planned before
    batches = [(_rows(i, dtype=d), np.arange(N, dtype=np.int64) + i) for i, d in enumerate(dtypes)]
    placed, oracles = _feed(strategy, batches)
    assert len(placed) == len(batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(strategy, p, o)
    assert placed[0][0].dtype == jnp.float32 and placed[4][0].dtype == jnp.int32  # x64 off


def test_a_bfloat16_batch_is_placed_as_jax_jit_takes_it(strategy):
    batches = [(_rows(0, dtype=np.float32),), (_rows(1, dtype=ml_dtypes.bfloat16),)]
    placed, oracles = _feed(strategy, batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(strategy, p, o)


def test_a_float8_batch_is_placed_as_jax_jit_takes_it(strategy):
    placed, oracles = _feed(strategy, [(_rows(0, dtype=ml_dtypes.float8_e4m3fn),)])
    _check(strategy, placed[0], oracles[0])


def test_distribute_batch_takes_bfloat16_as_distribute_dataset_does(strategy):
    x = _rows(0, dtype=ml_dtypes.bfloat16)
    placed = strategy.distribute_batch(x)
    _check(strategy, placed, _expected(x))


# -- shapes change --------------------------------------------------------------


def test_an_lm_whose_sequence_length_changes_every_batch(strategy):
    lengths = [7, 12, 7, 33, 1, 12]
    batches = [
        {"tokens": np.arange(N * t, dtype=np.int64).reshape(N, t) % 97 + i, "len": np.full(N, t)}
        for i, t in enumerate(lengths)
    ]
    placed, oracles = _feed(strategy, batches)
    assert [p["tokens"].shape[1] for p in placed] == lengths
    for p, o in zip(placed, oracles, strict=True):
        _check(strategy, p, o)


@pytest.mark.parametrize("remainder", ["pad", "drop", "error"])
def test_a_last_partial_batch(strategy, remainder):
    full = [(_rows(i), np.arange(N) + N * i) for i in range(2)]
    last = (_rows(2, n=5), np.arange(5) + 2 * N)
    options = spmd.InputOptions(remainder=remainder)
    if remainder == "error":
        dist = iter(strategy.distribute_dataset([*full, last], options))
        seen = [next(dist), next(dist)]
        with pytest.raises(spmd.BatchError, match="batch_index=2.*batch_size=5"):
            next(dist)
        assert len(seen) == 2
        return
    placed, oracles = _feed(strategy, [*full, last], options)
    if remainder == "drop":
        assert len(placed) == 2 and len(oracles) == 3
        for p, o in zip(placed, oracles[:2], strict=True):
            _check(strategy, p, o)
        return
    assert len(placed) == 3
    fill = np.r_[np.arange(5), np.full(N - 5, 4)]  # the last real row repeated
    x, y, mask = placed[2]
    _check(strategy, (x, y), (oracles[2][0][fill], oracles[2][1][fill]))
    np.testing.assert_array_equal(np.asarray(mask), (np.arange(N) < 5).astype(np.float32))
    for p, o in zip(placed[:2], oracles[:2], strict=True):
        assert isinstance(p, spmd.PaddedBatch)
        _check(strategy, p.inputs, o)
        np.testing.assert_array_equal(np.asarray(p.mask), np.ones(N, np.float32))


def test_scalar_and_0d_leaves_beside_rows_are_replicated_and_may_change(strategy):
    batches = [
        {"x": _rows(0), "lr": 0.5, "step": np.int64(3), "t": np.array(2.0)},
        {"x": _rows(1), "lr": 0.25, "step": np.int64(4), "t": np.array(7.0)},
        {"x": _rows(2), "lr": 1, "step": np.int32(5), "t": np.array(True)},
    ]
    placed, oracles = _feed(strategy, batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(strategy, p, o)
    assert float(placed[1]["lr"]) == 0.25 and int(placed[2]["step"]) == 5


def test_a_leaf_without_a_batch_axis_of_its_own_size_is_a_batch_error_at_its_batch(strategy):
    good = {"x": _rows(0), "table": np.zeros((N, 4))}
    bad = {"x": _rows(1), "table": np.zeros((5, 4))}  # a side table, not rows
    dist = iter(strategy.distribute_dataset([good, good, bad]))
    next(dist), next(dist)
    with pytest.raises(spmd.BatchError, match=r"batch_index=2.*leading_sizes=\[5, 16\]"):
        next(dist)


# -- structure changes ---------------------------------------------------------


def test_structure_changes_keys_added_removed_reordered_tuple_list_none(strategy):
    a, b, c = _rows(0), np.arange(N), _rows(1, dtype=np.float32)
    batches = [
        {"a": a, "b": b},
        {"b": b + 1, "a": a + 1},  # reordered: the same structure
        {"a": a + 2, "b": b + 2, "c": c},  # added
        {"a": a + 3},  # removed
        (a + 4, b + 4),
        [a + 5, b + 5],  # tuple vs list: another structure, same shapes
        {"a": a + 6, "b": None},  # a None leaf
        {"a": a + 7, "b": b + 7},
    ]
    placed, oracles = _feed(strategy, batches)
    assert type(placed[4]) is tuple and type(placed[5]) is list and placed[6]["b"] is None
    for p, o in zip(placed, oracles, strict=True):
        _check(strategy, p, o)


# -- the arrays the pipeline yields ---------------------------------------------


def _views():
    base = np.arange(N * 2 * 6, dtype=np.float64).reshape(N * 2, 6)
    fortran = np.asfortranarray(base[:N])
    read_only = base[:N].copy()
    read_only.flags.writeable = False

    class Tagged(np.ndarray):
        pass

    return {
        "fortran": fortran,
        "strided": base[::2, ::3],
        "negative": base[::-2, ::-1],
        "transposed": np.ascontiguousarray(base[N:].T).T,
        "read_only": read_only,
        "subclass": base[N:].view(Tagged),
        "broadcast": np.broadcast_to(np.arange(6.0), (N, 6)),
    }


def test_views_fortran_strided_negative_readonly_subclass_broadcast(strategy):
    views = _views()
    batches = [{k: v + i for k, v in views.items()} for i in range(2)]
    batches.append(views)  # the views themselves (read-only, broadcast, subclass as given)
    placed, oracles = _feed(strategy, batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(strategy, p, o)


def test_a_memmap_batch(strategy, tmp_path):
    mm = np.memmap(tmp_path / "rows.bin", np.float32, "w+", shape=(3 * N, 4))
    mm[:] = np.arange(3 * N * 4, dtype=np.float32).reshape(3 * N, 4)
    mm.flush()
    ro = np.memmap(tmp_path / "rows.bin", np.float32, "r", shape=(3 * N, 4))
    batches = [(ro[i * N : (i + 1) * N],) for i in range(3)]
    placed, oracles = _feed(strategy, batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(strategy, p, o)
    ds = strategy.make_numpy_dataset(ro, N, shuffle=True, seed=3)
    order = np.random.default_rng([3, 0]).permutation(3 * N)
    for b, got in enumerate(strategy.distribute_dataset(ds)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ro)[order[b * N : (b + 1) * N]])


def test_jax_arrays_yielded_on_device_on_another_device_and_sharded(strategy):
    x = _rows(0, dtype=np.float32)
    other = jax.devices()[5]
    batches = [
        (x, np.arange(N)),  # numpy first: its plan is made for numpy leaves
        (jnp.asarray(x + 1), jnp.arange(N) + 1),  # the same signature, jax arrays
        (jax.device_put(x + 2, other), jax.device_put(np.arange(N) + 2, other)),
        (jax.device_put(x + 3, spmd.MirroredStrategy().batch_sharding(2)), np.arange(N) + 3),
        (x + 4, np.arange(N) + 4),
    ]
    placed, oracles = _feed(strategy, batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(strategy, p, o)


def test_a_loader_refilling_one_buffer_keeps_each_batchs_values(strategy):
    buf, labels = np.zeros((N, 3), np.float32), np.zeros(N, np.int32)

    def loader():
        for i in range(5):
            buf[:] = i
            labels[:] = 10 * i
            yield {"x": buf, "y": labels}

    dist = iter(strategy.distribute_dataset(loader(), spmd.InputOptions(prefetch=0)))
    first = next(dist)
    rest = list(dist)  # batch 0 read long before these; its values must not move
    for i, b in enumerate([first, *rest]):
        np.testing.assert_array_equal(np.asarray(b["x"]), np.full((N, 3), i, np.float32))
        np.testing.assert_array_equal(np.asarray(b["y"]), np.full(N, 10 * i, np.int32))


# -- the plan cache ---------------------------------------------------------------


def test_more_than_64_signatures_in_one_epoch_then_the_early_ones_again(strategy):
    widths = list(range(1, 71)) + [1, 2, 3, 70, 69]
    batches = [
        (_rows(i, dtype=np.float32)[:, :1].repeat(w, 1) + w, np.arange(N) + i)
        for i, w in enumerate(widths)
    ]
    placed, oracles = _feed(strategy, batches)
    assert [p[0].shape[1] for p in placed] == widths
    for p, o in zip(placed, oracles, strict=True):
        _check(strategy, p, o)


def test_the_same_shapes_in_another_dtype_is_another_plan(strategy):
    x = np.arange(N * 2).reshape(N, 2)
    batches = [x.astype(d) + 0.5 * (d == np.float64) for d in (np.float64, np.int64, np.float64)]
    batches += [x.astype(np.complex128) * 1j, (x > 3)]
    placed, oracles = _feed(strategy, batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(strategy, p, o)
    np.testing.assert_array_equal(np.asarray(placed[0]), x + 0.5)


# -- bad input: a clear spmd error at the batch that is bad ----------------------


def _raised_at(strategy, bad, index=2):
    good = (_rows(0, dtype=np.float32),)
    batches = [good] * index + [bad, good]
    seen = []
    with pytest.raises(Exception) as info:
        for b in strategy.distribute_dataset(batches):
            seen.append(b)
    return info.value, len(seen)


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(np.dtype(np.longdouble), id="longdouble"),
        pytest.param(np.dtype("datetime64[s]"), id="datetime64"),
        pytest.param(np.dtype("timedelta64[s]"), id="timedelta64"),
    ],
)
def test_a_leaf_jax_cannot_hold_is_a_batch_error_naming_it(strategy, dtype):
    error, seen = _raised_at(strategy, (np.arange(N * 3).reshape(N, 3).astype(dtype),))
    assert seen == 2
    assert isinstance(error, spmd.BatchError), repr(error)
    assert "batch_index=2" in str(error) and str(dtype) in str(error)


def test_a_big_endian_leaf_is_placed_with_its_values_in_native_order(strategy):
    rows = np.arange(N * 3).reshape(N, 3).astype(">f4")
    (placed,) = next(iter(strategy.distribute_dataset([(rows,)])))
    assert placed.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(placed), rows.astype("<f4"))


def test_a_numpy_dataset_of_big_endian_arrays_gives_their_values(strategy):
    x = np.arange(64 * 3).reshape(64, 3).astype(">f4")
    batches = list(strategy.distribute_dataset(strategy.make_numpy_dataset((x,), N)))
    got = np.concatenate([np.asarray(b[0]) for b in batches])
    np.testing.assert_array_equal(got, x.astype("<f4"))


def test_a_batch_of_prng_keys(strategy):
    keys = jax.random.split(jax.random.key(0), N)
    error, seen = _raised_at(strategy, (keys,))
    assert isinstance(error, spmd.BatchError), repr(error)


def test_ragged_text_and_object_leaves_are_batch_errors_at_their_batch(strategy):
    for bad, words in [
        ((_rows(0, n=N - 1, dtype=np.float32),), "every batch but the last"),
        ((np.array(["a"] * N),), "numeric or bool"),
        (({"x": _rows(0), "y": np.arange(N - 1)},), "same leading"),
        ((np.float32(1.0),), "leading (batch) axis"),
    ]:
        error, seen = _raised_at(strategy, bad)
        assert isinstance(error, spmd.BatchError), repr(error)
        assert seen == 2 and "batch_index=2" in str(error)
        assert words.lower() in str(error).lower()


@pytest.mark.parametrize("dtype", ["<U1", "datetime64[s]", np.longdouble])
def test_a_numpy_dataset_of_an_array_jax_cannot_hold_is_an_spmd_error(strategy, dtype):
    x = _rows(0, n=64, dtype=np.float32)
    bad = np.arange(64).astype(dtype)
    with pytest.raises((spmd.BatchError, spmd.ConfigurationError), match="dtype"):
        list(strategy.distribute_dataset(strategy.make_numpy_dataset((x, bad), N)))
