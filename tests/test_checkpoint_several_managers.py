"""Several CheckpointManagers in one process: one save in flight, each failure its own manager's.

(With several processes, tests/multiprocess/test_checkpoint_two_writers.py.)
"""

import shutil

import pytest

import spmd
from spmd._src.checkpoint import turns
from tests.test_checkpoint_faults import make_state


def test_a_save_starts_once_the_other_managers_saves_are_committed(tmp_path):
    first = spmd.CheckpointManager(tmp_path / "a", async_save=True)
    second = spmd.CheckpointManager(tmp_path / "b", async_save=True)
    seen = []
    real = second._store.manager.save

    def save(step, **kwargs):  # what is committed when the second manager's Orbax save starts
        seen.append(spmd.CheckpointManager(tmp_path / "a", read_only=True).all_steps())
        return real(step, **kwargs)

    second._store.manager.save = save
    try:
        first.save(1, make_state(1))
        second.save(1, make_state(1))
        assert seen == [[1]]
    finally:
        first.close(), second.close()


def test_a_failed_save_is_reported_by_its_own_manager_not_by_the_next_one(tmp_path):
    failing = spmd.CheckpointManager(tmp_path / "a", async_save=True)
    other = spmd.CheckpointManager(tmp_path / "b", async_save=True)
    real = failing._store.manager.wait_until_finished
    armed = []

    def wait():  # the first save's commit fails: its folder is not there, and Orbax raises
        real()
        if armed:
            armed.clear()
            shutil.rmtree(tmp_path / "a" / "1")
            raise OSError(28, "No space left on device")

    failing._store.manager.wait_until_finished = wait
    try:
        failing.save(1, make_state(1))
        armed.append(True)
        assert other.save(1, make_state(1))  # waited for the first save, whose error it keeps
        with pytest.raises(spmd.CheckpointError, match=r"(?s)steps=\[1\].*a'.*No space left"):
            failing.wait()
        other.wait()
        assert other.all_steps() == [1]
    finally:
        failing.close(), other.close()


def test_each_manager_has_its_own_barrier_names(tmp_path):
    names = {
        turns.barrier_prefix(tmp_path / "a", "write"),
        turns.barrier_prefix(tmp_path / "b", "write"),
        turns.barrier_prefix(tmp_path / "a", "read"),
    }
    assert len(names) == 3
    assert turns.barrier_prefix(tmp_path / "a", "write") == turns.barrier_prefix(
        tmp_path / "a", "write"
    )  # the same on every process, which names the directory alike
