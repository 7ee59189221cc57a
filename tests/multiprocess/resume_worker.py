"""A training job that resumes from its checkpoints, on however many processes it runs.

Usage: python resume_worker.py CKPT_DIR OUT.npz [--steps N] [--stop-at K] [--sleep S]
                               [--heartbeat H] [--devices D] [--fail-at K --fail-above P]
                               [--fail-when K:P ...] [--failing P] [--hang] [--batch B]
                               [--uneven | --dividing]

Every process joins (TF_CONFIG, spmd launch's variables, ...), then trains one
model under MultiWorkerMirroredStrategy on spmd's own shuffled numpy dataset, a
global batch of 8 whatever the process count, and saves a checkpoint (state and
data position) after every step. A relaunch resumes from the newest one.

The state keeps the loss of every step ("losses") and how often each example
was trained on ("seen"), so a resumed run that lost or repeated an example
shows it. With --fail-at K --fail-above P, the last process (or process
--failing P) kills itself (SIGKILL) at step K whenever the job has more than P
processes: a host lost for good; with --hang it sleeps instead, alive and
heartbeating but never at the next collective. --fail-when K:P (repeatable)
kills that process at step K when the job has exactly P processes. With
--stop-at K the job ends cleanly after step K (a run to be
continued by a later launch). With --uneven the dataset pads a global batch
the replicas do not split (InputOptions(uneven_batch="pad")): every batch is a
spmd.PaddedBatch whose mask weighs the loss and the count of examples seen.
With --dividing the strategy takes the most devices that divide the global
batch (MultiWorkerMirroredStrategy(global_batch_size=...)): nothing padded.
Process 0 prints one JSON line per step and writes the final state to OUT.
"""

import argparse
import json
import os
import signal
import time

parser = argparse.ArgumentParser()
parser.add_argument("ckpt_dir")
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--stop-at", type=int, default=None)
parser.add_argument("--sleep", type=float, default=0.0, help="seconds after each step")
parser.add_argument("--heartbeat", type=int, default=100, help="spmd.initialize heartbeat_timeout")
parser.add_argument("--devices", type=int, default=None)
parser.add_argument("--fail-at", type=int, default=None)
parser.add_argument("--fail-above", type=int, default=1)
parser.add_argument("--failing", type=int, default=-1, help="which process fails: -1 the last")
parser.add_argument("--hang", action="store_true", help="the failing process hangs, not dies")
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--fail-when", action="append", default=[], help="STEP:PROCESSES")
parser.add_argument("--uneven", action="store_true", help='InputOptions(uneven_batch="pad")')
parser.add_argument("--dividing", action="store_true", help="devices that divide the batch")
args = parser.parse_args()
fail_when = {tuple(int(n) for n in when.split(":")) for when in args.fail_when}

import spmd  # noqa: E402

info = spmd.initialize(
    local_device_count=args.devices, heartbeat_timeout=args.heartbeat, initialization_timeout=90
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

BATCH, FEATURES = args.batch, 4
tx = optax.adam(1e-2)


def create_state(key):
    params = {"w": jax.random.normal(key, (FEATURES, 16)) * 0.5, "v": jnp.zeros((16, 1))}
    return {
        "params": params,
        "opt": tx.init(params),
        "step": jnp.zeros((), jnp.int32),
        "losses": jnp.zeros((args.steps,), jnp.float32),
        "seen": jnp.zeros((args.steps * BATCH,), jnp.int32),
    }


def train_step(state, x, y, example, mask=None):
    def loss_fn(params):
        per_example = (jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2
        if mask is None:
            return jnp.mean(per_example)
        return spmd.compute_average_loss(per_example, global_batch_size=BATCH, sample_weight=mask)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {
        "params": optax.apply_updates(state["params"], updates),
        "opt": opt,
        "step": state["step"] + 1,
        "losses": state["losses"].at[state["step"]].set(loss),
        "seen": state["seen"].at[example].add(1 if mask is None else mask.astype(jnp.int32)),
    }, loss


def say(event: str, **fields) -> None:
    if info.is_chief:
        fields.update(event=event, processes=info.process_count)
        print(json.dumps(fields), flush=True)


strategy = spmd.MultiWorkerMirroredStrategy(global_batch_size=BATCH if args.dividing else None)
say("mesh", replicas=strategy.num_replicas_in_sync)
examples = np.random.default_rng(7).normal(size=(args.steps * BATCH, FEATURES)).astype(np.float32)
targets = np.sin(examples.sum(1, keepdims=True))
numpy_data = (examples, targets, np.arange(args.steps * BATCH, dtype=np.int32))
options = spmd.InputOptions(uneven_batch="pad") if args.uneven else None
dataset = strategy.distribute_dataset(
    strategy.make_numpy_dataset(numpy_data, BATCH, shuffle=True, seed=3), options
)
batches = iter(dataset)
ckpt = spmd.CheckpointManager(args.ckpt_dir, max_to_keep=2)
failing = info.process_index == args.failing % info.process_count
with strategy.scope():
    state, start = ckpt.restore_or_init(create_state, jax.random.key(0), data=batches)
    say("start", step=start, position=batches.get_state()["batch"])
    step_fn = strategy.step(train_step)
    for step in range(start, min(args.steps, args.stop_at or args.steps)):
        lost = step == args.fail_at and info.process_count > args.fail_above
        if failing and (lost or (step, info.process_count) in fail_when):
            if args.hang:
                time.sleep(3600)  # alive, heartbeating, never at the collective
            os.kill(os.getpid(), signal.SIGKILL)
        state, loss = step_fn(state, *next(batches))
        ckpt.save(step + 1, state, data=batches)
        say("step", step=step, loss=float(loss))
        time.sleep(args.sleep)
ckpt.close()
batches.close()

final = jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), state)
if info.is_chief:
    params = final["params"]
    np.savez(args.out, w=params["w"], v=params["v"], losses=final["losses"], seen=final["seen"])
    say("done", step=int(final["step"]))
