"""The flax integration: what a flax user expects of a step.

Each test states the expectation: the numbers of the same program under
`nnx.jit` on one device, the model updated as `nnx.jit` updates it, or a
named spmd error that says how to fix the input.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from models import INIT, LogicalMLP, mse, nnx_update, xent

import spmd
from spmd.partitioners import FixedShardsPartitioner

RULES = [("mlp", "model"), ("embed", None)]


class Plain(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.l(x)


def two_d(**kw) -> spmd.Strategy:
    mesh = spmd.make_mesh({"data": 4, "model": 2})
    return spmd.Strategy(mesh, batch_axes=("data",), logical_axis_rules=RULES, **kw)


def _xy():
    rng = np.random.RandomState(0)
    return rng.randn(16, 8).astype(np.float32), rng.randn(16, 8).astype(np.float32)


def _spmd_step(strategy):
    @strategy.step
    def step(state, x, y):
        return nnx_update(*state, mse, x, y)

    return step


@nnx.jit
def _jit_step(model, opt, x, y):
    return nnx_update(model, opt, mse, x, y)


# --- 1. Dropout's RNG key in the state on CentralStorageStrategy -----------------------


class Net(nnx.Module):
    """The MNIST tutorial's layers: BatchNorm, and Dropout holding its rngs."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.do = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.do(nnx.relu(self.bn(self.l1(x)))))


def _digits():
    rng = np.random.RandomState(1)
    return rng.randn(32, 6).astype(np.float32), (np.arange(32) % 3).astype(np.int32)


@pytest.mark.slow
def test_trainer_with_dropout_trains_on_central_storage_like_nnx_jit():
    """On CentralStorageStrategy, Dropout's typed PRNG key, which
    jax cannot keep in pinned_host memory, stays in device memory; the Trainer
    gives the losses of an nnx.jit loop."""
    x, y = _digits()
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        return nnx_update(model, opt, xent, x, y)

    expected = np.mean(
        [float(step(model, opt, x[i : i + 8], y[i : i + 8])) for i in (0, 8, 16, 24)]
    )
    trainer = spmd.Trainer(
        Net(nnx.Rngs(0)),
        optax.sgd(0.1),
        "sparse_categorical_crossentropy",
        strategy=spmd.CentralStorageStrategy(),
    )
    history = trainer.fit((x, y), batch_size=8, epochs=1, shuffle=False)
    np.testing.assert_allclose(history.history["loss"][0], expected, rtol=1e-5)


@pytest.mark.slow
def test_hand_written_step_with_dropout_runs_on_central_storage():
    """The same in a hand-written `strategy.step` over (model, optimizer)."""
    x, y = _digits()
    ref_model = Net(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, optax.sgd(0.1), wrt=nnx.Param)
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    strategy = spmd.CentralStorageStrategy()

    @strategy.step
    def step(state, x, y):
        return nnx_update(*state, xent, x, y)

    @nnx.jit
    def ref_step(model, opt, x, y):
        return nnx_update(model, opt, xent, x, y)

    got = [float(step((model, opt), x[i : i + 8], y[i : i + 8])) for i in (0, 8)]
    want = [float(ref_step(ref_model, ref_opt, x[i : i + 8], y[i : i + 8])) for i in (0, 8)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


# --- 2. Optimizer moments whose shape is not the parameter's (adafactor) ---------------


@pytest.mark.cpu_mesh
@pytest.mark.slow
def test_adafactor_on_an_annotated_model_trains_on_a_2d_mesh():
    """optax.adafactor's factored moments (v_row, v_col) inherit the parameter's
    annotation through nnx.Optimizer but have a smaller rank: they take the
    default layout, and training matches nnx.jit on one device."""

    def create():
        model = LogicalMLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adafactor(1e-2), wrt=nnx.Param)

    x, y = _xy()
    strategy = two_d()
    model, opt = strategy.init(create)
    step = _spmd_step(strategy)
    got = [float(step((model, opt), x, y)) for _ in range(2)]
    with nnx.use_eager_sharding(False):
        ref_model, ref_opt = create()
    want = [float(_jit_step(ref_model, ref_opt, x, y)) for _ in range(2)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


# --- 3. What nnx.jit propagates and the step drops --------------------------------------


class Sown(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        h = self.l(x)
        self.sow(nnx.Intermediate, "h", h)
        return h


@pytest.mark.slow
def test_sow_inside_a_step_works_like_nnx_jit():
    """`self.sow(nnx.Intermediate, ...)` (flax's way to extract intermediates) adds
    a Variable during the call: as under nnx.jit the loss is returned and
    `model.h` is left on the model."""
    x, y = _xy()
    ref = Sown(nnx.Rngs(0))
    want = float(_jit_step(ref, nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param), x, y))
    model = Sown(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    got = float(_spmd_step(spmd.MirroredStrategy())((model, opt), x, y))
    assert got == pytest.approx(want, rel=1e-6)
    assert hasattr(model, "h")


class Counting(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l = nnx.Linear(8, 8, rngs=rngs)
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return self.l(x)


@pytest.mark.slow
def test_python_attribute_written_in_the_step_is_kept_like_nnx_jit():
    """A module attribute changed inside the step (a call counter, a flag set by
    the model) is propagated back, as nnx.jit does (3 after three steps)."""
    x, y = _xy()
    ref = Counting(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    model = Counting(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = _spmd_step(spmd.MirroredStrategy())
    for _ in range(3):
        _jit_step(ref, ref_opt, x, y)
        step((model, opt), x, y)
    assert ref.calls == 3
    assert model.calls == ref.calls


@pytest.mark.slow
def test_a_clone_of_the_model_survives_a_step():
    """EMA / teacher pattern: `teacher = nnx.clone(model)` shares the arrays
    (immutable in JAX). NNX state is not donated by default (nnx.jit's
    default), so the teacher's arrays survive a step."""
    x, y = _xy()
    strategy = spmd.MirroredStrategy()
    model, opt = strategy.init(
        lambda: (lambda m: (m, nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)))(Plain(nnx.Rngs(0)))
    )
    teacher = nnx.clone(model)
    expected = np.asarray(teacher(x))
    _spmd_step(strategy)((model, opt), x, y)
    assert not teacher.l.kernel.get_raw_value().is_deleted()
    np.testing.assert_array_equal(np.asarray(teacher(x)), expected)


# --- 4. Bad layouts and placements: named errors ----------------------------------------------


def test_a_rule_using_one_mesh_axis_twice_is_a_configuration_error():
    """P('model', 'model') in a state rule is rejected when the Strategy is built."""
    with pytest.raises(spmd.ConfigurationError, match="model"):
        two_d(rules=[("up/kernel", P("model", "model"))])


@pytest.mark.cpu_mesh
def test_a_logical_rule_using_one_mesh_axis_twice_is_a_configuration_error():
    """("mlp", ("model", "model")) is rejected when the Strategy is built."""
    with pytest.raises(spmd.ConfigurationError, match="mlp"):
        spmd.Strategy(
            spmd.make_mesh({"data": 4, "model": 2}),
            logical_axis_rules=[("mlp", ("model", "model")), ("embed", None)],
        )


@pytest.mark.slow
def test_a_linen_module_through_the_bridge_trains_on_central_storage():
    """`nnx.bridge.ToNNX` keeps an `nnx.Rngs` (typed keys) in the module: a bridged
    linen model trains on CentralStorageStrategy as under nnx.jit."""
    from flax import linen as nn
    from flax.nnx import bridge

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            return nn.Dense(8, kernel_init=init)(x)

    def create():
        model = bridge.ToNNX(Dense(), rngs=nnx.Rngs(0))
        bridge.lazy_init(model, jnp.ones((2, 8)))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    x, y = _xy()
    with nnx.use_eager_sharding(False):
        ref_model, ref_opt = create()
    want = [float(_jit_step(ref_model, ref_opt, x, y)) for _ in range(2)]
    strategy = spmd.CentralStorageStrategy()
    model, opt = strategy.init(create)
    step = _spmd_step(strategy)
    got = [float(step((model, opt), x, y)) for _ in range(2)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


class Lazy(nnx.Module):
    """A variable created on the first call (a lazily built cache or counter)."""

    def __init__(self, rngs: nnx.Rngs):
        self.l = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        if not hasattr(self, "seen"):
            self.seen = nnx.BatchStat(jnp.zeros(()))
        self.seen[...] += 1.0
        return self.l(x)


@pytest.mark.slow
def test_state_created_during_the_first_step_is_kept_like_nnx_jit():
    """The state changes structure inside the step (a Variable created on the
    first call): kept, as nnx.jit keeps it; later steps update it."""
    x, y = _xy()
    model = Lazy(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = _spmd_step(spmd.MirroredStrategy())
    step((model, opt), x, y)
    assert float(model.seen[...]) == 1.0
    ref = Lazy(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    want = [float(_jit_step(ref, ref_opt, x, y)) for _ in range(4)]
    got = [float(step((model, opt), x, y)) for _ in range(3)]
    assert float(model.seen[...]) == 4.0
    np.testing.assert_allclose(got, want[1:], rtol=1e-6)
    assert step.cache_size() == 2  # one program before `seen` existed, one after


@pytest.mark.slow
def test_nnx_state_is_donated_only_when_asked():
    """`@strategy.step(donate=True)` opts NNX state into donation: the input
    arrays are reused (deleted), the model holds the new ones."""
    x, y = _xy()
    strategy = spmd.MirroredStrategy()
    model, opt = strategy.init(_plain_create)

    @strategy.step(donate=True)
    def step(state, x, y):
        return nnx_update(*state, mse, x, y)

    before = model.l.kernel.get_raw_value()
    step((model, opt), x, y)
    assert before.is_deleted()
    assert not model.l.kernel.get_raw_value().is_deleted()
    assert spmd.MirroredStrategy().step(mse).donate is None  # the default: by state kind


def _plain_create():
    model = Plain(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@pytest.mark.cpu_mesh
@pytest.mark.slow
@pytest.mark.parametrize("other_mesh", [False, True], ids=["same-devices", "other-mesh"])
def test_weights_copied_from_another_strategys_model_are_a_named_error(other_mesh):
    """Loading pretrained weights: `nnx.update(model, nnx.state(other))` where `other`
    was placed by another strategy (laid out otherwise on the same mesh, or on
    another mesh). The next step names the leaf and the fix, and the fix works."""
    x, y = _xy()
    strategy = spmd.MirroredStrategy()
    model, opt = strategy.init(_plain_create)
    step = _spmd_step(strategy)
    step((model, opt), x, y)
    if other_mesh:
        other_strategy = spmd.ParameterServerStrategy(FixedShardsPartitioner(8))
    else:
        other_strategy = spmd.Strategy(strategy.mesh, rules=[(".*kernel", P("replica"))])
    other, _ = other_strategy.init(_plain_create)
    nnx.update(model, nnx.state(other))
    with pytest.raises(spmd.ConfigurationError, match="l/kernel|l/bias") as info:
        step((model, opt), x, y)
    assert "strategy.put" in str(info.value)
    nnx.update(model, strategy.put(nnx.state(model)))
    got = float(step((model, opt), x, y))
    assert got == pytest.approx(float(mse(other, x, y)), rel=1e-6)


@pytest.mark.cpu_mesh
def test_a_pytree_state_laid_out_by_another_strategy_is_a_named_error():
    """The same for a pytree state: an array laid out otherwise on the step's mesh."""
    strategy = spmd.MirroredStrategy()
    other = spmd.Strategy(strategy.mesh, rules=[("w", P("replica"))])

    @strategy.step
    def step(state, x):
        return jax.tree.map(lambda w: w - 0.1 * jnp.mean(x), state), jnp.mean(x)

    x = np.ones((8, 2), np.float32)
    state, _ = step({"w": np.ones((8, 2), np.float32)}, x)
    with pytest.raises(spmd.ConfigurationError, match="'w'"):
        step(other.put({"w": np.ones((8, 2), np.float32)}), x)
    state, loss = step(strategy.put(other.put({"w": np.ones((8, 2), np.float32)})), x)
    np.testing.assert_allclose(np.asarray(state["w"]), 0.9)


# --- 5. Annotations that flax rejects: named errors -------------------------------------


class Doubled(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(nnx.with_partitioning(INIT, ("model", "model"))(rngs.params(), (8, 8)))


def test_an_annotation_naming_one_mesh_axis_twice_is_an_error():
    """nnx.with_partitioning(init, ("model", "model")) is a DuplicateSpecError in
    flax; in spmd a ConfigurationError naming the axis."""
    with pytest.raises(spmd.ConfigurationError, match="model"):
        two_d().init(lambda: Doubled(nnx.Rngs(0)))


class TooLong(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(
            nnx.with_partitioning(INIT, ("embed", "mlp", None))(rngs.params(), (8, 4))
        )


def test_an_annotation_longer_than_the_leaf_rank_is_an_error():
    """Three names on a rank-2 leaf (a model bug: the annotation was written for
    another shape) is a ConfigurationError naming the leaf."""
    with pytest.raises(spmd.ConfigurationError, match="w"):
        two_d().init(lambda: TooLong(nnx.Rngs(0)))


class Indivisible(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(nnx.with_partitioning(INIT, (None, "mlp"))(rngs.params(), (8, 3)))


@pytest.mark.cpu_mesh
def test_an_annotation_that_does_not_divide_is_reported_as_an_annotation():
    """A dimension of 3 annotated "mlp" -> model (2): the error says the layout came
    from the annotation, not from a rule."""
    with pytest.raises(spmd.ConfigurationError, match="annotation") as info:
        two_d().init(lambda: Indivisible(nnx.Rngs(0)))
    assert "The rule for" not in str(info.value)


# --- 6. Typed PRNG keys and the size partitioners -------------------------------------


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l = nnx.Linear(8, 8, rngs=rngs)
        self.do = nnx.Dropout(0.1, rngs=rngs)


class Stacked(nnx.Module):
    """Layers stacked with nnx.split_rngs + nnx.vmap (the scan-over-layers idiom):
    each Dropout keeps a key array of shape (4,) in the state."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Layer(rngs)

        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return nnx.relu(layer.l(x))

        return body(x, self.layers)


@pytest.mark.slow
def test_default_parameter_server_inits_a_model_with_stacked_rng_keys():
    """ParameterServerStrategy(MinSizePartitioner()) -- the `parameter_server`
    default -- never gives a typed key array to its partitioner: keys are
    replicated, and a model of stacked layers with Dropout keys trains."""
    x, y = _xy()

    def create():
        model = Stacked(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    ref_model, ref_opt = create()
    want = float(_jit_step(ref_model, ref_opt, x, y))
    strategy = spmd.ParameterServerStrategy(
        spmd.partitioners.MinSizePartitioner(min_shard_bytes=64)
    )
    model, opt = strategy.init(create)
    assert float(_spmd_step(strategy)((model, opt), x, y)) == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_a_custom_partitioner_never_sees_a_key_array():
    """Any callable partitioner gets only arrays with a byte size; keys are replicated."""
    seen = []

    def partitioner(shape, dtype):
        seen.append(np.dtype(dtype))  # a TypeError for a key dtype
        return [2] + [1] * (len(shape) - 1)

    strategy = spmd.ParameterServerStrategy(partitioner)
    model = strategy.init(lambda: Stacked(nnx.Rngs(0)))
    keys = [
        v
        for v in jax.tree.leaves(nnx.state(model))
        if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)
    ]
    assert keys and all(k.sharding.is_fully_replicated for k in keys)
    assert len(seen) == 3  # the kernel, the bias and the key counter; not the key


@pytest.mark.slow
def test_host_placement_keeps_keys_in_device_memory():
    """CentralStorageStrategy: arrays in pinned_host, typed key arrays in device memory."""
    strategy = spmd.CentralStorageStrategy()
    model = strategy.init(lambda: Net(nnx.Rngs(0)))
    kinds = {
        jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key): v.sharding.memory_kind
        for v in jax.tree.leaves(nnx.state(model))
    }
    assert kinds == {True: "device", False: "pinned_host"}


# --- 7. The flax_gspmd guide's model, unchanged, on a named strategy --------------------


class DotReluDot(nnx.Module):
    """flax's docs_nnx/guides/flax_gspmd.md DotReluDot, unchanged: annotated kernels
    and a constraint on the activations written with mesh axis names."""

    def __init__(self, rngs: nnx.Rngs):
        self.dot1 = nnx.Linear(
            8, 16, kernel_init=nnx.with_partitioning(INIT, (None, "model")), rngs=rngs
        )
        self.w2 = nnx.Param(nnx.with_partitioning(INIT, ("model", None))(rngs.params(), (16, 8)))

    def __call__(self, x):
        y = nnx.relu(self.dot1(x))
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        return y @ self.w2[...]


def _guide_loss_on_one_device(x, y):
    """The guide's model's first loss under `nnx.jit` on a 1x1 ("data", "model") mesh."""
    one = jax.make_mesh((1, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(one):
        model = DotReluDot(nnx.Rngs(0))
        return float(_jit_step(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), x, y))


@pytest.mark.cpu_mesh
@pytest.mark.slow
def test_the_gspmd_guide_constraint_on_a_mesh_without_its_axes_is_a_named_error():
    """A `with_sharding_constraint(y, P("data", "model"))` in model code names mesh
    axes; on MirroredStrategy (axis `replica`) it is a ConfigurationError at
    trace time naming the axis, the strategy's mesh axes and the two fixes
    (logical names with nn.with_logical_constraint, or a Strategy whose mesh has
    the axes). On such a Strategy the model runs unchanged with one device's loss."""
    x, y = _xy()

    def create():
        model = DotReluDot(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    want = _guide_loss_on_one_device(x, y)
    strategy = spmd.MirroredStrategy()
    model, opt = strategy.init(create)
    with pytest.raises(spmd.ConfigurationError) as info:
        _spmd_step(strategy)((model, opt), x, y)
    text = str(info.value)
    assert "'data'" in text and "('replica',)" in text
    assert "with_logical_constraint" in text and "Strategy" in text
    # The same model on a strategy whose mesh has the axes gives one device's loss.
    mesh = spmd.make_mesh({"data": 4, "model": 2})
    on_2d = spmd.Strategy(mesh, batch_axes=("data",))
    model, opt = on_2d.init(create)
    assert float(_spmd_step(on_2d)((model, opt), x, y)) == pytest.approx(want, rel=1e-5)


class LogicalDotReluDot(DotReluDot):
    """The guide's model with its constraint in logical names (flax linen's function)."""

    def __call__(self, x):
        from flax import linen as nn

        y = nnx.relu(self.dot1(x))
        y = nn.with_logical_constraint(y, ("batch", "mlp"))
        return y @ self.w2[...]


@pytest.mark.slow
@pytest.mark.cpu_mesh
@pytest.mark.parametrize("name", ["mirrored", "2-D"])
def test_a_constraint_in_logical_names_runs_on_any_strategy(name):
    """The fix the error above gives: logical names, mapped by the strategy's rules
    (MirroredStrategy replicates them; a 2-D Strategy maps them), one device's loss."""
    x, y = _xy()

    def create():
        model = LogicalDotReluDot(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    want = _guide_loss_on_one_device(x, y)
    if name == "mirrored":
        strategy = spmd.MirroredStrategy()
    else:
        strategy = spmd.Strategy(
            spmd.make_mesh({"data": 4, "model": 2}),
            batch_axes=("data",),
            logical_axis_rules=[("batch", "data"), ("mlp", "model")],
        )
    model, opt = strategy.init(create)
    assert float(_spmd_step(strategy)((model, opt), x, y)) == pytest.approx(want, rel=1e-5)
