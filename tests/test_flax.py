"""Flax-native models: annotations, logical axis rules, the mesh in the step."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from models import LogicalMLP, mse, nnx_update

import spmd
from spmd._src.rules import LayoutConflictWarning, LeafLayout
from spmd.partitioners import FixedShardsPartitioner

RULES = [("mlp", "model"), ("embed", None), ("batch", "data")]


def create(lr: float = 1e-2):
    model = LogicalMLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)


def two_d(**kw) -> spmd.Strategy:
    mesh = spmd.make_mesh({"data": 4, "model": 2})
    return spmd.Strategy(mesh, batch_axes=("data",), logical_axis_rules=RULES, **kw)


def train(strategy, steps=3):
    model, opt = strategy.init(create)

    @strategy.step
    def step(state, x, y):
        return nnx_update(*state, mse, x, y)

    rng = np.random.RandomState(0)
    x, y = rng.randn(16, 8).astype(np.float32), rng.randn(16, 8).astype(np.float32)
    losses = [float(step((model, opt), x, y)) for _ in range(steps)]
    return losses, model


def oracle(steps=3):
    """The same model, data and seed with plain `nnx.jit` on one device."""
    rng = np.random.RandomState(0)
    x, y = rng.randn(16, 8).astype(np.float32), rng.randn(16, 8).astype(np.float32)

    @nnx.jit
    def step(model, opt, x, y):
        return nnx_update(model, opt, mse, x, y)

    with nnx.use_eager_sharding(False):
        model, opt = create()
    return [float(step(model, opt, x, y)) for _ in range(steps)], model


@pytest.mark.cpu_mesh
@pytest.mark.slow
def test_annotations_lay_out_init_put_and_abstract_state():
    strategy = two_d()
    model, opt = strategy.init(create)
    assert model.up.kernel[...].sharding.spec == P(None, "model")
    assert model.w[...].sharding.spec == P("model")
    # optimizer moments mirror the parameter they belong to
    assert opt.opt_state[0].mu["up"]["kernel"][...].sharding.spec == P(None, "model")
    abstract_model, _ = strategy.abstract_state(create)
    assert abstract_model.w.get_raw_value().sharding.spec == P("model")
    with strategy.scope():  # built eagerly inside the scope, then placed
        eager, _ = create()
    strategy.put(eager)
    assert eager.w[...].sharding.spec == P("model")


@pytest.mark.cpu_mesh
def test_state_spec_says_where_each_layout_came_from():
    strategy = two_d(rules=[(r"up/bias", P("model"))])
    model, opt = strategy.abstract_state(create)
    layouts = jax.tree.leaves(
        strategy.state_spec((model, opt), sources=True), is_leaf=lambda x: isinstance(x, LeafLayout)
    )
    by_source = {layout.source for layout in layouts}
    assert "annotation ('embed', 'mlp')" in by_source
    assert "rule 'up/bias'" in by_source
    assert "default" in by_source
    # the rule for the model's own path also lays out the moments of that leaf
    specs = strategy.state_spec((model, opt))
    assert specs[1]["opt_state"][0]["mu"]["up"]["bias"] == P("model")


@pytest.mark.cpu_mesh
def test_a_rule_that_overrides_an_annotation_warns():
    strategy = two_d(rules=[(r"up/kernel", P("model"))])
    with pytest.warns(LayoutConflictWarning, match="overriding its annotation") as caught:
        specs = strategy.state_spec(strategy.abstract_state(create))
    assert specs[0]["up"]["kernel"] == P("model")
    assert caught[0].filename == __file__  # the user's line, not spmd's or jax's


@pytest.mark.cpu_mesh
def test_a_rule_that_agrees_with_an_annotation_is_quiet():
    strategy = two_d(rules=[(r"up/kernel", P(None, "model"))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy.state_spec(strategy.abstract_state(create))


@pytest.mark.cpu_mesh
def test_logical_rule_naming_a_missing_mesh_axis_is_an_error():
    with pytest.raises(spmd.ConfigurationError, match="'tensor'"):
        spmd.Strategy(spmd.make_mesh({"data": 8}), logical_axis_rules=[("mlp", "tensor")])
    with pytest.raises(spmd.ConfigurationError, match="logical axis rule is a pair"):
        spmd.MirroredStrategy(logical_axis_rules=[("mlp",)])


@pytest.mark.cpu_mesh
def test_plain_strategy_rejects_an_unmapped_name_and_names_it():
    strategy = spmd.Strategy(spmd.make_mesh({"data": 4, "model": 2}), logical_axis_rules=[])
    with pytest.raises(spmd.ConfigurationError, match=r"'embed' \(at '"):
        strategy.init(create)


class Annotated(nnx.Module):
    """Four logical names over three layers: ("vocab", "embed"), ("embed", "mlp"),
    ("mlp", "heads")."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        self.embed = nnx.Param(nnx.with_partitioning(init, ("vocab", "embed"))(rngs(), (8, 4)))
        self.up = nnx.Linear(
            4, 8, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs
        )
        self.out = nnx.Param(nnx.with_partitioning(init, ("mlp", "heads"))(rngs(), (8, 2)))


@pytest.mark.cpu_mesh
def test_every_unmapped_name_of_an_nnx_model_is_listed_in_one_error_when_it_is_laid_out():
    """Building the strategy cannot tell (it has not seen the model); init and put
    each raise one error listing every unmapped name with a path that has it."""
    strategy = spmd.Strategy(
        spmd.make_mesh({"data": 4, "model": 2}), logical_axis_rules=[("mlp", "model")]
    )
    with nnx.use_eager_sharding(False):
        model = Annotated(nnx.Rngs(0))
    for lay_out in (lambda: strategy.init(Annotated, nnx.Rngs(0)), lambda: strategy.put(model)):
        with pytest.raises(spmd.ConfigurationError) as error:
            lay_out()
        text = str(error.value)
        for name, path in (("vocab", "embed"), ("embed", "embed"), ("heads", "out")):
            assert f"'{name}' (at '{path}')" in text, (name, text)
        assert "'mlp' (at" not in text  # mapped
        assert "unmapped=('vocab', 'embed', 'heads')" in text, text
        assert "(spmd.logical.REST, None)" in text


@pytest.mark.slow
@pytest.mark.cpu_mesh
def test_names_equal_to_mesh_axes_map_to_them():
    mesh = spmd.make_mesh({"embed": 2, "mlp": 4})
    model, _ = spmd.Strategy(mesh).init(create)
    assert model.up.kernel[...].sharding.spec == P("embed", "mlp")


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda: spmd.OneDeviceStrategy(),
        lambda: spmd.MirroredStrategy(),
        lambda: spmd.CentralStorageStrategy(),
        lambda: spmd.ParameterServerStrategy(FixedShardsPartitioner(2)),
        two_d,
    ],
    ids=["one_device", "mirrored", "central_storage", "parameter_server", "2d"],
)
@pytest.mark.cpu_mesh
def test_an_annotated_model_trains_unchanged_on_every_strategy(make):
    expected, expected_model = oracle()
    strategy = make()
    losses, model = train(strategy)
    np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.w[...], expected_model.w[...], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.cpu_mesh
def test_parameter_server_shards_a_replicated_annotation_by_its_partitioner():
    strategy = spmd.ParameterServerStrategy(FixedShardsPartitioner(2))
    model, _ = strategy.init(create)
    assert model.w[...].sharding.spec == P("ps2")


@pytest.mark.slow
@pytest.mark.cpu_mesh
def test_step_carries_its_mesh_outside_the_scope():
    strategy = two_d()
    model, opt = strategy.init(create)

    @strategy.step
    def step(state, x):
        model, _ = state
        y = jax.lax.with_sharding_constraint(model(x), P("data", None))
        return jnp.sum(y)

    x = np.ones((8, 8), np.float32)
    assert np.isfinite(float(step((model, opt), x)))


@pytest.mark.cpu_mesh
@pytest.mark.slow
def test_checkpoint_restores_into_the_annotated_layout(tmp_path):
    strategy = two_d()
    state = strategy.init(create)
    with spmd.CheckpointManager(tmp_path, async_save=False) as ckpt:
        ckpt.save(0, state)
        ckpt.wait()
        restored = ckpt.restore(0, target=strategy.abstract_state(create))
    model = restored[0]
    assert model.w[...].sharding.spec == P("model")
    np.testing.assert_array_equal(model.w[...], state[0].w[...])


class Tutorial(nnx.Module):
    """The flax tutorials' layers: BatchNorm, and Dropout with its rngs held or given per call."""

    def __init__(self, rngs: nnx.Rngs, *, held: bool):
        self.l1 = nnx.Linear(6, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.do = nnx.Dropout(0.5, rngs=rngs if held else None)
        self.l2 = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        return self.l2(self.do(nnx.relu(self.bn(self.l1(x))), rngs=rngs))


class Held(Tutorial):
    def __init__(self, rngs):
        super().__init__(rngs, held=True)

    def __call__(self, x):
        return super().__call__(x)


def _data():
    rng = np.random.RandomState(1)
    return rng.randn(64, 6).astype(np.float32), (np.arange(64) % 3).astype(np.int32)


def _nnx_jit_loop(model, rngs, x, y, batch=16):
    """The oracle: a plain `nnx.jit` loop over the same batches and RNG streams."""
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, rngs, x, y):
        def loss(model, rngs):
            logits = model(x) if rngs is None else model(x, rngs=rngs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        return nnx_update(model, opt, loss, rngs)

    losses = [
        step(model, opt, rngs, x[i : i + batch], y[i : i + batch]) for i in range(0, 64, batch)
    ]
    logits = nnx.view(model, deterministic=True, use_running_average=True)(x)
    return np.mean(losses), float(optax.softmax_cross_entropy_with_integer_labels(logits, y).mean())


@pytest.mark.slow
@pytest.mark.parametrize("held", [True, False], ids=["rngs_held", "rngs_at_call"])
@pytest.mark.parametrize(
    "make", [spmd.OneDeviceStrategy, spmd.MirroredStrategy], ids=["one_device", "mirrored"]
)
def test_trainer_trains_dropout_and_batchnorm_like_an_nnx_jit_loop(make, held):
    x, y = _data()
    build = (lambda: Held(nnx.Rngs(0))) if held else (lambda: Tutorial(nnx.Rngs(0), held=False))
    train_loss, eval_loss = _nnx_jit_loop(build(), None if held else nnx.Rngs(7), x, y)
    trainer = spmd.Trainer(
        build(),
        optax.sgd(0.1),
        "sparse_categorical_crossentropy",
        strategy=make(),
        rngs=None if held else nnx.Rngs(7),
    )
    history = trainer.fit((x, y), batch_size=16, epochs=1, shuffle=False)
    np.testing.assert_allclose(history.history["loss"][0], train_loss, rtol=1e-5)
    np.testing.assert_allclose(
        trainer.evaluate((x, y), batch_size=16)["loss"], eval_loss, rtol=1e-5
    )
    # the user's module is left in training mode, holding the trained state
    assert trainer.model.do.deterministic is False


class Flagged(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.do = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.do(self.lin(x))


def _sgd_step(strategy):
    @strategy.step
    def step(state, x):
        return nnx_update(*state, lambda model: jnp.mean(model(x) ** 2))

    return step


@pytest.mark.slow
def test_nnx_step_reuses_its_split_and_still_sees_every_change():
    strategy = spmd.MirroredStrategy()
    model = Flagged(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = _sgd_step(strategy)
    x = np.ones((8, 4), np.float32)
    step((model, opt), x)
    step((model, opt), x)
    assert step._hot is not None and step._hot.binding is not None  # the fast path is on
    assert step.cache_size() == 1
    # a value written from outside is what the next step reads
    model.lin.kernel[...] = jnp.zeros((4, 4))
    model.lin.bias[...] = jnp.zeros(4)
    assert float(step((model, opt), x)) == 0.0
    # a flag flipped from outside (eval mode) retraces, as nnx.jit does
    model.lin.kernel[...] = jnp.ones((4, 4))
    model.eval()
    assert float(step((model, opt), x)) == 16.0  # no dropout: every output is 4
    # a module given a new layer is split again: the new weights train too
    model.train()
    model.extra = nnx.Linear(4, 4, rngs=nnx.Rngs(1))
    before = np.asarray(model.lin.kernel[...])
    step((model, opt), x)
    assert not np.array_equal(before, model.lin.kernel[...])


@pytest.mark.slow
def test_nnx_step_matches_nnx_jit_over_many_fast_steps():
    expected, expected_model = oracle(steps=6)
    losses, model = train(spmd.OneDeviceStrategy(), steps=6)
    if jax.default_backend() == "cpu":
        assert losses == expected
        np.testing.assert_array_equal(model.w[...], expected_model.w[...])
    else:  # XLA:GPU may order a reduction differently in two programs: last-bit differences
        np.testing.assert_allclose(losses, expected, rtol=2e-6)
        np.testing.assert_allclose(model.w[...], expected_model.w[...], rtol=2e-6, atol=1e-7)


@pytest.mark.cpu_mesh
def test_linen_annotations_through_the_nnx_bridge_are_honored():
    from flax import linen as nn
    from flax.nnx import bridge

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            ones = nn.initializers.ones
            w = self.param("w", nn.with_logical_partitioning(ones, ("embed", "mlp")), (8, 16))
            v = self.param("v", nn.with_partitioning(ones, ("model", None)), (16, 8))
            return x @ w @ v

    def create():
        model = bridge.ToNNX(Linen(), rngs=nnx.Rngs(0))
        bridge.lazy_init(model, jnp.ones((2, 8)))
        return model

    model = two_d().init(create)
    assert model.w[...].sharding.spec == P(None, "model")
    assert model.v[...].sharding.spec == P("model")
