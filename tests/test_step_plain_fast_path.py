"""The step's inlined fast path for a pytree state: what it skips, and what it still catches."""

import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.strategy import step as step_module

X = np.arange(16, dtype=np.float32).reshape(8, 2)


def _sgd(state, x):
    loss = jnp.sum(x) * jnp.sum(state["w"])
    return {"w": state["w"] - 0.01 * jnp.sum(x)}, loss


@pytest.fixture
def strategy():
    return spmd.MirroredStrategy()


def test_a_batch_sharding_is_one_object_per_rank(strategy):
    assert strategy.batch_sharding(2) is strategy.batch_sharding(2)
    assert strategy.batch_sharding(1, axis=1) is strategy.batch_sharding(0, axis=1)
    assert strategy.batch_sharding(2) is not strategy.batch_sharding(2, axis=1)


def test_a_steady_call_flattens_the_state_once(strategy, monkeypatch):
    step = strategy.step(_sgd)
    batch = strategy.distribute_batch(X)
    state, _ = step({"w": jnp.ones(4)}, batch)
    state, _ = step(state, batch)
    flattened = []
    real = step_module._flatten
    monkeypatch.setattr(step_module, "_flatten", lambda t: flattened.append(t) or real(t))
    state, loss = step(state, batch)
    assert len(flattened) == 2  # the state, then the batch
    np.testing.assert_allclose(state["w"], np.ones(4) - 3 * 0.01 * X.sum(), rtol=1e-6)


def test_a_leaf_replaced_in_place_after_steady_calls_is_read(strategy):
    step = strategy.step(_sgd)
    state, _ = step({"w": jnp.ones(4)}, X)
    state, _ = step(state, X)
    state["w"] = strategy.put(jnp.full(4, 2.0))  # same shape, dtype and layout
    state, loss = step(state, X)
    assert float(loss) == pytest.approx(X.sum() * 8.0)
    np.testing.assert_allclose(state["w"], np.full(4, 2.0) - 0.01 * X.sum(), rtol=1e-6)


def test_a_leaf_of_another_shape_replaced_in_place_runs_its_own_program(strategy):
    step = strategy.step(_sgd)
    state, _ = step({"w": jnp.ones(4)}, X)
    state, _ = step(state, X)
    state["w"] = jnp.ones(6)
    state, loss = step(state, X)
    assert state["w"].shape == (6,) and step.cache_size() == 2
    assert float(loss) == pytest.approx(X.sum() * 6.0)


def test_a_state_donated_by_another_step_is_named_after_steady_calls(strategy):
    a, b = strategy.step(_sgd), strategy.step(_sgd)
    state, _ = a({"w": jnp.ones(4)}, X)
    state, _ = a(state, X)
    b(state, X)
    with pytest.raises(spmd.ConfigurationError, match="donated"):
        a(state, X)
