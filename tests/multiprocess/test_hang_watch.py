"""A process that is alive but makes no progress is found and named, bounded: real processes.

`spmd launch --hang-timeout 3` runs hang_worker.py on 2 processes; process 1 stops
stepping, or never takes its first step. Every process ends within a bound, naming
process 1, its step count and its stack, and the launcher exits with
HANG_EXIT_CODE. A slow process that still advances is not flagged.
"""

import os
import sys
import time
from pathlib import Path

import pytest
from commands import run_program

from spmd._src.clusters.launch_results import HANG_EXIT_CODE

from .procs import child_env

HERE = Path(__file__).parent
WORKER = HERE / "hang_worker.py"
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def launch(
    scenario: str, hang_timeout: float | None, seconds: float, *args: str
) -> tuple[int, str, float]:
    """(exit code, output, seconds taken) of spmd launch -n 2 running `scenario`
    (`--hang-timeout` left out for None)."""
    argv = [sys.executable, "-m", "spmd", "launch", "-n", "2"]
    argv += ["--hang-timeout", str(hang_timeout)] if hang_timeout is not None else []
    argv += ["--timeout", str(seconds), "--", sys.executable, str(WORKER), scenario, *args]
    start = time.monotonic()
    done = run_program(argv, child_env(), seconds + 30)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def assert_no_raw_traceback(out: str) -> None:
    """spmd's message is all a process says about a hang: no Python traceback, no collective's
    own error (a peer's end closes the collective's connections)."""
    for index in (0, 1):
        said = "\n".join(line for line in out.splitlines() if line.startswith(f"[{index}]"))
        assert "Traceback" not in said and "Gloo" not in said, said[-3000:]


@pytest.mark.parametrize(
    ("scenario", "where", "steps", "stuck"),
    [
        ("sleep", "time.sleep(120)", 4, 1),
        ("sleep0", "time.sleep(120)", 4, 0),  # process 0 hosts the service and judges
        ("lock", "lock.acquire(timeout=120)", 4, 1),
        ("loader", "time.sleep(120)  # the source stopped delivering", 5, 1),  # one prefetched
        ("run", "time.sleep(120)", 4, 1),  # each step a strategy.run (a pmap port)
    ],
)
def test_a_process_that_stops_stepping_is_named_with_its_step_and_stack(
    scenario, where, steps, stuck
):
    code, out, elapsed = launch(scenario, hang_timeout=3, seconds=100)
    assert code == HANG_EXIT_CODE, out[-3000:]
    assert elapsed < 60, elapsed  # joining takes seconds; the hang itself would last 120
    lines = out.splitlines()
    [own] = [line for line in lines if line.startswith(f"[{stuck}] spmd: process {stuck} hung: ")]
    assert f"after {steps} steps (hang_timeout=3 s)" in own, own
    assert any(line.startswith(f"[{stuck}]     {where}") for line in lines), out[-3000:]
    other = 1 - stuck
    follower = f"[{other}] spmd: ending: process {stuck} failed (hung: no progress"
    assert any(line.startswith(follower) for line in lines), out[-3000:]
    assert f"spmd launch: first failure: process {stuck}, alive but hung: no progress" in out
    assert "DONE" not in out
    assert_no_raw_traceback(out)


def test_initialize_s_hang_timeout_sets_the_limit():
    """spmd.initialize(hang_timeout=3) in the program, no --hang-timeout (SPMD_HANG_TIMEOUT)."""
    code, out, elapsed = launch("limit", hang_timeout=None, seconds=100)
    assert code == HANG_EXIT_CODE, out[-3000:]
    assert elapsed < 60, elapsed  # the default limit (300 s) would outlast the launcher's 100 s
    [own] = [line for line in out.splitlines() if line.startswith("[1] spmd: process 1 hung: ")]
    assert "after 4 steps (hang_timeout=3 s)" in own, own
    assert_no_raw_traceback(out)


def assert_named_before_its_first_step(code: int, out: str, elapsed: float, where: str) -> None:
    assert code == HANG_EXIT_CODE, out[-3000:]
    assert elapsed < 60, elapsed  # joining takes seconds; the hang itself would last 120
    lines = out.splitlines()
    [own] = [line for line in lines if line.startswith("[1] spmd: process 1 hung: ")]
    assert "before its first step (hang_timeout=3 s)" in own, own
    assert any(line.startswith("[1]     " + where) for line in lines), out[-3000:]
    follower = "[0] spmd: ending: process 1 failed (hung: no progress"
    assert any(line.startswith(follower) for line in lines), out[-3000:]
    assert "spmd launch: first failure: process 1, alive but hung: no progress" in out
    assert "DONE" not in out
    assert_no_raw_traceback(out)


def test_a_process_stuck_before_its_first_step_is_named_while_its_peer_waits_in_it():
    code, out, elapsed = launch("first", hang_timeout=3, seconds=100)
    assert_named_before_its_first_step(code, out, elapsed, "time.sleep(120)")


def test_a_hung_filesystem_read_in_a_loader_before_the_first_batch_is_named(tmp_path):
    fifo = tmp_path / "shard-0"
    os.mkfifo(fifo)  # nobody writes it: opening it blocks, as a read from a hung mount does
    code, out, elapsed = launch("fifo", 3, 100, str(fifo))
    assert_named_before_its_first_step(code, out, elapsed, "with open(path) as f:")


def test_a_restore_hung_in_a_read_is_named_while_the_others_wait_in_its_barrier(tmp_path):
    fifo = tmp_path / "array-shard"
    os.mkfifo(fifo)
    code, out, elapsed = launch("restore", 3, 100, str(tmp_path / "ckpt"), str(fifo))
    assert_named_before_its_first_step(code, out, elapsed, "with open(path) as f:")


def test_a_stall_in_one_process_s_callback_is_named_there_not_on_the_lowest_index():
    """Process 1's pure_callback blocks inside the step; both main threads wait in JAX at
    the same step count, but process 1's callback runs its own code on a runtime thread."""
    code, out, elapsed = launch("callback", hang_timeout=3, seconds=100)
    assert code == HANG_EXIT_CODE, out[-3000:]
    assert elapsed < 60, elapsed
    lines = out.splitlines()
    [own] = [line for line in lines if line.startswith("[1] spmd: process 1 hung: ")]
    assert "while its peers waited for it (a JAX callback of its ran the program's code" in own
    assert any(line.startswith("[1]     time.sleep(120)  # a feature lookup") for line in lines)
    assert any(line.startswith("[0] spmd: ending: process 1 failed (hung: ") for line in lines)
    assert not any(line.startswith("[0] spmd: process 0 hung") for line in lines), out[-3000:]
    assert "spmd launch: first failure: process 1, alive but hung" in out


def test_the_chief_s_own_work_after_the_last_step_is_not_a_hang():
    """Process 0 exports for 8 s after its last step, past --hang-timeout 2, while process
    1 waits at its end: nobody waits for process 0, so it is not named; both exit 0."""
    code, out, _ = launch("export", hang_timeout=2, seconds=150)
    assert code == 0, out[-3000:]
    assert "[0] EXPORTED" in out and out.count("DONE") == 2 and "hung" not in out


def test_a_slow_process_that_advances_is_not_flagged():
    code, out, _ = launch("slow", hang_timeout=2, seconds=150)
    assert code == 0, out[-3000:]
    assert out.count("DONE") == 2 and "hung" not in out
