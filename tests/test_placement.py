"""Placement: every batch and state move goes through spmd/_src/placement.py and its one cache.

The numbers are checked against the one-device oracle: the same step under plain
`jax.jit` on numpy batches.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from diloco_reference import batches, create, make_step
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from spmd._src import placement
from spmd._src.placement import CACHE, put_host
from spmd._src.trainer.model import stack

pytestmark = pytest.mark.cpu_mesh


def _data(n=4, rows=16):
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(rows, 3)).astype(np.float32), rng.normal(size=(rows,)).astype(np.float32))
        for _ in range(n)
    ]


def _sgd(w, x, y):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - 0.1 * grad, loss


def _key(strategy, ndim=2, axis=0):
    return (strategy.mesh, strategy.batch_axes, ndim > axis, axis)


@pytest.fixture
def cache():
    CACHE.clear()
    yield CACHE
    CACHE.clear()


def test_two_strategies_on_one_mesh_share_one_sharding_per_rank_and_axis(cache):
    a, b = spmd.MirroredStrategy(), spmd.MirroredStrategy()
    assert a is not b and a.mesh == b.mesh
    assert a.batch_sharding(2) is b.batch_sharding(2) is cache.shardings[_key(a)]
    assert a.batch_sharding(1, axis=1) is b.batch_sharding(0, axis=1)  # no batch axis: replicated
    assert a.batch_sharding(2) is not a.batch_sharding(2, axis=1)
    assert set(cache.shardings) == {_key(a), _key(a, 0, 1), _key(a, 2, 1)}


@pytest.mark.slow  # 7 s of CPU: compiles a step, DiLoCo's programs and a stacked batch
def test_iterators_steps_diloco_and_the_trainers_stack_hit_the_one_cache(cache):
    """The iterator of one strategy, the step of another on the same mesh, DiLoCo's
    batch path and the Trainer's stacked batches all read and fill CACHE, and the
    step's losses are the one-device oracle's."""
    placing, stepping = spmd.MirroredStrategy(), spmd.MirroredStrategy()
    data = _data()
    dist = placing.distribute_dataset(data)
    step = stepping.step(_sgd)
    w = jnp.zeros(3)
    oracle, w_oracle = [], jnp.zeros(3)
    for (xb, yb), (x, y) in zip(dist, data, strict=True):
        assert xb.sharding is cache.shardings[_key(stepping)]
        assert yb.sharding is cache.shardings[_key(stepping, 1)]
        w, loss = step(w, xb, yb)
        w_oracle, want = jax.jit(_sgd)(w_oracle, x, y)
        oracle.append(want)
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-6)
    assert step._hot.program.data_shardings == [xb.sharding, yb.sharding]
    assert all(
        map(lambda a, b: a is b, step._hot.program.data_shardings, [xb.sharding, yb.sharding])
    )
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_oracle), rtol=1e-5, atol=1e-6)
    # the input pipeline planned its batch once: one batch signature, a plan per leaf
    assert len(cache.batches) == 1
    assert {(k[0], k[1]) for k in cache.plans} == {
        (cache.shardings[_key(placing)], (16, 3)),
        (cache.shardings[_key(placing, 1)], (16,)),
    }

    diloco = spmd.DiLoCo(islands=2, sync_every=2)
    state = diloco.init(create, jax.random.key(0), inner="sgd")
    state, _ = diloco.step(make_step("sgd"))(state, *batches(1)[0])
    assert diloco.synchronous.mesh != stepping.mesh
    assert _key(diloco.synchronous) in cache.shardings

    stacked = stack(stepping, [(x, y) for x, y in data[:2]])
    assert stacked[0].sharding is cache.shardings[_key(stepping, 3, 1)]
    assert stacked[1].sharding is cache.shardings[_key(stepping, 2, 1)]
    np.testing.assert_array_equal(np.asarray(stacked[0][1]), data[1][0])
    # a batch's ranks share one sharding per axis: plain and stacked here, DiLoCo's mesh's
    assert set(cache.shardings) == {_key(stepping), _key(stepping, 2, 1), _key(diloco.synchronous)}


def test_a_batch_of_the_wrong_size_or_rank_is_still_a_clear_error(cache):
    strategy = spmd.MirroredStrategy()
    x = np.ones((12, 3), np.float32)  # 12 rows over 8 replicas
    with pytest.raises(spmd.BatchError, match=r"split evenly over the 8 replicas"):
        strategy.distribute_batch(x)
    with pytest.raises(spmd.BatchError, match=r"global_batch_size=12"):
        strategy.step(_sgd)(jnp.zeros(3), x, np.ones(12, np.float32))
    ragged = (np.ones((16, 3), np.float32), np.ones((8,), np.float32))
    with pytest.raises(spmd.BatchError, match=r"leading"):
        strategy.distribute_batch(ragged)
    # a rank the program was not built for compiles its own program; a rank the
    # function cannot take is the function's own error, not a silent result
    step = strategy.step(_sgd)
    with pytest.raises(TypeError):
        step(jnp.zeros(3), np.ones((16, 3, 2), np.float32), np.ones(16, np.float32))


def test_put_host_places_as_device_put_does(cache):
    """The input pipeline's batched transfer gives device_put's arrays: dtypes
    canonicalized (float64 -> float32), the same sharding, committed, and a copy
    (the host buffer changed afterwards leaves the placed batch as it was)."""
    strategy = spmd.MirroredStrategy()
    x = np.arange(64 * 3, dtype=np.float64).reshape(64, 3)
    y = np.arange(64, dtype=np.int64)
    scalar = np.asarray(2.5)
    shardings = [strategy.batch_sharding(2), strategy.batch_sharding(1), strategy.replicated]
    got = put_host([x, y, scalar], shardings)
    want = jax.device_put([x, y, scalar], shardings)
    x[0, 0] = 99.0
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.sharding == w.sharding and g.committed
        assert g.aval == w.aval  # the type jit sees: sharding and memory space included
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert float(got[0][0, 0]) == 0.0
    assert len(cache.plans) == 3  # one plan per (sharding, shape, dtype)
    # a leaf that is not a plain numpy array takes jax.device_put
    [placed] = put_host([jnp.ones((8, 2))], [strategy.batch_sharding(2)])
    assert placed.sharding == strategy.batch_sharding(2)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_put_host_types_a_batch_as_device_put_does_on_any_mesh(axis_type):
    """On a mesh of explicit axes the type carries the sharding (float32[16@d,1]):
    a batch placed by the input pipeline has device_put's type, so a step sees the
    same program input either way."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(getattr(AxisType, axis_type),))
    sharding = NamedSharding(mesh, P("d"))
    x = np.arange(16, dtype=np.float32).reshape(16, 1)
    [got] = put_host([x], [sharding])
    want = jax.device_put(x, sharding)
    assert got.aval == want.aval and jax.typeof(got) == jax.typeof(want)
    with jax.set_mesh(mesh):
        double = jax.jit(lambda v: v * 2)
        np.testing.assert_array_equal(np.asarray(double(got)), np.asarray(double(want)))


def test_a_full_cache_drops_its_oldest_entry_and_stays_bounded():
    small = placement.Cache(size=2)
    for i in range(5):
        small.add(small.plans, i, i)
    assert small.plans == {3: 3, 4: 4}
    small.clear()
    assert not (small.plans or small.shardings or small.batches)


def test_a_cleared_cache_costs_the_fast_path_identity_never_a_number(cache):
    """Batches placed before a clear carry shardings equal to, not the same object as,
    those a step compiled after it takes: the step moves nothing and computes the
    oracle's numbers."""
    strategy = spmd.MirroredStrategy()
    data = _data(3)
    placed = [strategy.distribute_batch(batch) for batch in data]
    cache.clear()
    step, w, w_oracle = strategy.step(_sgd), jnp.zeros(3), jnp.zeros(3)
    for (xb, yb), (x, y) in zip(placed, data, strict=True):
        assert xb.sharding == strategy.batch_sharding(2)
        assert xb.sharding is not strategy.batch_sharding(2)
        w, loss = step(w, xb, yb)
        w_oracle, want = jax.jit(_sgd)(w_oracle, x, y)
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-6)
    assert step.cache_size() == 1


def test_a_batch_placed_by_another_batch_layout_is_moved_to_the_steps(cache):
    mesh = spmd.make_mesh({"data": 4, "model": 2})
    by_data = spmd.Strategy(mesh, batch_axes=("data",))
    by_both = spmd.Strategy(mesh, batch_axes=("data", "model"))
    assert by_data.batch_sharding(2) is not by_both.batch_sharding(2)
    x, y = _data(1)[0]
    xb, yb = by_both.distribute_batch((x, y))
    w, loss = by_data.step(_sgd)(jnp.zeros(3), xb, yb)
    w_oracle, want = jax.jit(_sgd)(jnp.zeros(3), x, y)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_oracle), rtol=1e-5, atol=1e-6)
