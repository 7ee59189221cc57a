"""distribute_dataset places each batch with its own values, dtypes and structure, as
batches change between steps.

Every batch is flattened once, its leaves copied, checked in one pass and
placed by a plan cached per (structure, shapes, dtypes). Each test feeds a
pipeline whose batches change as real ones do and checks every placed value,
dtype and sharding against the numpy rows it must hold (the oracle is
`jnp.asarray` of the batch as read: what `jax.jit` would be given).
`input_strategy` (tests/conftest.py) runs each on one device, eight replicas
and a 4x2 mesh.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import spmd
from spmd._src.data.host_batches import HostBatch
from spmd._src.data.iterator import _describe
from spmd._src.trainer.data import as_dataset

N, FEATURES = 16, 4  # rows a batch, features a row
ALIASABLE = 1024  # 128 rows a device: shards whose views of the host buffer can be aliased


def _expected(batch):
    """What jax.jit would be given: each leaf as jnp.asarray makes it, read as numpy."""
    return jax.tree.map(lambda a: np.asarray(jnp.asarray(a)), batch)


def _check(input_strategy, placed, oracle):
    """Same structure, dtypes, values and the batch sharding for every leaf."""
    assert jax.tree.structure(placed) == jax.tree.structure(oracle)
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(oracle), strict=True):
        assert isinstance(got, jax.Array)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.sharding.is_equivalent_to(input_strategy.batch_sharding(got.ndim), got.ndim)


def _feed(input_strategy, batches, options=None):
    """Reads every placed batch, and the oracles taken before the pipeline reads the next one."""
    oracles, placed = [], []

    def source():
        for b in batches:
            oracles.append(_expected(b))
            yield b

    for b in input_strategy.distribute_dataset(source(), options):
        placed.append(b)
    return placed, oracles


def _rows(i, n=N, dtype=np.float64):
    return (np.arange(n * 3, dtype=np.float64).reshape(n, 3) + 100 * i).astype(dtype)


def _batch(i, size=N):
    x = np.arange(size * FEATURES, dtype=np.float32).reshape(size, FEATURES) + 1000 * i
    return x, np.arange(size, dtype=np.int32) + 100 * i


def _read(dist):
    return [jax.tree.map(np.asarray, b) for b in dist]


# -- dtypes change mid-stream --------------------------------------------------


def test_dtype_changes_between_batches_with_the_same_shapes(input_strategy):
    dtypes = [np.float64, np.float32, np.float16, np.bool_, np.int64, np.int32, np.uint8]
    dtypes += [np.float64, np.int64]  # back to signatures planned before
    batches = [(_rows(i, dtype=d), np.arange(N, dtype=np.int64) + i) for i, d in enumerate(dtypes)]
    placed, oracles = _feed(input_strategy, batches)
    assert len(placed) == len(batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(input_strategy, p, o)
    assert placed[0][0].dtype == jnp.float32 and placed[4][0].dtype == jnp.int32  # x64 off


def test_a_batch_whose_dtypes_and_feature_shapes_change_mid_stream_is_placed_as_is(input_strategy):
    x, y = _batch(1)
    batches = [_batch(0), (x[:, :2], y.astype(np.int8)), (x.astype(np.float64), y), _batch(3)]
    got = _read(input_strategy.distribute_dataset(batches))
    for want, have in zip(batches, got, strict=True):
        for w, h in zip(want, have, strict=True):
            expected = jax.dtypes.canonicalize_dtype(w.dtype)  # float64 -> float32 without x64
            assert h.dtype == expected and h.shape == w.shape
            assert np.array_equal(h, w.astype(expected))


def test_a_bfloat16_batch_is_placed_as_jax_jit_takes_it(input_strategy):
    batches = [(_rows(0, dtype=np.float32),), (_rows(1, dtype=ml_dtypes.bfloat16),)]
    placed, oracles = _feed(input_strategy, batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(input_strategy, p, o)


def test_a_float8_batch_is_placed_as_jax_jit_takes_it(input_strategy):
    placed, oracles = _feed(input_strategy, [(_rows(0, dtype=ml_dtypes.float8_e4m3fn),)])
    _check(input_strategy, placed[0], oracles[0])


def test_distribute_batch_takes_bfloat16_as_distribute_dataset_does(input_strategy):
    x = _rows(0, dtype=ml_dtypes.bfloat16)
    placed = input_strategy.distribute_batch(x)
    _check(input_strategy, placed, _expected(x))


def test_a_big_endian_leaf_is_placed_with_its_values_in_native_order(input_strategy):
    rows = np.arange(N * 3).reshape(N, 3).astype(">f4")
    (placed,) = next(iter(input_strategy.distribute_dataset([(rows,)])))
    assert placed.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(placed), rows.astype("<f4"))


def test_a_numpy_dataset_of_big_endian_arrays_gives_their_values(input_strategy):
    x = np.arange(64 * 3).reshape(64, 3).astype(">f4")
    batches = list(input_strategy.distribute_dataset(input_strategy.make_numpy_dataset((x,), N)))
    got = np.concatenate([np.asarray(b[0]) for b in batches])
    np.testing.assert_array_equal(got, x.astype("<f4"))


# -- shapes change -------------------------------------------------------------


def test_an_lm_whose_sequence_length_changes_every_batch(input_strategy):
    lengths = [7, 12, 7, 33, 1, 12]
    batches = [
        {"tokens": np.arange(N * t, dtype=np.int64).reshape(N, t) % 97 + i, "len": np.full(N, t)}
        for i, t in enumerate(lengths)
    ]
    placed, oracles = _feed(input_strategy, batches)
    assert [p["tokens"].shape[1] for p in placed] == lengths
    for p, o in zip(placed, oracles, strict=True):
        _check(input_strategy, p, o)


@pytest.mark.parametrize("remainder", ["pad", "drop", "error"])
def test_a_last_partial_batch(input_strategy, remainder):
    full = [(_rows(i), np.arange(N) + N * i) for i in range(2)]
    last = (_rows(2, n=5), np.arange(5) + 2 * N)
    options = spmd.InputOptions(remainder=remainder)
    if remainder == "error":
        dist = iter(input_strategy.distribute_dataset([*full, last], options))
        seen = [next(dist), next(dist)]
        with pytest.raises(spmd.BatchError, match="batch_index=2.*batch_size=5"):
            next(dist)
        assert len(seen) == 2
        return
    placed, oracles = _feed(input_strategy, [*full, last], options)
    if remainder == "drop":
        assert len(placed) == 2 and len(oracles) == 3
        for p, o in zip(placed, oracles[:2], strict=True):
            _check(input_strategy, p, o)
        return
    assert len(placed) == 3
    fill = np.r_[np.arange(5), np.full(N - 5, 4)]  # the last real row repeated
    x, y, mask = placed[2]
    _check(input_strategy, (x, y), (oracles[2][0][fill], oracles[2][1][fill]))
    np.testing.assert_array_equal(np.asarray(mask), (np.arange(N) < 5).astype(np.float32))
    for p, o in zip(placed[:2], oracles[:2], strict=True):
        assert isinstance(p, spmd.PaddedBatch)
        _check(input_strategy, p.inputs, o)
        np.testing.assert_array_equal(np.asarray(p.mask), np.ones(N, np.float32))


def test_scalar_and_0d_leaves_beside_rows_are_replicated_and_may_change(input_strategy):
    batches = [
        {"x": _rows(0), "lr": 0.5, "step": np.int64(3), "t": np.array(2.0)},
        {"x": _rows(1), "lr": 0.25, "step": np.int64(4), "t": np.array(7.0)},
        {"x": _rows(2), "lr": 1, "step": np.int32(5), "t": np.array(True)},
    ]
    placed, oracles = _feed(input_strategy, batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(input_strategy, p, o)
    assert float(placed[1]["lr"]) == 0.25 and int(placed[2]["step"]) == 5


# -- structure changes ---------------------------------------------------------


def test_structure_changes_keys_added_removed_reordered_tuple_list_none(input_strategy):
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
    placed, oracles = _feed(input_strategy, batches)
    assert type(placed[4]) is tuple and type(placed[5]) is list and placed[6]["b"] is None
    for p, o in zip(placed, oracles, strict=True):
        _check(input_strategy, p, o)


def test_a_batch_whose_structure_changes_mid_stream_keeps_its_own_structure(input_strategy):
    x, y = _batch(1)
    batches = [_batch(0), {"x": x, "y": y}, (x, y, y.astype(np.float32)), _batch(3)]
    got = _read(input_strategy.distribute_dataset(batches))
    assert len(got) == 4
    for want, have in zip(batches, got, strict=True):
        assert jax.tree.structure(have) == jax.tree.structure(want)
        for w, h in zip(jax.tree.leaves(want), jax.tree.leaves(have), strict=True):
            assert h.dtype == w.dtype and np.array_equal(h, w)


def test_the_shapes_record_processes_compare_names_global_shapes():
    """Processes may hold unequal parts of one global batch (a mesh over the devices that
    divide it): what they compare is each leaf's global shape, and the padding."""
    x, y = _batch(0)
    batch = HostBatch({"x": x, "y": y}, np.ones(N, np.float32), 32)
    treedef = jax.tree.structure({"x": x, "y": y})
    assert _describe(batch) == f"{treedef}: float32[32, 4], int32[32] + mask of global 32"
    padded = HostBatch({"x": x, "y": y}, np.ones(N, np.float32), 32, batch_size=30)
    assert _describe(padded).endswith("+ mask of global 32 (30 padded)")
    assert jax.tree.all(jax.tree.map(np.array_equal, batch.tree, {"x": x, "y": y}))


# -- the arrays the pipeline yields --------------------------------------------


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


def test_views_fortran_strided_negative_readonly_subclass_broadcast(input_strategy):
    views = _views()
    batches = [{k: v + i for k, v in views.items()} for i in range(2)]
    batches.append(views)  # the views themselves (read-only, broadcast, subclass as given)
    placed, oracles = _feed(input_strategy, batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(input_strategy, p, o)


def test_a_memmap_batch(input_strategy, tmp_path):
    mm = np.memmap(tmp_path / "rows.bin", np.float32, "w+", shape=(3 * N, 4))
    mm[:] = np.arange(3 * N * 4, dtype=np.float32).reshape(3 * N, 4)
    mm.flush()
    ro = np.memmap(tmp_path / "rows.bin", np.float32, "r", shape=(3 * N, 4))
    batches = [(ro[i * N : (i + 1) * N],) for i in range(3)]
    placed, oracles = _feed(input_strategy, batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(input_strategy, p, o)
    ds = input_strategy.make_numpy_dataset(ro, N, shuffle=True, seed=3)
    order = np.random.default_rng([3, 0]).permutation(3 * N)
    for b, got in enumerate(input_strategy.distribute_dataset(ds)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ro)[order[b * N : (b + 1) * N]])


@pytest.mark.cpu_mesh
def test_jax_arrays_yielded_on_device_on_another_device_and_sharded(input_strategy):
    x = _rows(0, dtype=np.float32)
    other = jax.devices()[5]
    batches = [
        (x, np.arange(N)),  # numpy first: its plan is made for numpy leaves
        (jnp.asarray(x + 1), jnp.arange(N) + 1),  # the same signature, jax arrays
        (jax.device_put(x + 2, other), jax.device_put(np.arange(N) + 2, other)),
        (jax.device_put(x + 3, spmd.MirroredStrategy().batch_sharding(2)), np.arange(N) + 3),
        (x + 4, np.arange(N) + 4),
    ]
    placed, oracles = _feed(input_strategy, batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(input_strategy, p, o)


# -- the plan cache ------------------------------------------------------------


@pytest.mark.slow
def test_more_than_64_signatures_in_one_epoch_then_the_early_ones_again(input_strategy):
    widths = list(range(1, 71)) + [1, 2, 3, 70, 69]
    batches = [
        (_rows(i, dtype=np.float32)[:, :1].repeat(w, 1) + w, np.arange(N) + i)
        for i, w in enumerate(widths)
    ]
    placed, oracles = _feed(input_strategy, batches)
    assert [p[0].shape[1] for p in placed] == widths
    for p, o in zip(placed, oracles, strict=True):
        _check(input_strategy, p, o)


def test_the_same_shapes_in_another_dtype_is_another_plan(input_strategy):
    x = np.arange(N * 2).reshape(N, 2)
    batches = [x.astype(d) + 0.5 * (d == np.float64) for d in (np.float64, np.int64, np.float64)]
    batches += [x.astype(np.complex128) * 1j, (x > 3)]
    placed, oracles = _feed(input_strategy, batches)
    for p, o in zip(placed, oracles, strict=True):
        _check(input_strategy, p, o)
    np.testing.assert_array_equal(np.asarray(placed[0]), x + 0.5)


# -- the values are the input rows ---------------------------------------------


def test_a_smaller_last_batch_is_dropped_under_drop(input_strategy):
    options = spmd.InputOptions(remainder="drop")
    got = _read(input_strategy.distribute_dataset([_batch(0), _batch(1, size=8)], options))
    assert len(got) == 1 and np.array_equal(got[0][0], _batch(0)[0])


@pytest.mark.parametrize("last", [N, 5])
def test_the_placed_values_are_the_rows_with_and_without_padding(input_strategy, last):
    batches = [_batch(0), _batch(1), _batch(2, size=last)]
    options = spmd.InputOptions(remainder="pad")
    for opts in (None, options) if last == N else (options,):
        got = _read(input_strategy.distribute_dataset(batches, opts))
        assert len(got) == 3
        for i, (want, have) in enumerate(zip(batches, got, strict=True)):
            real = len(want[1])
            fill = np.r_[np.arange(real), np.full(N - real, real - 1)]
            if opts is None:
                assert type(have) is tuple and len(have) == 2
            else:
                assert isinstance(have, spmd.PaddedBatch), i
                np.testing.assert_array_equal(have.mask, (np.arange(N) < real) * 1.0)
            for w, h in zip(want, have[:2], strict=True):
                assert h.dtype == w.dtype and np.array_equal(h, w[fill])


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("pad", [False, True])
def test_fits_dataset_of_arrays_gives_the_rows_numpy_orders(input_strategy, shuffle, pad):
    n, seed = 75, 3
    x = np.random.default_rng(0).normal(size=(n, FEATURES)).astype(np.float32)
    y = np.arange(n, dtype=np.int32)
    what = "evaluate" if pad else "fit"
    dist = as_dataset(input_strategy, (x, y), N, shuffle=shuffle, pad=pad, seed=seed, what=what)
    for epoch in range(2):
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        got = _read(dist)
        count = -(-n // N) if pad else n // N
        assert len(got) == count
        for b, have in enumerate(got):
            rows = order[b * N : (b + 1) * N]
            real = len(rows)
            rows = np.r_[rows, np.full(N - real, rows[-1])]
            assert np.array_equal(have[0], x[rows]) and np.array_equal(have[1], y[rows])
            if pad:
                assert isinstance(have, spmd.PaddedBatch)
                np.testing.assert_array_equal(have.mask, (np.arange(N) < real) * 1.0)


def test_an_unshuffled_batch_is_a_copy_not_a_view_of_the_callers_arrays(input_strategy):
    x, y = np.zeros((64, FEATURES), np.float32), np.zeros(64, np.int32)
    dist = input_strategy.distribute_dataset(input_strategy.make_numpy_dataset((x, y), N))
    host = dist._plan.batches(0, 0)
    first = next(host)
    x[:] = 7
    assert not np.shares_memory(first.leaves[0], x) and not first.leaves[0].any()
    placed = _read(dist)
    assert all(np.array_equal(b[0], np.full((N, FEATURES), 7)) for b in placed)


# -- a loader that refills one buffer -------------------------------------------------


def _buffer(kind):
    """A loader's buffer: rows of features, or one of ALIASABLE float32 on a 64-byte
    boundary (as XLA:CPU aliases them)."""
    if kind == "rows":
        return np.zeros((N, 3), np.float32)
    raw = np.zeros(ALIASABLE + 16, np.float32)
    skip = (-raw.ctypes.data % 64) // 4
    return raw[skip : skip + ALIASABLE]


@pytest.mark.parametrize("prefetch", [None, 0, 2])
@pytest.mark.parametrize("kind", ["rows", "aliasable"])
def test_a_loader_refilling_one_buffer_keeps_each_batchs_values(input_strategy, kind, prefetch):
    """A loader that fills one buffer for every batch (as hand-written loaders do)."""
    buf = _buffer(kind)
    labels = np.zeros(len(buf), np.int32)

    def loader():
        for i in range(6):
            buf[:] = i
            labels[:] = 10 * i
            yield {"x": buf, "y": labels}

    options = None if prefetch is None else spmd.InputOptions(prefetch=prefetch)
    dist = iter(input_strategy.distribute_dataset(loader(), options))
    first = next(dist)
    rest = list(dist)  # batch 0 read long before these; its values must not move
    assert len(rest) == 5
    for i, b in enumerate([first, *rest]):
        np.testing.assert_array_equal(np.asarray(b["x"]), np.full(buf.shape, i, np.float32))
        np.testing.assert_array_equal(np.asarray(b["y"]), np.full(len(buf), 10 * i, np.int32))
