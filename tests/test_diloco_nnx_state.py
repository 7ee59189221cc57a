"""spmd.DiLoCo over flax NNX objects (a module and its nnx.Optimizer), against the paper."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from diloco_reference import HIDDEN, IN, OUT, batches, make_step, reference
from flax import nnx

import spmd
from spmd.testing import assert_trees_allclose

pytestmark = pytest.mark.cpu_mesh
TOL = {"rtol": 1e-5, "atol": 1e-6}


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.dense(x)))


def create_nnx():
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def nnx_step(state, x, y):
    model, optimizer = state

    def loss(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)  # in place, as under a synchronous strategy
    return value


def _params(model):
    layers = {"dense": model.dense, "out": model.out}
    return {k: {"kernel": v.kernel[...], "bias": v.bias[...]} for k, v in layers.items()}


@pytest.mark.slow  # 6 s of CPU: the inner and sync programs of two islands
@pytest.mark.parametrize("made", ["init", "put"])
def test_a_module_and_its_optimizer_train_as_the_paper(made):
    """The state made by init(create) or put((model, optimizer)); each island's step gets
    the objects, updates them in place; their nnx.Params are averaged every H steps."""
    strategy = spmd.DiLoCo(islands=2, sync_every=3)
    state = strategy.init(create_nnx) if made == "init" else strategy.put(create_nnx())
    step = strategy.step(nnx_step)
    losses = []
    for x, y in batches(7):
        state, loss = step(state, x, y)
        losses.append(np.asarray(loss))
    start = _params(create_nnx()[0])
    opt = optax.sgd(0.1).init(start)
    want = reference({"params": start, "opt": opt}, make_step("sgd"), batches(7), 2, 3)
    model, _ = strategy.global_state(state)  # NNX objects again, the global parameters
    assert isinstance(model, MLP)
    assert_trees_allclose(jax.device_get(_params(model)), want[0], **TOL)
    np.testing.assert_allclose(np.asarray(losses), np.asarray(want[2]), **TOL)
    assert int(state.step) == 7


def test_a_step_given_the_objects_themselves_says_to_put_them():
    strategy = spmd.DiLoCo(islands=2, sync_every=3)
    step = strategy.step(nnx_step)
    with pytest.raises(spmd.ConfigurationError, match="Received: state='tuple'") as caught:
        step(create_nnx(), *batches(1)[0])
    assert "state = strategy.put((model, optimizer))" in str(caught.value)
