"""A step fed numpy batches directly by each process; the scenario makes them differ.

    python batch_signature_worker.py SCENARIO OUT

SCENARIO: same (every process the same global batches), rows (process 1's batch has
16 rows, process 0's 8), dtype (process 1 passes int32 images), structure
(process 1 passes a dict), ragged_on_one (process 1's
labels have 5 rows, its images 8). Writes the losses and the final weights to OUT (.npz)
when training finished; a BatchError is printed as "BatchError: <message>" and
exits with code 3.

SCENARIO back_on_K: both processes call the step with 8 rows, then 16, then process K
goes back to 8 alone while the other keeps 16; a BatchError is not caught (the process
ends as an uncaught error does, telling its peer). diloco_back_on_K: the same with a
DiLoCo step (one island over both processes).

SCENARIO absent: process 1 never calls the step (it sleeps); process 0 prints how
long it waited ("waited S s") with its BatchError. AGREE_DEFAULT_S in the
environment replaces the agreement's default bound (AGREE_TIMEOUT_S). SCENARIO steady: 6 steps with
8-row batches, 3 with 16 rows, 1 with 8 again, then 4 more; each process writes to OUT.<index>.json
how many batch agreements it took part in and how many coordination-service calls
the step's checks made, after the first step and after each phase.
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import spmd
from spmd._src.strategy import step_checks

scenario, out = sys.argv[1], sys.argv[2]
if "AGREE_DEFAULT_S" in os.environ:  # a shorter default bound than the hang timeout
    step_checks.AGREE_TIMEOUT_S = float(os.environ["AGREE_DEFAULT_S"])
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


class _Counting:
    """The coordination client, counting the calls a step's checks make through it."""

    def __init__(self, client):
        self.client, self.calls = client, 0

    def __getattr__(self, name):
        self.calls += 1
        return getattr(self.client, name)


if scenario == "absent":
    if me == 1:
        time.sleep(120)  # alive, and never at the step
        sys.exit(0)
    start = time.monotonic()
    try:
        step(state, *batch(0))
    except spmd.BatchError as error:
        print(f"waited {time.monotonic() - start:.1f} s", flush=True)
        print(f"BatchError: {error}", flush=True)
        sys.exit(3)
    sys.exit(1)

if scenario == "steady":
    from spmd._src.strategy import step_checks

    client = _Counting(step_checks.coordination_client())
    step_checks.coordination_client = lambda: client
    agreements = []
    agree = step_checks._BatchSignatures.agree

    def counted(self, index, record, stop=None):
        agreements.append(record["batch"])
        return agree(self, index, record, stop)

    step_checks._BatchSignatures.agree = counted
    counts = {}
    for phase, rows, steps in (
        ("first", 8, 1),
        ("eight", 8, 5),
        ("sixteen", 16, 3),
        ("back", 8, 1),
        ("again", 8, 4),
    ):
        for i in range(steps):
            x = np.random.default_rng(i).normal(size=(rows, 3)).astype(np.float32)
            state, metrics = step(state, x, x @ np.array([1.0, -2.0, 0.5], np.float32))
        jax.block_until_ready(state)
        counts[phase] = {"agreements": list(agreements), "client_calls": client.calls}
    with open(f"{out}.{me}.json", "w") as f:
        json.dump(counts, f)
    sys.exit(0)

if "back_on_" in scenario:
    alone = int(scenario.rpartition("_")[2])
    if scenario.startswith("diloco_"):
        strategy = spmd.DiLoCo(
            spmd.MultiWorkerMirroredStrategy(), islands=1, sync_every=2, params="w"
        )
        state = strategy.init(lambda: {"w": jnp.zeros(3, jnp.float32)})
        step = strategy.step(train_step)
    for i, rows in enumerate((8, 8, 16, 16, 8, 8, 8)):
        rows = 16 if i >= 4 and me != alone else rows
        x = np.random.default_rng(i).normal(size=(rows, 3)).astype(np.float32)
        state, metrics = step(state, x, x @ np.array([1.0, -2.0, 0.5], np.float32))
        jax.block_until_ready(metrics)
    np.savez(out, done=np.asarray(True))
    sys.exit(0)

try:
    for i in range(4):
        state, metrics = step(state, *batch(i))
        losses.append(float(metrics["loss"]))
except spmd.BatchError as error:
    print(f"BatchError: {error}", flush=True)
    sys.exit(3)
np.savez(out, losses=np.asarray(losses), w=np.asarray(jax.device_get(state["w"])))
