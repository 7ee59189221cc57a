"""The per-replica view: run, reduce, gather, local_results, ReplicaContext, loss helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import spmd

X = np.arange(16, dtype=np.float32).reshape(16, 1)


@pytest.mark.cpu_mesh
def test_run_gives_each_replica_its_slice_and_context():
    strategy = spmd.MirroredStrategy()

    def fn(x):
        ctx = spmd.get_replica_context()
        assert ctx.num_replicas_in_sync == 8
        return {
            "sum": x.sum(),
            "id": ctx.replica_id_in_sync_group,
            "total": ctx.all_reduce("SUM", x.sum()),
        }

    with strategy.scope():
        out = strategy.run(fn, args=(X,))
    assert set(out) == {"sum", "id", "total"}  # fn's structure, a PerReplica at each leaf
    assert all(isinstance(v, spmd.PerReplica) for v in out.values())
    np.testing.assert_array_equal(out["sum"].values, X.reshape(8, 2).sum(1))
    np.testing.assert_array_equal(out["id"].values, np.arange(8))
    np.testing.assert_array_equal(out["total"].values, np.full(8, X.sum()))


@pytest.mark.cpu_mesh
def test_reduce_sum_mean_and_axis():
    strategy = spmd.MirroredStrategy()
    per_replica = strategy.run(lambda x: x, args=(X,))  # each replica: shape (2, 1)
    assert float(strategy.reduce("SUM", strategy.run(jnp.sum, args=(X,)))) == X.sum()
    assert (
        float(strategy.reduce(spmd.ReduceOp.MEAN, strategy.run(jnp.sum, args=(X,)))) == X.sum() / 8
    )
    np.testing.assert_array_equal(
        strategy.reduce("SUM", per_replica, axis=None), X.reshape(8, 2, 1).sum(0)
    )
    np.testing.assert_array_equal(strategy.reduce("sum", per_replica, axis=0), X.sum(0))
    np.testing.assert_array_equal(strategy.reduce("MEAN", per_replica, axis=0), X.mean(0))
    assert float(strategy.reduce("MAX", strategy.run(jnp.max, args=(X,)))) == 15.0


def test_reduce_of_a_global_value():
    strategy = spmd.MirroredStrategy()
    value = jnp.arange(4.0)
    assert strategy.reduce("SUM", value, axis=None) is value
    assert float(strategy.reduce("SUM", value, axis=0)) == 6.0


def test_unknown_reduce_op_teaches():
    with pytest.raises(spmd.ConfigurationError) as info:
        spmd.MirroredStrategy().reduce("AVERAGE", jnp.ones(2))
    assert "op='AVERAGE'" in str(info.value) and "ReduceOp.SUM" in str(info.value)


@pytest.mark.cpu_mesh
def test_gather_and_local_results():
    strategy = spmd.MirroredStrategy()
    per_replica = strategy.run(lambda x: x * 2, args=(X,))
    np.testing.assert_array_equal(strategy.gather(per_replica, axis=0), X * 2)
    rows = strategy.run(lambda x: x.T, args=(X,))  # each (1, 2)
    np.testing.assert_array_equal(strategy.gather(rows, axis=1), (X.T))
    with strategy.scope():  # works inside the scope's mesh context too
        local = strategy.local_results(per_replica)
    assert len(local) == 8
    np.testing.assert_array_equal(local[3], X[6:8] * 2)
    assert local[3].devices() == {strategy.devices[3]}


@pytest.mark.cpu_mesh
def test_per_replica_values_flow_back_into_run():
    strategy = spmd.MirroredStrategy()
    first = strategy.run(lambda x: x.sum(), args=(X,))
    second = strategy.run(lambda s, scale: s * scale, args=(first,), kwargs={"scale": 10.0})
    np.testing.assert_array_equal(second.values, X.reshape(8, 2).sum(1) * 10)


@pytest.mark.cpu_mesh
@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("training", True, X * 2),
        ("training", False, X),
        ("mode", "double", X * 2),
        ("activation", jnp.tanh, np.tanh(X)),
        ("config", (("scale", 3.0),), X * 3),
    ],
    ids=["true", "false", "string", "function", "tuple"],
)
def test_run_passes_python_values_to_fn_as_they_are(name, value, expected):
    """As tf.distribute does: fn can branch on `training=True` or call a function it
    was given; each value compiles its own program, the arrays stay traced."""
    strategy = spmd.MirroredStrategy()

    def fn(x, **kwargs):
        given = kwargs[name]
        if name == "training":
            return x * 2 if given else x
        if name == "mode":
            return x * 2 if given == "double" else x
        if name == "activation":
            return given(x)
        return x * dict(given)["scale"]

    for _ in range(2):  # the second call reuses the first's program
        out = strategy.run(fn, args=(X,), kwargs={name: value})
        np.testing.assert_allclose(strategy.gather(out), expected, rtol=1e-6)


@pytest.mark.cpu_mesh
def test_run_passes_a_python_value_among_its_positional_arguments():
    strategy = spmd.MirroredStrategy()
    out = strategy.run(lambda x, training: x * 2 if training else x, args=(X, True))
    np.testing.assert_array_equal(strategy.gather(out), X * 2)


def test_run_with_an_unhashable_python_value_names_it_and_the_fix():
    with pytest.raises(spmd.ConfigurationError, match="must be hashable") as info:
        spmd.MirroredStrategy().run(lambda x, table: x, args=(X,), kwargs={"table": {1, 2}})
    assert "type='set'" in str(info.value) and "functools.partial" in str(info.value)


@pytest.mark.cpu_mesh
def test_run_over_batch_axes_of_a_two_d_mesh():
    strategy = spmd.Strategy(spmd.make_mesh({"data": 4, "model": 2}), batch_axes=("data",))
    out = strategy.run(lambda x: spmd.get_replica_context().all_gather(x.sum()[None]), args=(X,))
    assert out.values.shape == (4, 4)
    np.testing.assert_array_equal(out.values[0], X.reshape(4, 4).sum(1))


def test_replica_context_outside_run():
    assert spmd.get_replica_context().num_replicas_in_sync == 1
    with spmd.MirroredStrategy().scope():
        assert spmd.get_replica_context() is None  # cross-replica context


def test_compute_average_loss_uses_the_global_batch():
    strategy = spmd.MirroredStrategy()
    per_example = np.arange(16, dtype=np.float32)
    out = strategy.run(lambda loss: spmd.compute_average_loss(loss), args=(per_example,))
    assert float(strategy.reduce("SUM", out)) == pytest.approx(per_example.mean())
    weights = np.ones(16, np.float32)
    weights[::2] = 0
    out = strategy.run(
        lambda loss, w: spmd.compute_average_loss(loss, 16, w), args=(per_example, weights)
    )
    assert float(strategy.reduce("SUM", out)) == pytest.approx((per_example * weights).sum() / 16)
    assert float(spmd.compute_average_loss(per_example)) == pytest.approx(per_example.mean())
    with pytest.raises(spmd.ConfigurationError, match="per-example loss"):
        spmd.compute_average_loss(jnp.float32(1.0))


def test_scale_regularization_loss():
    strategy = spmd.MirroredStrategy()
    out = strategy.run(lambda x: spmd.scale_regularization_loss(jnp.float32(8.0)), args=(X,))
    assert float(strategy.reduce("SUM", out)) == 8.0
    assert float(spmd.scale_regularization_loss(8.0)) == 8.0


@pytest.mark.slow
def test_custom_loop_with_run_and_reduce_matches_one_device():
    """The seeds' custom training loop: per-replica loss and grads, SUM-reduced, applied once."""
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(4, 32, 8)).astype(np.float32)
    ys = rng.normal(size=(4, 32, 1)).astype(np.float32)
    tx = optax.sgd(0.1)

    def per_example(params, x, y):
        return ((x @ params["w"] + params["b"] - y) ** 2).sum(-1)

    def grad_fn(x, y, params):
        def loss(p):
            return spmd.compute_average_loss(per_example(p, x, y))

        return jax.value_and_grad(loss)(params)

    strategy = spmd.MirroredStrategy()

    @strategy.step
    def step(state, x, y):
        params, opt = state
        per_replica = strategy.run(grad_fn, args=(x, y), kwargs={"params": params})
        loss, grads = strategy.reduce("SUM", per_replica)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss

    params = {"w": jnp.zeros((8, 1)), "b": jnp.zeros(1)}
    oracle_params = jax.tree.map(jnp.copy, params)
    oracle_opt = tx.init(oracle_params)
    state = (params, tx.init(params))
    for x, y in zip(xs, ys, strict=True):
        state, loss = step(state, x, y)
        want, grads = jax.value_and_grad(lambda p, x=x, y=y: per_example(p, x, y).mean())(
            oracle_params
        )
        updates, oracle_opt = tx.update(grads, oracle_opt, oracle_params)
        oracle_params = optax.apply_updates(oracle_params, updates)
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    np.testing.assert_allclose(state[0]["w"], oracle_params["w"], rtol=1e-5, atol=1e-6)
    assert step.cache_size() == 1
    assert state[0]["w"].sharding.spec == P()


# -- compute_average_loss / scale_regularization_loss: their arguments checked -----------


@pytest.mark.parametrize("size", [0, -1, 10.0, [10], True, np.float32(10), jnp.array([10])])
def test_compute_average_loss_rejects_a_bad_global_batch_size(size):
    with pytest.raises(spmd.ConfigurationError, match="global_batch_size"):
        spmd.compute_average_loss(np.ones(10, np.float32), global_batch_size=size)


@pytest.mark.parametrize("size", [10, np.int64(10), jnp.int32(10), np.array(10)])
def test_compute_average_loss_takes_integer_scalars(size):
    out = spmd.compute_average_loss(np.arange(10, dtype=np.float32), global_batch_size=size)
    assert float(out) == pytest.approx(4.5)


def test_compute_average_loss_takes_a_traced_global_batch_size():
    fn = jax.jit(lambda loss, n: spmd.compute_average_loss(loss, global_batch_size=n))
    assert float(fn(np.arange(10, dtype=np.float32), 5)) == pytest.approx(9.0)


def test_compute_average_loss_checks_sample_weight_shape():
    loss = np.arange(8, dtype=np.float32)
    with pytest.raises(spmd.ConfigurationError, match="sample_weight"):
        spmd.compute_average_loss(loss, sample_weight=np.ones(4, np.float32))
    with pytest.raises(spmd.ConfigurationError, match="rank at least 1"):
        spmd.compute_average_loss(np.float32(3.0), global_batch_size=1)
    # (batch, 1) weights of a (batch,) loss weigh each example once (TF squeezes them)
    column = spmd.compute_average_loss(loss, sample_weight=np.full((8, 1), 2.0, np.float32))
    assert float(column) == pytest.approx(2 * loss.mean())


@pytest.mark.cpu_mesh
def test_scale_regularization_loss_sums_a_vector_then_divides():
    strategy = spmd.MirroredStrategy(jax.devices()[:2])
    out = strategy.run(lambda: spmd.scale_regularization_loss(jnp.array([5.0, 12.4, 10.0])))
    np.testing.assert_allclose(np.asarray(out.values), [13.7, 13.7], rtol=1e-6)
    assert float(spmd.scale_regularization_loss(np.array([1.0, 2.0]))) == 3.0


# -- items 7, 8, 17: run's structure, reduce over structures, context inside run, caches --


@pytest.mark.cpu_mesh
def test_run_returns_fns_structure_with_per_replica_leaves():
    strategy = spmd.MirroredStrategy()
    a, b = strategy.run(lambda x: (x.sum(), x * 2), args=(X,))
    assert isinstance(a, spmd.PerReplica) and isinstance(b, spmd.PerReplica)
    total, doubled = strategy.reduce("SUM", (a, b))
    assert float(total) == X.sum()
    np.testing.assert_allclose(doubled, (X * 2).reshape(8, 2, 1).sum(0))
    out = strategy.run(lambda x: {"loss": x.mean(), "n": x.shape[0]}, args=(X,))
    reduced = strategy.reduce("MEAN", out)
    assert set(reduced) == {"loss", "n"} and float(reduced["loss"]) == pytest.approx(X.mean())
    gathered = strategy.gather({"x": strategy.run(lambda x: x, args=(X,))}, axis=0)
    np.testing.assert_array_equal(gathered["x"], X)
    local = strategy.local_results((a, b))
    assert len(local) == 8 and float(local[3][0]) == X[6:8].sum()
    assert strategy.experimental_local_results(a)[0].shape == ()


@pytest.mark.cpu_mesh
def test_reduce_along_a_negative_axis():
    strategy = spmd.MirroredStrategy()
    per_replica = strategy.run(lambda x: x.reshape(1, 2) * 1.0, args=(X,))
    np.testing.assert_allclose(strategy.reduce("SUM", per_replica, axis=-1), X.sum())
    np.testing.assert_allclose(strategy.reduce("MEAN", per_replica, axis=-1), X.mean())
    with pytest.raises(spmd.ConfigurationError, match="axis"):
        strategy.reduce("SUM", per_replica, axis=2)


def test_inside_run_the_running_strategy_is_current():
    strategy = spmd.MirroredStrategy()
    seen = {}

    def fn(x):
        seen["strategy"] = spmd.get_strategy()
        seen["has"] = spmd.has_strategy()
        seen["cross"] = spmd.in_cross_replica_context()
        return x

    strategy.run(fn, args=(X,))
    assert seen == {"strategy": strategy, "has": True, "cross": False}
    with strategy.scope():
        assert spmd.in_cross_replica_context()
        strategy.run(lambda x: fn(x) + 1, args=(X,))
    assert seen["strategy"] is strategy and seen["cross"] is False
    assert not spmd.has_strategy()


def test_run_of_a_new_lambda_each_call_compiles_once(monkeypatch):
    """A new lambda each call with the same code and captures is one program; the programs
    kept are bounded (the bound lowered to 4 here: the same eviction, 16 compiles, not 300)."""
    from spmd._src.strategy import per_replica

    strategy = spmd.MirroredStrategy()
    per_replica._BY_FUNCTION.clear()
    per_replica._BY_JAXPR.clear()
    for _ in range(20):
        out = strategy.run(lambda x: x * 2.0, args=(X,))
    (program,) = per_replica._BY_JAXPR.values()  # one traced program, compiled once
    assert program._cache_size() == 1
    np.testing.assert_array_equal(strategy.gather(out), X * 2)
    for scale in (1.0, 3.0, -0.0):  # captured values that differ get their own program
        out = strategy.run(lambda x, s=scale: x * s, args=(X,))
        np.testing.assert_array_equal(strategy.gather(out), X * scale)
    monkeypatch.setattr(per_replica, "RUN_CACHE_SIZE", 4)
    for i in range(12):
        out = strategy.run(lambda x, i=i: x + i, args=(X,))
        assert len(per_replica._BY_JAXPR) <= 4 and len(per_replica._BY_FUNCTION) <= 4
    np.testing.assert_array_equal(strategy.gather(out), X + 11)
    first = strategy.run(lambda x, i=0: x + i, args=(X,))  # evicted long ago: built again
    np.testing.assert_array_equal(strategy.gather(first), X)


def test_run_traces_one_function_object_once_per_signature_as_jax_jit():
    """Values a function reads through globals are constants of its program, as in jax.jit."""
    strategy = spmd.MirroredStrategy()
    box = {"scale": 1.0}

    def fn(x):
        return x * box["scale"]

    first = strategy.gather(strategy.run(fn, args=(X,)))
    box["scale"] = 4.0
    np.testing.assert_array_equal(strategy.gather(strategy.run(fn, args=(X,))), first)
    jitted = jax.jit(fn)  # the oracle: jax.jit keeps the value it traced with
    box["scale"] = 1.0
    jitted(X)
    box["scale"] = 4.0
    np.testing.assert_array_equal(jitted(X), first)
    np.testing.assert_array_equal(strategy.gather(strategy.run(lambda x: fn(x), args=(X,))), X * 4)


def test_a_step_keeps_a_bounded_number_of_programs(monkeypatch):
    """The bound lowered to 4: the same eviction at 14 compiles instead of 42."""
    from spmd._src.strategy import step as step_module

    monkeypatch.setattr(step_module, "STEP_CACHE_SIZE", 4)
    strategy = spmd.MirroredStrategy()
    step = strategy.step(static_argnames=("k",))(lambda s, x, k: (s + k, x.sum()))
    state = jnp.zeros(4)
    for k in range(14):
        state, _ = step(state, X, k=k)
        assert len(step._compiled) <= 4
    assert len(step._compiled) == 4
    state, _ = step(state, X, k=0)  # evicted: built again, still right
    np.testing.assert_allclose(state, np.full(4, sum(range(14))))


def test_run_of_a_new_lambda_reading_a_mutated_value_sees_the_new_value():
    strategy = spmd.MirroredStrategy()
    config = {"scale": 1.0}
    for scale in (2.0, 5.0):
        config["scale"] = scale
        out = strategy.run(lambda x: x * config["scale"], args=(X,))
        np.testing.assert_array_equal(strategy.gather(out), X * scale)
