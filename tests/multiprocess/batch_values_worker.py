"""A step fed numpy batches of one shape by each process; the scenario makes their values
differ.

    python batch_values_worker.py SCENARIO OUT

SCENARIO: same (every process the same global batches; compare_batch_every=1), first
(process 1's batches differ from the first call), later (they differ from the 5th call,
with compare_batch_every=3: the processes compare at calls 1, 4 and 7), off (they differ
from the first call, with compare_batch_every=0). Each call prints "call N"; a
BatchError is printed as "BatchError: <message>" and exits with code 3. Writes the
losses and the final weights to OUT (.npz) when training finished.
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
EVERY = {"same": 1, "first": 100, "later": 3, "run": 100}[scenario]
DIFFER_FROM = {"first": 0, "later": 4, "run": 0}.get(scenario)


def train_step(state, images, labels):
    def loss_fn(w):
        return jnp.mean((images @ w - labels) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(state["w"])
    return {"w": state["w"] - 0.1 * grad}, {"loss": loss}


def batch(i: int):
    """The global batch of call `i`: the same on every process but where the scenario says."""
    seed = i + 1000 * me if DIFFER_FROM is not None and i >= DIFFER_FROM else i
    x = np.random.default_rng(seed).normal(size=(8, 3)).astype(np.float32)
    return x, x @ np.array([1.0, -2.0, 0.5], np.float32)


step = strategy.step(train_step, compare_batch_every=EVERY)
state = strategy.put({"w": np.zeros(3, np.float32)})
losses = []
try:
    for i in range(8):
        print(f"call {i + 1}", flush=True)
        if scenario == "run":
            total = strategy.run(lambda x, y: jnp.sum(x) + jnp.sum(y), args=batch(i))
            losses.append(float(strategy.reduce("sum", total, axis=None)))
            continue
        state, metrics = step(state, *batch(i))
        losses.append(float(metrics["loss"]))
except spmd.BatchError as error:
    print(f"BatchError: {error}", flush=True)
    sys.exit(3)
np.savez(out, losses=np.asarray(losses), w=np.asarray(jax.device_get(state["w"])))
