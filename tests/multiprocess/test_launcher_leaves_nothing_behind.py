"""`spmd launch` under faults: no worker nor its child is left, the first failure is named.

Real processes, real signals, loopback only (issue 11 items 5, 6 and 9). Every
wait is bounded and every process started is killed at the end.
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

from .procs import alive, child_env, wait_gone

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]

# A worker that starts a child of its own (a data loader, a `bash -c` without exec,
# a sidecar), prints both PIDs, then does what FATE says.
FORKING_WORKER = """
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "60"])
print("PID", os.getpid(), flush=True)
print("GRANDCHILD", child.pid, flush=True)
time.sleep(1.0)
FATE
"""

# Under jax.distributed: process VICTIM does WHAT, the other waits in Python.
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


class Launcher:
    """`spmd launch -n N [extra] -- python -c CODE` as a child, output read by a thread."""

    def __init__(self, code: str, n: int = 2, *extra: str, program=None) -> None:
        program = program or [PY, "-c", code]
        argv = [PY, "-m", "spmd", "launch", "-n", str(n), *extra, "--", *program]
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            argv,
            env=child_env(),
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
        """(exit code or None if it was still running after `seconds`, all output)."""
        try:
            code = self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            code = None
        time.sleep(0.2)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return code, "".join(self.seen)

    def cleanup(self) -> None:
        for pid in [*self.pids]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.mark.parametrize("fate", ["sys.exit(3)", "sys.exit(0)"])
def test_children_of_workers_that_already_exited_are_stopped(fate):
    """Every worker's group is stopped at the end, also that of a worker that already exited."""
    launcher = Launcher(FORKING_WORKER.replace("FATE", fate), 2, "--exit-grace", "3")
    try:
        launcher.collect("PID", 2)
        grandchildren = launcher.collect("GRANDCHILD", 2)
        code, out = launcher.finish(30)
        assert code is not None, out[-2000:]
        assert wait_gone(grandchildren, 3.0) == [], f"children left running after {fate}: {out}"
    finally:
        launcher.cleanup()


def test_sigkill_of_the_launcher_takes_the_workers_children_too():
    """The keeper stops every worker's group when the launcher dies: its children go too."""
    launcher = Launcher(FORKING_WORKER.replace("FATE", "time.sleep(60)"), 2)
    try:
        workers = launcher.collect("PID", 2)
        grandchildren = launcher.collect("GRANDCHILD", 2)
        os.kill(launcher.proc.pid, signal.SIGKILL)
        launcher.finish(10)
        assert wait_gone(workers, 3.0) == []
        assert wait_gone(grandchildren, 3.0) == [], (
            "a worker's child outlived SIGKILL of spmd launch"
        )
    finally:
        launcher.cleanup()


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
        assert wait_gone(workers, 3.0) == [], "the python under `bash -c` outlived spmd launch"
    finally:
        launcher.cleanup()


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
