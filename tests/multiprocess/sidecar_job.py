"""A training job and its evaluator, for tests/multiprocess/test_sidecar_evaluator.py.

Usage:
  python sidecar_job.py train CKPT ORACLE [--sleep S] [--kill-at STEP] [--wait-for FILE]
      every process trains (Trainer.fit, ModelCheckpoint every SAVE_EVERY steps);
      process 0 pickles each saved step's state to ORACLE/<step>.pkl, and the
      time fit ended to ORACLE/ended; --kill-at kills every process (SIGKILL)
      right after the save of that step began (an async save in flight);
      --wait-for makes every process wait at step 4 until FILE exists.
  python sidecar_job.py evaluate CKPT OUT.json [--timeout S]
      the evaluator task (TF_CONFIG names it): a SidecarEvaluator on one device
      (or, as several processes, on all of theirs); process 0 writes {"history",
      "times", "task_type", "process_count"} to OUT.json, and OUT.json.<step>
      after each evaluation.
"""

import argparse
import json
import os
import pickle
import signal
import sys
import time
from pathlib import Path

import numpy as np

SAVE_EVERY, EPOCHS, BATCH, ROWS = 2, 3, 32, 192  # 6 steps an epoch: checkpoints 2, 4, ..., 18


def data(rows: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4)).astype(np.float32)
    return x, (x[:, 0] - 0.5 * x[:, 2] > 0).astype(np.int32)


VAL = data(75, 1)  # the last batch of 32 is padded: padding must not count


def make_trainer(strategy):
    import jax
    import optax
    from flax import nnx

    import spmd

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(4, 16, rngs=rngs)
            self.out = nnx.Linear(16, 2, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.hidden(x)))

    return spmd.Trainer(
        MLP(nnx.Rngs(0)),
        optax.adam(1e-2),
        "sparse_categorical_crossentropy",
        metrics=("accuracy",),
        strategy=strategy,
    )


def train(args) -> None:
    import jax

    import spmd

    spmd.initialize()
    trainer = make_trainer(spmd.MultiWorkerMirroredStrategy())
    oracle = Path(args.oracle)

    class Oracle(spmd.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = self.trainer.iterations
            if step % SAVE_EVERY == 0:
                state = self.trainer.host_state()  # a collective: every process
                if jax.process_index() == 0:
                    (oracle / f"{step}.pkl").write_bytes(pickle.dumps(state))
            if step == args.kill_at:  # the async save of this step is in flight
                os.kill(os.getpid(), signal.SIGKILL)
            if step == 2 * SAVE_EVERY and args.wait_for:  # an evaluator has read the first step
                deadline = time.monotonic() + 240
                while not Path(args.wait_for).exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            time.sleep(args.sleep)

    oracle.mkdir(parents=True, exist_ok=True)
    checkpoint = spmd.callbacks.ModelCheckpoint(args.ckpt, save_freq=SAVE_EVERY, max_to_keep=None)
    trainer.fit(
        data(ROWS, 0),
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[checkpoint, Oracle()],
    )
    if jax.process_index() == 0:
        (oracle / "ended").write_text(repr(time.time()))


def evaluate(args) -> None:
    import logging

    import jax

    import spmd

    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    info = spmd.initialize()
    one = spmd.OneDeviceStrategy(jax.devices()[0])
    trainer = make_trainer(one if info.process_count == 1 else spmd.MultiWorkerMirroredStrategy())
    times = {}

    class Times(spmd.callbacks.Callback):
        def on_test_end(self, logs=None):
            times[self.trainer.iterations] = time.time()
            if jax.process_index() == 0:
                Path(f"{args.out}.{self.trainer.iterations}").write_text(json.dumps(logs))

    history = spmd.SidecarEvaluator(
        trainer,
        VAL,
        args.ckpt,
        batch_size=BATCH,
        callbacks=[Times()],
        poll_interval=0.1,
        timeout=args.timeout,
        final_grace=1.0,  # the run is never resumed
    ).start()
    result = {
        "history": history,
        "times": times,
        "task_type": info.task_type,
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
    }
    if jax.process_index() == 0:
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "evaluate"])
    parser.add_argument("ckpt")
    parser.add_argument("out", help="ORACLE folder (train) or OUT.json (evaluate)")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--wait-for", default=None, help="a file to wait for at step 4")
    args = parser.parse_args()
    args.oracle = args.out
    train(args) if args.mode == "train" else evaluate(args)
