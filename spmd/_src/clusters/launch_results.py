"""How the processes of `spmd launch` end: exit codes, per-process and per-group results, their
output as the launcher shows it, and the first failure named."""

from __future__ import annotations

import collections
import dataclasses
import re
import signal
import sys
import threading

from spmd._src.clusters.hang_watch import WAITED

__all__ = [
    "CONFIGURATION_EXIT_CODE",
    "EXIT_GRACE",
    "FOLLOWER",
    "FOLLOWER_LINE",
    "GroupResult",
    "HANG_EXIT_CODE",
    "NOT_ARRIVED_LINE",
    "PREEMPTED_EXIT_CODE",
    "Printer",
    "ProcessResult",
    "gloo_connected",
    "not_arrived",
    "not_worth_restarting",
    "summary",
]

# A process that exits with this code was preempted (it saved what it needs and
# stopped on purpose); `launch` restarts the group without counting it as a failure.
PREEMPTED_EXIT_CODE = 42
# A process that exits with this code raised spmd's ConfigurationError or BatchError
# (sysexits' EX_CONFIG): the same program raises it again, so `launch` neither restarts
# nor shrinks the job for it.
CONFIGURATION_EXIT_CODE = 78
# A process that exits with this code (sysexits' EX_TEMPFAIL: try again) was named by the
# hang watch: it made no progress for hang_timeout while its peers waited, or it fell
# silent (killed, lost, frozen); its peers exit with it too. A retry may well succeed:
# `launch` restarts as for any failure, and a scheduler may requeue on it.
HANG_EXIT_CODE = 75
# How a process that ends because a peer failed starts its last line ("ending: process 1
# failed (...)"); the launcher names that peer, not the follower.
FOLLOWER = "ending: process"
TIMEOUT_EXIT_CODE = 124  # what `launch` returns when its timeout ends the run, as timeout(1)
GRACE_PERIOD = 5.0  # seconds between SIGTERM and SIGKILL when stopping processes
# Seconds the other processes have to end once one has exited with code 0. A job whose
# processes end together (jax.distributed's shutdown barrier) never comes near it; a
# process that left early while its peers wait for it in a collective makes the job fail.
EXIT_GRACE = 30.0
# How an error about processes that never reached a collective starts (spmd._src.checkpoint's
# guard): `spmd launch` reads it to name those processes, not the one that waited, as at fault.
NOT_ARRIVED_LINE = re.compile(r"process\(es\) \[([\d, ]+)\] did not reach (.+?) within ")

# What a process that ends because a peer failed says last, naming the peer.
FOLLOWER_LINE = re.compile(rf"^spmd: {FOLLOWER} (\d+) failed")
# What a process the hang watch named as behind says last (its stack follows).
HUNG_LINE = re.compile(r"^spmd: process \d+ (hung: .*)")
# The pieces of gloo's "[Gloo] Rank N is connected to K peer ranks. Expected number of
# connected peer ranks is : K", which the threads of one process (one per device) write at
# once, so that their pieces interleave: "[Gloo] Rank [Gloo] Rank 0 is connected to ...".
_GLOO_PIECES = re.compile(
    r"\[Gloo\] Rank |is connected to|peer ranks\.|Expected number of connected peer ranks is :"
    r"|\d+|\s+"
)
_TRACEBACK = "Traceback (most recent call last):"
_SYNTAX_ERROR = re.compile(r"^(SyntaxError|IndentationError|TabError): ")
_KEPT_LINES = 200  # lines of each process's stderr kept for the failure summary


def not_arrived(missing: list[int], what: str, timeout: float) -> str:
    """E.g. "process(es) [1] did not reach save(step=5) within 30 s (hung or slow)"."""
    return f"process(es) {sorted(missing)} did not reach {what} within {timeout:g} s (hung or slow)"


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
            return f"process {self.process_index} was killed by {signal_name(-self.returncode)}"
        if self.returncode == PREEMPTED_EXIT_CODE:
            return f"process {self.process_index} was preempted (exit code {PREEMPTED_EXIT_CODE})"
        if self.returncode == CONFIGURATION_EXIT_CODE:
            return (
                f"process {self.process_index} exited with code {CONFIGURATION_EXIT_CODE} "
                "(a configuration error)"
            )
        if self.returncode == HANG_EXIT_CODE:
            return (
                f"process {self.process_index} exited with code {HANG_EXIT_CODE} (a hung or "
                "silent process; retryable)"
            )
        return f"process {self.process_index} exited with code {self.returncode}"


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """How a group of processes ended.

    Attributes:
      processes: one ProcessResult per process, in index order.
      failed: the processes that failed on their own (before the others were
        stopped), the first to end first; empty if none did.
      timed_out: whether the timeout stopped the group.
      exited_early: the processes that exited with code 0 while the others ran on
        for longer than the exit grace, which then stopped the group (a failure).
    """

    processes: tuple[ProcessResult, ...]
    failed: tuple[int, ...] = ()
    timed_out: bool = False
    exited_early: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether every process exited with code 0."""
        if self.timed_out or self.exited_early:
            return False
        return all(p.returncode == 0 for p in self.processes)

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
        if self.exited_early:
            return 1
        return max((p.exit_code for p in self.processes), default=0)

    def describe(self) -> str:
        """One line saying how the group ended."""
        if self.failed:
            failures = "; ".join(self.processes[i].describe() for i in self.failed)
            return f"{failures}; stopped the other processes"
        if self.exited_early:
            early = ", ".join(map(str, self.exited_early))
            return (
                f"process {early} exited with code 0 while the others ran on (a process that "
                "left early, e.g. by `if is_chief: return`, leaves its peers waiting for it in "
                "a collective); stopped the other processes"
            )
        if self.timed_out:
            return "timed out; stopped every process"
        return "every process exited with code 0" if self.ok else "a process failed"


def signal_name(number: int) -> str:
    """SIGTERM for 15, or 'signal 99' for a number with no name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# -- what the launcher shows, and the failure it names first


class Printer:
    """Writes the processes' lines prefixed with their index, one whole line at a time.

    Keeps the last lines of each process's stderr, to say at the end what
    failed first, and hides gloo's "[Gloo] Rank N is connected" lines unless
    `verbose`.
    """

    def __init__(self, verbose: bool = False) -> None:
        self._lock = threading.Lock()
        self._verbose = verbose
        self._stderr: dict[int, collections.deque[str]] = {}

    def __call__(self, index: int, stream: str, line: str) -> None:
        if stream == "stderr":
            kept = self._stderr.setdefault(index, collections.deque(maxlen=_KEPT_LINES))
            kept.append(line.rstrip("\n"))
        if not self._verbose and gloo_connected(line):
            return
        out = sys.stdout if stream == "stdout" else sys.stderr
        text = f"[{index}] {line}" if line.endswith("\n") else f"[{index}] {line}\n"
        with self._lock:
            out.write(text)
            out.flush()

    def exception(self, index: int) -> str | None:
        """The last Python exception process `index` printed ("Type: message"), if any."""
        lines = list(self._stderr.get(index, ()))
        starts = [i for i, line in enumerate(lines) if line.startswith(_TRACEBACK)]
        if not starts:  # a program that does not compile: Python prints no traceback header
            syntax = [line for line in lines if _SYNTAX_ERROR.match(line)]
            return syntax[-1] if syntax else None
        after = lines[starts[-1] + 1 :]
        last = [line for line in after if line and not line[0].isspace()]
        return last[0] if last else None

    def follows(self, index: int) -> int | None:
        """The peer process `index` said it ended for ("spmd: ending: process K failed")."""
        found = [FOLLOWER_LINE.match(line) for line in self._stderr.get(index, ())]
        return next((int(m[1]) for m in found if m), None)

    def hung(self, index: int) -> str | None:
        """What process `index` said when it ended as hung ("hung: no progress ..."), if it did."""
        found = [HUNG_LINE.match(line) for line in self._stderr.get(index, ())]
        return next((m[1] for m in found if m), None)

    def forget(self) -> None:
        """Drops what was kept, before a restart."""
        self._stderr.clear()


def gloo_connected(line: str) -> bool:
    """Whether `line` is made of gloo's "is connected" lines, whole or in interleaved pieces
    (a thread's newline may cut another's line: "7 peer ranks. Expected ... is : 7")."""
    marked = "is connected to" in line or "peer ranks" in line or "[Gloo] Rank" in line
    return marked and not _GLOO_PIECES.sub("", line)


def summary(result: GroupResult, printer: Printer) -> str | None:
    """One paragraph on the first failure: process, exception type and message.

    A process that failed because others never reached a collective (its error
    starts "process(es) [K] did not reach ...") is not at fault: those are named.
    """
    if not result.failed:
        return None
    first = result.processes[result.failed[0]]
    who, index = first.describe(), first.process_index
    leader = printer.follows(index)  # every failed process ended for a peer (stopped since)
    if leader is not None:
        who, index = f"process {leader} (process {index} ended because it failed)", leader
    hang = printer.hung(index)
    if hang is not None:
        return (
            f"first failure: process {index}, alive but {hang.split('; its main thread')[0]}; "
            + (
                "its stack is above. The other processes waited for it and ended with it."
                if WAITED in hang
                else "each process named prints its stack above; the others ended with them."
            )
        )
    exception = printer.exception(index)
    what = f"raised {exception}" if exception else "printed no Python exception"
    absent = NOT_ARRIVED_LINE.search(exception or "")
    if absent is not None:
        hung = [int(k) for k in absent[1].split(",")]
        one = len(hung) == 1
        names = f"process {hung[0]}" if one else f"processes {hung}"
        return (
            f"first failure: {names}, alive but hung or slow (or never started): "
            f"{'it' if one else 'they'} never reached {absent[2]}, where process {index} "
            f"waited; process {index} then "
            f"{what}. Look at what {names} {'was' if one else 'were'} doing (the output above, "
            "py-spy dump)."
        )
    return (
        f"first failure: {who}; it {what}. The other processes' output "
        "after that (C++ check failures, collectives that lost a peer) follows from it."
    )


def not_worth_restarting(result: GroupResult, printer: Printer) -> str | None:
    """Why restarting the job cannot help, or None if it may.

    So when every process that failed on its own (not one that ended because a
    peer failed) raised spmd's ConfigurationError or BatchError
    (CONFIGURATION_EXIT_CODE): the same program at the same size raises it
    again. At another size it may not (a global batch that does not divide over
    these replicas may over others), which the message says rather than claim
    that no size can work.
    """
    own = [i for i in result.failed if printer.follows(i) is None]
    codes = {result.processes[i].returncode for i in own}
    if not own or codes != {CONFIGURATION_EXIT_CODE}:
        return None
    names = ", ".join(map(str, own))
    size = len(result.processes)
    return (
        f"not restarting: process {names} raised a configuration error (spmd's "
        f"ConfigurationError or BatchError, exit code {CONFIGURATION_EXIT_CODE}) at "
        f"{size} process{'es' if size != 1 else ''}, which a restart of the same program at "
        "this size raises again, so neither a restart nor a smaller job is tried; fix the "
        "program or its arguments (the error above says how). If it depends on the size (a "
        "global batch that does not divide over the replicas), launch again at a size where "
        "it divides."
    )
