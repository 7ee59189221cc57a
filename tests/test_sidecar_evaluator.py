"""SidecarEvaluator in one process: each checkpoint fit writes, evaluated exactly, on any device count."""

import functools
import json
import logging
import shutil
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import spmd
from spmd._src.trainer import sidecar, sidecar_watch
from tests.multiprocess.procs import child_env, without_dac_override
from tests.test_callbacks import MLP, _read_events


def _data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x[:, 0] + 0.3 * x[:, 1] > 0).astype(np.int32)


def _trainer(strategy):
    return spmd.Trainer(
        MLP(nnx.Rngs(0)),
        optax.adam(1e-2),
        "sparse_categorical_crossentropy",
        metrics=("accuracy",),
        strategy=strategy,
    )


def _one_device():
    return spmd.OneDeviceStrategy(jax.devices()[0])


def damage_values(step_dir):
    """Flips every byte in the second half of each of the step's array data files."""
    for path in (step_dir / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            data = bytearray(path.read_bytes())
            half = len(data) // 2
            data[half:] = bytes(b ^ 0xFF for b in data[half:])
            path.write_bytes(bytes(data))


# The runs here are never resumed: each evaluator ends as soon as it has evaluated the final step.
_sidecar = functools.partial(spmd.SidecarEvaluator, final_grace=0)

VAL = _data(77, 1)  # 77 rows: the last batch of 32 is padded, and must not count


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A fit on 8 devices that saved every 3 steps (9 steps: 3, 6, 9) and marked step 9 final."""
    directory = tmp_path_factory.mktemp("run") / "ckpt"
    trainer = _trainer(spmd.MirroredStrategy())
    saved = {}

    class Remember(spmd.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.trainer.iterations % 3 == 0:
                saved[self.trainer.iterations] = jax.device_get(self.trainer.state)

    trainer.fit(
        _data(144, 0),
        batch_size=48,
        epochs=3,
        verbose=0,
        shuffle=False,
        callbacks=[
            Remember(),
            spmd.callbacks.ModelCheckpoint(str(directory), save_freq=3, max_to_keep=None),
        ],
    )
    return directory, saved


def _oracle(state):
    """Trainer.evaluate of `state` on one device."""
    trainer = _trainer(_one_device())
    trainer.build()
    trainer.load_state(state)
    return trainer.evaluate(VAL, batch_size=32)


@pytest.mark.slow  # 4 s of CPU: over the fast tier's share (tests/tiers.py)
def test_each_step_is_evaluated_as_evaluate_does_on_one_device(trained, tmp_path):
    directory, saved = trained
    assert spmd.CheckpointManager(directory, read_only=True).final_step() == 9
    evaluator = _sidecar(
        _trainer(_one_device()),
        VAL,
        str(directory),
        batch_size=32,
        log_dir=str(tmp_path / "logs"),
        poll_interval=0.05,
    )
    history = evaluator.start()  # ends at the final step: no timeout needed
    assert list(history) == [3, 6, 9]
    for step, metrics in history.items():
        want = _oracle(saved[step])
        assert metrics.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(metrics[key], want[key], rtol=1e-6, atol=1e-7)
    assert history[3]["loss"] != history[9]["loss"]
    (events_file,) = (tmp_path / "logs" / "validation").glob("events.out.tfevents.*")
    scalars = {
        (v.tag, e.step): v.simple_value for e in _read_events(events_file) for v in e.summary.value
    }
    for step, metrics in history.items():
        assert scalars[("evaluation_loss_vs_iterations", step)] == pytest.approx(metrics["loss"])
        got = scalars[("evaluation_accuracy_vs_iterations", step)]
        assert got == pytest.approx(metrics["accuracy"])


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_an_evaluator_on_eight_devices_and_a_steps_limit(trained):
    directory, saved = trained
    history = _sidecar(
        _trainer(spmd.MirroredStrategy()), VAL, str(directory), steps=1, batch_size=32
    ).start()
    first_batch = (VAL[0][:32], VAL[1][:32])
    trainer = _trainer(_one_device())
    trainer.build()
    trainer.load_state(saved[6])
    np.testing.assert_allclose(
        history[6]["loss"], trainer.evaluate(first_batch, batch_size=32)["loss"], rtol=1e-6
    )


def test_max_evaluations(trained):
    directory, _ = trained
    evaluator = _sidecar(
        _trainer(_one_device()), VAL, str(directory), max_evaluations=2, batch_size=32
    )
    assert list(evaluator.start()) == [3, 6]


def _evaluate_copy(trained, tmp_path, caplog, damage, callbacks=()):
    directory, _ = trained
    copy = tmp_path / "ckpt"
    shutil.copytree(directory, copy)
    damage(copy)
    with caplog.at_level(logging.INFO, logger="spmd.evaluator"):
        return _sidecar(
            _trainer(_one_device()), VAL, str(copy), callbacks=callbacks, batch_size=32
        ).start()


def test_damaged_steps_are_skipped_with_a_log_line(trained, tmp_path, caplog):
    def damage(copy):
        (copy / "3" / "state" / "_METADATA").unlink()  # an incomplete step folder
        damage_values(copy / "6")  # the files look whole: only the checksums tell

    history = _evaluate_copy(trained, tmp_path, caplog, damage)
    assert list(history) == [9]
    assert "skipping checkpoint step 3: not a complete checkpoint" in caplog.text
    assert "missing state/_METADATA" in caplog.text
    assert "skipping checkpoint step 6: damaged: The files of checkpoint step 6 must" in caplog.text
    assert "the training run ended at step 9" in caplog.text


def _uncommit(step_dir):
    """The step's folder as a save that renamed it but never committed it leaves it."""
    record = step_dir / "_CHECKPOINT_METADATA"
    meta = json.loads(record.read_text())
    committed = meta.pop("commit_timestamp_nsecs")
    record.write_text(json.dumps(meta))
    return lambda: record.write_text(json.dumps({**meta, "commit_timestamp_nsecs": committed}))


def _no_integrity_record(step_dir):
    """The step's folder without spmd's record (its checksums), written in the commit."""
    shutil.rmtree(step_dir / "metadata")


def _no_commit_record(step_dir):
    (step_dir / "_CHECKPOINT_METADATA").unlink()


@pytest.fixture
def restored_steps(monkeypatch):
    """The steps a CheckpointManager's restore is asked to read, in order."""
    asked = []
    restore = spmd.CheckpointManager.restore

    def spy(self, step=None, *args, **kwargs):
        asked.append(step)
        return restore(self, step, *args, **kwargs)

    monkeypatch.setattr(spmd.CheckpointManager, "restore", spy)
    return asked


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize(
    "uncommit, why",
    [
        (_uncommit, "_CHECKPOINT_METADATA has no commit time"),
        (_no_commit_record, "no _CHECKPOINT_METADATA"),
        (_no_integrity_record, "missing metadata/metadata"),
    ],
    ids=["renamed-not-committed", "no-commit-record", "no-integrity-record"],
)
def test_a_step_folder_never_committed_is_never_read(
    trained, tmp_path, caplog, restored_steps, uncommit, why
):
    history = _evaluate_copy(trained, tmp_path, caplog, lambda copy: uncommit(copy / "6"))
    assert list(history) == [3, 9]
    assert restored_steps == [3, 9]  # step 6's files were never opened
    assert "skipping checkpoint step 6: not a complete checkpoint" in caplog.text
    assert why in caplog.text


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_newest_step_not_yet_committed_is_read_once_its_commit_lands(
    trained, tmp_path, caplog, restored_steps, monkeypatch
):
    """The newest step folder may be a save in flight (on gs:// a step is written in its own
    folder before its commit marker): not skipped, not read, until it is committed."""
    nine = tmp_path / "ckpt" / "9"
    commit = []

    def in_flight(copy):  # arrays still being written, no commit time, the run not ended
        commit.append(_uncommit(copy / "9"))
        damage_values(copy / "9")
        (copy / "spmd-final-step.json").unlink()

    class Clock:  # the writer's commit lands while the evaluator waits between two looks
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds):
            if commit:
                damage_values(nine)  # the same flip again: the bytes as saved
                commit.pop()()
                (nine.parent / "spmd-final-step.json").write_text('{"step": 9}')
            time.sleep(seconds)

    monkeypatch.setattr(sidecar, "time", Clock)
    history = _evaluate_copy(trained, tmp_path, caplog, in_flight)
    assert list(history) == [3, 6, 9] and restored_steps == [3, 6, 9]
    assert "skipping checkpoint step 9" not in caplog.text
    np.testing.assert_allclose(history[9]["loss"], _oracle(trained[1][9])["loss"], rtol=1e-6)


def test_a_step_removed_before_it_was_read_is_skipped(trained, tmp_path, caplog):
    class RemoveNine(spmd.callbacks.Callback):  # as the writer's max_to_keep does
        def on_test_end(self, logs=None):  # step 9 was listed before step 3 was evaluated
            if self.trainer.iterations == 3:
                shutil.rmtree(tmp_path / "ckpt" / "9")

    history = _evaluate_copy(trained, tmp_path, caplog, lambda copy: None, [RemoveNine()])
    assert list(history) == [3, 6]
    assert (
        "skipping checkpoint step 9: removed by the writer's max_to_keep before it could be read"
    ) in caplog.text
    assert "damaged" not in caplog.text


@pytest.mark.parametrize("replaced", [True, False], ids=["by-a-file", "removed"])
def test_a_final_step_gone_before_it_was_listed_ends_the_evaluation_not_waits(
    trained, tmp_path, caplog, replaced
):
    """The run marked step 9 its last, then step 9 went: without a timeout, the evaluator
    would wait for it for ever."""

    def damage(copy):
        shutil.rmtree(copy / "9")
        if replaced:
            (copy / "9").write_text("not a step")

    history = _evaluate_copy(trained, tmp_path, caplog, damage)
    assert list(history) == [3, 6]
    assert (
        "the training run marked step 9 as its last, but the directory holds no step 9"
    ) in caplog.text


def test_a_step_removed_while_it_is_read_is_skipped_as_removed_not_damaged(
    trained, tmp_path, caplog, monkeypatch
):
    """Orbax deletes a folder file by file: a step listed whole loses its files mid-read."""
    restore = spmd.CheckpointManager.restore

    def deleted_meanwhile(self, step=None, *args, **kwargs):
        if step == 6:
            shutil.rmtree(tmp_path / "ckpt" / "6" / "state")  # the commit record still there
        return restore(self, step, *args, **kwargs)

    monkeypatch.setattr(spmd.CheckpointManager, "restore", deleted_meanwhile)
    history = _evaluate_copy(trained, tmp_path, caplog, lambda copy: None)
    assert list(history) == [3, 9]
    assert (
        "skipping checkpoint step 6: removed by the writer's max_to_keep while it was being read"
    ) in caplog.text
    assert "damaged" not in caplog.text


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("removed", [True, False], ids=["then-gone", "still-there"])
def test_an_incomplete_step_folder_is_logged_as_what_the_next_look_finds(
    trained, tmp_path, caplog, monkeypatch, removed
):
    """A folder seen incomplete between whole steps is one being deleted (gone at the next
    look: removed before it could be read) or a damaged one (still there: damaged)."""
    copy = tmp_path / "ckpt"
    shutil.copytree(trained[0], copy)
    (copy / "spmd-final-step.json").unlink()
    (copy / "6" / "state" / "_METADATA").unlink()
    finish = (lambda: shutil.rmtree(copy / "6")) if removed else (lambda: None)
    monkeypatch.setattr(sidecar, "time", _Between(finish))
    evaluator = _sidecar(
        _trainer(_one_device()), VAL, str(copy), batch_size=32, poll_interval=0.05, timeout=0.5
    )
    with caplog.at_level(logging.WARNING, logger="spmd.evaluator"):
        assert list(evaluator.start()) == [3, 9]
    if removed:
        want = "removed by the writer's max_to_keep before it could be read"
    else:
        want = "damaged: missing state/_METADATA"
    assert caplog.text.count("skipping checkpoint step 6") == 1
    assert f"skipping checkpoint step 6: {want}" in caplog.text


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_without_a_final_step_it_waits_until_the_timeout(tmp_path, caplog):
    trainer = _trainer(_one_device())
    trainer.fit(
        _data(64, 0),
        batch_size=32,
        epochs=1,
        verbose=0,
        callbacks=[spmd.callbacks.ModelCheckpoint(str(tmp_path / "ckpt"), save_freq=1)],
    )
    (tmp_path / "ckpt" / "spmd-final-step.json").unlink()  # as if the run went on
    evaluator = _sidecar(
        _trainer(_one_device()),
        VAL,
        str(tmp_path / "ckpt"),
        batch_size=32,
        timeout=0.3,
        poll_interval=0.05,
    )
    with caplog.at_level(logging.INFO, logger="spmd.evaluator"):
        assert list(evaluator.start()) == [1, 2]
    assert "(timeout)" in caplog.text
    missing = _sidecar(
        _trainer(_one_device()), VAL, str(tmp_path / "none-yet"), batch_size=32, timeout=0.2
    )
    assert missing.start() == {} and not (tmp_path / "none-yet").exists()


class _Between:
    """`sidecar.time` whose first pauses (the evaluator waiting) run `works`, one each: what the
    training job does while the evaluator waits."""

    monotonic = staticmethod(time.monotonic)

    def __init__(self, *works):
        self.works = list(works)

    def sleep(self, seconds):
        if self.works:
            self.works.pop(0)()
        time.sleep(seconds)


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_second_fit_call_goes_on_past_the_first_ones_final_step(tmp_path, monkeypatch):
    """Keras' two fit() calls with one ModelCheckpoint (a warm-up, then more epochs): the first
    fit marks its last step final; the evaluator waits out its grace, and the second fit
    takes the mark away, saves on and marks its own last step."""
    directory = str(tmp_path / "ckpt")
    trainer = _trainer(_one_device())
    checkpoint = spmd.callbacks.ModelCheckpoint(directory, save_freq=2, max_to_keep=None)
    fit = functools.partial(
        trainer.fit, _data(64, 0), batch_size=16, verbose=0, shuffle=False, callbacks=[checkpoint]
    )
    fit(epochs=1)
    monkeypatch.setattr(sidecar, "time", _Between(lambda: fit(epochs=2, initial_epoch=1)))
    evaluator = spmd.SidecarEvaluator(
        _trainer(_one_device()), VAL, directory, batch_size=32, poll_interval=0.05, final_grace=1
    )
    assert list(evaluator.start()) == [2, 4, 6, 8]


@pytest.mark.slow  # 5 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_resumed_run_keeps_the_evaluator_going_from_before_its_first_save(tmp_path, monkeypatch):
    """A finished run resumed for more epochs (BackupAndRestore) with an evaluator started
    beside it: the old run's final mark goes when the resumed run opens the directory, long
    before its first save, so the evaluator's grace never runs out on it."""
    directory = str(tmp_path / "ckpt")
    backup = lambda: spmd.callbacks.BackupAndRestore(  # noqa: E731
        directory, save_freq=4, delete_checkpoint=False
    )

    class Slow(spmd.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.4)  # the first save comes 1.6 s after the directory was opened

    def fit(epochs, callbacks):
        trainer = _trainer(_one_device())
        trainer.fit(_data(64, 0), batch_size=16, epochs=epochs, verbose=0, callbacks=callbacks)

    fit(1, [backup()])
    resumed = threading.Thread(target=fit, args=(3, [backup(), Slow()]))
    monkeypatch.setattr(sidecar, "time", _Between(resumed.start))
    evaluator = spmd.SidecarEvaluator(
        _trainer(_one_device()), VAL, directory, batch_size=32, poll_interval=0.05, final_grace=1
    )
    try:
        history = evaluator.start()
    finally:
        resumed.join(timeout=120)
    assert list(history) == [4, 8, 12]


def test_it_says_where_it_waits_when_a_wait_begins_and_while_it_lasts(
    tmp_path, caplog, monkeypatch
):
    """Keras logs "Waiting for new checkpoint at <dir>" (INFO); a long wait is logged again."""
    monkeypatch.setattr(sidecar_watch, "WAIT_LOG_S", 0.2)
    directory = str(tmp_path / "not-yet")
    evaluator = _sidecar(
        _trainer(_one_device()), VAL, directory, batch_size=32, timeout=0.7, poll_interval=0.05
    )
    with caplog.at_level(logging.INFO, logger="spmd.evaluator"):
        assert evaluator.start() == {}
    assert caplog.text.count(f"Waiting for new checkpoint at {directory}") == 1
    assert caplog.text.count(f"still waiting for a new checkpoint at {directory}") >= 2
    assert "(timeout 1 s)" in caplog.text


def test_a_file_or_a_step_folder_as_checkpoint_dir_is_a_clear_error(trained, tmp_path):
    directory, _ = trained
    (tmp_path / "notes.txt").write_text("x")
    make = lambda path: _sidecar(_trainer(_one_device()), VAL, str(path))  # noqa: E731
    with pytest.raises(spmd.ConfigurationError, match="(?s)not a file.*is_a='file'"):
        make(tmp_path / "notes.txt")
    with pytest.raises(spmd.ConfigurationError, match="(?s)is_a='step folder'") as error:
        make(directory / "6")
    assert f"checkpoint_dir={str(directory)!r}" in str(error.value)


def _new_run(directory, states):
    """A run of another seed in `directory`: steps 1 and 2, each state kept in `states`."""

    class Remember(spmd.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            states[self.trainer.iterations] = jax.device_get(self.trainer.state)

    checkpoint = spmd.callbacks.ModelCheckpoint(str(directory), save_freq=1, max_to_keep=None)
    trainer = spmd.Trainer(
        MLP(nnx.Rngs(5)), optax.sgd(0.1), "sparse_categorical_crossentropy", strategy=_one_device()
    )
    trainer.fit(_data(64, 2), batch_size=32, verbose=0, callbacks=[checkpoint, Remember()])


@pytest.mark.slow  # 6 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("seen_gone", [True, False], ids=["seen-removed", "replaced-between-looks"])
def test_a_directory_removed_and_recreated_by_a_new_run_is_followed_from_its_start(
    trained, tmp_path, caplog, monkeypatch, seen_gone
):
    """The run the evaluator followed (to step 9, unmarked) is deleted and a new run writes
    steps 1 and 2 at the same path: the evaluator says so and evaluates the new run's steps,
    each as Trainer.evaluate does, until the new run's final step."""
    copy, states = tmp_path / "ckpt", {}
    shutil.copytree(trained[0], copy)
    (copy / "spmd-final-step.json").unlink()  # the old run still going
    remove, recreate = lambda: shutil.rmtree(copy), lambda: _new_run(copy, states)
    works = [remove, recreate] if seen_gone else [lambda: (remove(), recreate())]
    monkeypatch.setattr(sidecar, "time", _Between(*works))
    evaluator = _sidecar(
        _trainer(_one_device()), VAL, str(copy), batch_size=32, poll_interval=0.05, timeout=60
    )
    with caplog.at_level(logging.INFO, logger="spmd.evaluator"):
        history = evaluator.start()
    assert list(history) == [1, 2]
    for step, metrics in history.items():
        np.testing.assert_allclose(metrics["loss"], _oracle(states[step])["loss"], rtol=1e-6)
    assert f"the checkpoint directory {copy} holds a new run" in caplog.text
    assert ("was removed: waiting for it" in caplog.text) == seen_gone
    assert "the training run ended at step 2" in caplog.text


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_run_whose_newest_steps_go_is_the_same_run(trained, tmp_path, caplog, monkeypatch):
    """Steps 6 and 9 set aside (a relaunched writer's restore_newest) or being deleted: the
    steps left are checkpoints the evaluator read, so it is the same run, evaluated once."""
    copy = tmp_path / "ckpt"
    shutil.copytree(trained[0], copy)
    (copy / "spmd-final-step.json").unlink()

    def set_aside():
        (copy / "9").rename(copy / "9.damaged")
        (copy / "6" / "state" / "_METADATA").unlink()  # a folder Orbax is deleting

    monkeypatch.setattr(sidecar, "time", _Between(set_aside))
    evaluator = _sidecar(
        _trainer(_one_device()), VAL, str(copy), batch_size=32, poll_interval=0.05, timeout=0.5
    )
    with caplog.at_level(logging.INFO, logger="spmd.evaluator"):
        assert list(evaluator.start()) == [3, 6, 9]
    assert "new run" not in caplog.text


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_the_optimizer_and_metrics_may_differ_from_trainings(trained):
    """Only the model is read (never the optimizer state): any optimizer, other metrics."""
    directory, saved = trained
    other = spmd.Trainer(
        MLP(nnx.Rngs(1)), optax.sgd(0.1), "sparse_categorical_crossentropy", strategy=_one_device()
    )
    history = _sidecar(other, VAL, str(directory), batch_size=32).start()
    assert list(history) == [3, 6, 9] and list(history[9]) == ["loss"]
    np.testing.assert_allclose(history[6]["loss"], _oracle(saved[6])["loss"], rtol=1e-6)


class Wider(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 32, rngs=rngs)
        self.out = nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


class Renamed(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 16, rngs=rngs)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.dense(x)))


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize(
    "model, match",
    [
        (Wider, r"shape_or_dtype_differs=\['params/hidden/bias/value: saved float32\[16\], target"),
        (
            Renamed,
            r"in_target_not_in_checkpoint=\['params/dense/bias/value', 'params/dense/kernel/value'",
        ),
    ],
    ids=["wider", "renamed"],
)
@pytest.mark.parametrize("bare", [True, False], ids=["model", "trainer"])
def test_a_checkpoint_of_another_model_is_an_error_naming_the_leaves(trained, model, match, bare):
    directory, _ = trained
    loss = "sparse_categorical_crossentropy"
    if bare:
        evaluator = _sidecar(
            model(nnx.Rngs(0)),
            VAL,
            str(directory),
            loss=loss,
            strategy=_one_device(),
            batch_size=32,
        )
    else:
        other = spmd.Trainer(model(nnx.Rngs(0)), optax.adam(1e-2), loss, strategy=_one_device())
        evaluator = _sidecar(other, VAL, str(directory), batch_size=32)
    with pytest.raises(spmd.CheckpointError, match=match):
        evaluator.start()
    assert evaluator.history == {}  # nothing evaluated with a part of the weights


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_dataset_that_never_ends_needs_steps(trained):
    tf = pytest.importorskip("tensorflow")
    directory, saved = trained
    endless = tf.data.Dataset.from_tensor_slices(VAL).batch(32).repeat()
    make = lambda steps: _sidecar(  # noqa: E731
        MLP(nnx.Rngs(0)),
        endless,
        str(directory),
        steps=steps,
        loss="sparse_categorical_crossentropy",
    )
    with pytest.raises(spmd.ConfigurationError, match="(?s)never ends.*Received: steps=None"):
        make(None).start()
    history = make(2).start()
    trainer = _trainer(_one_device())
    trainer.build()
    trainer.load_state(saved[9])
    want = trainer.evaluate((VAL[0][:64], VAL[1][:64]), batch_size=32)
    np.testing.assert_allclose(history[9]["loss"], want["loss"], rtol=1e-6)


def _linear_init(key):
    return {"w": jax.random.normal(key, (4, 2)) * 0.1, "b": jax.numpy.zeros(2)}


def _linear_apply(params, x):
    return x @ params["w"] + params["b"]


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_custom_loops_checkpoints_are_evaluated_as_evaluate_does(tmp_path):
    """examples/06's layout, {"params", "opt"} and no step counter, from a loop with its own
    optimizer: the evaluator reads "params" and evaluates each step as Trainer.evaluate."""
    tx, x, y = optax.sgd(0.5), *_data(64, 0)
    state = {"params": _linear_init(jax.random.key(0))}
    state["opt"] = tx.init(state["params"])
    saved = {}

    @jax.jit
    def train_step(state):
        loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
            _linear_apply(p, x), y
        ).mean()
        updates, opt = tx.update(jax.grad(loss)(state["params"]), state["opt"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    with spmd.CheckpointManager(tmp_path / "ckpt", max_to_keep=None) as ckpt:
        for step in (1, 2, 3):
            state = train_step(state)
            saved[step] = jax.device_get(state["params"])
            ckpt.save(step, state)
        ckpt.mark_final()
    loss = "sparse_categorical_crossentropy"
    history = _sidecar(
        (_linear_init, _linear_apply), VAL, str(tmp_path / "ckpt"), loss=loss, batch_size=32
    ).start()
    assert list(history) == [1, 2, 3]
    for step, metrics in history.items():
        oracle = spmd.Trainer((lambda key, p=saved[step]: p, _linear_apply), optax.sgd(0.1), loss)
        want = oracle.evaluate(VAL, batch_size=32)["loss"]
        np.testing.assert_allclose(metrics["loss"], want, rtol=1e-6)


class _Normed(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.norm(self.dense(x))))


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_custom_loops_model_state_nested_under_its_own_keys(tmp_path):
    """A loop that saves {"model": {"weights", "stats"}, "opt"}: params_key and rest_key say
    where; the BatchNorm statistics are the saved ones, not the evaluator model's own."""
    model, x = _Normed(nnx.Rngs(0)), _data(64, 0)[0]
    model(x)  # a forward pass in training mode: the statistics move off their initial values
    weights, stats = nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat)
    state = {"model": {"weights": weights, "stats": stats}, "opt": {"count": jax.numpy.ones(())}}
    with spmd.CheckpointManager(tmp_path / "ckpt") as ckpt:
        ckpt.save(5, state)
        ckpt.mark_final()
    loss = "sparse_categorical_crossentropy"
    evaluate = functools.partial(
        _sidecar, _Normed(nnx.Rngs(1)), VAL, str(tmp_path / "ckpt"), loss=loss, batch_size=32
    )
    history = evaluate(params_key="model/weights", rest_key="model/stats").start()
    want = spmd.Trainer(model, optax.sgd(0.1), loss).evaluate(VAL, batch_size=32)["loss"]
    np.testing.assert_allclose(history[5]["loss"], want, rtol=1e-6)
    with pytest.raises(spmd.CheckpointError) as error:
        evaluate().start()  # the Trainer's keys: nothing at "params"
    text = str(error.value)
    assert "Received: params_key='params', step=5, checkpoint_keys=['model', 'opt']" in text
    assert "examples/06_checkpoint_resume.py" in text
    with pytest.raises(spmd.CheckpointError, match="rest_key='rest'"):
        evaluate(params_key="model/weights").start()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"poll_interval": 3600}, "poll_interval is at most 600"),
        ({"poll_interval": 0}, "poll_interval must be"),
        ({"steps": 0}, "steps"),
        ({"batch_size": 0}, "Received: batch_size=0"),  # at construction, not at start()
        ({"max_evaluations": 1.5}, "max_evaluations"),
        ({"timeout": -1}, "timeout"),
        ({"final_grace": -1}, "final_grace must be a number of seconds >= 0"),
        ({"checkpoint_dir": 7}, "checkpoint_dir"),
        ({"log_dir": 123}, r"(?s)log_dir is the folder TensorBoard reads.*Received: log_dir=123"),
        ({"log_dir": ""}, "Received: log_dir=''"),
        ({"callbacks": [1]}, r"(?s)callbacks is a list of spmd.callbacks.Callback.*\[1\]"),
        ({"callbacks": "/logs"}, r"keyword-only, after Keras' callbacks: log_dir='/logs'"),
        ({"params_key": ""}, "params_key is a '/'-joined path"),
        ({"params_key": "a//b"}, "Received: params_key='a//b'"),
        ({"rest_key": 3}, "rest_key is a '/'-joined path"),
        ({"params_key": "model", "rest_key": "model/stats"}, "two separate parts"),
    ],
)
def test_bad_arguments_are_clear_errors(tmp_path, kwargs, match):
    with pytest.raises(spmd.ConfigurationError, match=match):
        _sidecar(_trainer(_one_device()), VAL, **{"checkpoint_dir": str(tmp_path), **kwargs})


def test_a_checkpoint_dir_that_never_appears_is_a_warning_at_the_timeout(tmp_path, caplog):
    """A typo in the path is said, not an evaluator that 'found no new checkpoint'."""
    missing = tmp_path / "no" / "such" / "run"
    evaluator = _sidecar(
        _trainer(_one_device()), VAL, str(missing), batch_size=32, poll_interval=0.05, timeout=0.3
    )
    with caplog.at_level(logging.INFO, logger="spmd.evaluator"):
        assert evaluator.start() == {}
    [warning] = [r for r in caplog.records if r.name == "spmd.evaluator" and r.levelno >= 30]
    assert f"{missing} never appeared in 0 s (timeout)" in warning.getMessage()
    assert "Check the path" in warning.getMessage()
    assert "no new checkpoint" not in caplog.text


def test_a_log_dir_that_cannot_be_written_is_an_error_before_any_evaluation(trained, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(spmd.ConfigurationError, match="(?s)can write.*NotADirectoryError"):
        _sidecar(
            _trainer(_one_device()), VAL, str(trained[0]), log_dir=str(tmp_path / "notes.txt" / "x")
        )


def test_keras_positional_arguments_put_callbacks_sixth(trained, tmp_path, monkeypatch):
    """Keras: SidecarEvaluator(model, data, checkpoint_dir, steps, max_evaluations, callbacks);
    a single Callback is taken as a list of one, as Keras flattens it."""
    directory, _ = trained
    monkeypatch.chdir(tmp_path)
    board = spmd.callbacks.TensorBoard(str(tmp_path / "board"))
    model = MLP(nnx.Rngs(1))
    loss = "sparse_categorical_crossentropy"
    history = _sidecar(
        model, VAL, str(directory), None, 2, [board], loss=loss, batch_size=32
    ).start()
    assert list(history) == [3, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["board"]  # nothing else written
    (events_file,) = (tmp_path / "board" / "validation").glob("events.out.tfevents.*")
    steps = {e.step for e in _read_events(events_file) for v in e.summary.value}
    assert steps == {3, 6}
    seen = []

    class Steps(spmd.callbacks.Callback):
        def on_test_end(self, logs=None):
            seen.append(self.trainer.iterations)

    _sidecar(model, VAL, str(directory), 1, None, Steps(), loss=loss, batch_size=32).start()
    assert seen == [3, 6, 9]


_UNREADABLE = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import numpy as np
from flax import nnx
import spmd
model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
data = (np.zeros((8, 4), np.float32), np.zeros(8, np.int32))
kwargs = dict(loss="sparse_categorical_crossentropy", batch_size=8, timeout=5)
for directory, log_dir in ((sys.argv[1], None), (sys.argv[2], sys.argv[3])):
    try:
        spmd.SidecarEvaluator(model, data, directory, log_dir=log_dir, **kwargs).start()
    except spmd.SpmdError as error:
        print(type(error).__name__ + ":", str(error).replace(chr(10), " / "), flush=True)
"""


@pytest.mark.slow
def test_a_folder_it_cannot_read_or_write_is_a_clear_error_not_a_traceback(trained, tmp_path):
    """A checkpoint_dir at mode 000 (Orbax's listing: PermissionError) and a log_dir it may not
    create (tensorboardX's, after the first evaluation): spmd errors naming path and errno,
    the second at construction. Run as root without its DAC override, so the modes hold."""
    unreadable, read_only = tmp_path / "ckpt", tmp_path / "ro"
    shutil.copytree(trained[0], unreadable)
    read_only.mkdir()
    unreadable.chmod(0), read_only.chmod(0o555)
    args = [str(unreadable), str(trained[0]), str(read_only / "logs")]
    command = without_dac_override([sys.executable, "-c", _UNREADABLE, *args])
    try:
        run = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=120)
    finally:
        unreadable.chmod(0o755), read_only.chmod(0o755)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert (
        f"CheckpointError: A CheckpointManager lists the step folders of its directory, so it "
        f"must be able to read it. / Received: directory='{unreadable}'"
    ) in output, output[-3000:]
    assert "errno='EACCES (13)'" in output
    assert "ConfigurationError: log_dir must be a folder the evaluator can write" in output
    assert "checkpoint step" not in output  # before any evaluation
    assert "Traceback" not in output


_UNDER = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import numpy as np
from flax import nnx
import spmd
model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
data = (np.zeros((8, 4), np.float32), np.zeros(8, np.int32))
kwargs = dict(loss="sparse_categorical_crossentropy", batch_size=8, timeout=2)
for directory in sys.argv[1:]:
    try:
        spmd.SidecarEvaluator(model, data, directory, **kwargs).start()
    except spmd.SpmdError as error:
        print(type(error).__name__ + ":", str(error).replace(chr(10), " / "), flush=True)
"""


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_directory_under_a_file_or_an_unreadable_folder_is_spmd_s_error_naming_it(tmp_path):
    """checkpoint_dir below a file (it can never be a folder), and below a folder of mode 000
    (it cannot be looked at): a ConfigurationError naming the file, a CheckpointError naming
    the path and EACCES, never a raw NotADirectoryError or PermissionError. Run as root
    without its DAC override, so the mode holds."""
    (tmp_path / "afile").write_text("")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    args = [str(tmp_path / "afile" / "sub"), str(locked / "sub")]
    command = without_dac_override([sys.executable, "-c", _UNDER, *args])
    try:
        run = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=120)
    finally:
        locked.chmod(0o755)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert (
        "ConfigurationError: checkpoint_dir is a folder, or a path where one can be made" in output
    )
    assert f"file='{tmp_path / 'afile'}'" in output, output[-3000:]
    assert (
        "CheckpointError: A CheckpointManager lists the step folders of its directory, so it "
        f"must be able to read it. / Received: directory='{locked / 'sub'}'"
    ) in output, output[-3000:]
    assert "errno='EACCES (13)'" in output and "Traceback" not in output


def test_a_one_shot_iterator_is_a_clear_error_before_any_evaluation(tmp_path):
    batches = iter([(VAL[0][:32], VAL[1][:32])])
    with pytest.raises(spmd.ConfigurationError, match="(?s)anew for every checkpoint"):
        _sidecar(_trainer(_one_device()), batches, str(tmp_path))


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_bare_model_with_loss_and_metrics_is_evaluated_as_keras_does(trained, tmp_path):
    """Keras' form: the model, with what model.compile gave it (loss, metrics); its weights
    are each checkpoint's, and a TensorBoard callback gets Keras' tags at each train step."""
    directory, saved = trained
    model = MLP(nnx.Rngs(1))  # other initial weights: each checkpoint replaces them
    seen = []

    class Steps(spmd.callbacks.Callback):
        def on_test_end(self, logs=None):
            seen.append((self.trainer.iterations, int(self.trainer.state["step"])))

    evaluator = _sidecar(
        model,
        VAL,
        str(directory),
        loss="sparse_categorical_crossentropy",
        metrics=("accuracy",),
        strategy=spmd.MirroredStrategy(),  # 8 devices, as the training job
        callbacks=[Steps(), spmd.callbacks.TensorBoard(str(tmp_path / "logs"))],
        batch_size=32,
    )
    history = evaluator.start()
    assert list(history) == [3, 6, 9]
    for step, metrics in history.items():
        want = _oracle(saved[step])
        assert metrics.keys() == want.keys() == {"loss", "accuracy"}
        for key in want:
            np.testing.assert_allclose(metrics[key], want[key], rtol=1e-6, atol=1e-7)
    assert seen == [(3, 3), (6, 6), (9, 9)]  # iterations: the train step each was saved at
    assert evaluator.model is model  # the model given, holding the last checkpoint's weights
    kernel = saved[9]["params"]["hidden"]["kernel"]
    kernel = kernel.get_value() if hasattr(kernel, "get_value") else kernel
    np.testing.assert_array_equal(np.asarray(model.hidden.kernel[...]), np.asarray(kernel))
    (events_file,) = (tmp_path / "logs" / "validation").glob("events.out.tfevents.*")
    tags = {(v.tag, e.step) for e in _read_events(events_file) for v in e.summary.value}
    assert ("evaluation_accuracy_vs_iterations", 9) in tags
    assert ("evaluation_loss_vs_iterations", 3) in tags


def test_the_model_given_holds_each_checkpoints_weights_as_it_is_evaluated(trained):
    """Keras loads each checkpoint into the model it was given: the module passed in holds
    the weights of the step being evaluated (callbacks see them), then of the last one."""
    directory, saved = trained
    model = MLP(nnx.Rngs(1))
    seen = {}

    def kernel(state):
        value = state["params"]["hidden"]["kernel"]
        return np.asarray(value.get_value() if hasattr(value, "get_value") else value)

    class Weights(spmd.callbacks.Callback):
        def on_test_begin(self, logs=None):
            seen[self.trainer.iterations] = np.asarray(model.hidden.kernel[...])

    _sidecar(
        model,
        VAL,
        str(directory),
        loss="sparse_categorical_crossentropy",
        strategy=_one_device(),
        callbacks=[Weights()],
        batch_size=32,
    ).start()
    np.testing.assert_array_equal(np.asarray(model.hidden.kernel[...]), kernel(saved[9]))
    assert list(seen) == [3, 6, 9]
    for step, weights in seen.items():
        np.testing.assert_array_equal(weights, kernel(saved[step]))


def test_a_bare_model_without_a_loss_is_a_clear_error_saying_what_to_pass(tmp_path):
    with pytest.raises(spmd.ConfigurationError) as error:
        _sidecar(MLP(nnx.Rngs(0)), VAL, str(tmp_path))
    text = str(error.value)
    assert "Received: model_or_trainer='MLP', loss=None" in text
    assert 'loss="sparse_categorical_crossentropy"' in text and "metrics=" in text


@pytest.mark.parametrize(
    "value, kwargs, match",
    [
        ("model.ckpt", {"loss": "mse"}, "(?s)nnx.Module.*Received: model_or_trainer='str'"),
        (
            "trainer",
            {"loss": "mse", "strategy": None},
            "(?s)brings its own loss.*Received: model_or_trainer='Trainer', loss='mse'",
        ),
        ("trainer", {"metrics": ("accuracy",)}, "(?s)brings its own.*metrics=\\('accuracy',\\)"),
    ],
)
def test_what_is_not_a_model_or_a_trainer_alone_is_a_clear_error(tmp_path, value, kwargs, match):
    value = _trainer(_one_device()) if value == "trainer" else value
    with pytest.raises(spmd.ConfigurationError, match=match):
        _sidecar(value, VAL, str(tmp_path), **kwargs)


@pytest.mark.slow
def test_an_evaluator_racing_a_writer_that_keeps_one_step(tmp_path):
    """A writer saving every step with max_to_keep=1, deleting steps while they are listed
    and read: the evaluator never fails, and every step it evaluated is that step's state."""
    directory, states, errors = tmp_path / "ckpt", {}, []

    class Remember(spmd.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            states[self.trainer.iterations] = jax.device_get(self.trainer.state)
            time.sleep(0.1)  # time for the evaluator to read while the writer deletes

    def train():
        try:
            checkpoint = spmd.callbacks.ModelCheckpoint(str(directory), save_freq=1, max_to_keep=1)
            _trainer(_one_device()).fit(
                _data(320, 0), batch_size=16, verbose=0, callbacks=[checkpoint, Remember()]
            )
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    writer = threading.Thread(target=train)
    writer.start()
    try:
        history = _sidecar(
            _trainer(_one_device()),
            VAL,
            str(directory),
            batch_size=32,
            poll_interval=0.01,
            timeout=120,
        ).start()
    finally:
        writer.join(timeout=300)
    assert not errors and 20 in history  # it ended at the final step, 20
    for step, metrics in history.items():
        np.testing.assert_allclose(metrics["loss"], _oracle(states[step])["loss"], rtol=1e-6)


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize(
    "make",
    [
        lambda d: spmd.callbacks.ModelCheckpoint(d, save_freq=2),
        lambda d: spmd.callbacks.BackupAndRestore(d, save_freq=2, delete_checkpoint=False),
    ],
    ids=["ModelCheckpoint", "BackupAndRestore"],
)
def test_fit_marks_its_last_save_final_even_while_it_is_in_flight(tmp_path, make):
    """One async save, still being written when fit ends: it is marked once committed."""
    directory = str(tmp_path / "ckpt")
    _trainer(_one_device()).fit(_data(64, 0), batch_size=32, verbose=0, callbacks=[make(directory)])
    assert spmd.CheckpointManager(directory, read_only=True).final_step() == 2


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
def test_each_evaluation_is_on_disk_when_on_test_end_returns_and_batch_hooks_run(trained, tmp_path):
    """A TensorBoard among the callbacks flushes each evaluation's scalars in on_test_end
    (nothing closes it at the end), and the test batch hooks run per batch, as in evaluate."""
    directory, _ = trained
    folder = tmp_path / "logs" / "validation"
    seen, batches = [], []

    class Probe(spmd.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            batches.append((self.trainer.iterations, batch, sorted(logs)))

        def on_test_end(self, logs=None):  # after TensorBoard's on_test_end
            (events_file,) = folder.glob("events.out.tfevents.*")
            events = _read_events(events_file)
            steps = [e.step for e in events for v in e.summary.value if "loss" in v.tag]
            seen.append((self.trainer.iterations, steps))

    board = spmd.callbacks.TensorBoard(str(tmp_path / "logs"))
    evaluator = _sidecar(  # no final_grace: the run ended, it ends at its final step
        _trainer(_one_device()), VAL, str(directory), callbacks=[board, Probe()], batch_size=32
    )
    evaluator.start()
    assert seen == [(3, [3]), (6, [3, 6]), (9, [3, 6, 9])]
    names = ["accuracy", "loss"]
    assert batches == [(step, b, names) for step in (3, 6, 9) for b in range(3)]  # 77 rows
