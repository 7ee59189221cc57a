"""SIGTERM with checkpoint writers open in one process: several, in any order, from any thread.

Every writer has a preemption watch; they share the process's one SIGTERM handler and
watchdog. A SIGTERM reaches each open writer; the handler from before the first is put
back when the last closes, whatever the order; a writer that fails to open, is closed
from another thread, or is dropped unclosed, leaves SIGTERM as it found it.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import jax.numpy as jnp
import pytest
from commands import run_program

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
    done = run_program([sys.executable, "-c", script], child_env(), 90)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "still alive" not in done.stdout


def test_a_handler_set_between_two_writers_does_not_cut_the_second_off(tmp_path, own_handler):
    first = spmd.CheckpointManager(tmp_path / "a")
    between = []
    signal.signal(signal.SIGTERM, lambda signum, frame: between.append(signum))
    second = spmd.CheckpointManager(tmp_path / "b")
    os.kill(os.getpid(), signal.SIGTERM)
    assert first._watcher.noticed() and second._watcher.noticed() and between == []
    first.close(), second.close()
    os.kill(os.getpid(), signal.SIGTERM)
    assert between == [signal.SIGTERM]  # the handler in place when the second opened
    assert own_handler == []


def test_a_writer_closed_from_another_thread_leaves_sigterm_to_the_handler_from_before(
    tmp_path, own_handler
):
    mine = signal.getsignal(signal.SIGTERM)
    writer = spmd.CheckpointManager(tmp_path / "a")
    closing = threading.Thread(target=writer.close)
    closing.start(), closing.join()
    assert preemption.open_watchers() == []
    os.kill(os.getpid(), signal.SIGTERM)  # the route, left in place, forwards it
    assert own_handler == [signal.SIGTERM]
    with spmd.CheckpointManager(tmp_path / "b") as again:  # the main thread's next writer
        os.kill(os.getpid(), signal.SIGTERM)
        assert again._watcher.noticed() and own_handler == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) == mine


def test_a_handler_swapped_out_and_back_across_the_last_close_still_reaches_the_first(
    tmp_path, own_handler
):
    writer = spmd.CheckpointManager(tmp_path)
    saved = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # a temporary swap
    writer.close()
    signal.signal(signal.SIGTERM, saved)  # the route's handler, put back by the program
    os.kill(os.getpid(), signal.SIGTERM)
    assert own_handler == [signal.SIGTERM]


def test_a_writer_whose_sigterm_watch_cannot_start_fails_to_open_and_changes_nothing(
    tmp_path, own_handler, monkeypatch
):
    mine = signal.getsignal(signal.SIGTERM)

    def no_sockets(act):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(preemption, "_SigtermWatchdog", no_sockets)
    with pytest.raises(OSError, match="Too many open files"):
        spmd.CheckpointManager(tmp_path)
    assert signal.getsignal(signal.SIGTERM) == mine and preemption.open_watchers() == []
    monkeypatch.undo()
    with spmd.CheckpointManager(tmp_path) as writer:  # the folder is not held
        writer.save(1, {"w": jnp.ones(2)})


def test_signal_and_jax_preemption_are_not_mixed_in_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(preemption, "jax_service_available", lambda: True)
    jax_watch = preemption.PreemptionWatcher("jax")
    try:
        with pytest.raises(spmd.ConfigurationError, match='preemption="jax" too'):
            spmd.CheckpointManager(tmp_path / "a")  # "auto" is the Python handler
        assert not (tmp_path / "a").exists()
    finally:
        jax_watch.close()
    with (
        spmd.CheckpointManager(tmp_path / "b"),
        pytest.raises(spmd.ConfigurationError, match='preemption="signal" too'),
    ):
        preemption.PreemptionWatcher("jax")
    assert preemption.open_watchers() == []


@pytest.mark.parametrize("name", ["async_save", "shared_filesystem", "exit_on_preemption"])
def test_a_flag_that_is_not_a_bool_is_refused_before_anything_is_opened(tmp_path, name):
    with pytest.raises(spmd.ConfigurationError, match=rf"{name} is True or False"):
        spmd.CheckpointManager(tmp_path / "never-made", **{name: "no"})
    assert not (tmp_path / "never-made").exists()


def _run(script: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return run_program([sys.executable, "-c", textwrap.dedent(script)], child_env(), timeout)


@pytest.mark.timeout(120)
def test_a_sigterm_with_every_writer_dropped_ends_a_process_whose_main_thread_is_blocked(
    tmp_path,
):
    """The main thread cannot run a Python handler (as when blocked in a collective: here
    SIGTERM is blocked for it, and it sleeps 60 s): the watchdog ends the process, as
    SIGTERM's default would have."""
    done = _run(
        f"""
        import gc, os, signal, threading, time
        import spmd
        writer = spmd.CheckpointManager({str(tmp_path)!r})
        del writer
        gc.collect()
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # the main thread's only
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        time.sleep(60)
        print("still alive")
        """
    )
    assert done.returncode == 143, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "SIGTERM with no checkpoint writer open" in done.stderr
    assert "still alive" not in done.stdout


@pytest.mark.timeout(120)
def test_a_writer_that_saved_its_preemption_step_without_exiting_is_not_ended_after_the_grace(
    tmp_path,
):
    done = _run(
        f"""
        import os, signal, time
        import jax.numpy as jnp
        import spmd
        writer = spmd.CheckpointManager(
            {str(tmp_path)!r}, save_interval_steps=100, exit_on_preemption=False
        )
        writer._watcher.grace_period = 1.0
        os.kill(os.getpid(), signal.SIGTERM)
        assert writer.save(1, {{"w": jnp.ones(2)}}) and writer.preempted_step == 1
        time.sleep(3)  # past the grace: the save was made, the program stops when it chooses
        writer.close()
        print("stopped by the program")
        """
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "stopped by the program" in done.stdout
