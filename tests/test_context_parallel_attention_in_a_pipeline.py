"""spmd.attention in spmd.pipeline's layers: a stage axis and a context axis in one mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd

pytestmark = pytest.mark.cpu_mesh


def _layer(w, h):
    """A residual causal self-attention layer, [batch, length, 8] in and out."""
    q = (h @ w).reshape(*h.shape[:2], 2, 4)
    return h + spmd.attention(q, q, q, causal=True).reshape(h.shape)


def _loss(w, h, axis):
    return jnp.mean(spmd.pipeline(_layer, w, h, microbatches=2, axis=axis) ** 2)


@pytest.mark.slow  # 8 s of CPU
def test_attention_in_pipelined_layers_equals_the_layers_in_order_on_one_device():
    w = jax.random.normal(jax.random.key(0), (4, 8, 8)) * 0.3  # 4 layers, 2 a stage
    h = jax.random.normal(jax.random.key(1), (8, 16, 8))
    want_loss, want_grad = jax.value_and_grad(_loss)(w, h, None)
    mesh = spmd.make_mesh({"stage": 2, "context": 2, "data": 2})
    strategy = spmd.Strategy(mesh=mesh, batch_axes=("data",))
    with strategy.scope():
        placed = jax.device_put(w, NamedSharding(mesh, P("stage")))
        loss, grad = jax.jit(jax.value_and_grad(_loss), static_argnums=2)(placed, h, "stage")
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
