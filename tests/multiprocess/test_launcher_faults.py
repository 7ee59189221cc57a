"""`spmd launch` under faults: it ends, bounded, takes every worker and its children
with it, and names the first failure. Real processes, real signals, loopback only.

Most tests start `python -m spmd launch` as a child, learn its workers' PIDs
(and their children's) from their output, do something unkind to the launcher
or a worker, and check by PID that no process is left alive. Every wait is
bounded and every process started is killed at the end.
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
from bounds import bound

from spmd._src.cli import main as cli
from spmd._src.clusters.launch import launch
from spmd._src.clusters.launch_results import CONFIGURATION_EXIT_CODE
from spmd._src.clusters.preload import ENV_PRELOAD

from .procs import alive, child_env, wait_gone

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]
WAITS_LONGER = pytest.mark.timeout(
    90
)  # tests that wait up to 30 s for a job, or start jax.distributed

STUBBORN_WORKER = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("PID", os.getpid(), flush=True)
time.sleep(120)
"""


FORKING_WORKER = """
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "60"])
print("PID", os.getpid(), flush=True)
print("GRANDCHILD", child.pid, flush=True)
time.sleep(1.0)
FATE
"""


DISTRIBUTED_WORKER = """
import os, sys, time
import spmd
spmd.initialize(initialization_timeout=30)
me = int(os.environ["SPMD_PROCESS_ID"])
print("PID", os.getpid(), flush=True)
time.sleep(2.0)
if me == VICTIM:
    WHAT
for _ in range(600):
    time.sleep(0.1)
print("SURVIVOR ENDED ALONE", flush=True)
"""


# `spmd launch` started as from a terminal: every signal unblocked and at its default action.
# A test process may have inherited, or had a library set, an ignored or blocked signal
# (ignored and blocked signals survive exec): a launcher started from it would then never
# see the Ctrl-C these tests send. The state it had is in every failure's message.
AS_FROM_A_TERMINAL = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_SETMASK, [])
for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT):
    signal.signal(sig, signal.SIG_DFL)
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def _signal_state() -> str:
    """This process's ignored and blocked signals (/proc), for a failure's message."""
    with open("/proc/self/status") as f:
        return " ".join(line.strip() for line in f if line.startswith(("SigIgn", "SigBlk")))


class Launcher:
    """`spmd launch -n N [extra] -- python -c CODE` as a child, output read by a thread."""

    def __init__(
        self, code: str, n: int = 2, *extra: str, program=None, preload: str | None = None
    ) -> None:
        program = program or [PY, "-c", code]
        argv = [PY, "-c", AS_FROM_A_TERMINAL, "-m", "spmd", "launch", "-n", str(n), *extra]
        argv += ["--", *program]
        self.signals = _signal_state()
        self.start = time.monotonic()
        env = child_env()
        if preload is not None:  # how the workers start: fresh ("0") or forked ("1")
            env[ENV_PRELOAD] = preload
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.pids: list[int] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def collect(self, tag: str, n: int, seconds: float = 40.0) -> list[int]:
        """The first `n` numbers printed after " TAG " (lines already seen count)."""
        deadline = time.monotonic() + seconds

        def found() -> list[int]:
            return [int(x.split(f" {tag} ")[1]) for x in self.seen if f" {tag} " in x][:n]

        while len(found()) < n:
            self.seen.append(self.lines.get(timeout=max(0.01, deadline - time.monotonic())))
        self.pids += found()
        return found()

    def finish(self, seconds: float) -> tuple[int | None, str]:
        """(exit code or None if it was still running after `seconds` with the run's
        headroom, all output)."""
        try:
            code = self.proc.wait(timeout=bound(seconds))
        except subprocess.TimeoutExpired:
            code = None
        time.sleep(0.2)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return code, "".join(self.seen)

    def cleanup(self) -> None:
        """Kills every worker seen and the launcher's group: no test leaves processes behind."""
        for pid in [*self.pids]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


# -- the workers die with their launcher --------------------------------------------


@pytest.mark.parametrize("signals", [["SIGKILL"], ["SIGHUP"], ["SIGINT", "SIGINT"]])
@pytest.mark.parametrize("start", ["fresh", "forked"])
def test_workers_die_with_their_launcher(signals, start):
    """SIGKILL (PR_SET_PDEATHSIG), a closed terminal, and a second Ctrl-C in the grace period;
    workers started fresh, and forked from a preload server (which dies with the launcher)."""
    launcher = Launcher(STUBBORN_WORKER, preload="1" if start == "forked" else "0")
    try:
        pids = launcher.collect("PID", 2, seconds=30)
        for name in signals:
            os.kill(launcher.proc.pid, getattr(signal, name))
            time.sleep(0.5)  # the second Ctrl-C lands in the 5 s grace of the first
        code, out = launcher.finish(15)
        assert code is not None, f"{out[-2000:]}\n(the test process's {launcher.signals})"
        assert wait_gone(pids, bound(3.0)) == [], f"workers left alive after {signals}"
    finally:
        launcher.cleanup()


def test_sighup_stops_the_workers_and_says_so():
    launcher = Launcher("import os, time; print('PID', os.getpid(), flush=True); time.sleep(120)")
    try:
        pids = launcher.collect("PID", 2, seconds=30)
        os.kill(launcher.proc.pid, signal.SIGHUP)
        code, out = launcher.finish(15)
        assert code == 128 + signal.SIGHUP
        assert "terminated (SIGHUP); stopped every process." in out
        assert wait_gone(pids, bound(3.0)) == []
    finally:
        launcher.cleanup()


@WAITS_LONGER
@pytest.mark.parametrize("fate", ["sys.exit(3)", "sys.exit(0)"])
def test_children_of_workers_that_already_exited_are_stopped(fate):
    """Every worker's group is stopped at the end, also that of a worker that already exited."""
    launcher = Launcher(FORKING_WORKER.replace("FATE", fate), 2, "--exit-grace", "3")
    try:
        launcher.collect("PID", 2)
        grandchildren = launcher.collect("GRANDCHILD", 2)
        code, out = launcher.finish(30)
        assert code is not None, out[-2000:]
        assert wait_gone(grandchildren, bound(3.0)) == [], (
            f"children left running after {fate}: {out}"
        )
    finally:
        launcher.cleanup()


@WAITS_LONGER
@pytest.mark.parametrize("start", ["fresh", "forked"])
def test_sigkill_of_the_launcher_takes_the_workers_children_too(start):
    """The keeper stops every worker's group when the launcher dies: its children go too,
    the workers started fresh or forked from a preload server."""
    code = FORKING_WORKER.replace("FATE", "time.sleep(60)")
    launcher = Launcher(code, 2, preload="1" if start == "forked" else "0")
    try:
        workers = launcher.collect("PID", 2)
        grandchildren = launcher.collect("GRANDCHILD", 2)
        os.kill(launcher.proc.pid, signal.SIGKILL)
        launcher.finish(10)
        assert wait_gone(workers, bound(3.0)) == []
        assert wait_gone(grandchildren, bound(3.0)) == [], (
            "a worker's child outlived SIGKILL of spmd launch"
        )
    finally:
        launcher.cleanup()


@WAITS_LONGER
def test_sigkill_of_the_launcher_kills_a_bash_wrapped_worker():
    """`bash -c 'python ...; echo done'` (no exec): the python, a grandchild, goes too."""
    code = FORKING_WORKER.replace("FATE", "time.sleep(60)")
    script = f"{PY} -c '{code}'; echo wrapper-done"
    launcher = Launcher("", 2, program=["bash", "-c", script])
    try:
        workers = launcher.collect("PID", 2)
        launcher.collect("GRANDCHILD", 2)  # so that cleanup kills them too
        os.kill(launcher.proc.pid, signal.SIGKILL)
        launcher.finish(10)
        assert wait_gone(workers, bound(3.0)) == [], (
            "the python under `bash -c` outlived spmd launch"
        )
    finally:
        launcher.cleanup()


# -- a job's end, and its first failure named --------------------------------------


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
import spmd, spmd._src.clusters.launch
info = spmd.initialize()
print("ATTEMPT", spmd._src.clusters.launch.restart_count(), "SIZE", info.process_count, flush=True)
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
    assert "it raised spmd.ConfigurationError: a batch of 7 rows cannot split" in err, err
    assert "spmd launch: not restarting: process " in err, err
    assert "raised a configuration error (spmd's ConfigurationError or BatchError" in err, err
    assert elapsed < 45, elapsed


@pytest.mark.slow  # 6 s of CPU: two interpreters importing spmd each
@pytest.mark.parametrize(
    "variable, value",
    [("SPMD_HANG_TIMEOUT", "abc"), ("SPMD_GLOO_INTERFACE", "no-such-interface0")],
)
def test_a_malformed_spmd_variable_exits_78_naming_it(capfd, variable, value):
    """Raised by initialize before the processes join: still a configuration error (78)."""
    code = launch(
        [PY, "-c", "import spmd; spmd.initialize()"],
        2,
        max_restarts=2,
        env={**child_env(), variable: value},
        grace_period=1.0,
    )
    out, err = capfd.readouterr()
    assert code == CONFIGURATION_EXIT_CODE, (code, out, err)
    assert variable in err and value in err, err
    assert "restarting all" not in err, err
    assert "exited with code 78 (a configuration error)" in err, err


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
from spmd._src.checkpoint.preemption import PreemptionWatcher
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


@WAITS_LONGER
@pytest.mark.parametrize("victim", [1, 0])
def test_sys_exit_3_mid_run_ends_the_job_fast_with_its_code(victim):
    """sys.exit(3) under jax.distributed ends the job within seconds, with code 3, naming it.

    A SystemExit reaches no excepthook: initialize() wraps sys.exit to record
    the code, and the exit handler ends the process with it, telling its peers,
    instead of waiting in the exit barrier. Process 0 (the coordinator) too.
    """
    code = DISTRIBUTED_WORKER.replace("VICTIM", str(victim)).replace("WHAT", "sys.exit(3)")
    launcher = Launcher(code, 2, "--devices-per-process", "1")
    try:
        launcher.collect("PID", 2, seconds=60)
        t0 = time.monotonic()
        rc, out = launcher.finish(25)
        elapsed = time.monotonic() - t0
        assert rc is not None, (
            f"the job still ran {elapsed:.0f} s after sys.exit(3):\n{out[-2000:]}"
        )
        assert rc == 3, out[-2000:]
        assert "reached the end of its program" not in out, out[-2000:]
        summary = [line for line in out.splitlines() if "first failure" in line]
        assert summary and f"process {victim} exited with code 3" in summary[-1], out[-2000:]
        assert f"spmd: ending: process {victim} failed (exited with code 3)" in out, out[-2000:]
    finally:
        launcher.cleanup()


@WAITS_LONGER
def test_process_0_raising_is_named_as_the_first_failure():
    """Process 0 lingers after reporting, so its peer ends first; the peer is not blamed."""
    code = DISTRIBUTED_WORKER.replace("VICTIM", "0").replace(
        "WHAT", 'raise ValueError("marker-from-process-0")'
    )
    launcher = Launcher(code, 2, "--devices-per-process", "1")
    try:
        launcher.collect("PID", 2, seconds=60)
        rc, out = launcher.finish(30)
        assert rc is not None, out[-2000:]
        summary = [line for line in out.splitlines() if "first failure" in line]
        assert summary, out[-2000:]
        assert "process 0" in summary[-1], summary[-1]
        assert "ValueError: marker-from-process-0" in summary[-1], summary[-1]
        assert "spmd: ending: process 0 failed (ValueError: marker-from-process-0)" in out
        assert rc == 1, out[-2000:]
    finally:
        launcher.cleanup()
