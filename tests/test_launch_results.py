"""How `spmd launch` reports a group's end, without starting processes (the fast tier's view).

The multi-process tests in tests/test_launch.py and tests/multiprocess/ check
the same results from real processes.
"""

import signal

from spmd.clusters.launch_results import (
    PREEMPTED_EXIT_CODE,
    TIMEOUT_EXIT_CODE,
    GroupResult,
    ProcessResult,
    signal_name,
)


def _group(*codes, **kwargs):
    return GroupResult(tuple(ProcessResult(i, c) for i, c in enumerate(codes)), **kwargs)


def test_a_signal_is_reported_as_a_shell_does():
    killed = ProcessResult(1, -signal.SIGKILL)
    assert killed.exit_code == 128 + signal.SIGKILL
    assert killed.describe() == "process 1 was killed by SIGKILL"
    assert signal_name(signal.SIGTERM) == "SIGTERM" and signal_name(99) == "signal 99"


def test_every_process_exiting_0_is_ok():
    group = _group(0, 0)
    assert group.ok and group.exit_code == 0 and not group.preempted
    assert group.describe() == "every process exited with code 0"


def test_the_first_failed_process_gives_the_exit_code():
    group = _group(0, 3, -signal.SIGTERM, failed=(1, 2))
    assert not group.ok and group.exit_code == 3
    assert group.describe() == (
        "process 1 exited with code 3; process 2 was killed by SIGTERM; stopped the other processes"
    )


def test_a_preempted_process_makes_the_group_preempted():
    group = _group(PREEMPTED_EXIT_CODE, -signal.SIGTERM, failed=(0,))
    assert group.preempted and group.exit_code == PREEMPTED_EXIT_CODE
    assert "process 0 was preempted" in group.describe()
    assert not _group(PREEMPTED_EXIT_CODE, 0).preempted  # only a process that failed first


def test_a_timeout_and_an_early_exit_are_failures_even_with_code_0():
    timed_out = _group(0, -signal.SIGTERM, timed_out=True)
    assert not timed_out.ok and timed_out.exit_code == TIMEOUT_EXIT_CODE
    assert timed_out.describe() == "timed out; stopped every process"
    early = _group(0, -signal.SIGTERM, exited_early=(0,))
    assert not early.ok and early.exit_code == 1
    assert early.describe().startswith("process 0 exited with code 0 while the others ran on")
