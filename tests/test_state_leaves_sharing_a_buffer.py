"""A state whose leaves are one array (a parameter EMA that starts as the parameters, an
optimizer state whose `init` returns them): placing it gives each leaf its own buffer, so
the donating step runs, with the numbers of one device; a step given such a state unplaced
names the two paths."""

import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from commands import run_program
from flax import nnx
from models import MLP, labelled, nnx_update, xent

import spmd
from spmd._src.strategy.state_placement import buffers
from spmd.testing import assert_trees_allclose

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
X = np.linspace(-1.0, 1.0, 16 * 8, dtype=np.float32).reshape(16, 8)


def ema_step(state, x):
    """SGD on the params and an EMA of them: the two leaves move apart from the first step."""
    grad = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(state["params"]["w"])
    w = state["params"]["w"] - 0.1 * grad
    ema = 0.9 * state["ema"]["w"] + 0.1 * w
    return {"params": {"w": w}, "ema": {"w": ema}}, jnp.sum(w)


def one_device(w0: np.ndarray, steps: int = 3):
    """The oracle: plain jax.jit on one device, no donation."""
    state, loss = {"params": {"w": w0}, "ema": {"w": w0}}, None
    for _ in range(steps):
        state, loss = jax.jit(ema_step)(state, X)
    return jax.device_get(state), float(loss)


def run_steps(strategy, state, steps: int = 3):
    step = strategy.step(ema_step)
    for _ in range(steps):
        state, loss = step(state, X)
    return jax.device_get(state), float(loss)


W0 = np.arange(32, dtype=np.float32).reshape(8, 4) / 32


def assert_own_buffers(state):
    seen: set[int] = set()
    for leaf in jax.tree.leaves(state):
        held = buffers(leaf)
        assert held and held.isdisjoint(seen)
        seen |= held


@pytest.mark.slow  # 6 s of CPU: a fresh interpreter
def test_put_of_one_array_at_two_paths_runs_in_a_subprocess_without_a_crash():
    """Unfixed, XLA says 'Attempt to donate the same buffer twice' and the process dies
    of a segmentation fault: run where a crash fails this test, not the suite."""
    script = textwrap.dedent(
        """
        import jax
        jax.config.update("jax_num_cpu_devices", 8)
        import jax.numpy as jnp, numpy as np, spmd
        from test_state_leaves_sharing_a_buffer import W0, run_steps
        strategy = spmd.Strategy(spmd.make_mesh({"data": -1}))
        p = jnp.asarray(W0)  # on one device: put shares its buffer across the leaves
        state, loss = run_steps(strategy, strategy.put({"params": {"w": p}, "ema": {"w": p}}))
        print("RESULT", loss, float(np.sum(state["ema"]["w"])))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    done = run_program([sys.executable, "-c", script], env, 240)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    loss, ema_sum = map(float, line.split()[1:])
    expected, expected_loss = one_device(W0)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    np.testing.assert_allclose(ema_sum, np.sum(expected["ema"]["w"]), rtol=1e-6)


@pytest.mark.parametrize("source", ["one device", "placed", "numpy"])
def test_put_gives_each_leaf_its_own_buffer_and_the_step_matches_one_device(source):
    strategy = spmd.Strategy(spmd.make_mesh({"data": -1}))
    p = {
        "one device": lambda: jnp.asarray(W0),
        "placed": lambda: strategy.put(jnp.asarray(W0)),
        "numpy": lambda: W0.copy(),
    }[source]()
    state = strategy.put({"params": {"w": p}, "ema": {"w": p}})
    assert_own_buffers(state)
    got, loss = run_steps(strategy, state)
    expected, expected_loss = one_device(W0)
    assert_trees_allclose(got, expected, rtol=1e-6)
    assert loss == pytest.approx(expected_loss, rel=1e-6)


def test_init_returning_an_argument_twice_gives_each_leaf_its_own_buffer():
    strategy = spmd.MirroredStrategy()
    p = strategy.put(jnp.asarray(W0))
    state = strategy.init(lambda w: {"params": {"w": w}, "ema": {"w": w}}, p)
    assert_own_buffers(state)
    got, loss = run_steps(strategy, state)
    expected, expected_loss = one_device(W0)
    assert_trees_allclose(got, expected, rtol=1e-6)
    assert loss == pytest.approx(expected_loss, rel=1e-6)


def test_arrays_put_apart_from_one_array_are_named_by_the_step_not_crashed_on():
    """Two device_puts of one single-device array share its buffer on that device: a
    step given them unplaced names both paths and the fix (strategy.put)."""
    strategy = spmd.MirroredStrategy()
    p = jnp.asarray(W0)
    state = {
        "params": {"w": jax.device_put(p, strategy.replicated)},
        "ema": {"w": jax.device_put(p, strategy.replicated)},
    }
    with pytest.raises(spmd.ConfigurationError) as error:
        strategy.step(ema_step)(state, X)
    text = str(error.value)
    assert "first='ema/w', second='params/w'" in text and "strategy.put(state)" in text


def _params_ema(decay: float) -> optax.GradientTransformation:
    """An optimizer state that starts as the parameters: their EMA, updated each step."""

    def update(updates, state, params):
        return updates, jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, state, params)

    return optax.GradientTransformation(lambda params: params, update)


@pytest.mark.slow  # 8 s of CPU: a fit and its one-device loop
def test_trainer_with_an_optimizer_state_that_is_the_params_matches_one_device():
    x, y = labelled(256, 6, 3)
    tx = optax.chain(_params_ema(0.9), optax.sgd(0.1))
    trainer = spmd.Trainer(
        MLP(nnx.Rngs(0), features=6, hidden=16, outputs=3),
        tx,
        "sparse_categorical_crossentropy",
        strategy=spmd.MirroredStrategy(),
    )
    history = trainer.fit((x, y), batch_size=64, epochs=1, shuffle=False, verbose=0)
    model = MLP(nnx.Rngs(0), features=6, hidden=16, outputs=3)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = nnx.jit(lambda m, o, xb, yb: nnx_update(m, o, xent, xb, yb))
    losses = [
        float(step(model, optimizer, x[i : i + 64], y[i : i + 64])) for i in range(0, 256, 64)
    ]
    np.testing.assert_allclose(history.history["loss"], [np.mean(losses)], rtol=1e-5)
    assert_trees_allclose(
        nnx.state(trainer.model, nnx.Param), nnx.state(model, nnx.Param), rtol=1e-5, atol=1e-6
    )
    ema = jax.tree.leaves(trainer.state["opt_state"][0])  # Params here, OptVariables there
    assert_trees_allclose(ema, jax.tree.leaves(optimizer.opt_state[0]), rtol=1e-5, atol=1e-6)
