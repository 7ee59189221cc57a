"""How `spmd launch` reports a group's end, without starting processes (the fast tier's view).

The multi-process tests in tests/test_launch.py and tests/multiprocess/ check
the same results from real processes.
"""

import signal

import pytest

from spmd._src.clusters.launch_results import (
    CONFIGURATION_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    TIMEOUT_EXIT_CODE,
    GroupResult,
    Printer,
    ProcessResult,
    not_arrived,
    not_worth_restarting,
    signal_name,
    summary,
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


def _printer_with(index: int, *lines: str) -> Printer:
    printer = Printer()
    for line in lines:
        printer(index, "stderr", line + "\n")
    return printer


@pytest.mark.parametrize(
    "line",
    [
        "[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3",
        "[Gloo] Rank [Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected "
        "peer ranks is : 3",  # two devices' threads wrote at once
        "3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3",
        "7 peer ranks. Expected number of connected peer ranks is : 7",  # a line's tail
        "[Gloo] Rank 5 is connected to [Gloo] Rank ",  # a line's head
    ],
)
def test_gloo_s_connected_lines_are_hidden_even_interleaved(capsys, line):
    Printer()(1, "stderr", line + "\n")
    assert capsys.readouterr().err == ""
    Printer(verbose=True)(1, "stderr", line + "\n")
    assert capsys.readouterr().err == f"[1] {line}\n"


def test_a_program_s_own_line_about_connections_is_shown(capsys):
    Printer()(0, "stdout", "Rank 3 is connected to the database\n")
    assert capsys.readouterr().out == "[0] Rank 3 is connected to the database\n"


def test_the_first_failure_is_the_process_that_raised(capsys):
    group = _group(1, 1, failed=(0, 1))
    printer = _printer_with(0, "Traceback (most recent call last):", "  File x", "ValueError: bad")
    text = summary(group, printer)
    assert text.startswith("first failure: process 0 exited with code 1; it raised ValueError: bad")


def test_a_program_that_does_not_compile_is_named_with_its_syntax_error(capsys):
    group = _group(1, 1, failed=(0, 1))
    printer = _printer_with(
        0, '  File "train.py", line 3', "    f(a,, b)", "SyntaxError: invalid syntax"
    )
    text = summary(group, printer)
    assert text.startswith("first failure: process 0 exited with code 1; it raised SyntaxError: ")


def test_processes_that_never_reached_a_collective_are_named_not_the_one_that_waited(capsys):
    """Process 0 waited in save(step=5) for process 1, which hung: process 1 is at fault."""
    error = f"spmd.CheckpointError: {not_arrived([2, 1], 'save(step=5)', 30.0)}: ..."
    printer = _printer_with(0, "Traceback (most recent call last):", "  File x", error)
    text = summary(_group(1, 1, 1, failed=(0, 1, 2)), printer)
    assert text.startswith("first failure: processes [1, 2], alive but hung or slow"), text
    assert "they never reached save(step=5), where process 0 waited" in text, text
    assert "process 0 then raised spmd.CheckpointError: process(es) [1, 2] did not " in text
    one = _printer_with(0, "Traceback (most recent call last):", error.replace("[1, 2]", "[1]"))
    assert summary(_group(1, 1, failed=(0, 1)), one).startswith("first failure: process 1, ")


def test_only_configuration_errors_of_their_own_stop_the_restarts():
    """Exit code 78 (ConfigurationError/BatchError) from every process that failed on its own."""
    code = CONFIGURATION_EXIT_CODE
    peer = _printer_with(1, "spmd: ending: process 0 failed (ConfigurationError: x); ending too.")
    why = not_worth_restarting(_group(code, 1, failed=(0, 1)), peer)
    assert why is not None and why.startswith("not restarting: process 0 raised a configuration")
    assert "at 2 processes" in why and "at any size" not in why
    assert not_worth_restarting(_group(code, code, failed=(0, 1)), Printer()) is not None
    assert not_worth_restarting(_group(code, 1, failed=(0, 1)), Printer()) is None  # 1 its own
    assert not_worth_restarting(_group(1, 1, failed=(0, 1)), peer) is None
    assert not_worth_restarting(_group(0, 0), Printer()) is None
    assert (
        ProcessResult(1, code).describe() == "process 1 exited with code 78 (a configuration error)"
    )


def test_a_hung_process_is_the_first_failure_with_what_it_said():
    """Process 1 ended itself as hung; process 0 ended because of it."""
    from spmd._src.clusters.launch_results import HANG_EXIT_CODE

    hung = "spmd: process 1 hung: no progress for 6 s after 4 steps (hang_timeout=5 s) while "
    printer = _printer_with(1, hung + "its peers waited for it; its main thread:", "  File x")
    printer(0, "stderr", "spmd: ending: process 1 failed (hung: no progress ...); ending too.\n")
    group = _group(HANG_EXIT_CODE, HANG_EXIT_CODE, failed=(1, 0))
    text = summary(group, printer)
    assert text.startswith(
        "first failure: process 1, alive but hung: no progress for 6 s after 4 "
    ), text
    assert "its main thread" not in text and "its stack is above" in text
    assert "(a hung or silent process; retryable)" in group.describe()
    assert group.exit_code == HANG_EXIT_CODE
