"""SIGTERM with several checkpoint writers open in one process, opened and closed in any order.

Every writer has a preemption watch; they share the process's one SIGTERM handler and
watchdog. A SIGTERM reaches each open writer; the handler from before the first is put
back when the last closes, whatever the order; a writer that fails to open, or is
dropped unclosed, leaves SIGTERM as it found it.
"""

import os
import signal
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

import spmd
from spmd._src.checkpoint import preemption
from tests.multiprocess.procs import child_env


@pytest.fixture
def own_handler():
    """A handler of the test's own, as a program's would be, put back afterwards."""
    calls = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        yield calls
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("order", ["first-opened first", "last-opened first"])
def test_the_handler_from_before_is_back_once_every_writer_closed(tmp_path, own_handler, order):
    mine = signal.getsignal(signal.SIGTERM)
    first = spmd.CheckpointManager(tmp_path / "a")
    second = spmd.CheckpointManager(tmp_path / "b")
    assert signal.getsignal(signal.SIGTERM) != mine
    closing = [first, second] if order == "first-opened first" else [second, first]
    closing[0].close()
    assert signal.getsignal(signal.SIGTERM) != mine  # the other is still watching
    closing[1].close()
    assert signal.getsignal(signal.SIGTERM) == mine
    assert preemption.open_watchers() == []
    os.kill(os.getpid(), signal.SIGTERM)
    assert own_handler == [signal.SIGTERM]  # the program's handler has it again


def test_a_sigterm_reaches_every_open_writer_and_each_saves(tmp_path, capfd):
    state = {"w": jnp.ones(3)}
    with (
        spmd.CheckpointManager(tmp_path / "a", save_interval_steps=100) as first,
        spmd.CheckpointManager(tmp_path / "b", save_interval_steps=100) as second,
    ):
        first.close()  # the first opened closes before the SIGTERM
        third = spmd.CheckpointManager(tmp_path / "c", save_interval_steps=100)
        os.kill(os.getpid(), signal.SIGTERM)
        for writer in (second, third):
            with pytest.raises(spmd.Preempted) as stopped:
                writer.save(7, state)
            assert stopped.value.step == 7
    assert capfd.readouterr().err.count("spmd: SIGTERM caught") == 1
    for name in ("b", "c"):
        with spmd.CheckpointManager(tmp_path / name, read_only=True) as view:
            assert view.all_steps() == [7]
    assert preemption.open_watchers() == []


def test_a_writer_that_fails_to_open_leaves_sigterm_as_it_was(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(spmd.CheckpointError):
        spmd.CheckpointManager(tmp_path / "a-file")
    assert signal.getsignal(signal.SIGTERM) == before
    with pytest.raises(spmd.ConfigurationError, match="preemption_check_steps"):
        spmd.CheckpointManager(tmp_path / "never-made", preemption_check_steps=0)
    assert not (tmp_path / "never-made").exists()  # refused before anything was opened
    assert signal.getsignal(signal.SIGTERM) == before
    assert preemption.open_watchers() == []


def test_a_handler_set_while_a_writer_is_open_is_left_in_place(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    try:
        with spmd.CheckpointManager(tmp_path):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the program's own, set later
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.timeout(120)
def test_a_sigterm_after_every_writer_was_dropped_unclosed_ends_the_process(tmp_path):
    """No writer left watching (dropped without close and collected): SIGTERM does what it
    did before any was opened, here end the process at once, rather than wait for a save
    that nothing will make."""
    script = textwrap.dedent(
        f"""
        import gc, os, signal, time
        import spmd
        writer = spmd.CheckpointManager({str(tmp_path)!r})
        del writer
        gc.collect()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
        print("still alive")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=child_env(), capture_output=True, text=True, timeout=90
    )
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "still alive" not in done.stdout
