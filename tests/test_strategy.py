"""The conformance suite: every strategy trains like one device, keeps its layout, compiles once."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmd
from spmd._src.strategy.step import CPU_MAX_IN_FLIGHT
from spmd.partitioners import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner
from spmd.testing import assert_compiles_once, assert_layout, assert_trees_allclose

STRATEGIES = {
    "default": lambda: spmd.get_strategy(),
    "mirrored": lambda: spmd.MirroredStrategy(),
    "mirrored_subset": lambda: spmd.MirroredStrategy(jax.devices()[:2]),
    "one_device": lambda: spmd.OneDeviceStrategy(jax.devices()[3]),
    "central_storage": lambda: spmd.CentralStorageStrategy(),
    "multi_worker_mirrored": lambda: spmd.MultiWorkerMirroredStrategy(),
    "ps_fixed": lambda: spmd.ParameterServerStrategy(FixedShardsPartitioner(4)),
    "ps_min_size": lambda: spmd.ParameterServerStrategy(MinSizePartitioner(min_shard_bytes=512)),
    "ps_max_size": lambda: spmd.ParameterServerStrategy(MaxSizePartitioner(max_shard_bytes=1024)),
    "two_d": lambda: spmd.Strategy(
        mesh=spmd.make_mesh({"data": -1, "model": 2}),
        rules=[(r".*hidden/kernel", P(None, "model")), (r".*out/kernel", P("model"))],
        batch_axes=("data",),
    ),
    "fsdp_rule": lambda: spmd.Strategy(
        mesh=spmd.make_mesh({"data": 8}),
        rules=[(r".*kernel", FixedShardsPartitioner(8))],
        batch_axes=("data",),
    ),
}
LEARNING_RATE = 1e-2
STEPS, BATCH, FEATURES, CLASSES = 6, 32, 16, 4


def create_state(key):
    k1, k2 = jax.random.split(key)
    params = {
        "hidden": {"kernel": jax.random.normal(k1, (FEATURES, 64)) * 0.3, "bias": jnp.zeros(64)},
        "out": {"kernel": jax.random.normal(k2, (64, CLASSES)) * 0.3, "bias": jnp.zeros(CLASSES)},
    }
    return {"params": params, "opt": optax.adam(LEARNING_RATE).init(params)}


def loss_fn(params, x, y):
    hidden = jnp.tanh(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
    logits = hidden @ params["out"]["kernel"] + params["out"]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train_step(state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
    updates, opt = optax.adam(LEARNING_RATE).update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}


def batches():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(STEPS, BATCH)).astype(np.int32)
    return list(zip(x, y, strict=True))


@pytest.fixture(scope="module")
def oracle():
    """The same model, data and seed on one device with plain jax.jit."""
    state, step, losses = create_state(jax.random.key(0)), jax.jit(train_step), []
    for x, y in batches():
        state, metrics = step(state, x, y)
        losses.append(float(metrics["loss"]))
    return jax.device_get(state), losses


@pytest.mark.cpu_mesh
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_pytree_state_matches_one_device(name, oracle):
    strategy = STRATEGIES[name]()
    with strategy.scope():
        state = strategy.init(create_state, jax.random.key(0))
        expected_layout = strategy.state_sharding(state)
        assert_layout(state, expected_layout)
        step = strategy.step(train_step)
        losses = []
        for x, y in batches():
            state, metrics = step(state, x, y)
            losses.append(float(metrics["loss"]))
            assert metrics["loss"].sharding.is_fully_replicated
    oracle_state, oracle_losses = oracle
    np.testing.assert_allclose(losses, oracle_losses, rtol=1e-5, atol=1e-6)
    assert_trees_allclose(state, oracle_state)
    assert_layout(state, expected_layout)
    assert_compiles_once(step)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, 64, rngs=rngs)
        self.out = nnx.Linear(64, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def create_nnx():
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)


def nnx_step(state, x, y):
    model, optimizer = state

    def loss(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value


@pytest.fixture(scope="module")
def nnx_oracle():
    state, step = create_nnx(), nnx.jit(nnx_step)
    losses = [float(step(state, x, y)) for x, y in batches()]
    return nnx.state(state[0]), losses


@pytest.mark.parametrize(
    "name",
    [
        "mirrored",
        "central_storage",
        "ps_fixed",
        pytest.param("two_d", marks=pytest.mark.cpu_mesh),
        "default",
    ],
)
def test_nnx_state_updates_in_place_and_matches_one_device(name, nnx_oracle):
    strategy = STRATEGIES[name]()
    with strategy.scope():
        state = strategy.init(create_nnx)
        model = state[0]
        step = strategy.step(nnx_step)
        losses = [float(step(state, x, y)) for x, y in batches()]
    oracle_params, oracle_losses = nnx_oracle
    np.testing.assert_allclose(losses, oracle_losses, rtol=1e-5, atol=1e-6)
    got = jax.device_get(nnx.state(model))
    for a, b in zip(
        jax.tree.leaves(got), jax.tree.leaves(jax.device_get(oracle_params)), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert_layout(nnx.state(state), strategy.state_sharding(state))
    assert step.cache_size() == 1


@pytest.mark.slow
def test_central_storage_keeps_state_in_host_memory():
    strategy = spmd.CentralStorageStrategy()
    state = strategy.init(create_state, jax.random.key(0))
    step = strategy.step(train_step)
    state, _ = step(state, *batches()[0])
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state)}
    assert kinds == {"pinned_host"}


@pytest.mark.cpu_mesh
def test_parameter_server_shards_are_one_over_num_shards():
    strategy = spmd.ParameterServerStrategy(FixedShardsPartitioner(4))
    big = strategy.init(lambda: {"embedding": jnp.ones((1024, 32)), "scale": jnp.ones(())})
    shard_shapes = {s.data.shape for s in big["embedding"].addressable_shards}
    assert shard_shapes == {(256, 32)}
    assert big["scale"].sharding.is_fully_replicated


@pytest.mark.cpu_mesh
def test_put_places_an_existing_state():
    strategy = STRATEGIES["two_d"]()
    state = strategy.put(jax.device_get(create_state(jax.random.key(0))))
    assert state["params"]["hidden"]["kernel"].sharding.spec == P(None, "model")
    model = MLP(nnx.Rngs(0))
    assert strategy.put(model) is model
    assert model.hidden.kernel[...].sharding.spec == P(None, "model")


def test_step_decorator_bare_and_called():
    strategy = spmd.MirroredStrategy()

    @strategy.step
    def bare(state, x):
        return state + x.sum(), x.sum()  # a scalar state comes back with the metrics

    @strategy.step(donate=False, static_argnames=("scale",))
    def called(state, x, *, scale):
        return state * scale, x.mean()

    state = jnp.zeros(())
    assert float(bare(state, np.ones(8))[0]) == 8.0
    kept = strategy.put(jnp.ones(()))
    new, mean = called(kept, np.arange(8.0), scale=3)
    assert float(new) == 3.0 and float(mean) == 3.5 and float(kept) == 1.0  # not donated
    called(kept, np.arange(8.0), scale=3)
    assert called.cache_size() == 1
    called(kept, np.arange(8.0), scale=4)
    assert called.cache_size() == 2  # a new static value compiles anew


def test_keyword_arguments_are_replicated():
    strategy = spmd.MirroredStrategy()

    @strategy.step
    def step(state, x, *, table):
        return state, (x * table[:1]).sum()

    _, total = step(jnp.zeros(()), np.ones(8, np.float32), table=np.full(3, 2.0, np.float32))
    assert float(total) == 16.0


def test_scope_sets_strategy_and_mesh():
    strategy = spmd.MirroredStrategy()
    assert spmd.get_strategy().name == "DefaultStrategy" and not spmd.has_strategy()
    with strategy.scope():
        assert spmd.get_strategy() is strategy
        assert spmd.in_cross_replica_context()
        assert jax.sharding.get_abstract_mesh().shape == strategy.mesh.shape
        with strategy.scope():  # re-entering the same strategy is fine
            pass
        with (
            pytest.raises(spmd.ConfigurationError, match="do not nest"),
            spmd.OneDeviceStrategy().scope(),
        ):
            pass
    assert spmd.get_strategy().name == "DefaultStrategy"


@pytest.mark.cpu_mesh
def test_num_replicas_in_sync():
    assert spmd.MirroredStrategy().num_replicas_in_sync == 8
    assert spmd.ParameterServerStrategy().num_replicas_in_sync == 8
    assert STRATEGIES["two_d"]().num_replicas_in_sync == 4
    assert spmd.OneDeviceStrategy().num_replicas_in_sync == 1
    assert spmd.get_strategy().num_replicas_in_sync == 1


@pytest.mark.cpu_mesh
def test_batch_not_divisible_teaches():
    step = spmd.MirroredStrategy().step(train_step)
    state = create_state(jax.random.key(0))
    with pytest.raises(spmd.BatchError) as info:
        step(state, np.zeros((30, FEATURES), np.float32), np.zeros(30, np.int32))
    text = str(info.value)
    assert "global_batch_size=30" in text and "num_replicas_in_sync=8" in text and "e.g. 32" in text


def test_ragged_batch_teaches():
    step = spmd.MirroredStrategy().step(train_step)
    with pytest.raises(spmd.BatchError, match=r"leading_sizes=\[16, 32\]"):
        step(create_state(jax.random.key(0)), np.zeros((32, FEATURES)), np.zeros(16, np.int32))


def test_step_must_return_the_state_first():
    step = spmd.MirroredStrategy().step(lambda state, x: x.sum())
    with pytest.raises(spmd.ConfigurationError, match="donated state would be lost"):
        step({"w": jnp.zeros(3)}, np.ones(8))


@pytest.mark.cpu_mesh
def test_bad_strategy_arguments():
    mesh = spmd.make_mesh({"data": 8})
    with pytest.raises(spmd.ConfigurationError, match="batch_axes must name axes"):
        spmd.Strategy(mesh, batch_axes=("replica",))
    with pytest.raises(spmd.ConfigurationError, match="placement is one of"):
        spmd.Strategy(mesh, placement="disk")
    with pytest.raises(spmd.ConfigurationError, match="jax.Device"):
        spmd.OneDeviceStrategy("/gpu:0")
    with pytest.raises(spmd.ConfigurationError, match="NCCL all-reduce needs GPUs"):
        spmd.MultiWorkerMirroredStrategy(
            spmd.CommunicationOptions(implementation=spmd.CommunicationImplementation.NCCL)
        )


@pytest.mark.slow
@pytest.mark.cpu_mesh
def test_batches_placed_elsewhere_are_moved_to_the_batch_layout():
    strategy = spmd.MirroredStrategy()
    step = strategy.step(train_step)
    state = strategy.init(create_state, jax.random.key(0))
    x, y = batches()[0]
    on_one_device = jax.device_put((x, y), jax.devices()[5])
    state, metrics = step(state, *on_one_device)
    ran = strategy.run(lambda x: x.sum(), args=(jax.device_put(x, jax.devices()[2]),))
    np.testing.assert_allclose(float(strategy.reduce("SUM", ran)), x.sum(), rtol=1e-5)
    assert_compiles_once(step)


@pytest.mark.slow
def test_explain_accepts_another_strategys_step():
    mirrored, ps = spmd.MirroredStrategy(), spmd.ParameterServerStrategy(FixedShardsPartitioner(8))
    step = mirrored.step(train_step)
    x, y = batches()[0]
    report = ps.explain(step, ps.abstract_state(create_state, jax.random.key(0)), x, y)
    assert report.strategy.startswith("ParameterServerStrategy")


@pytest.mark.cpu_mesh
@pytest.mark.slow
def test_batch_axis_one_runs_stacked_batches_in_one_call():
    """K batches stacked on axis 0 and scanned in one call equal K calls of the step."""
    strategy = spmd.MirroredStrategy()

    def many(state, xs, ys):
        def body(state, batch):
            return train_step(state, *batch)

        return jax.lax.scan(body, state, (xs, ys))

    scanned = strategy.step(many, batch_axis=1)
    xs = np.stack([x for x, _ in batches()])
    ys = np.stack([y for _, y in batches()])
    state, metrics = scanned(strategy.init(create_state, jax.random.key(0)), xs, ys)
    assert metrics["loss"].shape == (STEPS,)
    one = strategy.step(train_step)
    oracle = strategy.init(create_state, jax.random.key(0))
    for x, y in batches():
        oracle, _ = one(oracle, x, y)
    assert_trees_allclose(state, oracle)
    with pytest.raises(spmd.BatchError, match="global_batch_size=30"):
        scanned(state, xs[:, :30], ys[:, :30])


@pytest.mark.slow
def test_a_step_that_does_not_donate_may_return_only_metrics():
    strategy = spmd.ParameterServerStrategy(FixedShardsPartitioner(8))
    state = strategy.init(create_state, jax.random.key(0))

    @strategy.step(donate=False)
    def evaluate(state, x, y):
        return {"loss": loss_fn(state["params"], x, y)}

    x, y = batches()[0]
    metrics = evaluate(state, x, y)
    assert float(metrics["loss"]) == pytest.approx(
        float(loss_fn(jax.device_get(state["params"]), x, y)), rel=1e-5
    )
    assert not state["params"]["hidden"]["kernel"].is_deleted()


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_many_queued_steps_on_cpu_finish():
    """A thousand steps without reading a result: on XLA:CPU the queue stays bounded."""
    strategy = spmd.MirroredStrategy()

    @strategy.step
    def step(state, x):
        return state + jnp.mean(x), jnp.sum(x)

    state = strategy.put(jnp.zeros(()))
    x = strategy.distribute_batch(np.ones((8, 4), np.float32))
    for _ in range(1000):
        state, _ = step(state, x)
    assert float(state) == 1000.0
    assert len(step._in_flight) <= CPU_MAX_IN_FLIGHT


# -- variable_partitioner is any TF-protocol callable, checked ---------------------------


@pytest.mark.cpu_mesh
def test_a_tf_protocol_callable_partitions_variables():
    def two_shards(shape, dtype):
        return [2] + [1] * (len(shape) - 1)

    strategy = spmd.ParameterServerStrategy(variable_partitioner=two_shards)
    state = strategy.put({"w": np.ones((8, 4), np.float32), "b": np.ones((3,), np.float32)})
    assert state["w"].addressable_shards[0].data.shape == (4, 4)
    assert state["b"].addressable_shards[0].data.shape == (3,)  # 3 rows do not split in 2


@pytest.mark.parametrize(
    "answer",
    [[2], [0, 1], [-2, 1], [2.0, 1], [1, 2], "2", None, [2, 1, 1]],
    ids=["short", "zero", "negative", "float", "second-axis", "str", "none", "long"],
)
def test_a_partitioners_bad_answer_names_variable_partitioner(answer):
    strategy = spmd.ParameterServerStrategy(variable_partitioner=lambda shape, dtype: answer)
    with pytest.raises(spmd.ConfigurationError, match="variable_partitioner") as info:
        strategy.put({"w": np.ones((8, 4), np.float32)})
    assert repr(answer) in str(info.value)


def test_a_partitioner_that_is_not_callable_is_an_error():
    with pytest.raises(spmd.ConfigurationError, match="variable_partitioner"):
        spmd.ParameterServerStrategy(variable_partitioner=4)
