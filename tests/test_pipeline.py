"""spmd.pipeline: the layer scan split over a `stage` axis, checked against the scan on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from spmd.testing import assert_trees_allclose

pytestmark = pytest.mark.cpu_mesh
TOL = {"rtol": 2e-5, "atol": 2e-5}
LAYERS, D, BATCH = 8, 8, 16


def layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def stacked(layers=LAYERS, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w": jax.random.normal(k1, (layers, D, D)) / np.sqrt(D),
        "b": jax.random.normal(k2, (layers, D)) / 4,
    }


def batch(rows=BATCH, seed=1):
    return jax.random.normal(jax.random.key(seed), (rows, D))


def scan(layer_fn, params, x):
    """The oracle: the layers in order, on one device."""
    return jax.lax.scan(lambda h, p: (layer_fn(p, h), None), x, params)[0]


def loss_and_grad(apply, params, x):
    """The loss and its gradients with respect to the parameters and the input."""
    return jax.value_and_grad(lambda p, x: jnp.sum(apply(p, x) ** 2), argnums=(0, 1))(params, x)


def on_mesh(mesh, params, x):
    specs = {"w": P("stage", None, "model"), "b": P("stage")}
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    return params, jax.device_put(x, NamedSharding(mesh, P("data")))


@pytest.mark.parametrize(
    "repeats, microbatches, remat",
    [(1, 4, False), pytest.param(2, 2, True, marks=pytest.mark.slow)],  # 4 s of CPU
)
def test_forward_and_gradients_equal_the_scan_on_a_stage_data_model_mesh(
    repeats, microbatches, remat
):
    params, x = stacked(), batch()
    want = jax.jit(lambda p: loss_and_grad(lambda p, x: scan(layer, p, x), p, x))(params)
    layer_fn = jax.checkpoint(layer) if remat else layer
    mesh = spmd.make_mesh({"stage": 2, "data": 2, "model": 2})
    with jax.set_mesh(mesh):
        params, x = on_mesh(mesh, params, x)
        run = jax.jit(
            lambda p, x: loss_and_grad(
                lambda p, x: spmd.pipeline(
                    layer_fn, p, x, microbatches=microbatches, repeats=repeats
                ),
                p,
                x,
            )
        )
        got = run(params, x)
        hlo = run.lower(params, x).compile().as_text()
    assert_trees_allclose(got, want, **TOL)
    assert "collective-permute" in hlo  # the activations move between stages


def test_circular_repeats_use_every_layer_in_order():
    """Four stages, two repeats, one layer each: a layer out of order changes the result."""
    params, x = stacked(), batch()
    mesh = spmd.make_mesh({"stage": 4, "data": 2})
    with jax.set_mesh(mesh):
        got = jax.jit(lambda p, x: spmd.pipeline(layer, p, x, microbatches=4, repeats=2))(params, x)
    np.testing.assert_allclose(got, scan(layer, params, x), **TOL)


def test_one_device_mesh_and_axis_none_run_the_layers_in_order():
    params, x = stacked(), batch()
    want = scan(layer, params, x)
    with jax.set_mesh(spmd.make_mesh({"data": 1}, jax.devices()[:1])):
        np.testing.assert_allclose(spmd.pipeline(layer, params, x, microbatches=2), want, **TOL)
    np.testing.assert_allclose(
        spmd.pipeline(layer, params, x, microbatches=2, axis=None), want, **TOL
    )


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, h):
        return jax.nn.gelu(self.linear(h))


@pytest.mark.slow  # 3 s of CPU
def test_nnx_scan_stacked_layers():
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return Block(rngs)

    graphdef, state = nnx.split(create(nnx.Rngs(0)))

    def layer_fn(one, h):
        return nnx.merge(graphdef, one)(h)

    x = batch()
    want = jax.value_and_grad(lambda s: jnp.sum(scan(layer_fn, s, x) ** 2))(state)
    mesh = spmd.make_mesh({"stage": 4, "data": 2})
    with jax.set_mesh(mesh):
        placed = jax.device_put(state, NamedSharding(mesh, P("stage")))
        got = jax.jit(
            jax.value_and_grad(
                lambda s: jnp.sum(spmd.pipeline(layer_fn, s, x, microbatches=4) ** 2)
            )
        )(placed)
    assert_trees_allclose(got, want, **TOL)


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(D)(h)), None


@pytest.mark.slow  # 3 s of CPU
def test_linen_scan_stacked_layers():
    stack = nn.scan(
        LinenBlock,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=LAYERS,
    )()
    x = batch()
    variables = stack.init(jax.random.key(0), x, None)
    want = stack.apply(variables, x, None)[0]

    def layer_fn(one, h):
        return LinenBlock().apply({"params": one}, h, None)[0]

    mesh = spmd.make_mesh({"stage": 2, "data": 4})
    with jax.set_mesh(mesh):
        placed = jax.device_put(variables["params"], NamedSharding(mesh, P("stage")))
        got = jax.jit(lambda p: spmd.pipeline(layer_fn, p, x, microbatches=2))(placed)
    np.testing.assert_allclose(got, want, **TOL)


def _pipelined_step(microbatches=4):
    def train_step(state, x, y):
        def loss(params):
            h = spmd.pipeline(layer, params, x, microbatches=microbatches)
            return jnp.mean((h - y) ** 2)

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = optax.adam(1e-2).update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, value

    return train_step


def _train(strategy, steps=3):
    params = stacked()
    state = strategy.put({"params": params, "opt": optax.adam(1e-2).init(params)})
    step = strategy.step(_pipelined_step())
    losses = []
    for i in range(steps):
        state, loss = step(state, batch(seed=10 + i), batch(seed=20 + i))
        losses.append(float(loss))
    return state, losses, step


PIPELINE_RULES = [(r".*params/w", P("stage", None, "model")), (r".*params/b", P("stage"))]


def _pipelined(stages=2, model=2):
    mesh = spmd.make_mesh({"stage": stages, "data": -1, "model": model})
    return spmd.Strategy(mesh, rules=PIPELINE_RULES, batch_axes=("data",))


@pytest.mark.slow  # 6 s of CPU
def test_strategy_step_trains_like_one_device_and_explain_names_the_bubble():
    state, losses, step = _train(_pipelined())
    want_state, want, _ = _train(spmd.OneDeviceStrategy())
    np.testing.assert_allclose(losses, want, **TOL)
    assert_trees_allclose(state["params"], want_state["params"], **TOL)
    assert state["params"]["w"].sharding.spec[0] == "stage"
    explained = step.strategy.explain(step, state, batch(), batch())
    assert explained.pipelines == (spmd.PipelineSchedule(2, 4, 1),)
    assert explained.pipelines[0].bubble == pytest.approx(1 / 5)
    assert "bubble 20.0%" in str(explained)
    assert "collective-permute" in explained.collectives


@pytest.mark.slow  # 8 s of CPU
@pytest.mark.parametrize("stages", [4, 1])
def test_a_checkpoint_saved_with_two_stages_restores_into_four_or_one(tmp_path, stages):
    saving = _pipelined(stages=2)
    state, _, _ = _train(saving, steps=1)
    with spmd.CheckpointManager(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state)
    target = _pipelined(stages=stages, model=1)
    placed = target.put(jax.tree.map(jnp.zeros_like, jax.device_get(state)))
    with spmd.CheckpointManager(tmp_path) as ckpt:
        restored = ckpt.restore(1, target=placed)
    assert_trees_allclose(restored, jax.device_get(state), rtol=0, atol=0)
    assert restored["params"]["w"].sharding.mesh.shape["stage"] == stages
    step = target.step(_pipelined_step())
    _, loss = step(restored, batch(seed=11), batch(seed=21))
    _, want = _train(spmd.OneDeviceStrategy(), steps=2)[:2]
    np.testing.assert_allclose(float(loss), want[1], **TOL)


def _error(match, **overrides):
    args = {"layer_fn": layer, "stacked_params": stacked(), "x": batch(), "microbatches": 4}
    args |= overrides
    with pytest.raises(spmd.ConfigurationError, match=match) as info:
        jax.jit(lambda: spmd.pipeline(**args))()
    assert "Received:" in str(info.value) and "To fix:" in str(info.value)


@pytest.mark.parametrize(
    "match, overrides",
    [
        (r"layers = stages \* repeats", {"stacked_params": stacked(layers=3)}),
        (r"layers = stages \* repeats", {"repeats": 3}),
        ("divides into `microbatches`", {"microbatches": 3}),
        ("at least as many microbatches", {"microbatches": 1, "repeats": 2}),
        ("positive integer", {"microbatches": 0}),
        ("positive integer", {"microbatches": 4.0}),
        ("positive integer", {"repeats": True}),
        ("layer_fn is a function", {"layer_fn": None}),
        (
            "inside one stage of another pipeline",
            {"layer_fn": lambda p, h: spmd.pipeline(layer, stacked(2), h, microbatches=1)},
        ),
        ("which the current mesh must have", {"axis": "pipe"}),
        ("h's shape and dtype", {"layer_fn": lambda p, h: h[:, :4]}),
        ("h's shape and dtype", {"layer_fn": lambda p, h: (h @ p["w"]).astype(jnp.bfloat16)}),
        (
            "same leading layers axis",
            {"stacked_params": {"w": stacked()["w"], "b": stacked(layers=4)["b"]}},
        ),
    ],
)
def test_bad_input_is_a_configuration_error_that_teaches(match, overrides):
    """On a stage 2 x data 4 mesh; a mesh without `stage` at all: the next tests."""
    with jax.set_mesh(spmd.make_mesh({"stage": 2, "data": 4})):
        _error(match, **overrides)


class DropoutBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, h):
        return self.dropout(self.linear(h))


def test_random_keys_among_the_stacked_parameters_are_an_error():
    """The keys would not advance: one dropout mask for every microbatch and step."""

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return DropoutBlock(rngs)

    graphdef, state = nnx.split(create(nnx.Rngs(0)))
    call = lambda s, h: nnx.merge(graphdef, s)(h)  # noqa: E731
    with jax.set_mesh(spmd.make_mesh({"stage": 2, "data": 4})):
        _error(r"without random keys(.|\n)*drop", layer_fn=call, stacked_params=state)
        _error("without random keys", layer_fn=lambda p, h: h, stacked_params=state)


def test_a_pipeline_nested_with_axis_none_runs_its_layers_in_order():
    inner = stacked(layers=2, seed=5)

    def block(p, h):  # an outer layer running an inner stack in order
        return spmd.pipeline(
            layer, jax.tree.map(lambda w: w + p["b"][0], inner), h, microbatches=1, axis=None
        )

    params, x = stacked(), batch()
    with jax.set_mesh(spmd.make_mesh({"stage": 2, "data": 4})):
        got = jax.jit(lambda p, x: spmd.pipeline(block, p, x, microbatches=4))(params, x)
    np.testing.assert_allclose(got, scan(block, params, x), **TOL)


def test_numpy_integer_microbatches_and_repeats_count_as_integers():
    """A count read from a config array (np.int64) is a count, as Python's int is."""
    params, x = stacked(), batch()
    with jax.set_mesh(spmd.make_mesh({"stage": 2, "data": 4})):
        got = jax.jit(
            lambda p, x: spmd.pipeline(layer, p, x, microbatches=np.int64(4), repeats=np.int32(2))
        )(params, x)
    np.testing.assert_allclose(got, scan(layer, params, x), **TOL)


@pytest.mark.parametrize("where", ["explicit mesh", "inside shard_map"])
def test_a_stage_axis_that_is_not_auto_is_an_error(where):
    params, x = stacked(), batch()
    call = lambda p, x: spmd.pipeline(layer, p, x, microbatches=2)  # noqa: E731
    if where == "explicit mesh":
        mesh = spmd.make_mesh({"stage": 2, "data": 4}, axis_types=jax.sharding.AxisType.Explicit)
    else:
        mesh = spmd.make_mesh({"stage": 2, "data": 4})
        call = jax.shard_map(call, in_specs=P(), out_specs=P(), axis_names={"stage"})
    with jax.set_mesh(mesh), pytest.raises(spmd.ConfigurationError, match="an Auto mesh axis"):
        jax.jit(call)(params, x)


def test_x_that_is_not_one_array_is_an_error():
    mesh = spmd.make_mesh({"stage": 2, "data": 4})
    with jax.set_mesh(mesh), pytest.raises(spmd.ConfigurationError, match="x is one array"):
        spmd.pipeline(layer, stacked(), {"h": batch()}, microbatches=2)


def test_no_mesh_is_an_error_naming_axis_none():
    with pytest.raises(spmd.ConfigurationError, match="axis=None"):
        spmd.pipeline(layer, stacked(), batch(), microbatches=2)


class PipelinedMLP(nnx.Module):
    """An input layer, four stacked blocks run by spmd.pipeline, a head."""

    def __init__(self, rngs: nnx.Rngs, axis: str | None = "stage"):
        self.axis = axis
        self.embed = nnx.Linear(D, D, rngs=rngs)

        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        graphdef, state = nnx.split(self.blocks)
        h = spmd.pipeline(
            lambda s, h: nnx.merge(graphdef, s)(h),
            state,
            self.embed(x),
            microbatches=4,
            axis=self.axis,
        )
        return self.head(h)


@pytest.mark.slow  # 10 s of CPU
def test_trainer_fits_a_pipelined_model_like_one_device():
    rng = np.random.RandomState(0)
    x, y = rng.randn(64, D).astype(np.float32), rng.randn(64, 1).astype(np.float32)

    def fit(strategy):
        trainer = spmd.Trainer(
            PipelinedMLP(nnx.Rngs(0)), optax.adam(1e-2), "mse", strategy=strategy
        )
        history = trainer.fit((x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)
        return history.history["loss"], nnx.state(trainer.model, nnx.Param)

    mesh = spmd.make_mesh({"stage": 2, "data": 4})
    pipelined = spmd.Strategy(mesh, rules=[(r"blocks/.*", P("stage"))], batch_axes=("data",))
    losses, params = fit(pipelined)
    want_losses, want_params = fit(spmd.OneDeviceStrategy())
    np.testing.assert_allclose(losses, want_losses, **TOL)
    assert_trees_allclose(params, want_params, **TOL)


@pytest.mark.slow  # 12 s of CPU
def test_trainer_on_diloco_islands_fits_a_pipelined_model_like_one_device_islands():
    """A Trainer on two islands of stage 2 x data 2, with validation data, against
    the same Trainer on one device per island running the layers in order."""
    rng = np.random.RandomState(0)
    x, y = rng.randn(64, D).astype(np.float32), rng.randn(64, 1).astype(np.float32)

    def fit(strategy, axis):
        trainer = spmd.Trainer(
            PipelinedMLP(nnx.Rngs(0), axis), optax.adam(1e-2), "mse", strategy=strategy
        )
        history = trainer.fit(
            (x, y), batch_size=16, shuffle=False, verbose=0, validation_data=(x[:16], y[:16])
        )
        return history.history, nnx.state(trainer.model, nnx.Param)

    rules = [(r"blocks/.*", P("stage"))]
    inner = {"stage": 2, "data": 2}
    history, params = fit(
        spmd.DiLoCo(inner, islands=2, sync_every=2, rules=rules, batch_axes=("data",)), "stage"
    )
    oracle = spmd.DiLoCo({"data": 1}, islands=2, sync_every=2, devices=jax.devices()[:2])
    want_history, want_params = fit(oracle, None)
    for name in ("loss", "val_loss"):
        np.testing.assert_allclose(history[name], want_history[name], **TOL)
    assert_trees_allclose(params, want_params, **TOL)


class _Interrupt(spmd.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        raise KeyboardInterrupt


@pytest.mark.slow  # 18 s of CPU
def test_a_fit_interrupted_on_two_stages_resumes_on_four_like_one_device(tmp_path):
    """BackupAndRestore's checkpoint of a 2-stage fit, resumed by a Trainer on 4 stages."""
    rng = np.random.RandomState(0)
    x, y = rng.randn(64, D).astype(np.float32), rng.randn(64, 1).astype(np.float32)

    def trainer(stages, axis="stage"):
        mesh = spmd.make_mesh({"stage": stages, "data": 8 // stages})
        strategy = spmd.Strategy(mesh, rules=[(r"blocks/.*", P("stage"))], batch_axes=("data",))
        model = PipelinedMLP(nnx.Rngs(0), axis)
        return spmd.Trainer(model, optax.adam(1e-2), "mse", strategy=strategy)

    fit = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0}
    backup = spmd.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(KeyboardInterrupt):
        trainer(2).fit((x, y), callbacks=[backup, _Interrupt()], **fit)
    resumed = trainer(4)
    history = resumed.fit((x, y), callbacks=[backup], **fit)
    oracle = spmd.Trainer(PipelinedMLP(nnx.Rngs(0), None), optax.adam(1e-2), "mse")
    want = oracle.fit((x, y), **fit)
    np.testing.assert_allclose(history.history["loss"], want.history["loss"][1:], **TOL)
    assert_trees_allclose(
        nnx.state(resumed.model, nnx.Param), nnx.state(oracle.model, nnx.Param), **TOL
    )


def _island_step(pipelined):
    def train_step(state, x, y):
        def loss(params):
            if pipelined:
                h = spmd.pipeline(layer, params, x, microbatches=2)
            else:
                h = scan(layer, params, x)
            return jnp.mean((h - y) ** 2)

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = optax.adam(1e-2).update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, value

    return train_step


@pytest.mark.slow  # 12 s of CPU
def test_diloco_islands_each_pipeline_over_their_own_stage_axis():
    """Two islands of stage 2 x model 2, synchronising every 2 steps, against the same
    DiLoCo with one device per island running the layer scan."""

    def train(strategy, pipelined):
        params = stacked()
        state = strategy.init(lambda: {"params": params, "opt": optax.adam(1e-2).init(params)})
        step = strategy.step(_island_step(pipelined))
        losses = []
        for i in range(3):
            state, loss = step(state, batch(seed=10 + i), batch(seed=20 + i))
            losses.append(np.asarray(loss))
        return losses, strategy.global_params(state)

    inner = {"stage": 2, "data": 1, "model": 2}
    islands = spmd.DiLoCo(
        inner, islands=2, sync_every=2, rules=PIPELINE_RULES, batch_axes=("data",)
    )
    losses, params = train(islands, True)
    oracle = spmd.DiLoCo({"data": 1}, islands=2, sync_every=2, devices=jax.devices()[:2])
    want, want_params = train(oracle, False)
    np.testing.assert_allclose(losses, want, **TOL)
    assert_trees_allclose(params, want_params, **TOL)
