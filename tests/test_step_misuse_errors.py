"""Misuses at the joints of state, placement and step, each a ConfigurationError in three
parts (what was expected, `Received: ...`, how to fix it) rather than JAX's raw error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd

X = np.ones((8, 3), np.float32)


def assert_three_parts(error: Exception, *fragments: str) -> None:
    text = str(error)
    assert "\nReceived: " in text and "\nTo fix: " in text, text
    for fragment in fragments:
        assert fragment in text, text


def test_init_returning_a_string_leaf_names_it():
    strategy = spmd.MirroredStrategy()
    with pytest.raises(spmd.ConfigurationError) as error:
        strategy.init(
            lambda key: {"w": jax.random.normal(key, (4,)), "name": "mlp"}, jax.random.key(0)
        )
    assert_three_parts(error.value, "leaf='name'", "type='str'", "out of the state")
    with pytest.raises(spmd.ConfigurationError, match="leaf='name'"):
        strategy.abstract_state(lambda: {"w": jnp.zeros(4), "name": "mlp"})


@pytest.mark.parametrize("bad", ["mlp", np.array(["a", "b"]), object()])
def test_put_of_a_leaf_that_is_not_a_number_names_it(bad):
    with pytest.raises(spmd.ConfigurationError) as error:
        spmd.MirroredStrategy().put({"w": jnp.ones(4), "config": {"name": bad}})
    assert_three_parts(error.value, "leaf='config/name'", f"type='{type(bad).__name__}'")


def test_a_diloco_state_given_to_a_synchronous_step_names_diloco_step():
    diloco = spmd.DiLoCo(spmd.MirroredStrategy(), islands=2, sync_every=2, params="w")
    state = diloco.init(lambda: {"w": jnp.zeros(3, jnp.float32)})
    strategy = spmd.MirroredStrategy()

    @strategy.step
    def step(state, x):
        return jax.tree.map(lambda a: a + jnp.mean(x), state), jnp.mean(x)

    with pytest.raises(spmd.ConfigurationError) as error:
        step(state, X)
    assert_three_parts(error.value, "state='DiLoCoState'", "islands=2", "diloco.step(")
    # the parameters taken out train on the synchronous strategy
    params, loss = step(strategy.put({"w": state.params}), X)  # params="w": the array
    np.testing.assert_allclose(params["w"], np.ones(3))
    assert float(loss) == 1.0


def test_a_step_closing_over_a_donated_array_names_it():
    strategy = spmd.MirroredStrategy()

    def build():
        w = strategy.put(jnp.ones(4))

        @strategy.step
        def train(state, x):
            return {"w": state["w"] + jnp.mean(x)}, jnp.mean(x)

        @strategy.step
        def scale(state, x):
            return {"v": state["v"] * jnp.sum(w)}, jnp.mean(x)

        return w, train, scale

    w, train, scale = build()
    train({"w": w}, X)  # donates w, which scale reads from its closure
    assert w.is_deleted()
    with pytest.raises(spmd.ConfigurationError) as error:
        scale({"v": strategy.put(jnp.ones(2))}, X)
    assert_three_parts(error.value, "deleted=['w']", "donate=False", "float32[4]")
