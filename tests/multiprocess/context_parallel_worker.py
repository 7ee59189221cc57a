"""One process of a job whose `context` axis spans both processes: spmd.attention and a
transformer LM using it, against one device."""

import json
import sys
from pathlib import Path

import spmd

spmd.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import lm_batches, lm_create, lm_step  # noqa: E402

TOL = {"rtol": 1e-4, "atol": 1e-5}  # float32, summed in another order (test_context_parallel_*)


def whole(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def attention_matches(strategy):
    keys = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(key, (2, 16, 4, 8)) for key in keys)
    k, v = k[:, :, :2], v[:, :, :2]
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) ** 2)  # noqa: E731
    want = jax.jit(jax.grad(loss(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True)),
                            (0, 1, 2)))(q, k, v)  # fmt: skip
    with strategy.scope():
        split = jax.sharding.NamedSharding(
            strategy.mesh, jax.sharding.PartitionSpec(None, "context")
        )
        placed = [jax.make_array_from_callback(x.shape, split, lambda i, x=x: np.asarray(x)[i])
                  for x in (q, k, v)]  # fmt: skip
        got = jax.jit(jax.grad(loss(lambda *a: spmd.attention(*a, causal=True)), (0, 1, 2)))(
            *placed
        )
    return all(np.allclose(whole(g), np.asarray(w), **TOL) for g, w in zip(got, want, strict=True))


def lm_matches(strategy, steps=3):
    state, step, want = lm_create(jax.random.key(0)), jax.jit(lm_step()), []
    for tokens in lm_batches(steps):
        state, metrics = step(state, tokens)
        want.append(float(metrics["loss"]))
    spmd_state = strategy.init(lm_create, jax.random.key(0))
    spmd_step, losses = strategy.step(lm_step()), []
    for tokens in strategy.distribute_dataset(lm_batches(steps)):
        spmd_state, metrics = spmd_step(spmd_state, tokens)
        losses.append(float(whole(metrics["loss"]).ravel()[0]))
    params = jax.tree.map(whole, spmd_state["params"])
    same = jax.tree.map(lambda a, b: bool(np.allclose(a, b, **TOL)), params, state["params"])
    return bool(np.allclose(losses, want, **TOL)) and all(jax.tree.leaves(same)), losses


mesh = spmd.make_mesh({"data": 1, "context": 4})
strategy = spmd.Strategy(mesh=mesh, batch_axes=("data",))
processes = sorted({d.process_index for d in mesh.devices.flat})
lm_ok, losses = lm_matches(strategy)
result = {
    "process": jax.process_index(),
    "context_processes": processes,
    "attention": attention_matches(strategy),
    "lm": lm_ok,
    "losses": losses,
}
print("RESULT " + json.dumps(result), flush=True)
