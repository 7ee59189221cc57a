"""Damaged checkpoints and misuse an unlucky operator meets, and what each one gets.

Each test damages real files (or runs real processes) and asserts what the
guarantees in docs/checkpoints.md and docs/multihost.md promise: damage is
skipped or an error, never restored; a disk that cannot be read is an error,
never damage; nothing is wrong silently. Every wait is bounded; loopback only.
"""

import errno
import json
import os
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from commands import run_program
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd._src.checkpoint.integrity import Damaged, checksums, json_checksum
from spmd._src.checkpoint.store import SharedStore
from tests.multiprocess.procs import without_dac_override

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def make_state(seed: int) -> dict:
    key = jax.random.key(seed)
    return {"w": jax.random.normal(key, (128, 64)), "b": jnp.arange(64.0) + seed, "key": key}


def _saved(directory: Path, steps=(1, 2)) -> None:
    """Saves make_state(step) with data position {"batch": 10 * step} at each step."""
    with spmd.CheckpointManager(directory, max_to_keep=None) as ckpt:
        for step in steps:
            assert ckpt.save(
                step, make_state(step), data={"batch": 10 * step}, metadata={"lr": 0.1}
            )


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, text
    path.write_text(text.replace(old, new))


def _flip_biggest_data_file(step_dir: Path) -> None:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    path = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    for i in range(4):
        data[len(data) // 2 + 16 * i] ^= 0xFF
    path.write_bytes(bytes(data))


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("SPMD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


# -- a damaged data position crash-loops the job (issue 11 item 2) ---------------------------


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_truncated_data_position_falls_back_instead_of_a_raw_crash(tmp_path):
    """Truncating step 2's `data/metadata` (the input position) is damage like any other.

    restore_or_init skips step 2 (a warning) and resumes step 1 with its
    position, as it does for a truncated `metadata/metadata`: never a raw
    json.JSONDecodeError on every start, a crash loop.
    """
    _saved(tmp_path)
    os.truncate(tmp_path / "2" / "data" / "metadata", 10)
    position = {}
    with spmd.CheckpointManager(tmp_path) as ckpt:
        _, step = ckpt.restore_or_init(
            make_state, 0, data=position, strategy=spmd.MirroredStrategy()
        )
    assert (step, position) == (1, {"batch": 10})


# -- silent wrong results: what the checksums do not cover (item 1) --------------------------


def test_a_changed_data_position_is_not_restored_silently(tmp_path):
    """One digit of step 2's saved input position changes on disk (20 -> 29).

    A CheckpointError (the position is part of what is resumed: a wrong one
    skips or repeats examples), never batch 29 without a word.
    """
    _saved(tmp_path)
    _edit(tmp_path / "2" / "data" / "metadata", '"batch": 20', '"batch": 29')
    position = {}
    target = spmd.MirroredStrategy().abstract_state(make_state, 0)
    with spmd.CheckpointManager(tmp_path) as ckpt, pytest.raises(spmd.CheckpointError):
        ckpt.restore(2, target=target, data=position)
    assert position != {"batch": 29}


def test_changed_user_metadata_is_not_returned_silently(tmp_path):
    """One digit of step 2's metadata dict changes on disk (lr 0.1 -> 0.7): an error."""
    _saved(tmp_path)
    _edit(tmp_path / "2" / "metadata" / "metadata", '"lr": 0.1', '"lr": 0.7')
    with spmd.CheckpointManager(tmp_path) as ckpt, pytest.raises(spmd.CheckpointError):
        ckpt.metadata(2)


def test_a_checksummed_step_that_lost_its_checksums_is_not_restored_unverified(tmp_path):
    """Bit rot in the metadata's key name ("checksums" -> "checksumz") plus flipped data bytes.

    The step's format says it was written with checksums: it is damaged, and
    restore_or_init falls back to step 1, never returning wrong values.
    """
    _saved(tmp_path)
    _edit(tmp_path / "2" / "metadata" / "metadata", '"checksums"', '"checksumz"')
    _flip_biggest_data_file(tmp_path / "2")
    with spmd.CheckpointManager(tmp_path) as ckpt:
        state, step = ckpt.restore_or_init(make_state, 0, strategy=spmd.MirroredStrategy())
    want = np.asarray(make_state(step)["w"])
    assert np.array_equal(np.asarray(state["w"]), want), f"step {step}: wrong values restored"


def test_two_sign_flips_do_not_leave_the_checksum_unchanged():
    """Two flipped sign bits (elements 1 and 5 of make_state(2)'s w) change the checksum.

    A linear, position-weighted sum missed them (its two halves' changes
    cancelled); each element is now mixed with its index nonlinearly first.
    """
    w = np.asarray(make_state(2)["w"])
    damaged = w.copy().ravel()
    damaged[[1, 5]] *= -1
    damaged = damaged.reshape(w.shape)
    assert not np.array_equal(w, damaged)
    assert checksums({"w": w}) != checksums({"w": damaged})


# -- permission denied is not damage: intact checkpoints set aside, training from 0 ----------

_RESTORE = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import spmd
def make_state(seed):
    key = jax.random.key(seed)
    return {"w": jax.random.normal(key, (128, 64)), "b": jnp.arange(64.0) + seed, "key": key}
with spmd.CheckpointManager(sys.argv[1]) as ckpt:
    _, step = ckpt.restore_or_init(make_state, 0, strategy=spmd.MirroredStrategy())
print("RESUMED", step, flush=True)
"""


@pytest.mark.slow
def test_permission_denied_is_an_error_not_a_fresh_start(tmp_path):
    """Step folders another user owns, mode 0700 (a copy made with `sudo cp` and umask 077).

    A CheckpointError that says the files cannot be read (permission), the
    intact steps left where they are: never renamed to `1.damaged` /
    `2.damaged` with the job started fresh at step 0, all progress dropped.
    """
    _saved(tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".spmd-lock").unlink()
    command = [sys.executable, "-c", _RESTORE, str(tmp_path / "ckpt")]
    for step in ("1", "2"):
        folder = tmp_path / "ckpt" / step
        for p in [folder, *folder.rglob("*")]:
            p.chmod(0o700 if p.is_dir() else 0o600)
            if os.geteuid() == 0:
                os.chown(p, 65534, 65534)  # nobody
    command = without_dac_override(command)  # root reads anything: not without them
    run = run_program(command, _child_env(), 90)
    output = run.stdout + run.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir()) == ["1", "2"]
    assert "RESUMED 0" not in output
    assert run.returncode != 0 and "ermission" in output, output[-2000:]


_LIST = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import spmd
try:
    if sys.argv[2] == "reader":
        spmd.CheckpointManager(sys.argv[1], read_only=True).damaged_steps()
    else:
        with spmd.CheckpointManager(sys.argv[1]) as ckpt:
            ckpt.restore_newest({"w": None})
except spmd.CheckpointError as error:
    print("CheckpointError:", error, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("who", ["reader", "writer"])
def test_a_step_folder_that_cannot_be_read_is_named_never_called_damaged(tmp_path, who):
    """Step 2's state/ folder mode 000 (its _METADATA cannot even be looked at): a
    CheckpointError naming the file and EACCES, for a reader listing the directory and a
    writer's restore_newest alike; never 'missing state/_METADATA', never set aside."""
    _saved(tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".spmd-lock").unlink()
    (tmp_path / "ckpt" / "2" / "state").chmod(0)
    command = without_dac_override([sys.executable, "-c", _LIST, str(tmp_path / "ckpt"), who])
    try:
        run = run_program(command, _child_env(), 90)
    finally:
        (tmp_path / "ckpt" / "2" / "state").chmod(0o755)
    output = run.stdout + run.stderr
    assert "CheckpointError: The files of checkpoint step 2 must be readable" in output, output
    assert "errno='EACCES (13)'" in output and "2/state/_METADATA" in output
    assert "missing" not in output
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir()) == ["1", "2"]


_SAVE_MORE = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import jax.numpy as jnp
import spmd
try:
    ckpt = spmd.CheckpointManager(sys.argv[1])
    print("SAVED", ckpt.save(3, {"w": jnp.ones(4)}), flush=True)
    ckpt.close()
except spmd.CheckpointError as error:
    print("CheckpointError:", str(error).replace(chr(10), " | "), flush=True)
"""


@pytest.mark.slow
def test_a_directory_made_read_only_after_a_run_is_refused_at_open_pointing_at_read_only(
    tmp_path,
):
    """The folder mode 555, its .spmd-lock still writable: the writer cannot save there, which
    it says when it opens (pointing at read_only=True), not after save returned True."""
    _saved(tmp_path / "ckpt")
    folder = tmp_path / "ckpt"
    folder.chmod(0o555)
    command = without_dac_override([sys.executable, "-c", _SAVE_MORE, str(folder)])
    try:
        run = run_program(command, _child_env(), 90)
    finally:
        folder.chmod(0o755)
    output = run.stdout + run.stderr
    assert "SAVED" not in output, output[-2000:]
    assert "CheckpointError: A CheckpointManager that saves needs a directory it can write" in (
        output
    ), output[-2000:]
    assert "read_only=True" in output and "Traceback" not in output
    assert sorted(p.name for p in folder.iterdir()) == [".spmd-lock", "1", "2"]


# -- forgetting spmd.initialize() under `spmd launch` (item 8) -------------------------------

_NO_INITIALIZE = """
import os, sys, time
import jax, jax.numpy as jnp
import spmd
time.sleep(0.5 * int(os.environ["SPMD_PROCESS_ID"]))
ckpt = spmd.CheckpointManager(sys.argv[1])
ckpt.save(1, {"w": jnp.ones(4)})
time.sleep(3)
ckpt.close()
print("SAVED as process", jax.process_index(), "of", jax.process_count(), flush=True)
"""


@pytest.mark.multiprocess
def test_a_checkpoint_manager_without_initialize_under_launch_names_initialize(tmp_path):
    """Two processes of `spmd launch`, neither calls spmd.initialize(), both open a manager.

    An InitializationError naming spmd.initialize(), as a strategy raises
    (docs/multihost.md), never "process 0 of 1" twice: then the second is
    told another manager holds the directory (`held_by='pid N'`), which sends
    the operator the wrong way, or both write the directory as process 0.
    """
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(_NO_INITIALIZE))
    launch = [sys.executable, "-m", "spmd", "launch", "-n", "2", "--devices-per-process", "2"]
    run = run_program(
        [*launch, "--", sys.executable, str(script), str(tmp_path / "ckpt")], _child_env(), 90
    )
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert "spmd.initialize()" in output, output[-3000:]
    assert "held_by" not in output


def test_the_checkpoint_layout_probe_is_what_the_tests_assume(tmp_path):
    """Guard for the tests above: the files they edit exist and hold what they expect."""
    _saved(tmp_path)
    assert json.loads((tmp_path / "2" / "data" / "metadata").read_text()) == {
        "position": {"batch": 20}
    }
    meta = json.loads((tmp_path / "2" / "metadata" / "metadata").read_text())
    assert meta["format"] == 3 and set(meta["checksums"]) == {"w", "b", "key"}


# -- the array checksum: no two changes cancel out --------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from([(7,), (16, 5), (3, 4, 6)]),
    seed=st.integers(0, 2**31 - 1),
    changes=st.lists(
        st.tuples(st.integers(0, 2**31 - 1), st.integers(1, 2**32 - 1)), min_size=1, max_size=2
    ),
)
def test_random_single_and_paired_changes_change_the_checksum(shape, seed, changes):
    """Any one or two elements with changed bits (xor a nonzero mask): another checksum."""
    values = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    bits = values.view(np.uint32).ravel().copy()
    positions = {at % bits.size: mask for at, mask in changes}
    for at, mask in positions.items():
        bits[at] ^= np.uint32(mask)
    damaged = bits.view(np.float32).reshape(shape)
    want = checksums({"x": values})
    assert checksums({"x": damaged}) != want
    assert checksums({"x": jnp.asarray(values)}) == want  # on the devices: the same sum


def test_format_2_steps_are_still_verified_with_their_own_checksum(tmp_path):
    """A step written before format 3 (linear array checksums, no record checksum) restores
    with its values, and its flipped bytes are still an error."""
    state = {"w": make_state(2)["w"]}
    with spmd.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(2, state)
    path = tmp_path / "2" / "metadata" / "metadata"
    meta = json.loads(path.read_text())
    meta = {"format": 2, "prng_keys": meta["prng_keys"], "user": None}
    meta["checksums"] = checksums({"w": np.asarray(state["w"])}, 2)
    path.write_text(json.dumps(meta))
    with spmd.CheckpointManager(tmp_path) as ckpt:
        assert np.array_equal(ckpt.restore(2)["w"], np.asarray(state["w"]))
    _flip_biggest_data_file(tmp_path / "2")
    with spmd.CheckpointManager(tmp_path) as ckpt, pytest.raises(spmd.CheckpointError, match="w"):
        ckpt.restore(2)


def _reseal(path: Path, change) -> None:
    """Rewrites a metadata record changed by `change`, with a matching record checksum."""
    meta = json.loads(path.read_text())
    change(meta)
    meta.pop("checksum", None)
    path.write_text(json.dumps({**meta, "checksum": json_checksum(meta)}))


def test_a_format_3_step_without_array_checksums_is_damaged(tmp_path):
    """Even with a record checksum that matches, format 3 without "checksums" is damage."""
    _saved(tmp_path)
    _reseal(tmp_path / "2" / "metadata" / "metadata", lambda m: m.pop("checksums"))
    with spmd.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(spmd.CheckpointError, match="missing=\\['checksums'\\]"):
            ckpt.restore(2)
        state, step = ckpt.restore_or_init(make_state, 0, strategy=spmd.MirroredStrategy())
    assert step == 1 and np.array_equal(state["w"], make_state(1)["w"])


def test_a_step_that_claims_format_1_but_has_checksums_is_damaged(tmp_path):
    """A flipped digit in "format" must not switch verification off."""
    _saved(tmp_path)
    _edit(tmp_path / "2" / "metadata" / "metadata", '"format": 3', '"format": 1')
    with spmd.CheckpointManager(tmp_path) as ckpt, pytest.raises(spmd.CheckpointError, match="2"):
        ckpt.metadata(2)


def test_an_io_error_reading_a_step_is_an_error_that_sets_nothing_aside(tmp_path, monkeypatch):
    """EIO from the disk while reading a step: a CheckpointError naming the step, the path and
    the errno; not damage, so no step is skipped or renamed and the job does not start fresh."""
    _saved(tmp_path)

    def broken_disk(self, step, item):
        raise OSError(errno.EIO, "Input/output error", str(self.step_dir(step) / item))

    monkeypatch.setattr(SharedStore, "read_json", broken_disk)
    with spmd.CheckpointManager(tmp_path) as ckpt, pytest.raises(spmd.CheckpointError) as raised:
        ckpt.restore_or_init(make_state, 0, strategy=spmd.MirroredStrategy())
    assert not isinstance(raised.value, Damaged)
    text = str(raised.value)
    assert "step=2" in text and "EIO" in text and str(tmp_path / "2") in text, text
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["1", "2"]


def test_saving_where_a_file_has_the_step_s_name_is_an_error(tmp_path):
    """A plain file named 3 in the directory: save(3) says so, before anything is written."""
    (tmp_path / "3").write_text("not a checkpoint")
    with spmd.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(spmd.CheckpointError, match="a file, not a step folder"):
            ckpt.save(3, make_state(3))
        assert ckpt.all_steps() == []
    assert (tmp_path / "3").read_text() == "not a checkpoint"


# -- BackupAndRestore: a damaged newest backup falls back to the older one --------------------


@pytest.mark.slow
def test_backup_and_restore_falls_back_to_the_older_backup(tmp_path, caplog):
    """Backups at iterations 3 and 6; 6's data is damaged: fit resumes from 3, its values."""
    import optax
    from flax import nnx

    from tests.test_callbacks import MLP, _data

    def trainer():
        return spmd.Trainer(
            MLP(nnx.Rngs(0)),
            optax.adam(1e-2),
            "sparse_categorical_crossentropy",
            strategy=spmd.MirroredStrategy(),
        )

    x, y = _data()
    backup = tmp_path / "backup"
    first = spmd.callbacks.BackupAndRestore(str(backup), save_freq=3, delete_checkpoint=False)
    trainer().fit((x, y), batch_size=32, epochs=1, callbacks=[first], verbose=0)
    with spmd.CheckpointManager(backup) as ckpt:
        assert ckpt.all_steps() == [3, 6]
        want = ckpt.restore(3)
    for path in (backup / "6" / "state").rglob("d/*"):  # the state is small: damage every file
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    seen = {}

    class Record(spmd.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen["iterations"] = self.trainer.iterations
            seen["params"] = jax.device_get(self.trainer.state["params"])

    again = spmd.callbacks.BackupAndRestore(str(backup), save_freq=3, delete_checkpoint=False)
    trainer().fit((x, y), batch_size=32, epochs=1, callbacks=[again, Record()], verbose=0)
    assert again.restored_step == 3 and seen["iterations"] == 3
    assert any("skipping checkpoint step 6" in r.getMessage() for r in caplog.records)
    got = jax.tree_util.tree_leaves(seen["params"])
    assert len(got) == len(jax.tree_util.tree_leaves(want["params"]))
    for a, b in zip(got, jax.tree_util.tree_leaves(want["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)  # bitwise


def test_a_64_bit_state_restored_with_64_bit_mode_off_is_refused_not_set_aside(tmp_path):
    """An intact step whose float64/int64 arrays jax holds as 32 bits is not 'damaged'.

    restore_newest (restore_or_init, BackupAndRestore) skips and sets aside damaged
    steps: a dtype it cannot hold must stop it with the dtypes and the 64-bit mode
    instead, leaving the good step where it is.
    """
    assert not jax.config.jax_enable_x64
    state = {"w": np.arange(4, dtype=np.float64) / 3, "step": np.arange(3, dtype=np.int64)}
    with spmd.CheckpointManager(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
    with spmd.CheckpointManager(tmp_path / "ckpt") as ckpt:
        with pytest.raises(spmd.CheckpointError, match="float64.*jax_enable_x64") as caught:
            ckpt.restore_newest(state)
        assert not isinstance(caught.value, Damaged)
        assert ckpt.all_steps() == [1] and not ckpt.damaged_steps()
        restored = ckpt.restore(1)  # without a target: numpy, as saved
    np.testing.assert_array_equal(restored["w"], state["w"])
    assert restored["step"].dtype == np.int64


def test_saving_an_abstract_state_is_an_error_that_writes_nothing(tmp_path):
    strategy = spmd.MirroredStrategy()
    abstract = strategy.abstract_state(make_state, 0)
    with spmd.CheckpointManager(tmp_path, async_save=False) as ckpt:
        with pytest.raises(spmd.CheckpointError, match="a placed state") as info:
            ckpt.save(1, abstract, force=True)
        assert "abstract_leaves=['b', 'key', 'w']" in str(info.value)
        assert ckpt.all_steps() == []


@pytest.mark.parametrize("under", [False, True], ids=["the-path", "a-folder-above"])
def test_a_file_where_the_directory_goes_is_named_as_a_file(tmp_path, under):
    """Not 'give this process write access' (it has it): the file is in the way."""
    blocking = tmp_path / "ckpt"
    blocking.write_text("x")
    directory = blocking / "run" if under else blocking
    with pytest.raises(spmd.CheckpointError, match="is a folder") as caught:
        spmd.CheckpointManager(directory)
    assert f"file='{blocking}'" in str(caught.value)
    assert "move that file away" in str(caught.value)
