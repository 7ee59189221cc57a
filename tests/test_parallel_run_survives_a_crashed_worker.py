"""A worker that dies in the parallel run costs the test it died in, never the run.

With xdist's own `loadgroup`, a crashed worker left the run waiting forever at its end,
every worker idle (CI stopped it at its time limit). tests/scheduling.py is the run's
scheduler; here it runs small suites in which a worker dies.
"""

import subprocess
import sys
import textwrap
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
