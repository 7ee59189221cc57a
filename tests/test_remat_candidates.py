"""The model's remat policies as a dimension of auto_strategy's candidates."""

import jax
import jax.numpy as jnp
import optax
import pytest

import spmd

pytestmark = pytest.mark.cpu_mesh

POLICIES = {
    "none": jax.checkpoint_policies.everything_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
X = jax.ShapeDtypeStruct((512, 256), jnp.float32)


def _create(key):
    params = {"w": jax.random.normal(key, (8, 256, 256)) * 0.05}
    return {"params": params, "opt": optax.sgd(0.1).init(params)}


def _build_step(remat: str):
    """The train step under one remat policy: 8 scanned layers, each rematerialised so."""

    def layer(h, w):
        return jnp.tanh(jnp.tanh(h @ w) @ w), None

    def loss(params, x):
        layer_fn = jax.checkpoint(layer, policy=POLICIES[remat])
        return (jax.lax.scan(layer_fn, x, params["w"])[0] ** 2).mean()

    def step(state, x):
        value, grads = jax.value_and_grad(loss)(state["params"], x)
        updates, opt = optax.sgd(0.1).update(grads, state["opt"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {
            "loss": value
        }

    return step


@pytest.mark.slow  # 10 s of CPU: two compiles
def test_full_remat_needs_less_temporary_memory_than_none_per_the_compiler():
    _, plan = spmd.auto_strategy(
        _create, _build_step, X, remat=("none", "full"), only=["data parallel"]
    )
    by_name = {c.name: c for c in plan.candidates}
    assert set(by_name) == {"data parallel, remat none", "data parallel, remat full"}
    none = by_name["data parallel, remat none"].explanation
    full = by_name["data parallel, remat full"].explanation
    # Saving every layer's activations for the backward pass, against recomputing them.
    assert full.temp_bytes < none.temp_bytes
    assert full.matmul_flops > none.matmul_flops  # the recomputed forward pass
    assert "remat full" in str(plan) and "remat none" in str(plan)


@pytest.mark.parametrize("remat", [(), ("full", "full"), [1], 3])
def test_remat_that_names_no_distinct_policies_is_refused(remat):
    with pytest.raises(spmd.ConfigurationError, match="remat policies") as info:
        spmd.auto_strategy(_create, _build_step, X, remat=remat)
    assert "Received: remat=" in str(info.value)


@pytest.mark.slow  # 2 s of CPU
def test_one_string_is_one_policy():
    _, plan = spmd.auto_strategy(_create, _build_step, X, remat="full", only=["data parallel"])
    assert [c.name for c in plan.candidates] == ["data parallel, remat full"]


@pytest.mark.parametrize("builder", [lambda remat: None, _build_step("full")])
def test_a_step_where_a_builder_is_expected_is_refused(builder):
    # A builder that returns no step; the train step itself (it takes no remat=).
    with pytest.raises(spmd.ConfigurationError, match=r"step\(remat=name\) returns") as info:
        spmd.auto_strategy(_create, builder, X, remat=("none",))
    assert "Received: remat='none'" in str(info.value)


SCRIPT = """
import jax, jax.numpy as jnp, optax


def create(key):
    return {"w": jax.random.normal(key, (4, 256, 256)) * 0.05}


def build_step(remat):
    policy = {"none": jax.checkpoint_policies.everything_saveable,
              "full": jax.checkpoint_policies.nothing_saveable}[remat]

    def step(state, x):
        def loss(w):
            layer = jax.checkpoint(lambda h, wi: (jnp.tanh(h @ wi), None), policy=policy)
            return (jax.lax.scan(layer, x, w)[0] ** 2).mean()
        value, grad = jax.value_and_grad(loss)(state["w"])
        return {"w": state["w"] - 0.1 * grad}, {"loss": value}
    return step


def plan_inputs():
    return dict(create_fn=create, step=build_step, remat=("none", "full"),
                batch=(jax.ShapeDtypeStruct((64, 256), jnp.float32),))
"""


@pytest.mark.slow  # 6 s of CPU
def test_spmd_plan_tries_the_remat_policies_plan_inputs_declares(tmp_path, capsys):
    from spmd._src.cli.main import main

    script = tmp_path / "remat_train.py"
    script.write_text(SCRIPT)
    code = main(["plan", "--target", "cpu", "--only", "data parallel", f"{script}:plan_inputs"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "data parallel, remat none" in out and "data parallel, remat full" in out
