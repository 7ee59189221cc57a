"""TensorBoard event files hold each epoch's (and each logged batch's) scalars when the
callback says it flushed: read by TensorFlow's own event reader during fit, before any
close, and after the fitting process is killed."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import optax
import pytest
from flax import nnx
from models import MLP

import spmd

ROOT = Path(__file__).resolve().parents[1]


def _data(n=256):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def _trainer():
    return spmd.Trainer(
        MLP(nnx.Rngs(0), features=4, hidden=16, outputs=2),
        optax.adam(1e-2),
        "sparse_categorical_crossentropy",
        metrics=("accuracy",),
        strategy=spmd.MirroredStrategy(),
    )


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] in the run's event files, read by TensorFlow's event reader."""
    import tensorflow as tf

    found: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


class ReadsAtEpochEnd(spmd.callbacks.Callback):
    """After the TensorBoard callback in the list: what the files hold as each epoch ends."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.seen, self.logs = log_dir, [], []

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(logs))
        self.seen.append({run: _scalars(self.log_dir / run) for run in ("train", "validation")})


@pytest.mark.slow
def test_each_epochs_scalars_are_in_the_file_when_on_epoch_end_returns(tmp_path):
    x, y = _data()
    probe = ReadsAtEpochEnd(tmp_path)
    board = spmd.callbacks.TensorBoard(str(tmp_path))
    _trainer().fit(
        (x, y), batch_size=64, epochs=2, validation_data=(x, y), callbacks=[board, probe], verbose=0
    )
    for epoch, (seen, logs) in enumerate(zip(probe.seen, probe.logs, strict=True)):
        for key, value in logs.items():
            run, name = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
            steps, values = zip(*seen[run][f"epoch_{name}"], strict=True)
            assert steps == tuple(range(epoch + 1)), (epoch, key, steps)
            assert values[-1] == np.float32(value), (epoch, key)


class FlushesAtLoggedBatches(spmd.callbacks.Callback):
    """After the TensorBoard callback: flushes it at each logged batch, then reads the file."""

    def __init__(self, board, log_dir: Path, every: int):
        self.board, self.log_dir, self.every = board, log_dir, every
        self.expected, self.seen = {}, []

    def on_train_batch_end(self, batch, logs=None):
        step = self.trainer.iterations
        if step % self.every == 0:
            self.expected[step] = self.trainer.running_metrics()  # the oracle: a read
            self.board.flush()
            self.seen.append(_scalars(self.log_dir / "train"))


@pytest.mark.slow
def test_each_logged_batchs_scalars_are_in_the_file_after_flush(tmp_path):
    x, y = _data()
    board = spmd.callbacks.TensorBoard(str(tmp_path), update_freq=3)
    probe = FlushesAtLoggedBatches(board, tmp_path, every=3)
    trainer = _trainer()
    trainer.fit((x, y), batch_size=32, epochs=2, callbacks=[board, probe], verbose=0)
    assert sorted(probe.expected) == [3, 6, 9, 12, 15]
    for seen, step in zip(probe.seen, sorted(probe.expected), strict=True):
        assert seen["batch_loss"][-1][0] == step and len(seen["batch_loss"]) == step // 3
        for name, value in probe.expected[step].items():
            assert seen[f"batch_{name}"][-1] == (step, np.float32(value)), (step, name)


_KILLED_AT_EPOCH_3 = textwrap.dedent(
    """
    import json, sys, time
    import jax, numpy as np, optax
    from flax import nnx
    import spmd

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(4, 16, rngs=rngs)
            self.out = nnx.Linear(16, 2, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.hidden(x)))

    class Report(spmd.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            print(json.dumps({"epoch": epoch, "logs": logs}), flush=True)

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                print("EPOCH 3", flush=True)
                time.sleep(600)  # killed here, with the event files open

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    trainer = spmd.Trainer(MLP(nnx.Rngs(0)), optax.adam(1e-2), "sparse_categorical_crossentropy",
                           metrics=("accuracy",), strategy=spmd.MirroredStrategy())
    trainer.fit((x, y), batch_size=64, epochs=4, validation_data=(x, y), verbose=0,
                callbacks=[spmd.callbacks.TensorBoard(sys.argv[1]), Report()])
    """
)


@pytest.mark.slow
def test_a_process_killed_in_its_third_epoch_keeps_the_first_two_epochs_scalars(tmp_path):
    """A writer's first events reach the disk early anyway (tensorboardX flushes once
    when its thread starts): the second epoch's are those that were lost."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-c", _KILLED_AT_EPOCH_3, str(tmp_path)]
    with (tmp_path / "stderr").open("w") as err:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        lines = []
        for line in child.stdout:
            lines.append(line)
            if line.startswith("EPOCH 3"):
                break
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        child.kill()
        child.stdout.close()
    stderr = (tmp_path / "stderr").read_text()[-3000:]
    assert child.returncode == -signal.SIGKILL and lines[-1:] == ["EPOCH 3\n"], (lines, stderr)
    logs = [json.loads(line)["logs"] for line in lines[-3:-1]]
    train, validation = _scalars(tmp_path / "train"), _scalars(tmp_path / "validation")
    for name, run in (("loss", train), ("accuracy", train), ("val_loss", validation)):
        tag = f"epoch_{name.removeprefix('val_')}"
        assert run[tag] == [(e, np.float32(epoch[name])) for e, epoch in enumerate(logs)], name
