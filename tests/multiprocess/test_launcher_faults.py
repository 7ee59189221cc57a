"""`spmd launch` ends, bounded, and takes its workers with it: real processes, real signals.

Each test starts `python -m spmd launch` as a child, learns its workers' PIDs from
their output, does something unkind to the launcher, and checks by PID that no
worker is left alive. Every wait is bounded; loopback only.
"""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spmd.cli import main as cli
from spmd.clusters.launch import launch
from spmd.clusters.launch_results import CONFIGURATION_EXIT_CODE

from .procs import alive, child_env, wait_gone

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

# Prints its PID, then sleeps; ignores SIGTERM so that only SIGKILL ends it.
STUBBORN_WORKER = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("PID", os.getpid(), flush=True)
time.sleep(120)
"""


class Launcher:
    """`spmd launch -n N -- python -c CODE` as a child process, its output read by a thread."""

    def __init__(self, code: str, n: int = 2, *extra: str) -> None:
        argv = [PY, "-m", "spmd", "launch", "-n", str(n), *extra, "--", PY, "-c", code]
        self.proc = subprocess.Popen(
            argv,
            env=child_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # our signals only, not the terminal's
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def worker_pids(self, n: int, seconds: float = 30.0) -> list[int]:
        """The PIDs the first `n` workers printed ("[i] PID 123"), within `seconds`."""
        deadline = time.monotonic() + seconds
        pids: list[int] = []
        while len(pids) < n:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            self.seen.append(line)
            if " PID " in line:
                pids.append(int(line.split(" PID ")[1]))
        return pids

    def finish(self, seconds: float = 15.0) -> int:
        """The launcher's exit code, within `seconds` (else it is killed and the test fails)."""
        try:
            return self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def kill_everything(self, pids: list[int]) -> None:
        """Cleanup after a failed assertion: no test leaves processes behind."""
        for pid in [self.proc.pid, *pids]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signals", [["SIGKILL"], ["SIGHUP"], ["SIGINT", "SIGINT"]])
def test_workers_die_with_their_launcher(signals):
    """SIGKILL (PR_SET_PDEATHSIG), a closed terminal, and a second Ctrl-C in the grace period."""
    launcher = Launcher(STUBBORN_WORKER)
    pids = launcher.worker_pids(2)
    try:
        for name in signals:
            os.kill(launcher.proc.pid, getattr(signal, name))
            time.sleep(0.5)  # the second Ctrl-C lands in the 5 s grace of the first
        launcher.finish()
        assert wait_gone(pids, 3.0) == [], f"workers left alive after {signals}"
    finally:
        launcher.kill_everything(pids)


def test_sighup_stops_the_workers_and_says_so():
    launcher = Launcher("import os, time; print('PID', os.getpid(), flush=True); time.sleep(120)")
    pids = launcher.worker_pids(2)
    try:
        os.kill(launcher.proc.pid, signal.SIGHUP)
        code = launcher.finish()
        out = "".join(launcher.seen) + "".join(iter_queue(launcher.lines))
        assert code == 128 + signal.SIGHUP
        assert "terminated (SIGHUP); stopped every process." in out
        assert wait_gone(pids, 3.0) == []
    finally:
        launcher.kill_everything(pids)


def iter_queue(q: queue.Queue[str]) -> list[str]:
    """What is in `q` now, without waiting."""
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


EXITS_EARLY = """
import os, time
if os.environ["SPMD_PROCESS_ID"] == "0":
    raise SystemExit(0)  # e.g. `if is_chief: return` before a collective
time.sleep(120)  # process 1 would wait for process 0 forever
"""


def test_a_worker_that_exits_0_early_fails_the_job_and_is_named(capsys):
    start = time.monotonic()
    code = launch([PY, "-c", EXITS_EARLY], 2, exit_grace=1.0, grace_period=1.0)
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 1 and elapsed < 10, (code, elapsed)
    assert "process 0 exited with code 0 while the others ran on" in err
    assert "giving up" in err


RAISES_A_CONFIGURATION_ERROR = """
import spmd, spmd.clusters.launch
info = spmd.initialize()
print("ATTEMPT", spmd.clusters.launch.restart_count(), "SIZE", info.process_count, flush=True)
raise spmd.ConfigurationError("a batch of 7 rows cannot split over 2 replicas")
"""


def test_a_configuration_error_is_not_restarted_nor_shrunk(capfd):
    """Every process raises spmd.ConfigurationError: one attempt, not 3 restarts at each size."""
    start = time.monotonic()
    code = launch(
        [PY, "-c", RAISES_A_CONFIGURATION_ERROR],
        2,
        max_restarts=3,
        min_processes=1,
        env=child_env(),
        grace_period=1.0,
    )
    elapsed = time.monotonic() - start
    out, err = capfd.readouterr()
    assert code == CONFIGURATION_EXIT_CODE, (code, out, err)
    assert out.count("ATTEMPT 0 SIZE 2") == 2 and "ATTEMPT 1" not in out, out
    assert "restarting all" not in err and "relaunching" not in err, err
    assert "it raised spmd.errors.ConfigurationError: a batch of 7 rows cannot split" in err, err
    assert "spmd launch: not restarting: process " in err, err
    assert "raised a configuration error (spmd's ConfigurationError or BatchError" in err, err
    assert elapsed < 45, elapsed


def test_processes_that_end_together_still_succeed():
    code = "import os, time; time.sleep(0.3 * int(os.environ['SPMD_PROCESS_ID']))"
    assert launch([PY, "-c", code], 3, exit_grace=5.0) == 0


FAILS_WITH_A_PEER_CHECK_FAILURE = """
import os, sys, time
if os.environ["SPMD_PROCESS_ID"] == "1":
    time.sleep(1.0)
    raise KeyError("batch_stats")
print("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1", file=sys.stderr, flush=True)
print("F0000 client.h:80] Terminating process because the JAX distributed service detected fatal errors.", file=sys.stderr, flush=True)
time.sleep(120)
"""


def test_the_first_failure_is_summarized_last_and_gloo_lines_hidden(capsys):
    code = cli.main(["launch", "-n", "2", "--", PY, "-c", FAILS_WITH_A_PEER_CHECK_FAILURE])
    err = capsys.readouterr().err
    assert code == 1
    summary = "first failure: process 1 exited with code 1; it raised KeyError: 'batch_stats'."
    assert summary in err
    assert err.index(summary) > err.index("client.h:80] Terminating")  # after the peers' output
    assert "[Gloo] Rank" not in err


def test_verbose_shows_gloo_lines(capsys):
    code = "import sys; print('[Gloo] Rank 0 is connected to 1 peer ranks.', file=sys.stderr)"
    assert cli.main(["launch", "-n", "1", "--verbose", "--", PY, "-c", code]) == 0
    assert "[0] [Gloo] Rank 0 is connected" in capsys.readouterr().err


BLOCKED_WITH_A_WATCHER = """
import time
from spmd.checkpoint.preemption import PreemptionWatcher
watcher = PreemptionWatcher(grace_period=1)
print("READY", flush=True)
time.sleep(60)  # the handler sets a flag; nothing would ever save or exit
"""


def test_sigterm_ends_a_single_process_after_the_grace():
    proc = subprocess.Popen(
        [PY, "-c", BLOCKED_WITH_A_WATCHER],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in proc.stdout:  # ends when the process does: bounded by the test timeout
            if line.strip() == "READY":
                break
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
        assert proc.returncode == 143, out
        assert 0.9 < time.monotonic() - sent < 5
        assert "no save ended the process" in out
    finally:
        if proc.poll() is None:
            proc.kill()
