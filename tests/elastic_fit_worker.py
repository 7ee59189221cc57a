"""Trainer.fit with Dropout, BackupAndRestore and steps_per_execution, on the first D devices.

Usage: python elastic_fit_worker.py DEVICES BACKUP_DIR OUT.npz KILL_AT STEPS_PER_EXECUTION

With KILL_AT >= 0 the process kills itself (SIGKILL) once `trainer.iterations`
reaches it: a host lost mid-epoch. A later run on another device count resumes
from the backup; OUT gets the final parameters. BACKUP_DIR "-" runs without a backup
(the uninterrupted oracle, which nothing resumes).
"""

import os
import signal
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import spmd  # noqa: E402


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.out(self.drop(jax.nn.relu(self.hidden(x)), rngs=rngs))


class Kill(spmd.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.trainer.iterations == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


devices, backup, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
kill_at, per_execution = int(sys.argv[4]), int(sys.argv[5])
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 4)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32)
trainer = spmd.Trainer(
    Net(nnx.Rngs(0)),
    optax.adam(1e-2),
    "sparse_categorical_crossentropy",
    strategy=spmd.MirroredStrategy(jax.devices()[:devices]),
    steps_per_execution=per_execution,
)
callbacks = [Kill()]
if backup != "-":
    callbacks.insert(0, spmd.callbacks.BackupAndRestore(backup, save_freq=4))
history = trainer.fit((x, y), batch_size=32, epochs=2, shuffle=True, callbacks=callbacks, verbose=0)
leaves = jax.tree.leaves(jax.device_get(trainer.state["params"]))
arrays = {f"param_{i}": np.asarray(leaf) for i, leaf in enumerate(leaves)}
np.savez(out, loss=np.asarray(history.history["loss"]), **arrays)
