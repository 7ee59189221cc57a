"""A reader beside a writer whose max_to_keep removes steps: a removed step is skipped and said so.

The removals are made at fixed points (the seams between a reader's listing and
its looks at a step, and inside a restore's read), so each case is deterministic;
one case runs a writer thread against a reader for a few hundred listings.
"""

import logging
import shutil
import threading

import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd._src.checkpoint import store as store_module
from spmd._src.checkpoint.integrity import Removed
from tests.test_checkpoint_faults import _assert_equal, _target, make_state


def _saved(directory, steps=(1, 2, 3)) -> None:
    with spmd.CheckpointManager(directory, max_to_keep=None, async_save=False) as writer:
        for step in steps:
            writer.save(step, make_state(step))


def test_a_step_removed_between_listing_and_looking_is_skipped_with_a_log_line(
    tmp_path, monkeypatch, caplog
):
    _saved(tmp_path)
    real = store_module.damage

    def removed_first(step_dir, step):  # the writer's max_to_keep, just after the listing
        if step == 1:
            shutil.rmtree(step_dir)
        return real(step_dir, step)

    monkeypatch.setattr(store_module, "damage", removed_first)
    with spmd.CheckpointManager(tmp_path, read_only=True) as reader, caplog.at_level(logging.INFO):
        assert reader.all_steps() == [2, 3]
        assert reader.damaged_steps() == {}  # gone is not damaged
    assert "checkpoint step 1" in caplog.text and "removed by the writer" in caplog.text


def test_a_step_removed_while_it_is_restored_is_named_removed_and_skipped(
    tmp_path, monkeypatch, caplog
):
    _saved(tmp_path)
    with spmd.CheckpointManager(tmp_path, read_only=True) as reader:
        real = reader._store.restore_placed

        def removed_while_read(step, abstract, partial=False):
            if step == 3:
                shutil.rmtree(tmp_path / "3")
            return real(step, abstract, partial)

        monkeypatch.setattr(reader._store, "restore_placed", removed_while_read)
        with pytest.raises(Removed, match=r"(?s)step=3.*exists=False.*max_to_keep removed it"):
            reader.restore(3, target=_target())
        _saved_again(tmp_path, 3)
        with caplog.at_level(logging.WARNING):
            state, step = reader.restore_newest(_target())
    assert step == 2 and "skipping checkpoint step 3" in caplog.text
    assert "max_to_keep removed it" in caplog.text
    _assert_equal(state, make_state(2))


def _saved_again(directory, step) -> None:
    """Puts step `step` back (as the writer's next save of that number would)."""
    with spmd.CheckpointManager(directory, max_to_keep=None, async_save=False) as writer:
        writer.save(step, make_state(step), force=True)


def test_a_file_with_a_steps_name_is_named_by_readers_and_writers(tmp_path):
    _saved(tmp_path)
    shutil.rmtree(tmp_path / "2")
    (tmp_path / "2").write_text("not a checkpoint")
    with spmd.CheckpointManager(tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [1, 3]
        assert reader.damaged_steps() == {2: "a file, not a step folder, has the step's name"}
    with spmd.CheckpointManager(tmp_path, max_to_keep=None) as writer:
        assert writer.all_steps() == [1, 3]
        assert list(writer.damaged_steps()) == [2]


@pytest.mark.slow  # 14 s of CPU
def test_a_reader_lists_and_restores_while_a_writer_removes_steps(tmp_path):
    """A writer thread saving with max_to_keep=1 against a reader that lists and restores:
    every listing works, and every failed restore is a Removed."""
    state = {"x": jnp.zeros((4,))}
    stop, failures = threading.Event(), []
    writer = spmd.CheckpointManager(tmp_path, max_to_keep=1, async_save=False)
    writer.save(1, state)

    def write() -> None:
        try:
            for step in range(2, 200):
                if stop.is_set():
                    return
                writer.save(step, {"x": jnp.full((4,), float(step))})
        except BaseException as e:  # noqa: BLE001 - reported by the test
            failures.append(e)

    thread = threading.Thread(target=write)
    reader = spmd.CheckpointManager(tmp_path, read_only=True)
    thread.start()
    restored = removed = 0
    try:
        for _ in range(150):
            steps = reader.all_steps()
            assert all(s >= 1 for s in steps) and reader.damaged_steps() == {}
            if not steps:
                continue
            try:
                x = reader.restore(steps[-1])["x"]
                np.testing.assert_array_equal(x, np.full((4,), float(steps[-1])) * (steps[-1] > 1))
                restored += 1
            except Removed:
                removed += 1
            except spmd.CheckpointError as e:  # listed, then removed before the restore began
                assert "complete_steps=" in str(e), e
    finally:
        stop.set()
        thread.join()
        reader.close()
        writer.close()
    assert not failures and restored > 0
