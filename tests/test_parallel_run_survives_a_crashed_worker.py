"""A worker that dies in the parallel run costs the test it died in, never the run.

With xdist's own `loadgroup`, a crashed worker left the run waiting forever at its end,
every worker idle (CI stopped it at its time limit). tests/scheduling.py is the run's
scheduler; here it runs small suites in which a worker dies.
"""

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from scheduling import CrashSafeLoadGroupScheduling

def pytest_xdist_make_scheduler(config, log):
    return CrashSafeLoadGroupScheduling(config, log)
"""

SUITE = {
    "test_a.py": """
        import os, time
        def test_1(): pass
        def test_2(): time.sleep(0.3)
        def test_dies(): os._exit(3)
        def test_after(): pass
        def test_3(): pass
    """,
    "test_b.py": """
        import time
        import pytest
        def test_b1(): time.sleep(0.5)
        @pytest.mark.xdist_group("serial")
        def test_g1(): pass
        @pytest.mark.xdist_group("serial")
        def test_g2(): pass
    """,
}


def _run(folder: Path, workers: int) -> subprocess.CompletedProcess[str]:
    (folder / "conftest.py").write_text(CONFTEST)
    for name, text in SUITE.items():
        (folder / name).write_text(textwrap.dedent(text))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf"]
    command += ["-n", str(workers), "--dist", "loadgroup", str(folder)]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("workers", [1, 2])
def test_the_run_ends_with_the_dead_workers_test_failed_and_every_other_run(tmp_path, workers):
    done = _run(tmp_path, workers)
    assert "1 failed, 7 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    assert "FAILED test_a.py::test_dies" in done.stdout
    assert "node down: Not properly terminated" in done.stdout  # a real crash, not a failure


class _Worker:
    """What the scheduler uses of xdist's WorkerController: sends that fail once it died."""

    def __init__(self, name: str):
        self.gateway = types.SimpleNamespace(id=name)
        self.dead, self.shutting_down, self.got = False, False, []

    def send_runtest_some(self, indices):
        if self.dead:
            raise OSError("cannot send (already closed?)")  # execnet's words
        self.got += indices

    def shutdown(self):
        self.shutting_down = True


def test_work_sent_to_a_worker_that_died_unnoticed_goes_to_the_others():
    """The run reads a dead worker's last report before its death: the work it then sends
    fails (its channel is closed). That is no internal error of the run: the work stays the
    dead worker's until the run learns of the death, then goes to the others, and only the
    test it died in is lost."""
    from scheduling import CrashSafeLoadGroupScheduling

    config = types.SimpleNamespace(
        getvalue=lambda name: ["2*popen"], option=types.SimpleNamespace(loadscopereorder=False)
    )
    sched = CrashSafeLoadGroupScheduling(config)
    tests = [f"test_a.py::test_{i}" for i in range(8)]
    a, b = _Worker("a"), _Worker("b")
    for worker in (a, b):
        sched.add_node(worker)
        sched.add_node_collection(worker, tests)
    sched.schedule()
    assert a.got and b.got
    a.dead = True  # it ran its first test, reported it, and died in its second
    sched.mark_test_complete(a, a.got[0])  # the report read after the death: a send fails
    crashed = sched.remove_node(a)  # the run learns of the death
    assert crashed == tests[a.got[1]]
    while not b.shutting_down:
        sched.mark_test_complete(b, next(i for i in b.got if not _done(sched, b, tests[i])))
    ran = {tests[i] for i in a.got[:1] + b.got}
    assert ran | {crashed} == set(tests) and crashed not in {tests[i] for i in b.got}


def _done(sched, worker, nodeid: str) -> bool:
    return any(unit.get(nodeid) for unit in sched.assigned_work[worker].values())


def test_units_go_out_in_the_runs_order_not_largest_first():
    """The run orders its tests long poles first (tests/conftest.py); xdist would hand out
    the units with the most tests first (a module grouped whole before the single tests
    that start processes, which then end the run alone). The scheduler keeps the order,
    whatever xdist's reorder option says."""
    from scheduling import CrashSafeLoadGroupScheduling

    config = types.SimpleNamespace(
        getvalue=lambda name: ["2*popen"], option=types.SimpleNamespace(loadscopereorder=True)
    )
    sched = CrashSafeLoadGroupScheduling(config)
    tests = ["test_a.py::test_long", "test_a.py::test_longer"]
    tests += [f"test_b.py::test_{i}@test_b.py" for i in range(4)]  # one module, one group
    a, b = _Worker("a"), _Worker("b")
    for worker in (a, b):
        sched.add_node(worker)
        sched.add_node_collection(worker, tests)
    sched.schedule()
    assert [tests[a.got[0]], tests[b.got[0]]] == tests[:2]
