"""Activations laid out by logical names (`spmd.logical.constrain`), per auto_strategy candidate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmd
from spmd._src.activations import activation_rules, constrains_activations

pytestmark = pytest.mark.cpu_mesh

RESIDUAL = ("activation_batch", "activation_length", "activation_embed")


def _layer(w, x):
    h = spmd.logical.constrain(jnp.tanh(x @ w), RESIDUAL)
    return h, (h**2).sum()


def _tensor_parallel():
    sizes = {"data": 2, "model": 4}
    return spmd.Strategy(
        spmd.make_mesh(sizes),
        logical_axis_rules=activation_rules(sizes, ("data",), "model"),
    )


@pytest.mark.slow  # 2 s of CPU
def test_the_residual_stream_splits_over_the_tensor_axis_as_maxtext_maps_it():
    strategy = _tensor_parallel()
    w = jnp.asarray(np.random.default_rng(0).normal(size=(16, 16)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 8, 16)), jnp.float32)
    with strategy.scope():
        h, total = jax.jit(_layer)(w, x)
    assert h.sharding.spec == P("data", None, "model")
    # The numbers are the one-device oracle's: a layout changes where they live, not them.
    oracle_h, oracle_total = _layer(w, x)
    np.testing.assert_allclose(np.asarray(h), np.asarray(oracle_h), rtol=1e-6)
    np.testing.assert_allclose(float(total), float(oracle_total), rtol=1e-5)


def test_on_one_device_and_outside_a_strategy_it_changes_nothing():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    assert spmd.logical.constrain(x, RESIDUAL) is x
    one = spmd.Strategy(spmd.make_mesh({"data": 1}, jax.devices()[:1]))
    with one.scope():
        out = jax.jit(lambda a: spmd.logical.constrain(a * 2, RESIDUAL))(x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x * 2))


def test_inside_strategy_run_the_manual_batch_axes_are_left_out():
    strategy = _tensor_parallel()

    @strategy.step
    def step(state, x):
        per = strategy.run(
            lambda r: (spmd.logical.constrain(jnp.tanh(r), RESIDUAL) ** 2).sum(), (x,)
        )
        return state, {"loss": strategy.reduce("sum", per)}

    state = strategy.init(lambda key: {"w": jnp.ones((4,))}, jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8, 16)), jnp.float32)
    _, metrics = step(state, x)
    np.testing.assert_allclose(float(metrics["loss"]), float((jnp.tanh(x) ** 2).sum()), rtol=1e-5)


def test_an_axis_that_does_not_divide_its_dimension_is_left_out():
    with _tensor_parallel().scope():
        out = jax.jit(lambda a: spmd.logical.constrain(a, RESIDUAL))(jnp.ones((4, 8, 6)))
    assert out.sharding.spec in (P("data"), P("data", None, None))


@pytest.mark.parametrize(
    "names", [("activation_batch", "activation_embed"), "activation_batch", (1, 2, 3)]
)
def test_names_not_one_per_dimension_are_refused(names):
    with pytest.raises(spmd.ConfigurationError, match="one per dimension") as info:
        spmd.logical.constrain(jnp.ones((2, 3, 4)), names)
    assert "Received:" in str(info.value)


def test_a_name_given_to_two_dimensions_is_refused_naming_the_call():
    with _tensor_parallel().scope(), pytest.raises(spmd.ConfigurationError) as info:
        spmd.logical.constrain(jnp.ones((4, 8, 16)), ("activation_batch", "activation_batch", None))
    assert "spmd.logical.constrain(x of shape (4, 8, 16))" in str(info.value)


def test_each_candidate_maps_the_names_by_its_own_layout():
    tp = dict(activation_rules({"data": 2, "fsdp": 2, "model": 2}, ("data", "fsdp"), "model"))
    assert tp["activation_batch"] == ("data", "fsdp")
    assert tp["activation_embed"] == tp["activation_mlp"] == tp["activation_vocab"] == "model"
    assert tp["activation_length"] is None
    fsdp = dict(activation_rules({"data": 1, "fsdp": 8}, ("data", "fsdp"), "model"))
    assert fsdp["activation_embed"] is None and fsdp["activation_heads"] is None
    assert set(dict(activation_rules({}, (), "model"))) == set(spmd.logical.ACTIVATIONS)


def test_a_step_that_lays_out_an_activation_is_told_from_one_that_does_not():
    w, x = jnp.ones((16, 16)), jnp.ones((4, 8, 16))
    with _tensor_parallel().scope():
        assert constrains_activations(jax.make_jaxpr(lambda w, x: _layer(w, x)[1])(w, x))
        # A constraint on a result is the strategy's layout of it, not an activation's.
        assert not constrains_activations(jax.make_jaxpr(lambda w, x: _layer(w, x)[0])(w, x))
    assert not constrains_activations(jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w))(w, x))


def _create(key):
    return {"w": jax.random.normal(key, (256, 256)) * 0.05}


def _step(constrained: bool):
    def step(state, x):
        def loss(w):
            h = jnp.tanh(x @ w)
            if constrained:
                h = spmd.logical.constrain(h, RESIDUAL)
            return (h**2).mean()

        value, grad = jax.value_and_grad(loss)(state["w"])
        return {"w": state["w"] - 0.1 * grad}, {"loss": value}

    return step


@pytest.mark.slow  # 8 s of CPU
def test_a_plan_notes_a_step_that_lays_out_no_activation_where_tensor_parallelism_is_tried():
    x = jax.ShapeDtypeStruct((8, 16, 256), jnp.float32)
    _, bare = spmd.auto_strategy(_create, _step(False), x, only=["TP over 2"])
    assert any("lays out none of its activations" in n for n in bare.notes)
    assert "note: the step lays out none" in str(bare)
    _, named = spmd.auto_strategy(_create, _step(True), x, only=["TP over 2"])
    assert named.notes == ()
    _, plain = spmd.auto_strategy(_create, _step(False), x, only=["FSDP over 8"])
    assert plain.notes == ()  # no tensor parallelism: nothing to say


@pytest.mark.slow  # 26 s of CPU: two TPU compiles of a small decoder
def test_on_a_tpu_topology_naming_the_activations_lowers_the_tensor_parallel_memory():
    from bench import plan_maxtext as pm

    config = pm.Config(
        vocab=256, width=1024, heads=4, head_dim=64, mlp=1024, layers=8, seq=128,
        per_device_batch=2, remat="full",
    )  # fmt: skip
    tokens = jax.ShapeDtypeStruct((8, config.seq + 1), jnp.int32)
    temp = {}
    for annotate in ("maxtext", "batch"):
        c = pm.Config(**{**config.__dict__, "annotate": annotate})
        _, plan = spmd.auto_strategy(
            pm.create_fn(c),
            pm.step_fn(c),
            (tokens,),
            "v5e:2x2",
            only=["TP over 4"],
            rules=pm.ROW_PARALLEL,
        )
        temp[annotate] = plan.candidates[0].explanation.temp_bytes
    # The residual stream split over the tensor group (MaxText's activation_embed rule)
    # against the same constrained by its batch alone, whole on each of the 4 chips.
    assert temp["maxtext"] < 0.8 * temp["batch"], temp
