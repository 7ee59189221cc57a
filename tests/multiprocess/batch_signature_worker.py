"""A step fed numpy batches directly by each process; the scenario makes them differ.

    python batch_signature_worker.py SCENARIO OUT

SCENARIO: same (every process the same global batches), rows (process 1's batch has
16 rows, process 0's 8), dtype (process 1 passes int32 images), structure
(process 1 passes a dict), ragged_on_one (process 1's
labels have 5 rows, its images 8). Writes the losses and the final weights to OUT (.npz)
when training finished; a BatchError is printed as "BatchError: <message>" and
exits with code 3.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import spmd

scenario, out = sys.argv[1], sys.argv[2]
spmd.initialize()
strategy = spmd.MultiWorkerMirroredStrategy()
me = jax.process_index()


def train_step(state, images, labels):
    def loss_fn(w):
        x = images["x"] if isinstance(images, dict) else images
        return jnp.mean((x.astype(jnp.float32) @ w - labels) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(state["w"])
    return {"w": state["w"] - 0.1 * grad}, {"loss": loss}


def batch(i: int):
    rows = 16 if scenario == "rows" and me == 1 else 8
    rng = np.random.default_rng(i)
    x = rng.normal(size=(rows, 3)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], np.float32)
    if scenario == "dtype" and me == 1:
        x = (x * 10).astype(np.int32)
    if scenario == "structure" and me == 1:
        return {"x": x}, y
    if scenario == "ragged_on_one" and me == 1:
        return x, y[:5]
    return x, y


step = strategy.step(train_step)
state = strategy.put({"w": np.zeros(3, np.float32)})
losses = []
try:
    for i in range(4):
        state, metrics = step(state, *batch(i))
        losses.append(float(metrics["loss"]))
except spmd.BatchError as error:
    print(f"BatchError: {error}", flush=True)
    sys.exit(3)
np.savez(out, losses=np.asarray(losses), w=np.asarray(jax.device_get(state["w"])))
