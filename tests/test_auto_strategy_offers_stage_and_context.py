"""spmd.auto_strategy offers a stage axis where the step calls spmd.pipeline, and a context
axis where it calls spmd.attention; a step calling neither gets neither."""

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmd
from spmd._src.candidates import candidates
from spmd._src.pipeline import PipelineCall

pytestmark = pytest.mark.cpu_mesh

LR = 0.1


def _sgd(loss):
    def step(state, x):
        value, grads = jax.value_and_grad(loss)(state, x)
        return jax.tree.map(lambda w, g: w - LR * g, state, grads), {"loss": value}

    return step


def _pipelined_create(key):
    return {"layers": {"w": jax.random.normal(key, (4, 64, 64)) * 0.1}}  # 4 stacked layers


def _pipelined_loss(state, x):
    y = spmd.pipeline(lambda p, h: jnp.tanh(h @ p["w"]), state["layers"], x, microbatches=4)
    return jnp.mean((y - x) ** 2)


PIPELINE_RULES = [("layers/w", P("stage"))]  # the stacked layers over the stages


def _attention_create(key):
    return {"w": jax.random.normal(key, (32, 32)) * 0.2}


def _attention_loss(state, x):
    q = (x @ state["w"]).reshape(*x.shape[:2], 2, 16)  # [batch, length 16, 2 heads, 16]
    out = spmd.attention(q, q, q, causal=True).reshape(x.shape)
    return jnp.mean((out - x) ** 2)


def _one_device(create, step, x, rules=()):
    """The oracle: the same step, state and batch on one device."""
    one = spmd.Strategy(spmd.make_mesh({"stage": 1, "data": 1}, jax.devices()[:1]), rules=rules)
    state = one.init(create, jax.random.key(0))
    return one.step(step)(state, x)


def _runs_like_one_device(best, create, step, x, rules=()):
    state, metrics = best.step(step)(best.init(create, jax.random.key(0)), x)
    want_state, want_metrics = _one_device(create, step, x, rules)
    np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], rtol=1e-5)
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    return state


@pytest.mark.slow  # 10 s of CPU: four pipelined layouts compiled
def test_a_pipelined_step_gets_stage_candidates_outermost_that_equal_one_device():
    x = jax.random.normal(jax.random.key(1), (16, 64))
    step = _sgd(_pipelined_loss)
    best, plan = spmd.auto_strategy(
        _pipelined_create, step, x, jax.devices(), rules=PIPELINE_RULES, only="stage"
    )
    names = {c.name for c in plan.candidates}
    # Sizes dividing the 4 layers and the 8 devices; data or FSDP over the rest.
    assert names == {"stage 2 x data 4", "stage 2 x FSDP 4", "stage 4 x data 2", "stage 4 x FSDP 2"}
    assert not plan.dropped
    for c in plan.candidates:
        assert next(iter(c.strategy.mesh.shape)) == "stage"  # outermost: across slices
    state = _runs_like_one_device(best, _pipelined_create, step, x, PIPELINE_RULES)
    assert state["layers"]["w"].sharding.spec[0] == "stage"  # the stacked layers split
    assert best.explain(step, state, x).pipelines[0].stages == best.mesh.shape["stage"]


@pytest.mark.slow  # 7 s of CPU: five context-parallel layouts compiled
def test_an_attention_step_gets_context_candidates_that_equal_one_device():
    x = jax.random.normal(jax.random.key(1), (4, 16, 32))
    step = _sgd(_attention_loss)
    best, plan = spmd.auto_strategy(_attention_create, step, x, jax.devices(), only="context")
    names = {c.name for c in plan.candidates}
    # Sizes dividing the length 16 and the 8 devices; data or FSDP over the rest.
    assert names == {
        "context 2 x data 4",
        "context 2 x FSDP 4",
        "context 4 x data 2",
        "context 4 x FSDP 2",
        "context 8",
    }
    assert not plan.dropped  # the context axis splits no leaf, yet is not idle
    c4 = next(c for c in plan.candidates if c.name == "context 4 x data 2")
    assert dict(c4.strategy.mesh.shape) == {"data": 2, "context": 4}
    assert ("activation_length", "context") in c4.strategy.logical_axis_rules
    _runs_like_one_device(best, _attention_create, step, x)


def test_the_length_and_the_layers_bound_the_sizes_offered():
    x = jax.random.normal(jax.random.key(1), (4, 6, 32))  # length 6: only a context of 2

    def loss(state, x):
        q = (x @ state["w"]).reshape(*x.shape[:2], 2, 16)
        return jnp.mean(spmd.attention(q, q, q) ** 2)

    with pytest.raises(spmd.ConfigurationError) as err:
        spmd.auto_strategy(_attention_create, _sgd(loss), x, jax.devices(), only="context 4")
    assert "context 2 x data 4" in str(err.value) and "'context 8'" not in str(err.value)


def test_a_step_without_pipeline_or_attention_gets_neither_axis():
    def create(key):
        return {"w": jax.random.normal(key, (32, 32))}

    def loss(state, x):
        return jnp.mean(jnp.tanh(x @ state["w"]) ** 2)

    for axis in ("stage", "context"):
        with pytest.raises(spmd.ConfigurationError, match="none does") as err:
            spmd.auto_strategy(create, _sgd(loss), jnp.ones((8, 32)), jax.devices(), only=axis)
        assert "FSDP over 8" in str(err.value)  # the candidates it has, none of them this axis


def test_stage_sizes_follow_the_layers_repeats_and_slices():
    leaves = [("layers/w", jax.ShapeDtypeStruct((8, 64, 64), jnp.float32))]
    # 8 layers, 2 repeats, 2 microbatches: 4 stages would need 4 microbatches.
    calls = [PipelineCall("stage", 8, 2, 2)]
    names = [name for name, _ in candidates(leaves, jax.devices(), 2, pipelines=calls)]
    staged = [n for n in names if n.startswith("stage")]
    # Two slices of 4: the stage axis of 2 spans the slices, FSDP inside each.
    assert staged == ["stage 2 x data 4", "stage 2 x FSDP 4"]
    assert "TP over 2" in names  # the tensor axis is "model", not the stage axis
    built = dict(candidates(leaves, jax.devices(), 2, model_axes=("stage",), pipelines=calls))
    tp = built["TP over 2"]()
    assert tp.mesh.shape["stage"] == 1 and tp.mesh.shape["model"] == 2


@pytest.mark.slow  # 8 s of CPU: two layouts compiled
def test_a_pipeline_without_a_stage_rule_runs_in_every_candidate():
    x = jax.random.normal(jax.random.key(1), (16, 64))
    step = _sgd(_pipelined_loss)
    only = ["FSDP over 8", "stage 2 x data 4"]
    best, plan = spmd.auto_strategy(_pipelined_create, step, x, jax.devices(), only=only)
    assert {c.name for c in plan.ranked} == set(only) and not plan.dropped
    fsdp = next(c for c in plan.ranked if c.name == "FSDP over 8")
    assert fsdp.strategy.mesh.shape["stage"] == 1  # the layers run in order there
    _runs_like_one_device(best, _pipelined_create, step, x)


@pytest.mark.slow  # 4 s of CPU: four layouts compiled for two v5e:2x2 slices
def test_on_two_slices_the_stage_axis_is_the_one_across_them():
    pytest.importorskip("libtpu", reason="the TPU compiler (the tpu-compile extra)")
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    _, plan = spmd.auto_strategy(
        _pipelined_create,
        _sgd(_pipelined_loss),
        x,
        "v5e:2x2",
        slices=2,
        rules=PIPELINE_RULES,
        only="stage",
    )
    assert not plan.dropped and all(c.explanation.fits for c in plan.ranked)
    two = next(c for c in plan.ranked if c.name == "stage 2 x FSDP 4")
    slice_of = np.vectorize(lambda d: d.slice_index)(two.strategy.mesh.devices)
    assert (slice_of == np.arange(2).reshape(2, 1, 1)).all()  # stage s is slice s: DCN


class _Block(linen.Module):
    @linen.compact
    def __call__(self, h, _):
        init = linen.with_logical_partitioning(linen.initializers.normal(0.1), ("embed", "mlp"))
        return jnp.tanh(h @ self.param("kernel", init, (128, 128))), None


def _scanned_create(key):
    stack = linen.scan(
        _Block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=4,
        metadata_params={linen.PARTITION_NAME: "layers"},
    )
    return stack().init(key, jnp.zeros((2, 128)), None)["params"]


def _scanned_loss(state, x):
    layers = linen.unbox(state)
    y = spmd.pipeline(lambda p, h: jnp.tanh(h @ p["kernel"]), layers, x, microbatches=4)
    return jnp.mean((y - x) ** 2)


@pytest.mark.slow  # 6 s of CPU: one layout compiled
def test_annotated_stacked_layers_split_over_stage_and_fsdp():
    rules = [("layers", "stage"), ("embed", None), ("mlp", None)]
    x = jax.random.normal(jax.random.key(1), (16, 128))
    step = _sgd(_scanned_loss)
    only = ["stage 2 x FSDP 4"]
    with pytest.warns(spmd.LayoutConflictWarning):  # FSDP adds its axis to the annotation
        best, plan = spmd.auto_strategy(
            _scanned_create, step, x, jax.devices(), logical_axis_rules=rules, only=only
        )
        one = spmd.Strategy(
            spmd.make_mesh({"stage": 1, "data": 1}, jax.devices()[:1]), logical_axis_rules=rules
        )
        state, metrics = best.step(step)(best.init(_scanned_create, jax.random.key(0)), x)
    assert [c.name for c in plan.ranked] == only
    assert state["kernel"].value.sharding.spec == P("stage", "fsdp")
    want_state, want = one.step(step)(one.init(_scanned_create, jax.random.key(0)), x)
    np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(
        state["kernel"].value, want_state["kernel"].value, rtol=1e-4, atol=1e-6
    )
