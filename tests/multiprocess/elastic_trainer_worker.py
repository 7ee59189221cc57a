"""Trainer.fit of an elastic job: a global batch of 6, Dropout, BackupAndRestore every batch.

Usage: python elastic_trainer_worker.py BACKUP_DIR OUT.npz [--fail-when K:P ...] [--devices D]
                                       [--dividing] [--steps-per-execution K]

Every process joins (spmd launch's variables), then fits a small classifier
with Dropout under MultiWorkerMirroredStrategy on (x, y) arrays: 36 examples,
a global batch of 6 whatever the process count, 3 epochs, shuffled. A
relaunch resumes from the backup. --fail-when K:P (repeatable) makes the last
process kill itself (SIGKILL) once `trainer.iterations` reaches K when the job
has exactly P processes: a host lost for good. With --dividing the model
normalizes its hidden layer with BatchNorm, which padding cannot serve, and the
strategy takes the most devices that divide the batch
(MultiWorkerMirroredStrategy(global_batch_size=6)). --steps-per-execution K runs
K batches a call (the last call of an epoch is short where K does not divide 6).

The model counts the examples it trains on: a parameter `seen` (one entry per
example) enters each example's loss as `seen[id]`, so its gradient is the
weight the step gives that example (1 for a real row, 0 for padding) over
the global batch, and plain SGD with learning rate -6 adds it up. Process 0
prints one JSON line per start and epoch and writes the final parameters to OUT.
"""

import argparse
import json
import os
import signal

parser = argparse.ArgumentParser()
parser.add_argument("backup_dir")
parser.add_argument("out")
parser.add_argument("--devices", type=int, default=None)
parser.add_argument("--fail-when", action="append", default=[], help="STEP:PROCESSES")
parser.add_argument("--dividing", action="store_true", help="BatchNorm, devices that divide")
parser.add_argument("--steps-per-execution", type=int, default=1)
args = parser.parse_args()
fail_when = {tuple(int(n) for n in when.split(":")) for when in args.fail_when}

import spmd  # noqa: E402

info = spmd.initialize(
    local_device_count=args.devices, heartbeat_timeout=100, initialization_timeout=90
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

EXAMPLES, BATCH, EPOCHS, FEATURES = 36, 6, 3, 4


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        # BatchNorm's own shift stands for the bias (whose gradient it would make 0)
        self.hidden = nnx.Linear(FEATURES, 16, use_bias=not args.dividing, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs) if args.dividing else None
        self.drop = nnx.Dropout(0.5)
        self.out = nnx.Linear(16, 2, rngs=rngs)
        self.seen = nnx.Param(jnp.zeros(EXAMPLES))

    def __call__(self, x, rngs=None):
        features, example = x[:, :FEATURES], x[:, FEATURES].astype(jnp.int32)
        hidden = self.hidden(features)
        if self.norm is not None:
            hidden = self.norm(hidden)
        logits = self.out(self.drop(jax.nn.relu(hidden), rngs=rngs))
        return logits, self.seen[example]


def loss(outputs, labels):
    logits, seen = outputs
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels) + seen


def labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "count" if "seen" in jax.tree_util.keystr(path) else "train", params
    )


def say(event: str, **fields) -> None:
    if info.is_chief:
        fields.update(event=event, processes=info.process_count)
        print(json.dumps(fields), flush=True)


class Report(spmd.callbacks.Callback):
    """Says where each attempt starts and each epoch's loss; kills the last process at K:P."""

    def on_train_begin(self, logs=None):
        say("start", step=self.trainer.iterations)

    def on_train_batch_end(self, batch, logs=None):
        last = info.process_index == info.process_count - 1
        if last and (self.trainer.iterations, info.process_count) in fail_when:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_end(self, epoch, logs=None):
        say("epoch", epoch=epoch, loss=logs["loss"])


rng = np.random.default_rng(0)
features = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
x = np.concatenate([features, np.arange(EXAMPLES, dtype=np.float32)[:, None]], axis=1)
y = (features[:, 0] + features[:, 1] > 0).astype(np.int32)
optimizer = optax.multi_transform(
    {"train": optax.adam(1e-2), "count": optax.sgd(-float(BATCH))}, labels
)
strategy = spmd.MultiWorkerMirroredStrategy(global_batch_size=BATCH if args.dividing else None)
say("mesh", replicas=strategy.num_replicas_in_sync)
with strategy.scope():  # the model's parameters are made over every process's devices
    trainer = spmd.Trainer(
        Net(nnx.Rngs(0)), optimizer, loss, steps_per_execution=args.steps_per_execution
    )
callbacks = [spmd.callbacks.BackupAndRestore(args.backup_dir, save_freq=1), Report()]
trainer.fit((x, y), batch_size=BATCH, epochs=EPOCHS, callbacks=callbacks, verbose=0)
params = jax.tree.map(np.asarray, trainer.host_state()["params"])
if info.is_chief:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    np.savez(args.out, **{jax.tree_util.keystr(path): leaf for path, leaf in leaves})
    say("done", step=trainer.iterations)
