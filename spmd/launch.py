"""`spmd launch`: start N local processes of one program as a cluster, and restart them."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from spmd.cluster import (
    ENV_COORDINATOR_ADDRESS,
    ENV_DEVICES_PER_PROCESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_RESTART_COUNT,
    TF_CONFIG,
)
from spmd.errors import ConfigurationError, message, received

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "GroupResult",
    "ProcessResult",
    "free_port",
    "launch",
    "restart_count",
    "run_group",
]

# A process that exits with this code was preempted (it saved what it needs and
# stopped on purpose); `launch` restarts the group without counting it as a failure.
PREEMPTED_EXIT_CODE = 42
TIMEOUT_EXIT_CODE = 124  # what `launch` returns when its timeout ends the run, as timeout(1)
GRACE_PERIOD = 5.0  # seconds between SIGTERM and SIGKILL when stopping processes
_POLL = 0.05  # seconds between checks of the processes

OnLine = Callable[[int, str, str], None]  # (process index, "stdout" | "stderr", line)


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """How one process of a group ended.

    Attributes:
      process_index: its SPMD_PROCESS_ID.
      returncode: as `subprocess`: the exit code, or minus the signal that ended it.
      stdout: what it printed, when the group was run with `capture=True`.
      stderr: what it printed to stderr, likewise.
    """

    process_index: int
    returncode: int
    stdout: str = ""
    stderr: str = ""

    @property
    def exit_code(self) -> int:
        """The exit code as a shell reports it: 128 + N for signal N."""
        return self.returncode if self.returncode >= 0 else 128 - self.returncode

    def describe(self) -> str:
        """E.g. "process 1 exited with code 3" or "... was killed by SIGKILL"."""
        if self.returncode < 0:
            return f"process {self.process_index} was killed by {_signal_name(-self.returncode)}"
        if self.returncode == PREEMPTED_EXIT_CODE:
            return f"process {self.process_index} was preempted (exit code {PREEMPTED_EXIT_CODE})"
        return f"process {self.process_index} exited with code {self.returncode}"


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """How a group of processes ended.

    Attributes:
      processes: one ProcessResult per process, in index order.
      failed: the processes that failed on their own (before the others were
        stopped), in index order; empty if none did.
      timed_out: whether the timeout stopped the group.
    """

    processes: tuple[ProcessResult, ...]
    failed: tuple[int, ...] = ()
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """Whether every process exited with code 0."""
        return not self.timed_out and all(p.returncode == 0 for p in self.processes)

    @property
    def preempted(self) -> bool:
        """Whether a process that failed on its own exited with PREEMPTED_EXIT_CODE."""
        return any(self.processes[i].returncode == PREEMPTED_EXIT_CODE for i in self.failed)

    @property
    def exit_code(self) -> int:
        """0, the first failed process's shell exit code, or TIMEOUT_EXIT_CODE."""
        if self.failed:
            return self.processes[self.failed[0]].exit_code
        if self.timed_out:
            return TIMEOUT_EXIT_CODE
        return max((p.exit_code for p in self.processes), default=0)

    def describe(self) -> str:
        """One line saying how the group ended."""
        if self.failed:
            failures = "; ".join(self.processes[i].describe() for i in self.failed)
            return f"{failures}; stopped the other processes"
        if self.timed_out:
            return "timed out; stopped every process"
        return "every process exited with code 0" if self.ok else "a process failed"


def _signal_name(number: int) -> str:
    """SIGTERM for 15, or 'signal 99' for a number with no name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port on `host` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def restart_count() -> int:
    """Which attempt this is under `spmd launch`: 0 first, 1 after one restart, ...

    Outside `spmd launch` (SPMD_RESTART_COUNT unset) this is 0.
    """
    return int(os.environ.get(ENV_RESTART_COUNT, "0") or 0)


def process_env(
    base: Mapping[str, str],
    index: int,
    num_processes: int,
    coordinator: str,
    devices_per_process: int | None,
    restart: int,
) -> dict[str, str]:
    """The environment of process `index`: `base` plus what `spmd.initialize()` reads.

    TF_CONFIG is removed: it comes before the SPMD_* variables in the resolution
    order, and a TF_CONFIG inherited from the shell would override the launcher.
    """
    env = {k: v for k, v in base.items() if k != TF_CONFIG}
    env.pop(ENV_DEVICES_PER_PROCESS, None)
    env.update(
        {
            ENV_COORDINATOR_ADDRESS: coordinator,
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(index),
            ENV_RESTART_COUNT: str(restart),
            "PYTHONUNBUFFERED": "1",  # so that output streams live
        }
    )
    if devices_per_process is not None:
        env[ENV_DEVICES_PER_PROCESS] = str(devices_per_process)
    return env


def _pump(
    stream: IO[bytes], index: int, name: str, on_line: OnLine | None, sink: list[str] | None
) -> None:
    """Reads `stream` line by line until EOF, passing each line on."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        if sink is not None:
            sink.append(line)
        if on_line is not None:
            on_line(index, name, line)
    stream.close()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Sends `sig` to the process group `proc` leads (its children too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace_period: float) -> None:
    """SIGTERM to every running process, then SIGKILL to those still running after the grace."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
    for p in running:
        with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in the kernel: give up
            p.wait(timeout=grace_period)


def _watch(
    procs: Sequence[subprocess.Popen[bytes]], deadline: float | None
) -> tuple[tuple[int, ...], bool]:
    """Waits until all succeed, one fails, or the deadline; returns (failed, timed_out)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = tuple(i for i, c in enumerate(codes) if c not in (None, 0))
        if failed or all(c == 0 for c in codes):
            return failed, False
        if deadline is not None and time.monotonic() >= deadline:
            return (), True
        time.sleep(_POLL)


def run_group(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    restart: int = 0,
    on_line: OnLine | None = None,
    capture: bool = False,
    grace_period: float = GRACE_PERIOD,
) -> GroupResult:
    """Runs one attempt: N processes of `command` as a cluster on a free loopback port.

    As soon as one process fails the others are stopped (SIGTERM, then SIGKILL
    after `grace_period`), so a failure never leaves the group hanging.

    Args:
      command: the program and its arguments, e.g. ["python", "train.py"].
      num_processes: how many processes to start.
      devices_per_process: simulated CPU devices per process (SPMD_DEVICES_PER_PROCESS).
      env: variables to set on top of this process's environment.
      timeout: seconds after which every process is stopped (None: no limit).
      restart: the value of SPMD_RESTART_COUNT.
      on_line: called with (process index, "stdout" | "stderr", line) for each
        line, from reader threads, as the line arrives.
      capture: whether to keep the output in the ProcessResults.
      grace_period: seconds between SIGTERM and SIGKILL.

    Returns:
      A GroupResult.
    """
    coordinator = f"127.0.0.1:{free_port()}"
    base = {**os.environ, **(env or {})}
    procs: list[subprocess.Popen[bytes]] = []
    sinks: list[list[str]] = [[] for _ in range(2 * num_processes)]  # stdout, stderr of each
    threads: list[threading.Thread] = []
    failed: tuple[int, ...] = ()
    timed_out = False
    try:
        for i in range(num_processes):
            child_env = process_env(
                base, i, num_processes, coordinator, devices_per_process, restart
            )
            procs.append(_start(command, child_env))
            streams = (("stdout", procs[i].stdout), ("stderr", procs[i].stderr))
            for k, (name, stream) in enumerate(streams):
                sink = sinks[2 * i + k] if capture else None
                args = (stream, i, name, on_line, sink)
                threads.append(threading.Thread(target=_pump, args=args, daemon=True))
                threads[-1].start()
        deadline = None if timeout is None else time.monotonic() + timeout
        failed, timed_out = _watch(procs, deadline)
    finally:
        _stop(procs, grace_period)
        join_deadline = time.monotonic() + grace_period  # a grandchild holding a pipe open
        for t in threads:  # must not hang us: the readers are daemons, left behind
            t.join(timeout=max(0.0, join_deadline - time.monotonic()))
    return GroupResult(
        tuple(
            ProcessResult(i, _returncode(p), "".join(sinks[2 * i]), "".join(sinks[2 * i + 1]))
            for i, p in enumerate(procs)
        ),
        failed,
        timed_out,
    )


def _returncode(proc: subprocess.Popen[bytes]) -> int:
    """The process's return code; -SIGKILL for one that would not even die of SIGKILL."""
    return proc.returncode if proc.returncode is not None else -signal.SIGKILL


def _start(command: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Starts one process of the group, in a process group of its own."""
    try:
        return subprocess.Popen(
            list(command),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # so that stopping it stops its children too
        )
    except OSError as e:
        raise ConfigurationError(
            message(
                "The command to launch must be an executable program and its arguments.",
                received(command=list(command), error=str(e)),
                "check the program name and PATH, e.g. spmd launch -n 2 -- python train.py.",
            )
        ) from e


def _check_launch_args(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int | None,
    restarts: dict[str, int],
) -> None:
    """Checks launch()'s arguments eagerly, naming the bad one."""
    checks = {"num_processes": (num_processes, 1), **{k: (v, 0) for k, v in restarts.items()}}
    if devices_per_process is not None:
        checks["devices_per_process"] = (devices_per_process, 1)
    for name, (value, low) in checks.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigurationError(
                message(
                    f"{name} must be an integer >= {low}.",
                    received(**{name: value}),
                    f"pass e.g. {name}={max(low, 2)}.",
                )
            )
    if not command or not all(isinstance(c, str) for c in command):
        raise ConfigurationError(
            message(
                "The command must be a non-empty list of strings.",
                received(command=command),
                'pass e.g. ["python", "train.py"] (on the command line: -- python train.py).',
            )
        )


class _Printer:
    """Writes the processes' lines prefixed with their index, one whole line at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, index: int, stream: str, line: str) -> None:
        out = sys.stdout if stream == "stdout" else sys.stderr
        text = f"[{index}] {line}" if line.endswith("\n") else f"[{index}] {line}\n"
        with self._lock:
            out.write(text)
            out.flush()


def _report(text: str) -> None:
    """Tells the user what the launcher did, on stderr."""
    print(f"spmd launch: {text}", file=sys.stderr, flush=True)


class _TerminatedError(KeyboardInterrupt):
    """The launcher itself got SIGTERM: stop the processes as for Ctrl-C."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _TerminatedError()


def launch(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int | None = None,
    max_restarts: int = 0,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    *,
    max_preemptions: int = 10,
    grace_period: float = GRACE_PERIOD,
) -> int:
    """Runs `command` as `num_processes` local processes that form one spmd cluster.

    Every process gets SPMD_COORDINATOR_ADDRESS (127.0.0.1 and a free port, new for
    each attempt), SPMD_NUM_PROCESSES, SPMD_PROCESS_ID, SPMD_RESTART_COUNT and, if
    given, SPMD_DEVICES_PER_PROCESS, which `spmd.initialize()` reads. Output lines
    are streamed live, prefixed with the process index ("[0] ..."). As soon as one
    process fails, the others are stopped and the failure is reported; the whole
    group is then restarted up to `max_restarts` times. A process exiting with
    PREEMPTED_EXIT_CODE restarts the group without using up `max_restarts`
    (up to `max_preemptions` times).

    Args:
      command: the program and its arguments, e.g. ["python", "train.py"].
      num_processes: how many processes to start.
      devices_per_process: simulated CPU devices per process.
      max_restarts: how many times to restart the group after a failure.
      timeout: seconds for the whole launch, restarts included (None: no limit).
      env: variables to set on top of this process's environment.
      max_preemptions: how many times to restart the group after a preemption.
      grace_period: seconds between SIGTERM and SIGKILL when stopping processes.

    Returns:
      0 if every process of an attempt succeeded; else the failed process's exit
      code (128 + N for signal N), or TIMEOUT_EXIT_CODE (124) on timeout.

    Raises:
      ConfigurationError: if an argument is malformed or the program cannot start.

    Example:
      >>> launch(["python", "train.py"], num_processes=2, devices_per_process=4)  # doctest: +SKIP
      0
    """
    budget = {"max_restarts": max_restarts, "max_preemptions": max_preemptions}
    _check_launch_args(command, num_processes, devices_per_process, budget)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main else None
    try:
        return _attempts(
            command, num_processes, devices_per_process, budget, timeout, env, grace_period
        )
    except _TerminatedError:
        _report("terminated (SIGTERM); stopped every process.")
        return 128 + signal.SIGTERM
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _attempts(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int | None,
    budget: dict[str, int],
    timeout: float | None,
    env: Mapping[str, str] | None,
    grace_period: float,
) -> int:
    """Runs attempts until one succeeds, the budgets run out, or the deadline passes."""
    deadline = None if timeout is None else time.monotonic() + timeout
    used = {"max_restarts": 0, "max_preemptions": 0}
    printer = _Printer()
    for attempt in range(sum(budget.values()) + 1):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            _report(f"timed out after {timeout:g} s before restarting.")
            return TIMEOUT_EXIT_CODE
        result = run_group(
            command,
            num_processes,
            devices_per_process=devices_per_process,
            env=env,
            timeout=left,
            restart=attempt,
            on_line=printer,
            grace_period=grace_period,
        )
        if result.ok:
            return 0
        if result.timed_out:
            _report(f"timed out after {timeout:g} s; stopped every process.")
            return TIMEOUT_EXIT_CODE
        _report(result.describe() + ".")
        kind = "max_preemptions" if result.preempted else "max_restarts"
        if used[kind] >= budget[kind]:
            _report(f"giving up: no restarts left ({kind}={budget[kind]}).")
            return result.exit_code
        used[kind] += 1
        why = "preemption" if result.preempted else "restart"
        _report(f"restarting all {num_processes} processes ({why} {used[kind]} of {budget[kind]}).")
    return result.exit_code
