"""The parallel run's groups and order (tests/conftest.py).

A module-scoped fixture is computed once per run, not once per worker that gets one
of its tests: a module that starts no process runs whole on one worker, and in a
module that starts processes the tests sharing such a fixture (a crashed-and-resumed
pair of processes, an oracle's fit) go to one worker together (`_sharing_groups`).
The workers are handed the benchmarks first, then the tests that start processes with
the slow modules that compute spread among them, the fast tier last (`_run_order`).
"""

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

PLUGIN = """
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = item.get_closest_marker("xdist_group")
        print("GROUP", item.nodeid, group.args[0] if group else "-")
"""

MODULES = (
    "multiprocess/test_loader_resume_mid_epoch.py",
    "multiprocess/test_elastic.py",
    "test_diloco_nnx_state.py",
)


@pytest.mark.slow  # a collection of its own: JAX's import and the modules'
def test_tests_sharing_a_module_fixture_are_one_group_and_the_others_spread(tmp_path):
    (tmp_path / "groups_plugin.py").write_text(PLUGIN)
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "groups_plugin", *(str(TESTS / m) for m in MODULES)]
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        command, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    groups = {}
    for line in result.stdout.splitlines():
        if line.startswith("GROUP "):
            _, nodeid, group = line.split(" ")
            groups[nodeid.split("/", 1)[1]] = group
    assert groups, result.stdout[-3000:]

    # Every test reads the processes of one fixture: one group, named after it.
    resumed = {n: g for n, g in groups.items() if n.startswith(MODULES[0])}
    assert len(resumed) == 5
    assert set(resumed.values()) == {f"tests/{MODULES[0]}::runs"}

    # The fits share their one-device oracle; the tests without it stay spread.
    elastic = {n.split("::")[1]: g for n, g in groups.items() if n.startswith(MODULES[1])}
    oracle = f"tests/{MODULES[1]}::one_device_fit"
    fits = {n for n in elastic if n.startswith("test_fit_")}
    assert len(fits) == 3 and {elastic[n] for n in fits} == {oracle}
    assert {g for n, g in elastic.items() if n not in fits} == {"-"}

    # A module that starts no process: one group, the module.
    whole = {g for n, g in groups.items() if n.startswith(MODULES[2])}
    assert whole == {f"tests/{MODULES[2]}"}


class _Item:
    """A collected test as the run's order reads it: its node id and markers."""

    def __init__(self, nodeid: str, *marks: str, group: str | None = None):
        self.nodeid, self.marks = nodeid, {name: pytest.Mark(name, (), {}) for name in marks}
        if group:
            self.marks["xdist_group"] = pytest.Mark("xdist_group", (group,), {})

    def get_closest_marker(self, name):
        return self.marks.get(name)


def test_the_slow_modules_that_compute_are_spread_among_the_tests_that_start_processes():
    """The benchmarks first; each test that starts processes (or its group), with the
    modules computing in the worker spread evenly among them; the fast tier last."""
    from conftest import _run_order

    fast = [_Item("test_f.py::test_1", group="test_f.py")]
    computing = [
        _Item(f"test_{m}.py::test_{i}", "slow", group=f"test_{m}.py") for m in "bc" for i in (1, 2)
    ]
    waiting = [_Item(f"test_p.py::test_{i}", "multiprocess", "slow") for i in (1, 2, 3)]
    waiting.append(_Item("test_q.py::test_1", "multiprocess", "slow"))
    bench = [_Item("test_bench.py::test_quick", "bench", "slow")]
    ordered = [item.nodeid for item in _run_order(fast + computing + waiting + bench)]
    assert ordered == [
        "test_bench.py::test_quick",
        "test_p.py::test_1",
        "test_q.py::test_1",  # the modules that start processes in turn
        "test_b.py::test_1",
        "test_b.py::test_2",  # a module stays whole and in order
        "test_p.py::test_2",
        "test_p.py::test_3",
        "test_c.py::test_1",
        "test_c.py::test_2",
        "test_f.py::test_1",
    ]
