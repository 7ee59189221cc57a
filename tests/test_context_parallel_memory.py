"""spmd.attention's memory per device falls with the context axis (explain, on a TPU slice)."""

import jax
import jax.numpy as jnp
import pytest

import spmd

pytestmark = pytest.mark.cpu_mesh
pytest.importorskip("libtpu", reason="the TPU compiler (the tpu-compile extra)")

# 1024 tokens and 16 query heads: the [heads, length, length] scores still dominate the
# peak (one device over four: 5.4x, against 3.9x at 4096 tokens and 4 heads), at a third
# of the compile.
LENGTH, WIDTH, HEADS, KV_HEADS, HEAD_DIM = 1024, 256, 16, 2, 64


def create(key):
    a, b = jax.random.split(key)
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return {
        "wqkv": jax.random.normal(a, (WIDTH, qkv), jnp.bfloat16),
        "wo": jax.random.normal(b, (HEADS * HEAD_DIM, WIDTH), jnp.bfloat16),
    }


def train_step(p, x):
    def loss(p):
        b, n, _ = x.shape
        qkv = (x @ p["wqkv"]).reshape(b, n, HEADS + 2 * KV_HEADS, HEAD_DIM)
        q, k, v = jnp.split(qkv, [HEADS, HEADS + KV_HEADS], axis=2)
        out = spmd.attention(q, k, v, causal=True).reshape(b, n, -1) @ p["wo"]
        return jnp.mean(out.astype(jnp.float32) ** 2)

    value, grads = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda w, g: w - 1e-3 * g, p, grads), {"loss": value}


def peak(context, topology):
    mesh = spmd.make_mesh({"data": 2, "context": context}, devices=list(topology)[: 2 * context])
    strategy = spmd.Strategy(mesh=mesh, batch_axes=("data",))
    state = strategy.abstract_state(create, jax.random.key(0))
    batch = jax.ShapeDtypeStruct((2, LENGTH, WIDTH), jnp.bfloat16)
    return strategy.explain(train_step, state, batch)


@pytest.mark.slow  # 9 s of CPU: two TPU compilations
def test_peak_per_device_falls_with_the_context_axis_on_a_v5p_slice():
    topology = spmd.topology("v5p-16")
    one, four = peak(1, topology), peak(4, topology)
    # the [length, length] scores dominate: a quarter of the rows on each device
    assert four.peak_bytes < one.peak_bytes / 3
    assert four.fits and one.fits
    assert "all-gather" in str(four) and "all-gather" not in str(one)
