"""How the processes of `spmd launch` ended: exit codes, per-process and per-group results."""

from __future__ import annotations

import dataclasses
import re
import signal

__all__ = [
    "CONFIGURATION_EXIT_CODE",
    "EXIT_GRACE",
    "HANG_EXIT_CODE",
    "NOT_ARRIVED_LINE",
    "PREEMPTED_EXIT_CODE",
    "GroupResult",
    "ProcessResult",
    "not_arrived",
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
TIMEOUT_EXIT_CODE = 124  # what `launch` returns when its timeout ends the run, as timeout(1)
GRACE_PERIOD = 5.0  # seconds between SIGTERM and SIGKILL when stopping processes
# Seconds the other processes have to end once one has exited with code 0. A job whose
# processes end together (jax.distributed's shutdown barrier) never comes near it; a
# process that left early while its peers wait for it in a collective makes the job fail.
EXIT_GRACE = 30.0
# How an error about processes that never reached a collective starts (spmd._src.checkpoint's
# guard): `spmd launch` reads it to name those processes, not the one that waited, as at fault.
NOT_ARRIVED_LINE = re.compile(r"process\(es\) \[([\d, ]+)\] did not reach (.+?) within ")


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
