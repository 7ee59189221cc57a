"""BackupAndRestore resumes a fit stopped after any call, at any steps_per_execution, exactly.

30 rows, a batch of 6 (5 batches an epoch), 3 shuffled epochs. A fit is stopped
(an exception from a callback, after that call's backup) after each call of
`steps_per_execution` batches in turn, and a new Trainer resumes it from the
backup: it must end as the uninterrupted fit does, to the bit, having run each
epoch's batches once. With 2 or 3 batches a call, an epoch's last call is short
(5 is no multiple of them): fit reads past the end of the data to find that
out, so its backup holds the next pass's position.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import spmd

ROWS, BATCH, EPOCHS = 30, 6, 3
CALLS = {  # the iterations after each call of k batches, every epoch's calls in turn
    k: [e * 5 + min(b + k, 5) for e in range(EPOCHS) for b in range(0, 5, k)] for k in (1, 2, 3)
}
FAST = (2, 5)  # the case of the fast tier: a short last call ends epoch 0


class Linear(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)[:, 0]


class _Stopped(Exception):
    """Stands for the process being killed after the backup of `at` iterations."""


class _StopAt(spmd.callbacks.Callback):
    def __init__(self, at: int):
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if self.trainer.iterations == self.at:
            raise _Stopped


class _Epochs(spmd.callbacks.Callback):
    """The epochs fit begins, with the iterations at each begin."""

    def __init__(self):
        self.begun = []

    def on_epoch_begin(self, epoch, logs=None):
        self.begun.append((epoch, self.trainer.iterations))


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3)).astype(np.float32)
    return x, rng.normal(size=(ROWS,)).astype(np.float32)


def _fit(steps_per_execution: int, *callbacks) -> tuple[spmd.Trainer, dict, _Epochs]:
    trainer = spmd.Trainer(
        Linear(nnx.Rngs(0)),
        optax.sgd(0.1),
        "mse",
        strategy=spmd.OneDeviceStrategy(jax.devices()[0]),
        steps_per_execution=steps_per_execution,
    )
    epochs = _Epochs()
    history = trainer.fit(
        _data(), batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=[*callbacks, epochs]
    )
    return trainer, history.history, epochs


@pytest.fixture(scope="module")
def uninterrupted():
    made = {}

    def fit(steps_per_execution: int):
        if steps_per_execution not in made:
            trainer, history, _ = _fit(steps_per_execution)
            made[steps_per_execution] = (trainer.host_state()["params"], history)
        return made[steps_per_execution]

    return fit


def _cases() -> list:
    """Every (k, stop_at); the slow tier has all but k=2 at 5 (the end of epoch 0)."""
    return [
        pytest.param(k, at, id=f"k{k}-at{at}", marks=() if (k, at) == FAST else pytest.mark.slow)
        for k, calls in CALLS.items()
        for at in calls
    ]


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("steps_per_execution, stop_at", _cases())
def test_a_fit_stopped_after_any_call_resumes_to_the_uninterrupted_fit(
    tmp_path, uninterrupted, steps_per_execution, stop_at
):
    backup = str(tmp_path / "backup")
    with pytest.raises(_Stopped):
        _fit(
            steps_per_execution,
            spmd.callbacks.BackupAndRestore(backup, save_freq=1),
            _StopAt(stop_at),
        )
    resumed, history, epochs = _fit(
        steps_per_execution, spmd.callbacks.BackupAndRestore(backup, save_freq=1)
    )
    params, whole_history = uninterrupted(steps_per_execution)
    epoch = (stop_at - 1) // 5  # the epoch of the stopped call: the resume finishes it
    assert epochs.begun[0] == (epoch, stop_at), epochs.begun
    assert [e for e, _ in epochs.begun] == list(range(epoch, EPOCHS)), epochs.begun
    assert resumed.iterations == EPOCHS * 5
    assert history["loss"] == whole_history["loss"][epoch:]
    for got, want in zip(
        jax.tree.leaves(resumed.host_state()["params"]), jax.tree.leaves(params), strict=True
    ):
        np.testing.assert_array_equal(got, want)


class _StopAfterEpoch(spmd.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise _Stopped


def _fit_until_early_stop(backup: str, *callbacks) -> tuple[spmd.Trainer, int]:
    """8 epochs at most; EarlyStopping (listed after BackupAndRestore) counts every epoch
    after the first as no better (min_delta), so it stops fit after epoch 3."""
    early = spmd.callbacks.EarlyStopping(monitor="loss", patience=3, min_delta=1e9)
    trainer = spmd.Trainer(
        Linear(nnx.Rngs(0)), optax.sgd(0.1), "mse", strategy=spmd.OneDeviceStrategy()
    )
    backup_callback = spmd.callbacks.BackupAndRestore(backup)
    trainer.fit(
        _data(),
        batch_size=BATCH,
        epochs=8,
        verbose=0,
        callbacks=[backup_callback, early, *callbacks],
    )
    return trainer, early.stopped_epoch


@pytest.mark.slow  # 2 s of CPU: three fits
def test_early_stopping_resumed_from_a_backup_stops_where_the_uninterrupted_fit_does(tmp_path):
    """A fit stopped after epoch 1's backup resumes EarlyStopping's wait and best with it,
    so it stops after the same epoch with the same weights (not 2 epochs later)."""
    whole, whole_stop = _fit_until_early_stop(str(tmp_path / "whole"))
    with pytest.raises(_Stopped):
        _fit_until_early_stop(str(tmp_path / "backup"), _StopAfterEpoch())
    resumed, resumed_stop = _fit_until_early_stop(str(tmp_path / "backup"))
    assert (whole_stop, whole.iterations) == (3, 20)
    assert (resumed_stop, resumed.iterations) == (3, 20)
    for got, want in zip(
        jax.tree.leaves(resumed.host_state()["params"]),
        jax.tree.leaves(whole.host_state()["params"]),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # 4 s of CPU: three fits
def test_model_checkpoint_steps_after_the_backup_are_set_aside_and_saved_anew(tmp_path):
    """BackupAndRestore each epoch, ModelCheckpoint each batch: stopped at step 8, resumed from
    epoch 0's backup (step 5), the steps 7 and 8 the stopped attempt saved are newer than the
    resumed fit's first save; they are set aside, not a CheckpointError at every resume."""
    ckpt, backup = tmp_path / "ckpt", str(tmp_path / "backup")

    def saving():
        return spmd.callbacks.ModelCheckpoint(str(ckpt), save_freq=1, max_to_keep=2)

    with pytest.raises(_Stopped):
        _fit(1, spmd.callbacks.BackupAndRestore(backup), saving(), _StopAt(8))
    resumed, _, _ = _fit(1, spmd.callbacks.BackupAndRestore(backup), saving())
    whole, _, _ = _fit(1)
    assert resumed.iterations == EPOCHS * 5
    assert sorted(p.name for p in ckpt.iterdir() if p.name[0].isdigit()) == [
        "14",
        "15",
        "7.superseded",
        "8.superseded",
    ]
    with spmd.CheckpointManager(ckpt, read_only=True) as reader:
        saved = reader.restore(15, target=resumed.state)
    for got, want in zip(
        jax.tree.leaves(jax.device_get(saved["params"])),
        jax.tree.leaves(whole.host_state()["params"]),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)
