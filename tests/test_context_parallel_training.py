"""A transformer LM using spmd.attention trains as on one device: in a step, the Trainer, DiLoCo."""

import jax
import numpy as np
import optax
import pytest
from models import lm_batches, lm_create, lm_logits, lm_step, oracle_compiled

import spmd
from spmd.testing import assert_trees_allclose

pytestmark = pytest.mark.cpu_mesh

# float32 rounding: the K/V gradients summed over the context axis and the batch's over
# the data axis in another order than one device's sums.
TOL = {"rtol": 1e-4, "atol": 1e-5}


def one_device(steps):
    """The oracle: the same model, data and seed, jax.jit on one device (no mesh)."""
    state, batches, losses = lm_create(jax.random.key(0)), lm_batches(steps), []
    step = oracle_compiled(lm_step(), state, batches[0])
    for tokens in batches:
        state, metrics = step(state, tokens)
        losses.append(float(metrics["loss"]))
    return state, losses


def spmd_train(strategy, steps):
    state = strategy.init(lm_create, jax.random.key(0))
    step, losses = strategy.step(lm_step()), []
    for tokens in lm_batches(steps):
        state, metrics = step(state, tokens)
        losses.append(np.asarray(metrics["loss"]))
    return state, losses


@pytest.mark.slow  # 8 s of CPU
def test_a_step_with_context_and_data_axes_trains_as_one_device():
    strategy = spmd.Strategy(mesh=spmd.make_mesh({"data": 2, "context": 4}), batch_axes=("data",))
    state, losses = spmd_train(strategy, 3)
    want_state, want_losses = one_device(3)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    assert_trees_allclose(state["params"], want_state["params"], **TOL)
    assert losses[-1] < losses[0]


@pytest.mark.slow  # 5 s of CPU
def test_the_trainer_fits_a_context_parallel_model_as_one_device():
    tokens = np.concatenate(lm_batches(3))
    x, y = tokens, np.roll(tokens, -1, axis=1)  # the length stays a multiple of 2

    def init(key):
        return lm_create(key)["params"]

    def per_example(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(axis=-1)

    mesh = spmd.make_mesh({"context": 2, "model": 2, "data": 2})
    strategy = spmd.Strategy(mesh=mesh, batch_axes=("data",))
    trainer = spmd.Trainer((init, lm_logits), optax.adamw(1e-2), per_example, strategy=strategy)
    history = trainer.fit((x, y), batch_size=8, epochs=1, shuffle=False, verbose=0)

    params, tx = init(jax.random.key(0)), optax.adamw(1e-2)
    opt, losses = tx.init(params), []

    def train_step(params, opt, x, y):
        loss, grads = jax.value_and_grad(lambda p: per_example(lm_logits(p, x), y).mean())(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    step = oracle_compiled(train_step, params, opt, x[:8], y[:8])
    for i in range(0, len(x), 8):
        params, opt, loss = step(params, opt, x[i : i + 8], y[i : i + 8])
        losses.append(float(loss))
    np.testing.assert_allclose(history.history["loss"][-1], np.mean(losses), **TOL)
    assert_trees_allclose(trainer.model, params, **TOL)


@pytest.mark.slow  # 10 s of CPU
def test_diloco_islands_with_a_context_axis_train_as_islands_without_one():
    options = {"islands": 2, "sync_every": 2, "batch_axes": ("data",)}
    with_context = spmd.DiLoCo({"data": -1, "context": 2}, **options)
    without = spmd.DiLoCo({"data": -1}, **options)
    assert with_context.mesh.shape["context"] == 2
    state, losses = spmd_train(with_context, 3)
    want_state, want_losses = spmd_train(without, 3)
    np.testing.assert_allclose(losses, want_losses, **TOL)
    assert_trees_allclose(state.params, want_state.params, **TOL)
