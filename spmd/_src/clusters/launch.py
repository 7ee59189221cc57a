"""`spmd launch`: start N local processes of one program as a cluster, and restart them."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from spmd._src.clusters import preload
from spmd._src.clusters.hang_watch import check_hang_timeout
from spmd._src.clusters.launch_keeper import Keeper, group_alive, signal_groups
from spmd._src.clusters.launch_results import (
    EXIT_GRACE,
    FOLLOWER_LINE,
    GRACE_PERIOD,
    PREEMPTED_EXIT_CODE,
    TIMEOUT_EXIT_CODE,
    GroupResult,
    Printer,
    ProcessResult,
    not_worth_restarting,
    signal_name,
    summary,
)
from spmd._src.clusters.spec import (
    ENV_COORDINATOR_ADDRESS,
    ENV_DEVICES_PER_PROCESS,
    ENV_HANG_TIMEOUT,
    ENV_LAUNCH_TF_CONFIG,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_RESTART_COUNT,
    TF_CONFIG,
    check_int,
)
from spmd._src.errors import ConfigurationError, message, received

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "GroupResult",
    "ProcessResult",
    "free_port",
    "launch",
    "restart_count",
    "run_group",
]

_POLL = 0.05  # seconds between checks of the processes
# Seconds to wait, once processes failed, for the one they say they end for to end too.
_LEADER_WAIT = 3.0
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies

OnLine = Callable[[int, str, str], None]  # (process index, "stdout" | "stderr", line)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # a closed terminal sends SIGHUP


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port on `host` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def restart_count() -> int:
    """Which attempt this is under `spmd launch`: 0 first, 1 after one restart, ...

    Outside `spmd launch` (SPMD_RESTART_COUNT unset) this is 0.

    Raises:
      ClusterError: SPMD_RESTART_COUNT is set to something else than a count.
    """
    value = os.environ.get(ENV_RESTART_COUNT, "").strip()
    fix = (
        f"unset {ENV_RESTART_COUNT}: spmd launch sets it (0 on the first attempt, then 1, 2, ...)."
    )
    return check_int(value, ENV_RESTART_COUNT, 0, None, fix) if value else 0


def process_env(
    base: Mapping[str, str],
    index: int,
    num_processes: int,
    coordinator: str,
    devices_per_process: int | None,
    restart: int,
    workers: Sequence[str] | None = None,
) -> dict[str, str]:
    """The environment of process `index`: `base` plus what `spmd.initialize()` reads.

    An inherited TF_CONFIG is replaced: it would describe another cluster than
    the launcher's. With `workers` (every process's "host:port", the
    coordinator's first) the process gets a TF_CONFIG of its own, task
    `worker` `index`, as a TF program reads it for its task index; spmd itself
    resolves from the SPMD_* variables while TF_CONFIG is that text
    (SPMD_LAUNCH_TF_CONFIG), so a TF_CONFIG the program sets for itself wins.
    """
    env = {k: v for k, v in base.items() if k not in (TF_CONFIG, ENV_LAUNCH_TF_CONFIG)}
    env.pop(ENV_DEVICES_PER_PROCESS, None)
    if workers is not None:
        config = {"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}}
        env[TF_CONFIG] = env[ENV_LAUNCH_TF_CONFIG] = json.dumps(config)
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
    stream: IO[bytes],
    index: int,
    name: str,
    on_line: OnLine | None,
    sink: list[str] | None,
    closed: dict[int, float],
) -> None:
    """Reads `stream` line by line until EOF, passing each line on; notes when it closed."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        if sink is not None:
            sink.append(line)
        if on_line is not None:
            on_line(index, name, line)
    stream.close()
    if name == "stderr":  # all it said is read; the process ended (about) now
        closed.setdefault(index, time.monotonic())


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace_period: float) -> None:
    """SIGTERM to every process's group, then SIGKILL to the groups alive after the grace.

    Every group is signalled, also that of a process that already exited: its
    children (a data loader, the program under `bash -c`) would live on
    otherwise. A second interrupt (Ctrl-C, SIGTERM, SIGHUP) during the grace
    period kills every group at once rather than leaving them behind.
    """
    running = [p for p in procs if p.poll() is None]
    groups = [p.pid for p in procs]  # each process leads a group of its own
    try:
        signal_groups(groups, signal.SIGTERM)
        deadline = time.monotonic() + grace_period
        for p in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        while time.monotonic() < deadline and any(group_alive(g) for g in groups):
            time.sleep(_POLL)
    finally:  # also on a second interrupt: nobody is left alive
        signal_groups([g for g in groups if group_alive(g)], signal.SIGKILL)
        for p in running:
            with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in the kernel: give up
                p.wait(timeout=grace_period)


@dataclasses.dataclass
class _Outcome:
    """What `_watch` saw: who failed on their own, a timeout, who exited early."""

    failed: tuple[int, ...] = ()
    timed_out: bool = False
    exited_early: tuple[int, ...] = ()


def _waiting_for_leader(
    failed: tuple[int, ...],
    codes: list[int | None],
    followers: Mapping[int, int],
    closed: Mapping[int, float],
) -> bool:
    """Whether to look again before naming the first failure.

    Yes while a failed process's output is not all read (it may say below that
    it ended because of a peer), or while every failed process ended because
    of a peer that is still running (process 0 lingers so that its peers can
    read its notice).
    """
    if any(i not in closed for i in failed):
        return True
    if not all(i in followers for i in failed):
        return False
    leaders = {followers[i] for i in failed}
    return any(0 <= k < len(codes) and codes[k] is None for k in leaders)


def _watch(
    procs: Sequence[subprocess.Popen[bytes]],
    deadline: float | None,
    exit_grace: float,
    seen: tuple[Mapping[int, int], Mapping[int, float]],
) -> _Outcome:
    """Waits until all succeed, one fails, one exits early, or the deadline passes.

    `seen` is (followers, closed): which processes said they end because a
    peer failed (and which), and when each one's output ended.
    """
    followers, closed = seen
    first_exit: float | None = None  # when the first process exited with code 0
    first_failure: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        failed = tuple(i for i, c in enumerate(codes) if c not in (None, 0))
        now = time.monotonic()
        if failed:
            first_failure = now if first_failure is None else first_failure
            if now - first_failure >= _LEADER_WAIT or not _waiting_for_leader(
                failed, codes, followers, closed
            ):
                return _Outcome(failed=failed)
        elif all(c == 0 for c in codes):
            return _Outcome()
        if first_exit is None and 0 in codes:
            first_exit = now
        if first_exit is not None and now - first_exit >= exit_grace:
            return _Outcome(exited_early=tuple(i for i, c in enumerate(codes) if c == 0))
        if deadline is not None and now >= deadline:
            return _Outcome(timed_out=True)
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
    exit_grace: float = EXIT_GRACE,
) -> GroupResult:
    """Runs one attempt: N processes of `command` as a cluster on a free loopback port.

    As soon as one process fails the others are stopped (SIGTERM, then SIGKILL
    after `grace_period`), so a failure never leaves the group hanging; so are
    they when one process exited with code 0 and the others have not ended
    `exit_grace` seconds later. Each process is in a process group of its own,
    and every group is stopped at the end, also that of a process that already
    exited. Each process gets SIGKILL if this process dies (Linux:
    PR_SET_PDEATHSIG), and a keeper process (spmd._src.clusters.launch_keeper) then stops
    every group, so that no worker nor a child of one outlives the launcher,
    whichever way it ends.

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
      exit_grace: seconds the others have to end after one exits with code 0.

    Returns:
      A GroupResult.
    """
    coordinator = f"127.0.0.1:{free_port()}"
    workers = [coordinator] + [f"127.0.0.1:{free_port()}" for _ in range(num_processes - 1)]
    base = {**os.environ, **(env or {})}
    procs: list[subprocess.Popen[bytes]] = []
    sinks: list[list[str]] = [[] for _ in range(2 * num_processes)]  # stdout, stderr of each
    threads: list[threading.Thread] = []
    closed: dict[int, float] = {}  # when each process's first stream closed: its end
    outcome = _Outcome()
    followers: dict[int, int] = {}  # process -> the peer it says it ends for
    on_line = _noting_followers(followers, on_line)
    keeper = Keeper(grace_period)  # stops the groups if this process dies, however
    try:
        for i in range(num_processes):
            child_env = process_env(
                base, i, num_processes, coordinator, devices_per_process, restart, workers
            )
            procs.append(_start(command, child_env))
            keeper.watch(procs[i].pid)
            threads += _readers(procs[i], i, on_line, sinks if capture else None, closed)
        deadline = None if timeout is None else time.monotonic() + timeout
        outcome = _watch(procs, deadline, exit_grace, (followers, closed))
    finally:
        _stop(procs, grace_period)
        keeper.release()
        _join_readers(threads, grace_period)
    return _group_result(procs, sinks, outcome, followers, closed)


def _readers(
    proc: subprocess.Popen[bytes],
    index: int,
    on_line: OnLine,
    sinks: list[list[str]] | None,
    closed: dict[int, float],
) -> list[threading.Thread]:
    """Started daemon threads that read process `index`'s stdout and stderr line by line
    (into `sinks[2 * index]` and `sinks[2 * index + 1]` when capturing)."""
    threads = []
    for k, (name, stream) in enumerate((("stdout", proc.stdout), ("stderr", proc.stderr))):
        sink = sinks[2 * index + k] if sinks is not None else None
        args = (stream, index, name, on_line, sink, closed)
        threads.append(threading.Thread(target=_pump, args=args, daemon=True))
        threads[-1].start()
    return threads


def _join_readers(threads: list[threading.Thread], grace_period: float) -> None:
    """Waits for the readers at most `grace_period` in all: a grandchild holding a pipe
    open must not hang the launcher (the readers are daemons, left behind)."""
    deadline = time.monotonic() + grace_period
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))


def _group_result(
    procs: list[subprocess.Popen[bytes]],
    sinks: list[list[str]],
    outcome: _Outcome,
    followers: dict[int, int],
    closed: dict[int, float],
) -> GroupResult:
    """The attempt's result; the failed processes ordered by who failed first (a process
    that ended because a peer failed after the processes that did not)."""
    return GroupResult(
        tuple(
            ProcessResult(i, _returncode(p), "".join(sinks[2 * i]), "".join(sinks[2 * i + 1]))
            for i, p in enumerate(procs)
        ),
        tuple(sorted(outcome.failed, key=lambda i: (i in followers, closed.get(i, math.inf), i))),
        outcome.timed_out,
        outcome.exited_early,
    )


def _noting_followers(followers: dict[int, int], on_line: OnLine | None) -> OnLine:
    """`on_line`, noting in `followers` each process that ends because a peer failed."""

    def note(index: int, name: str, line: str) -> None:
        match = FOLLOWER_LINE.match(line)
        if name == "stderr" and match:
            followers.setdefault(index, int(match[1]))
        if on_line is not None:
            on_line(index, name, line)

    return note


def _returncode(proc: subprocess.Popen[bytes]) -> int:
    """The process's return code; -SIGKILL for one that would not even die of SIGKILL."""
    return proc.returncode if proc.returncode is not None else -signal.SIGKILL


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get SIGKILL when the launcher dies (Linux only).

    The libc function is looked up here, in the parent: the child between fork
    and exec only calls it, and exits at once if the parent is already gone.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl: do not outlive it
            os._exit(1)

    return preexec


def _start(
    command: Sequence[str], env: dict[str, str]
) -> subprocess.Popen[bytes] | preload.ForkedProcess:
    """Starts one process of the group, in a process group of its own, dying with us:
    forked from a warm interpreter where SPMD_LAUNCH_PRELOAD asks for one and the
    command is a Python program it can run (spmd._src.clusters.preload), else fresh."""
    forked = preload.start(command, env)
    if forked is not None:
        return forked
    try:
        return subprocess.Popen(
            list(command),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # so that stopping it stops its children too
            preexec_fn=_die_with_parent(),  # noqa: PLW1509 (no locks taken in the child)
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


def _report(text: str) -> None:
    """Tells the user what the launcher did, on stderr."""
    print(f"spmd launch: {text}", file=sys.stderr, flush=True)


class _TerminatedError(KeyboardInterrupt):
    """The launcher itself got SIGTERM or SIGHUP: stop the processes as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame: object) -> None:
    raise _TerminatedError(signum)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """How `launch` runs each attempt."""

    num_processes: int
    devices_per_process: int | None
    timeout: float | None
    env: Mapping[str, str] | None
    grace_period: float
    exit_grace: float
    verbose: bool
    min_processes: int


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
    exit_grace: float = EXIT_GRACE,
    verbose: bool = False,
    min_processes: int | None = None,
    hang_timeout: float | None = None,
) -> int:
    """Runs `command` as `num_processes` local processes that form one spmd cluster.

    Every process gets SPMD_COORDINATOR_ADDRESS (127.0.0.1 and a free port, new for
    each attempt), SPMD_NUM_PROCESSES, SPMD_PROCESS_ID, SPMD_RESTART_COUNT and, if
    given, SPMD_DEVICES_PER_PROCESS, which `spmd.initialize()` reads. Output lines
    are streamed live, prefixed with the process index ("[0] ..."). As soon as one
    process fails, the others are stopped and the failure is reported, ending
    with a summary of the first failure (its exception type and message); the
    whole group is then restarted up to `max_restarts` times. A process exiting
    with PREEMPTED_EXIT_CODE restarts the group without using up `max_restarts`
    (up to `max_preemptions` times). A process that exits with code 0 while the
    others still run `exit_grace` seconds later fails the attempt. Ctrl-C,
    SIGTERM or SIGHUP stop every process (a second one kills them at once);
    SIGKILL of the launcher kills them and their children too (Linux; a keeper
    process, spmd._src.clusters.launch_keeper, stops every worker's process group).

    Elastic: with `min_processes` below `num_processes`, a failure with no
    restarts left relaunches the job on one process fewer (down to
    `min_processes`), with `max_restarts` restarts again at that size. The
    program resumes from its checkpoint on the smaller mesh; SPMD_NUM_PROCESSES
    says how many processes this attempt has. Neither happens when every
    process that failed on its own exited with CONFIGURATION_EXIT_CODE (78:
    spmd's ConfigurationError or BatchError, which a restart raises again).

    Args:
      command: the program and its arguments, e.g. ["python", "train.py"].
      num_processes: how many processes to start.
      devices_per_process: simulated CPU devices per process.
      max_restarts: how many times to restart the group after a failure.
      timeout: seconds for the whole launch, restarts included (None: no limit).
      env: variables to set on top of this process's environment.
      max_preemptions: how many times to restart the group after a preemption.
      grace_period: seconds between SIGTERM and SIGKILL when stopping processes.
      exit_grace: seconds the other processes have to end after one exits with 0.
      verbose: also show gloo's "[Gloo] Rank N is connected" lines.
      min_processes: the fewest processes to relaunch the job on once the
        restarts are used up (None: `num_processes`, never fewer).
      hang_timeout: seconds a process may go without a step before every
        process ends naming it (SPMD_HANG_TIMEOUT; None: `spmd.initialize`'s
        default rule). The attempt then fails with HANG_EXIT_CODE (75), which
        is restarted as any failure and returned once the restarts are used up.

    Returns:
      0 if every process of an attempt succeeded; else the failed process's exit
      code (128 + N for signal N), 1 for a process that exited early,
      TIMEOUT_EXIT_CODE (124) on timeout, or 128 + N when signal N stopped it.

    Raises:
      ConfigurationError: if an argument is malformed or the program cannot start.

    Example:
      >>> launch(["python", "train.py"], num_processes=2, devices_per_process=4)  # doctest: +SKIP
      0
    """
    budget = {"max_restarts": max_restarts, "max_preemptions": max_preemptions}
    _check_launch_args(command, num_processes, devices_per_process, budget)
    fewest = check_min_processes(min_processes, num_processes)
    if hang_timeout is not None:
        hang = check_hang_timeout(hang_timeout)
        env = {**(env or {}), ENV_HANG_TIMEOUT: repr(hang)}
    settings = _Settings(
        num_processes, devices_per_process, timeout, env, grace_period, exit_grace, verbose, fewest
    )
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _raise_terminated) for s in _STOP_SIGNALS} if in_main else {}
    try:
        return _attempts(command, settings, budget)
    except _TerminatedError as e:
        _report(f"terminated ({signal_name(e.signum)}); stopped every process.")
        return 128 + e.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _attempts(command: Sequence[str], settings: _Settings, budget: dict[str, int]) -> int:
    """Runs attempts until one succeeds, the budgets run out, or the deadline passes."""
    timeout = settings.timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    used = {"max_restarts": 0, "max_preemptions": 0}
    printer = Printer(settings.verbose)
    size, attempt = settings.num_processes, 0
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            _report(f"timed out after {timeout:g} s before restarting.")
            return TIMEOUT_EXIT_CODE
        printer.forget()
        result = run_group(
            command,
            size,
            devices_per_process=settings.devices_per_process,
            env=settings.env,
            timeout=left,
            restart=attempt,
            on_line=printer,
            grace_period=settings.grace_period,
            exit_grace=settings.exit_grace,
        )
        if result.ok:
            return 0
        if result.timed_out:
            _report(f"timed out after {timeout:g} s; stopped every process.")
            return TIMEOUT_EXIT_CODE
        _report(result.describe() + ".")
        first = summary(result, printer)
        if first is not None:
            _report(first)
        if (why := not_worth_restarting(result, printer)) is not None:
            _report(why)
            return result.exit_code
        size = _next_size(result, size, settings.min_processes, budget, used)
        if size == 0:
            return result.exit_code
        attempt += 1


def _next_size(
    result: GroupResult, size: int, fewest: int, budget: dict[str, int], used: dict[str, int]
) -> int:
    """How many processes the next attempt has (0: none, give up); counts the restart.

    A failure with no restarts left shrinks the job by one process while it has
    more than `fewest`, with a fresh restart budget; a preemption never does.
    """
    kind = "max_preemptions" if result.preempted else "max_restarts"
    if used[kind] < budget[kind]:
        used[kind] += 1
        why = "preemption" if result.preempted else "restart"
        _report(f"restarting all {size} processes ({why} {used[kind]} of {budget[kind]}).")
        return size
    if kind == "max_restarts" and size > fewest:
        used[kind] = 0
        _report(
            f"no restarts left at {size} processes (max_restarts={budget[kind]}); relaunching "
            f"on {size - 1} (min_processes={fewest}): the job resumes from its checkpoint."
        )
        return size - 1
    _report(f"giving up: no restarts left ({kind}={budget[kind]}).")
    return 0


def check_min_processes(min_processes: int | None, num_processes: int) -> int:
    """`min_processes` checked against `num_processes` (None: `num_processes`).

    Raises:
      ConfigurationError: it is not an integer from 1 to `num_processes`.
    """
    if min_processes is None:
        return num_processes
    if (
        not isinstance(min_processes, int)
        or isinstance(min_processes, bool)
        or not 1 <= min_processes <= num_processes
    ):
        raise ConfigurationError(
            message(
                "min_processes is the fewest processes to relaunch the job on: an integer "
                "from 1 to num_processes.",
                received(min_processes=min_processes, num_processes=num_processes),
                f"pass e.g. min_processes={max(1, num_processes // 2)} "
                f"(on the command line: --min-processes {max(1, num_processes // 2)}).",
            )
        )
    return min_processes
