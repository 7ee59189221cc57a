"""Trainer.fit with BackupAndRestore and ModelCheckpoint together: two writers in one job.

Usage: python two_writers_worker.py BACKUP_DIR CKPT_DIR OUT.json [--save-freq F] [--sync]

Every process joins (spmd launch's variables) and fits a small classifier under
MultiWorkerMirroredStrategy, 5 steps an epoch, with TensorFlow's multi-worker
Keras pair of callbacks: BackupAndRestore(BACKUP_DIR, delete_checkpoint=False)
and ModelCheckpoint(CKPT_DIR), both saving every epoch or every F batches
(--save-freq F), asynchronously unless --sync. Each process restores the last
step of both directories and checks its parameters and optimizer state are the
trained ones, bit for bit;
process 0 writes {"steps": {dir: committed steps}, "final": {dir: final step}}
to OUT.json.
"""

import argparse
import json

parser = argparse.ArgumentParser()
parser.add_argument("backup_dir")
parser.add_argument("ckpt_dir")
parser.add_argument("out")
parser.add_argument("--save-freq", default="epoch")
parser.add_argument("--sync", action="store_true")
args = parser.parse_args()
freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)

import spmd  # noqa: E402

info = spmd.initialize(heartbeat_timeout=100, initialization_timeout=90)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from spmd.testing import assert_trees_allclose  # noqa: E402

ROWS, BATCH = 40, 8  # 5 steps an epoch, 15 in all


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


rng = np.random.default_rng(0)
x = rng.normal(size=(ROWS, 4)).astype(np.float32)
y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
strategy = spmd.MultiWorkerMirroredStrategy()
with strategy.scope():
    trainer = spmd.Trainer(Net(nnx.Rngs(0)), optax.adam(1e-2), "sparse_categorical_crossentropy")
callbacks = [
    spmd.callbacks.BackupAndRestore(args.backup_dir, save_freq=freq, delete_checkpoint=False),
    spmd.callbacks.ModelCheckpoint(
        args.ckpt_dir, save_freq=freq, max_to_keep=2, async_save=not args.sync
    ),
]
trainer.fit((x, y), batch_size=BATCH, epochs=3, callbacks=callbacks, verbose=0)
report = {"steps": {}, "final": {}}
for directory in (args.backup_dir, args.ckpt_dir):
    with spmd.CheckpointManager(directory, read_only=True) as reader:
        report["steps"][directory] = reader.all_steps()
        report["final"][directory] = reader.final_step()
        restored = reader.restore(trainer.iterations, target=trainer.state)
        for part in ("params", "opt_state"):  # the trained state (the metrics reset at epochs)
            assert_trees_allclose(restored[part], trainer.state[part], rtol=0, atol=0)
if info.is_chief:
    with open(args.out, "w") as f:
        json.dump(report, f)
