"""Callbacks: TensorBoard event files parse, ModelCheckpoint saves, BackupAndRestore resumes exactly."""

import os
import struct
import sys
from pathlib import Path

import jax
import models
import numpy as np
import optax
import pytest
from commands import run_program
from flax import nnx
from models import labelled

import spmd

ROOT = Path(__file__).resolve().parents[1]


class MLP(models.MLP):
    """4 features -> 16 (relu) -> 2 logits; test_sidecar_evaluator.py and
    test_checkpoint_damage_and_misuse.py fit it too."""

    def __init__(self, rngs: nnx.Rngs):
        super().__init__(rngs, features=4, outputs=2)


def _model():
    return MLP(nnx.Rngs(0))


def _data(n=256):
    return labelled(n, features=4, classes=2)


def _trainer():
    return spmd.Trainer(
        _model(),
        optax.adam(1e-2),
        "sparse_categorical_crossentropy",
        metrics=("accuracy",),
        strategy=spmd.MirroredStrategy(),
    )


def _read_events(path: Path) -> list:
    """Decodes a TensorBoard event file (TFRecord framing + Event protos)."""
    from tensorboardX.proto import event_pb2

    events, raw = [], path.read_bytes()
    offset = 0
    while offset < len(raw):
        (length,) = struct.unpack("<Q", raw[offset : offset + 8])
        data = raw[offset + 12 : offset + 12 + length]
        offset += 12 + length + 4
        event = event_pb2.Event()
        event.ParseFromString(data)
        events.append(event)
    return events


@pytest.mark.slow
def test_tensorboard_writes_event_files_tensorboard_reads(tmp_path):
    x, y = _data()
    trainer = _trainer()
    trainer.fit(
        (x, y),
        batch_size=64,
        epochs=2,
        validation_data=(x, y),
        callbacks=[spmd.callbacks.TensorBoard(str(tmp_path))],
        verbose=0,
    )
    scalars = {}
    for split in ("train", "validation"):
        (event_file,) = (tmp_path / split).glob("events.out.tfevents.*")
        for event in _read_events(event_file):
            for value in event.summary.value:
                scalars.setdefault((split, value.tag), []).append((event.step, value.simple_value))
    assert [s for s, _ in scalars[("train", "epoch_loss")]] == [0, 1]
    assert ("validation", "epoch_accuracy") in scalars
    assert scalars[("train", "epoch_loss")][1][1] < scalars[("train", "epoch_loss")][0][1]


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_execution, saved", [(1, [3, 6, 9]), (2, [4, 6, 10])])
def test_model_checkpoint_save_freq_never_skips_with_steps_per_execution(
    tmp_path, steps_per_execution, saved
):
    """A hook per K batches saves at the group that crosses each multiple of save_freq."""
    x, y = _data(320)
    trainer = spmd.Trainer(
        _model(),
        optax.adam(1e-2),
        "sparse_categorical_crossentropy",
        strategy=spmd.MirroredStrategy(),
        steps_per_execution=steps_per_execution,
    )
    callback = spmd.callbacks.ModelCheckpoint(
        str(tmp_path), save_freq=3, max_to_keep=None, async_save=False
    )
    trainer.fit((x, y), batch_size=32, epochs=1, callbacks=[callback], verbose=0)
    manager = spmd.CheckpointManager(tmp_path)
    assert manager.all_steps() == saved and trainer.iterations == 10
    manager.close()


@pytest.mark.slow
def test_model_checkpoint_saves_best_only(tmp_path):
    x, y = _data()
    trainer = _trainer()
    callback = spmd.callbacks.ModelCheckpoint(
        str(tmp_path), monitor="val_loss", save_best_only=True, async_save=False
    )
    trainer.fit(
        (x, y), batch_size=64, epochs=3, validation_data=(x, y), callbacks=[callback], verbose=0
    )
    manager = spmd.CheckpointManager(tmp_path)
    steps = manager.all_steps()
    assert steps and steps[-1] == trainer.iterations == 12  # val_loss improved every epoch
    restored = manager.restore(target=trainer.state)
    np.testing.assert_array_equal(
        np.asarray(jax.device_get(restored["params"]["out"]["kernel"])),
        np.asarray(jax.device_get(trainer.state["params"]["out"]["kernel"])),
    )
    assert manager.metadata()["epoch"] == 2
    manager.close()


@pytest.mark.parametrize("bad", ["batch", 0])
def test_bad_save_freq_teaches(bad):
    with pytest.raises(spmd.ConfigurationError, match="save_freq"):
        spmd.callbacks.BackupAndRestore("/tmp/x", save_freq=bad)


WORKER = """
import sys, os, signal
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np, optax, spmd
from flax import nnx
sys.path.insert(0, {tests!r})
from models import MLP, labelled
backup, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])

class Kill(spmd.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.trainer.iterations == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

x, y = labelled(256, features=4, classes=2)
trainer = spmd.Trainer(MLP(nnx.Rngs(0), features=4, outputs=2), optax.adam(1e-2), "sparse_categorical_crossentropy",
                       strategy=spmd.MirroredStrategy())
callbacks = [spmd.callbacks.BackupAndRestore(backup, save_freq=3), Kill()]
trainer.fit((x, y), batch_size=32, epochs=3, shuffle=True, callbacks=callbacks, verbose=0)
np.savez(out, **{{"/".join(map(str, p)): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(
    jax.device_get(trainer.state["params"]))[0]}})
"""


@pytest.mark.slow
def test_backup_and_restore_resumes_to_the_same_weights(tmp_path):
    """Killed mid-epoch (SIGKILL) and relaunched, fit ends with the weights of an uninterrupted fit."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(ROOT / "tests")))

    def run(backup, out, kill_at):
        return run_program(
            [sys.executable, str(script), str(backup), str(out), str(kill_at)],
            dict(os.environ),
            300,
            cwd=ROOT,
        )

    whole = run(tmp_path / "b1", tmp_path / "whole.npz", -1)
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = run(
        tmp_path / "b2", tmp_path / "resumed.npz", 13
    )  # epoch 1, batch 5; last backup at 12
    assert killed.returncode == -9
    assert (tmp_path / "b2").exists()
    resumed = run(tmp_path / "b2", tmp_path / "resumed.npz", -1)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert not (tmp_path / "b2").exists()  # a completed fit deletes its backup
    want, got = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "resumed.npz")
    for key in want.files:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)  # bitwise
