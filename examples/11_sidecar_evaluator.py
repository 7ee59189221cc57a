"""The evaluator task: two workers train, a third process evaluates each checkpoint they write.

tf.distribute's `evaluator` (Keras' SidecarEvaluator): a job of its own, beside the
training job. The workers run `Trainer.fit` with a `ModelCheckpoint`; the evaluator,
told by TF_CONFIG that it is the "evaluator" task, runs `spmd.SidecarEvaluator` (the
model with its loss and metrics, as Keras takes a compiled model) on one device over
the same directory: it restores each step as it is committed (the
workers' 4 devices resharded onto its 1), evaluates it exactly, writes TensorBoard
scalars, and stops after the step fit marks as its last.

Run:  python examples/11_sidecar_evaluator.py [--epochs 3] [--dir /tmp/sidecar]
With no TF_CONFIG the script starts the three tasks itself, each with its TF_CONFIG;
across machines, run it on each with its own (task "worker" 0 and 1, "evaluator" 0).
"""

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices per worker")
parser.add_argument("--dir", default=None, help="checkpoints and logs (a temporary folder)")
args = parser.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start_tasks(folder):
    """Two workers and an evaluator, each this script with its own TF_CONFIG."""
    cluster = {
        "worker": [f"localhost:{free_port()}", f"localhost:{free_port()}"],
        "evaluator": [f"localhost:{free_port()}"],
    }
    tasks = [("worker", 0), ("worker", 1), ("evaluator", 0)]
    processes = []
    for kind, index in tasks:
        tf_config = {"cluster": cluster, "task": {"type": kind, "index": index}}
        env = {**os.environ, "TF_CONFIG": json.dumps(tf_config)}
        command = [sys.executable, __file__, *sys.argv[1:], "--dir", folder]
        processes.append(subprocess.Popen(command, env=env))
    while all(p.poll() in (None, 0) for p in processes) and any(
        p.poll() is None for p in processes
    ):
        time.sleep(0.1)
    for p in processes:  # one task failed: stop the others rather than leave them waiting
        if p.poll() is None:
            p.kill()
            p.wait()
    return next((abs(p.returncode) for p in processes if p.returncode), 0)


if "TF_CONFIG" not in os.environ:
    sys.exit(start_tasks(args.dir or tempfile.mkdtemp(prefix="spmd-sidecar-")))

# ---------------------------------------------------------------- each task

import spmd  # noqa: E402

info = spmd.initialize(local_device_count=args.devices)  # the evaluator: its own job

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

CKPT, LOGS = os.path.join(args.dir, "ckpt"), os.path.join(args.dir, "logs")
BATCH, SAVE_EVERY = 64, 16


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.out = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def dataset(rows, seed):
    """Three classes split by two planes: learnable in a few epochs."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0.5).astype(np.int32)


def make_trainer(strategy):
    """The same Trainer in both jobs: the checkpoint holds its whole train state."""
    return spmd.Trainer(
        MLP(nnx.Rngs(0)),
        optax.adam(1e-2),
        "sparse_categorical_crossentropy",
        metrics=("accuracy",),
        strategy=strategy,
    )


if info.task_type == "evaluator":
    assert jax.process_count() == 1  # not part of the training group
    logging.basicConfig(level=logging.INFO, format="[evaluator] %(message)s")  # a line a step
    logging.getLogger("absl").setLevel(logging.ERROR)
    one_device = spmd.OneDeviceStrategy(jax.devices()[0])
    val = dataset(1000, 1)  # 1000 rows: the last batch is padded, never counted
    history = spmd.SidecarEvaluator(
        MLP(nnx.Rngs(1)),  # the model, with what Keras' model.compile would give it
        val,
        CKPT,
        loss="sparse_categorical_crossentropy",
        metrics=("accuracy",),
        strategy=one_device,
        batch_size=BATCH,
        log_dir=LOGS,
        poll_interval=0.2,
        timeout=300,  # a worker that died without marking its final step: give up then
        final_grace=5,  # the run is never resumed: end 5 s after its final step
    ).start()
    last = max(history)
    # The oracle: the final checkpoint, restored into a Trainer and evaluated here by hand.
    trainer = make_trainer(one_device)
    trainer.build()
    reader = spmd.CheckpointManager(CKPT, read_only=True)
    trainer.load_state(reader.restore(last, target=trainer.state))
    again = trainer.evaluate(val, batch_size=BATCH)
    assert abs(again["loss"] - history[last]["loss"]) < 1e-6, (again, history[last])
    assert history[last]["loss"] < history[min(history)]["loss"], history  # it learned
    print(f"[evaluator] evaluated {len(history)} checkpoints; TensorBoard: {LOGS}", flush=True)
else:
    strategy = spmd.MultiWorkerMirroredStrategy()
    trainer = make_trainer(strategy)
    trainer.fit(
        dataset(2048, 0),
        batch_size=BATCH,
        epochs=args.epochs,
        verbose=2,
        callbacks=[spmd.callbacks.ModelCheckpoint(CKPT, save_freq=SAVE_EVERY, max_to_keep=None)],
    )
    if info.is_chief:
        print(f"[worker 0] trained {trainer.iterations} steps, checkpoints in {CKPT}", flush=True)
