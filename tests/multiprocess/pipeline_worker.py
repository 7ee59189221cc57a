"""One process of a 2-process pipeline: the stage axis spans the processes.

Trains 3 steps of a stacked tanh MLP with spmd.pipeline on a {"stage": 2, "data": 2}
mesh (stage outermost: stage 0 on process 0, stage 1 on process 1), and the same
steps with the layer scan on this process's first device, the oracle; prints both
as a RESULT JSON line.
"""

import json

import spmd

spmd.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

LAYERS, D, BATCH = 4, 8, 16


def layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def make_step(pipelined):
    def train_step(state, x, y):
        def loss(params):
            if pipelined:
                h = spmd.pipeline(layer, params, x, microbatches=4)
            else:
                h = jax.lax.scan(lambda h, p: (layer(p, h), None), x, params)[0]
            return jnp.mean((h - y) ** 2)

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = optax.adam(1e-2).update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, value

    return train_step


def train(strategy, pipelined):
    rng = np.random.default_rng(0)
    params = {
        "w": (rng.normal(size=(LAYERS, D, D)) / np.sqrt(D)).astype(np.float32),
        "b": (rng.normal(size=(LAYERS, D)) / 4).astype(np.float32),
    }
    state = strategy.put({"params": params, "opt": optax.adam(1e-2).init(params)})
    step = strategy.step(make_step(pipelined))
    losses = []
    for i in range(3):
        data = np.random.default_rng(10 + i).normal(size=(2, BATCH, D)).astype(np.float32)
        state, loss = step(state, data[0], data[1])
        losses.append(float(loss))
    return losses, state


mesh = spmd.make_mesh({"stage": 2, "data": 2})
stages = spmd.Strategy(mesh, rules=[(r".*params/.*", P("stage"))], batch_axes=("data",))
losses, state = train(stages, True)
w = state["params"]["w"]
here = jax.process_index()
local_stages = [
    i for i, row in enumerate(mesh.devices) if any(d.process_index == here for d in row)
]
oracle, _ = train(spmd.OneDeviceStrategy(jax.local_devices()[0]), False)
result = {
    "losses": losses,
    "oracle": oracle,
    "stages_here": local_stages,
    "stage_spec": str(w.sharding.spec),
}
print("RESULT " + json.dumps(result), flush=True)
