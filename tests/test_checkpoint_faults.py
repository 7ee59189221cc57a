"""Damaged checkpoints, misuse and a full disk: real files flipped, truncated, deleted, filled."""

import logging
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from commands import run_program
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from spmd._src.checkpoint.integrity import checksums

ROOT = Path(__file__).resolve().parents[1]


def make_state(seed: int) -> dict:
    """A state whose biggest array, "w", fills most of the data files."""
    key = jax.random.key(seed)
    return {
        "w": jax.random.normal(key, (128, 64)),
        "b": jnp.arange(64.0) + seed,
        "count": jnp.int32(seed),
        "key": key,
    }


def _target():
    return spmd.MirroredStrategy().abstract_state(make_state, 0)


def _host(tree):
    is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
    return jax.tree.map(lambda x: np.asarray(jax.random.key_data(x) if is_key(x) else x), tree)


def _assert_equal(got, want):
    for g, w in zip(jax.tree.leaves(_host(got)), jax.tree.leaves(_host(want)), strict=True):
        assert g.dtype == w.dtype and np.array_equal(g, w)


def _saved(directory: Path, steps=(1, 2, 3)) -> dict[int, dict]:
    """Saves make_state(step) at each step; returns the states (the oracle)."""
    states = {step: make_state(step) for step in steps}
    with spmd.CheckpointManager(directory, max_to_keep=None) as ckpt:
        for step, state in states.items():
            assert ckpt.save(step, state)
    return states


def _biggest_data_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


def flip_bytes(step_dir: Path, count: int = 4) -> None:
    """Flips `count` bytes in the middle of the step's biggest array data file."""
    path = _biggest_data_file(step_dir)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(count):
        data[middle + 16 * i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(step_dir: Path) -> None:
    path = _biggest_data_file(step_dir)
    os.truncate(path, path.stat().st_size // 2)


def delete_metadata(step_dir: Path) -> None:
    (step_dir / "state" / "_METADATA").unlink()


def empty_folder(step_dir: Path) -> None:
    """A step folder with nothing in it (the step itself is left whole)."""
    (step_dir.parent / "4").mkdir()


def delete_commit_record(step_dir: Path) -> None:
    (step_dir / "_CHECKPOINT_METADATA").unlink()


# -- item 1: bit rot is an error naming the step and the array ------------------------------


@pytest.mark.parametrize("into", ["placed", "numpy"])
def test_flipped_bytes_are_an_error_naming_step_and_array(tmp_path, into):
    _saved(tmp_path, steps=(1, 2))
    flip_bytes(tmp_path / "2")
    with spmd.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1, 2]  # the files look whole: only the values tell
        target = _target() if into == "placed" else None
        with pytest.raises(spmd.CheckpointError, match=r"(?s)step=2.*arrays=\['w'\]"):
            ckpt.restore(2, target=target)
        _assert_equal(ckpt.restore(1, target=_target()), make_state(1))  # step 1 is untouched


@pytest.mark.cpu_mesh
def test_checksums_are_the_same_for_every_layout_and_for_numpy():
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    arrays = {
        "f32": jax.random.normal(jax.random.key(0), (16, 8)),
        "bf16": jnp.linspace(0, 1, 40, dtype=jnp.bfloat16).reshape(8, 5),
        "i8": jnp.arange(-5, 5, dtype=jnp.int8),
        "bool": jnp.arange(7) % 3 == 0,
        "scalar": jnp.float32(3.5),
        "keys": jax.random.key_data(jax.random.key(2)),
    }
    want = checksums({p: np.asarray(x) for p, x in arrays.items()})
    assert checksums(arrays) == want
    spread = jax.device_put(arrays["f32"], NamedSharding(mesh, P("a", "b")))
    assert checksums({"f32": spread}) == {"f32": want["f32"]}
    for index in [(0, 0), (7, 3), (15, 7)]:  # any one flipped bit changes it
        changed = np.asarray(arrays["f32"]).copy()
        changed.view(np.uint32)[index] ^= 1 << (sum(index) % 32)
        assert checksums({"f32": changed})["f32"] != want["f32"]
    swapped = np.asarray(arrays["f32"])[::-1].copy()  # the same values in another order
    assert checksums({"f32": swapped})["f32"] != want["f32"]


# -- item 2: a damaged step is never listed or restored; restore_or_init falls back ----------

FOLDER_DAMAGE = {
    "empty_folder": empty_folder,
    "deleted_metadata": delete_metadata,
    "deleted_commit_record": delete_commit_record,
}
DATA_DAMAGE = {"flipped_bytes": flip_bytes, "truncated_file": truncate}


@pytest.mark.parametrize("damage", sorted(FOLDER_DAMAGE))
def test_incomplete_step_folders_are_not_listed(tmp_path, damage):
    _saved(tmp_path)
    FOLDER_DAMAGE[damage](tmp_path / "3")
    damaged = 4 if damage == "empty_folder" else 3
    with spmd.CheckpointManager(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1, 2, 3][: 3 if damaged == 4 else 2]
        assert list(ckpt.damaged_steps()) == [damaged]
        assert ckpt.latest_step() == (3 if damaged == 4 else 2)
        with pytest.raises(spmd.CheckpointError, match=f"step={damaged}"):
            ckpt.restore(damaged, target=_target())


@pytest.mark.slow
@pytest.mark.parametrize("damage", sorted(FOLDER_DAMAGE | DATA_DAMAGE))
def test_restore_or_init_falls_back_to_the_newest_intact_step(tmp_path, damage, caplog):
    states = _saved(tmp_path)
    (FOLDER_DAMAGE | DATA_DAMAGE)[damage](tmp_path / "3")
    damaged, resumed = (4, 3) if damage == "empty_folder" else (3, 2)
    with spmd.MirroredStrategy().scope(), spmd.CheckpointManager(tmp_path) as ckpt:
        with caplog.at_level(logging.WARNING, logger="spmd.checkpoint"):
            state, step = ckpt.restore_or_init(make_state, 0)
        assert step == resumed
        _assert_equal(state, states[resumed])
        skips = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
        assert len(skips) == 1 and f"step {damaged}" in skips[0], skips
        assert (tmp_path / f"{damaged}.damaged").is_dir()  # kept for inspection
        assert ckpt.all_steps() == [1, 2, 3][:resumed] and not ckpt.damaged_steps()
        assert ckpt.save(resumed + 1, make_state(9))  # the run goes on and saves that step anew
    with spmd.CheckpointManager(tmp_path) as ckpt:
        _assert_equal(ckpt.restore(resumed + 1, target=_target()), make_state(9))


def test_restore_or_init_starts_fresh_when_no_step_is_intact(tmp_path, caplog):
    _saved(tmp_path, steps=(1,))
    flip_bytes(tmp_path / "1")
    with spmd.MirroredStrategy().scope(), spmd.CheckpointManager(tmp_path) as ckpt:
        with caplog.at_level(logging.WARNING, logger="spmd.checkpoint"):
            state, step = ckpt.restore_or_init(make_state, 0)
        assert step == 0
        _assert_equal(state, make_state(0))
        assert any("skipping checkpoint step 1" in r.getMessage() for r in caplog.records)


# -- item 3: misuse is an error before anything is written; a full disk is named -----------


def test_saving_a_lower_step_than_the_directory_holds_is_an_error(tmp_path):
    _saved(tmp_path, steps=(10,))
    before = sorted(p.name for p in tmp_path.iterdir())
    with spmd.CheckpointManager(tmp_path) as ckpt:
        with pytest.raises(spmd.CheckpointError, match=r"(?s)step=5.*newer_steps=\[10\]"):
            ckpt.save(5, make_state(5))
        assert ckpt.save(10, make_state(5)) is False  # a saved step is never overwritten
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_two_managers_on_one_directory_is_an_error(tmp_path):
    first = spmd.CheckpointManager(tmp_path)
    with pytest.raises(spmd.CheckpointError, match=rf"held_by='pid {os.getpid()}"):
        spmd.CheckpointManager(tmp_path)
    first.close()
    with spmd.CheckpointManager(tmp_path) as second:  # free again once closed
        assert second.save(1, make_state(1))


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_manager_in_another_process_holds_the_directory(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, spmd; m = spmd.CheckpointManager(sys.argv[1]); print('open', flush=True);"
            " sys.stdin.read()",
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(spmd.CheckpointError, match=rf"held_by='pid {holder.pid} "):
            spmd.CheckpointManager(tmp_path)
    finally:
        holder.communicate("", timeout=60)
    with spmd.CheckpointManager(tmp_path):
        pass


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs mounted for the test (needs root), unmounted after."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.fail(f"this test mounts a small tmpfs and needs root: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_full_disk_is_reported_naming_the_step(small_disk, async_save):
    big = {"w": jax.random.normal(jax.random.key(0), (1024, 1024))}  # 4 MiB, incompressible
    ckpt = spmd.CheckpointManager(small_disk / "ckpt", async_save=async_save)
    try:
        with pytest.raises(spmd.CheckpointError, match=r"(?s)steps=\[1\].*free space"):
            ckpt.save(1, big)
            ckpt.wait()
        assert ckpt.all_steps() == []  # never listed, never restored
    finally:
        ckpt.close()


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("keep", [None, 3], ids=["keep_all", "keep_3"])
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_full_disk_names_only_the_steps_that_failed(small_disk, async_save, keep):
    """Steps 1-10 commit on the small disk, 11 fills it: the error names 11 (and 12, never
    written), not the committed, intact steps saved since the last wait, nor those
    max_to_keep deleted after they committed."""
    small = {"w": jnp.arange(16.0)}
    big = {"w": jax.random.normal(jax.random.key(0), (1024, 1024))}  # 4 MiB, incompressible
    ckpt = spmd.CheckpointManager(small_disk / "ckpt", max_to_keep=keep, async_save=async_save)
    try:
        for step in range(1, 11):
            ckpt.save(step, small)
        with pytest.raises(spmd.CheckpointError) as raised:
            ckpt.save(11, big)
            ckpt.save(12, small)
            ckpt.wait()
        named = re.search(r"steps=\[([\d, ]*)\]", str(raised.value))
        failed = [int(s) for s in named.group(1).split(",")] if named else None
        assert failed in ([11], [11, 12]), str(raised.value)
        kept = ckpt.all_steps()  # Orbax may delete the oldest kept step when 11 starts
        assert kept == list(range(1, 11))[-len(kept) :] and len(kept) >= min(keep or 10, 2)
    finally:
        ckpt.close()


FILLS_THE_DISK = """
import os, sys, jax, numpy as np, spmd
folder = sys.argv[1]
def make(step):  # 1 MiB a step, in 4 incompressible arrays
    return {f"l{i}": np.random.default_rng(step * 10 + i).random(65536, np.float32) for i in range(4)}
ckpt = spmd.CheckpointManager(folder, max_to_keep=3)
for step in range(1, 7):
    try:
        print("SAVE", step, ckpt.save(step, make(step)), flush=True)
    except spmd.CheckpointError as e:
        print("SAVE-ERROR", step, str(e).replace(chr(10), " | "), flush=True)
for end in (ckpt.wait, ckpt.close):
    try:
        end()
    except spmd.CheckpointError as e:
        print("END-ERROR", str(e).replace(chr(10), " | "), flush=True)
print("LISTING", sorted(os.listdir(folder)), flush=True)
"""


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_full_disk_is_said_once_per_step_in_spmd_s_words_and_its_space_freed(small_disk):
    """Orbax's own logs of the failed save (ERROR:absl with tracebacks) and its late writes'
    'Event loop is closed' tracebacks stay out of the output; each failed step is named by
    one CheckpointError; its temporary folder is removed, so it stops taking the space."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", FILLS_THE_DISK, str(small_disk / "ckpt")]
    done = run_program(argv, env, 300)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = re.findall(r"steps=\[([\d, ]*)\]", done.stdout)
    named = [int(s) for group in errors for s in group.split(",")]
    assert named and len(named) == len(set(named)), done.stdout  # each failed step once
    for noise in ("Traceback", "ERROR:absl", "Event loop is closed"):
        assert noise not in done.stderr, done.stderr[-3000:]
    [listing] = [line for line in done.stdout.splitlines() if line.startswith("LISTING")]
    assert "orbax-checkpoint-tmp" not in listing, listing


# -- a damaged OCDBT manifest: skipped with one warning, no late tracebacks -----------------

MANY_ARRAYS = """
import sys, pathlib, jax, spmd
folder = pathlib.Path(sys.argv[1])
def make(seed):
    return {f"w{i}": jax.random.normal(jax.random.key(seed + i), (256, 64)) for i in range(30)}
if sys.argv[2] == "save":
    with spmd.CheckpointManager(folder, max_to_keep=None) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, make(step))
else:
    with spmd.MirroredStrategy().scope(), spmd.CheckpointManager(folder) as ckpt:
        print("RESUMED", ckpt.restore_or_init(make, 0)[1])
"""


def _run_many(folder: Path, mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", MANY_ARRAYS, str(folder), mode]
    return run_program(argv, env, 300)


@pytest.mark.slow
def test_a_damaged_manifest_is_skipped_with_one_warning_and_no_tracebacks(tmp_path):
    """Orbax's other reads complete after its loop closed: no 'Event loop is closed' per array."""
    assert _run_many(tmp_path, "save").returncode == 0
    manifest = tmp_path / "3" / "state" / "manifest.ocdbt"
    raw = bytearray(manifest.read_bytes())
    for i in range(40, len(raw), 9):
        raw[i] ^= 0xFF
    manifest.write_bytes(bytes(raw))
    done = _run_many(tmp_path, "load")
    assert done.returncode == 0 and "RESUMED 2" in done.stdout, done.stderr[-3000:]
    assert done.stderr.count("skipping checkpoint step 3") == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Event loop is closed" not in done.stderr
