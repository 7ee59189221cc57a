"""Keras' fit as the multi-worker tutorial grows it, for test_a_killed_keras_fit_resumes.py.

fit with BackupAndRestore, ModelCheckpoint (two), EarlyStopping on val_loss,
validation_data, class_weight, sample weights and a partial last batch (602
rows in batches of 64). Process 1 of the first attempt signals itself (KILL
or TERM) at `--kill-at` iterations. Process 0 writes the final parameters, the
iterations and EarlyStopping's stopped epoch. `--oracle`: the same fit on one
device, without checkpoints.

Run: python keras_fit_worker.py WORK [--oracle] [--kill-at N] [--signal KILL|TERM]
"""

import argparse
import json
import os
import signal

import spmd

parser = argparse.ArgumentParser()
parser.add_argument("work")
parser.add_argument("--oracle", action="store_true")
parser.add_argument("--kill-at", type=int, default=0)
parser.add_argument("--signal", choices=("KILL", "TERM"), default="KILL")
args = parser.parse_args()
spmd.initialize(local_device_count=1 if args.oracle else None)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

ROWS, BATCH, EPOCHS = 602, 64, 6  # 9 whole batches, then 26 rows: 10 steps an epoch


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(12, 32, rngs=rngs)
        self.out = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = np.random.default_rng(0).normal(size=(12, 10))
    x = rng.normal(size=(n, 12)).astype(np.float32)
    return x, (x @ w + rng.normal(size=(n, 10))).argmax(-1)


class Kill(spmd.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        first = spmd.restart_count() == 0 and jax.process_index() == 1
        if first and self.trainer.iterations == args.kill_at:
            os.kill(os.getpid(), getattr(signal, f"SIG{args.signal}"))


strategy = spmd.OneDeviceStrategy() if args.oracle else spmd.MultiWorkerMirroredStrategy()
with strategy.scope():
    trainer = spmd.Trainer(
        Net(nnx.Rngs(0)), optax.adam(3e-2), "sparse_categorical_crossentropy", ["accuracy"]
    )
x, y = data(ROWS, 1)
weights = np.where(y % 2 == 0, 1.0, 0.5).astype(np.float32)
early = spmd.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=0.02)
callbacks = [early]
if not args.oracle:
    callbacks = [
        spmd.callbacks.BackupAndRestore(os.path.join(args.work, "backup")),
        spmd.callbacks.ModelCheckpoint(filepath=os.path.join(args.work, "ckpt")),
        spmd.callbacks.ModelCheckpoint(
            filepath=os.path.join(args.work, "every_step"), save_freq=1, max_to_keep=2
        ),
        Kill(),
        *callbacks,
    ]
trainer.fit(
    (x, y, weights),
    batch_size=BATCH,
    epochs=EPOCHS,
    validation_data=data(100, 2),
    class_weight={c: 2.0 if c < 3 else 1.0 for c in range(10)},
    callbacks=callbacks,
    verbose=0,
)
if jax.process_index() == 0:
    name = "oracle" if args.oracle else "job"
    leaves = jax.tree.leaves(trainer.host_state()["params"])
    np.savez(os.path.join(args.work, f"{name}.npz"), *leaves)
    with open(os.path.join(args.work, f"{name}.json"), "w") as f:
        json.dump({"iterations": trainer.iterations, "stopped_epoch": early.stopped_epoch}, f)
