"""CheckpointManager(read_only=True): a reader beside the writer that never writes, on any disk."""

import json
import logging
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from commands import run_program, start_program

import spmd
from tests.gcs_emulator import GcsEmulator
from tests.multiprocess.procs import child_env
from tests.test_checkpoint_faults import _assert_equal, _target, flip_bytes, make_state


def _listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_a_reader_beside_the_writer_sees_each_step_as_it_is_committed(tmp_path):
    writer = spmd.CheckpointManager(tmp_path, max_to_keep=None, async_save=True)
    reader = spmd.CheckpointManager(tmp_path, read_only=True)  # no lock: the writer holds it
    other = spmd.CheckpointManager(tmp_path, read_only=True)  # any number of readers
    try:
        assert reader.all_steps() == [] and reader.latest_step() is None
        for step in (1, 2, 3):
            writer.save(step, make_state(step))
            writer.wait()
            assert reader.all_steps() == list(range(1, step + 1)) == other.all_steps()
            _assert_equal(reader.restore(target=_target()), make_state(step))  # the latest
        _assert_equal(reader.restore(1, target=_target()), make_state(1))
        np.testing.assert_array_equal(reader.restore(2)["b"], np.arange(64.0) + 2)
    finally:
        writer.close(), reader.close(), other.close()


def test_a_reader_refuses_to_write(tmp_path):
    with spmd.CheckpointManager(tmp_path) as writer:
        writer.save(1, make_state(1))
    with spmd.CheckpointManager(tmp_path, read_only=True) as reader:
        for call in (lambda: reader.save(2, make_state(2)), reader.mark_final):
            with pytest.raises(
                spmd.CheckpointError, match=r"(?s)read_only=True\) never.*training job"
            ):
                call()
        assert reader.all_steps() == [1]
        assert "read_only=True" in repr(reader)


def test_two_writers_stay_refused_with_readers_open(tmp_path):
    reader = spmd.CheckpointManager(tmp_path, read_only=True)
    refused = pytest.raises(spmd.CheckpointError, match="One CheckpointManager at a time writes")
    with spmd.CheckpointManager(tmp_path), refused:
        spmd.CheckpointManager(tmp_path)
    reader.close()


def test_a_reader_creates_nothing_and_leaves_a_writers_unfinished_save(tmp_path):
    missing = tmp_path / "not-yet"
    with spmd.CheckpointManager(missing, read_only=True) as reader:
        assert reader.all_steps() == [] and reader.final_step() is None
    assert not missing.exists()  # a reader may start before the writer made the folder
    with spmd.CheckpointManager(tmp_path) as writer:
        writer.save(1, make_state(1))
    shutil.copytree(tmp_path / "1", tmp_path / "2.orbax-checkpoint-tmp-123")  # a save in flight
    (tmp_path / "3").mkdir()  # a step folder whose save never committed
    before = _listing(tmp_path)
    with spmd.CheckpointManager(tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [1]
        assert list(reader.damaged_steps()) == [3]
        state, step = reader.restore_newest(_target())
        assert step == 1
    assert _listing(tmp_path) == before  # no lock file, no cleanup, nothing set aside


def test_a_damaged_step_is_an_error_and_restore_newest_skips_it(tmp_path, caplog):
    with spmd.CheckpointManager(tmp_path, max_to_keep=None) as writer:
        for step in (1, 2):
            writer.save(step, make_state(step))
    flip_bytes(tmp_path / "2")
    with spmd.CheckpointManager(tmp_path, read_only=True) as reader:
        with pytest.raises(spmd.CheckpointError, match=r"(?s)step=2.*arrays=\['w'\]"):
            reader.restore(2, target=_target())
        with caplog.at_level(logging.WARNING):
            state, step = reader.restore_newest(_target())
        assert step == 1 and "skipping checkpoint step 2" in caplog.text
        _assert_equal(state, make_state(1))
    assert (tmp_path / "2").is_dir()  # the writer's folder, left in place


def test_a_step_removed_after_listing_is_an_error_not_a_hang(tmp_path):
    with spmd.CheckpointManager(tmp_path, max_to_keep=None) as writer:
        for step in (1, 2):
            writer.save(step, make_state(step))
    with spmd.CheckpointManager(tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [1, 2]
        shutil.rmtree(tmp_path / "1")  # as the writer's max_to_keep does
        with pytest.raises(spmd.CheckpointError, match="complete_steps=\\[2\\]"):
            reader.restore(1, target=_target())


def test_the_final_step_marker(tmp_path):
    with spmd.CheckpointManager(tmp_path) as writer:
        reader = spmd.CheckpointManager(tmp_path, read_only=True)
        with pytest.raises(spmd.CheckpointError, match="complete_steps=\\[\\]"):
            writer.mark_final()  # nothing saved yet
        writer.save(1, make_state(1))
        writer.save(2, make_state(2))
        with pytest.raises(spmd.CheckpointError, match="latest complete checkpoint"):
            writer.mark_final(1)
        assert reader.final_step() is None
        assert writer.mark_final() == 2 == reader.final_step()
        writer.save(3, make_state(3))  # a resumed run goes on: the mark goes
        assert reader.final_step() is None
        reader.close()
    (tmp_path / "spmd-final-step.json").write_text("{not json")
    with spmd.CheckpointManager(tmp_path, read_only=True) as reader:
        assert reader.final_step() is None  # unreadable: logged, not trusted


def _marked(directory: Path) -> dict | None:
    path = directory / "spmd-final-step.json"
    return json.loads(path.read_text()) if path.exists() else None


def test_a_writer_holds_an_ended_runs_final_mark_away_while_it_is_open(tmp_path):
    """A resumed run (or a second fit) may save again: from the moment its writer opens the
    directory, before its first save, no reader sees the old run's final step. A writer that
    lets go having saved nothing puts the mark back, naming itself; one that saved does not."""
    with spmd.CheckpointManager(tmp_path) as writer:
        writer.save(1, make_state(1))
        writer.mark_final()
    first = _marked(tmp_path)
    assert first["step"] == 1 and first["session"]
    reader = spmd.CheckpointManager(tmp_path, read_only=True)
    with spmd.CheckpointManager(tmp_path):  # opened only to restore: nothing saved
        assert reader.final_step() is None
    again = _marked(tmp_path)
    assert again["step"] == 1 and again["session"] != first["session"]
    unclosed = spmd.CheckpointManager(tmp_path)  # a program that never closes its manager
    assert reader.final_step() is None
    del unclosed  # collected (or the interpreter exits): the mark comes back
    assert reader.final_step() == 1
    with spmd.CheckpointManager(tmp_path) as writer:  # the run goes on, then stops unmarked
        assert reader.final_step() is None
        writer.save(2, make_state(2))
    assert reader.final_step() is None and _marked(tmp_path) is None
    reader.close()


def test_read_only_must_be_a_bool(tmp_path):
    with pytest.raises(spmd.ConfigurationError, match="read_only=1"):
        spmd.CheckpointManager(tmp_path, read_only=1)


@pytest.fixture
def read_only_mount(tmp_path):
    """(source, mount): `source` bind-mounted read-only at `mount` (needs root), unmounted after."""
    source, mount = tmp_path / "source", tmp_path / f"ro-{uuid.uuid4().hex[:6]}"
    source.mkdir(), mount.mkdir()
    for command in (
        ["mount", "--bind", str(source), str(mount)],
        ["mount", "-o", "remount,bind,ro", str(mount)],
    ):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            subprocess.run(["umount", str(mount)], check=False, capture_output=True)
            pytest.fail(f"this test bind-mounts a folder read-only and needs root: {done.stderr}")
    try:
        yield source, mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_reader_works_on_a_read_only_filesystem(read_only_mount):
    source, mount = read_only_mount
    with spmd.CheckpointManager(source, max_to_keep=None) as writer:
        for step in (1, 2):
            writer.save(step, make_state(step))
        writer.mark_final()
    flip_bytes(source / "2")
    before = _listing(source)
    with pytest.raises(OSError, match="Read-only"):
        (mount / "probe").write_text("")
    for directory in (mount, mount / "new"):  # an error that says what to do, not an OSError
        with pytest.raises(spmd.CheckpointError, match="(?s)can write.*read_only=True"):
            spmd.CheckpointManager(directory)
    with spmd.CheckpointManager(mount, read_only=True) as reader:
        assert reader.all_steps() == [1, 2] and reader.final_step() == 2
        _assert_equal(reader.restore(1, target=_target()), make_state(1))
        state, step = reader.restore_newest(_target())  # skips the damaged step 2
        assert step == 1
        assert reader.restore_data(1) is None and reader.metadata(1) is None
    assert _listing(source) == before


def test_a_reader_follows_a_writer_that_keeps_few_steps(tmp_path):
    with spmd.CheckpointManager(tmp_path, max_to_keep=1) as writer:
        reader = spmd.CheckpointManager(tmp_path, read_only=True)
        for step in (1, 2, 3):
            writer.save(step, {"x": jnp.full((4,), float(step))})
            writer.wait()
            assert reader.all_steps() == [step]
            np.testing.assert_array_equal(reader.restore()["x"], np.full((4,), float(step)))
        reader.close()


# -- on an object store: a GCS emulator on loopback, writer and reader in processes of their own

JOB = Path(__file__).with_name("object_store_job.py")


@pytest.fixture(scope="module")
def gcs():
    emulator = GcsEmulator()
    try:
        yield emulator
    finally:
        emulator.stop()


def _gcs_env(gcs) -> dict[str, str]:
    """A child process's environment, pointed at the emulator."""
    return {**child_env(), **gcs.env(), "JAX_PLATFORMS": "cpu"}


def _job(gcs, *args, wait=True):
    command = [sys.executable, str(JOB), *args]
    process = start_program(command, _gcs_env(gcs), stderr=subprocess.STDOUT)
    if not wait:
        return process
    output = process.communicate(timeout=300)[0]
    return process.returncode, output


def _state_values(step):
    return {"b": (np.arange(16.0) + step).tolist(), "w": np.full((8, 4), float(step)).tolist()}


_CONDITIONAL_WRITE = """
import tensorstore as ts
kv = ts.KvStore.open({"driver": "gcs", "bucket": "spmd"}).result()
written = kv.write("generations/x", b"first").result().generation
read = kv.read("generations/x").result().stamp.generation
again = kv.write("generations/x", b"second", if_equal=read).result().generation
print(read == written, again not in (b"", written), kv.read("generations/x").result().value)
"""


def test_the_emulator_answers_a_read_with_the_generation_written(gcs):
    """As GCS does (x-goog-generation): tensorstore reads the generation it wrote, and a
    write conditioned on it succeeds. Without the header a read's generation was 0 and
    such a write "Malformed StorageGeneration": OCDBT's writer, reading its manifest again
    under load, then failed a save (tests/gcs_emulator.py)."""
    done = run_program([sys.executable, "-c", _CONDITIONAL_WRITE], _gcs_env(gcs), 120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True True b'second'", done.stdout


@pytest.mark.slow
def test_a_reader_in_another_process_follows_a_writer_on_an_object_store(gcs, tmp_path):
    """gs:// has no rename: a step is committed by its commit_success.txt, and a reader in
    another process must list the bucket anew (fsspec caches listings) to see it."""
    seen_file = tmp_path / "seen.json"
    reader = _job(gcs, "read", "gs://spmd/follow", str(seen_file), "--deadline", "150", wait=False)
    try:
        code, output = _job(
            gcs, "write", "gs://spmd/follow", "--steps", "6", "--keep", "2", "--pause", "1.5"
        )
        assert code == 0, output[-3000:]
        reader_output = reader.communicate(timeout=200)[0]
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(timeout=60)
    assert reader.returncode == 0, reader_output[-3000:]
    seen = json.loads(seen_file.read_text())
    assert seen["final"] == 6, seen["listings"]  # it saw the run end
    assert any(steps and steps[-1] < 6 for steps in seen["listings"]), seen["listings"]
    assert {int(s) for s in seen["restored"]} | {int(s) for s in seen["unreadable"]} >= {5, 6}
    for step, values in seen["restored"].items():
        assert values == _state_values(int(step)), step
    for why in seen["unreadable"].values():  # only steps max_to_keep removed after the listing
        assert "complete_steps=" in why, why
    assert seen["damaged"] == {}
    names = gcs.objects("follow/")
    assert "follow/6/commit_success.txt" in names  # Orbax's commit marker: no rename on gs://
    assert not any(n.startswith(("follow/1/", "follow/2/")) for n in names)  # max_to_keep


@pytest.mark.slow
def test_a_step_without_its_commit_marker_on_an_object_store_is_never_listed(gcs, tmp_path):
    """A step whose objects are all there but commit_success.txt (a save in flight on gs://,
    or cut short): not listed, not restored, left as it is."""
    code, output = _job(gcs, "write", "gs://spmd/cut", "--steps", "2", "--no-final")
    assert code == 0, output[-3000:]
    for name in gcs.objects("cut/2/"):  # step 3: step 2's objects, without the marker
        if not name.endswith("/commit_success.txt"):
            gcs.write(name.replace("cut/2/", "cut/3/", 1), gcs.read(name))
    before = gcs.objects("cut/")
    assert "cut/3/state/_METADATA" in before and "cut/3/commit_success.txt" not in before
    seen_file = tmp_path / "seen.json"
    code, output = _job(gcs, "read", "gs://spmd/cut", str(seen_file), "--deadline", "3")
    assert code == 0, output[-3000:]
    seen = json.loads(seen_file.read_text())
    assert seen["listings"] == [[1, 2]] and sorted(seen["restored"]) == ["1", "2"]  # polled 3 s
    assert seen["final"] is None and seen["damaged"] == {}
    assert seen["restored"]["2"] == _state_values(2)
    assert gcs.objects("cut/") == before  # the reader wrote nothing and deleted nothing
