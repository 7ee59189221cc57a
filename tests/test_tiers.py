"""The test tiers: `-m "not slow"` leaves out every slow kind of test, and per-file progress."""

import functools
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import conftest  # tests/conftest.py, as pytest imports it
import pytest

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def _tiers():
    """tests/tiers.py, loaded once (it is a script, not a module of a package)."""
    spec = importlib.util.spec_from_file_location("tiers", ROOT / "tests" / "tiers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Item:
    """What the collection hook reads and writes of a test item."""

    def __init__(self, *marks: str):
        self.marks = {name: getattr(pytest.mark, name).mark for name in marks}
        self.nodeid = "tests/test_x.py::test_x"

    def get_closest_marker(self, name):
        return self.marks.get(name)

    def add_marker(self, mark, append=True):
        self.marks[mark.name] = getattr(mark, "mark", mark)


@pytest.mark.parametrize("kind", ["multiprocess", "engines", "bench", "slow"])
def test_every_slow_kind_is_slow(kind):
    item = _Item(kind, "timeout")
    conftest.pytest_collection_modifyitems(None, [item])
    assert "slow" in item.marks


def test_other_tests_stay_in_the_fast_tier():
    item = _Item("timeout", "parametrize")
    conftest.pytest_collection_modifyitems(None, [item])
    assert "slow" not in item.marks


def test_the_slow_marker_is_registered(request):
    markers = request.config.getini("markers")
    assert any(m.startswith("slow:") and "not slow" in m for m in markers)


def test_progress_names_each_file(request):
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    assert reporter is None or reporter.showfspath is True


def test_modules_that_only_reexport_need_no_test():
    modules = _tiers().runnable()
    assert "_src/strategy/step.py" in modules and "_src/clusters/initialize.py" in modules
    assert "callbacks.py" not in modules and "_src/data/__init__.py" not in modules
    # spmd/__init__.py imports each public name on first use (__getattr__): it has code to run.
    assert "__init__.py" in modules


def _record(
    tests: dict[str, tuple[list[str], float]], cpu_s: float, slow: tuple[str, ...] = ()
) -> dict:
    """A record of the form conftest.py writes: per test, the modules it ran, its CPU s and
    whether it is slow (those named in `slow`); the run's wall time twice its CPU."""
    entries = {
        name: {"ran": ran, "cpu_s": cpu, "wall_s": 2 * cpu, "slow": name in slow}
        for name, (ran, cpu) in tests.items()
    }
    return {"run": {"cpu_s": cpu_s, "wall_s": 2 * cpu_s}, "tests": entries}


def _main(tiers, tmp_path, record: dict, capsys) -> tuple[int, list[str]]:
    path = tmp_path / "ran.json"
    path.write_text(json.dumps(record))
    status = tiers.main([str(path)])
    return status, capsys.readouterr().out.splitlines()


def test_a_module_no_test_ran_is_reported_with_a_failing_verdict(tmp_path, capsys):
    tiers = _tiers()
    tests = _record(
        {"tests/test_a.py::test_x": (["mesh.py"], 1.0), "tests/test_b.py::test_y": ([], 1.0)}, 2.0
    )
    assert tiers.unrun(tests["tests"], ["mesh.py", "rules.py"]) == ["rules.py"]
    status, lines = _main(tiers, tmp_path, _record({"t": (["mesh.py"], 1.0)}, 10.0), capsys)
    assert status == 1
    assert lines[-1].startswith("verdict: FAIL: ")
    assert "module(s) of spmd/ run by no test of the fast tier" in lines[-1]
    assert "over the fast tier's budget" not in lines[-1]


def test_a_record_running_every_module_within_budget_has_an_ok_verdict(tmp_path, capsys):
    tiers = _tiers()
    status, lines = _main(tiers, tmp_path, _record({"t": (tiers.runnable(), 4.0)}, 239.0), capsys)
    assert status == 0
    assert lines[-1] == (
        "verdict: OK: every module of spmd/ with code is run by a test of the fast tier, "
        "in 239 s of CPU (budget 240 s), no test of it over 5 s"
    )


def test_a_run_over_the_cpu_budget_fails_and_shows_its_costliest_tests(tmp_path, capsys):
    tiers = _tiers()
    modules = tiers.runnable()
    tests = {f"tests/test_a.py::test_{i}": (modules, i / 4) for i in range(20)}
    status, lines = _main(tiers, tmp_path, _record(tests, 250.5), capsys)
    assert status == 1
    assert lines[-1] == "verdict: FAIL: 250 s of CPU is over the fast tier's budget of 240 s"
    assert "the run: 250.5 s CPU, 501.0 s wall (8:21, 1 worker(s))" in lines
    assert "the fast tier's tests: 47.5 s CPU, 95.0 s wall" in lines
    shown = lines[lines.index("the 15 costliest tests (CPU s, wall s):") + 1 : -1]
    assert [line.split()[-1] for line in shown] == [
        f"tests/test_a.py::test_{i}" for i in range(19, 4, -1)
    ]
    assert shown[0].split()[:2] == ["4.8", "9.5"]


def test_a_fast_test_over_five_seconds_of_cpu_is_named_and_fails_the_verdict(tmp_path, capsys):
    tiers = _tiers()
    modules = tiers.runnable()
    tests = {
        "tests/test_a.py::test_cheap": (modules, 1.0),
        "tests/test_a.py::test_dear": ([], 31.0),
    }
    status, lines = _main(tiers, tmp_path, _record(tests, 60.0), capsys)
    assert status == 1
    assert "over 5 s of CPU in the fast tier: tests/test_a.py::test_dear (31.0 s)" in lines
    assert lines[-1] == (
        "verdict: FAIL: 1 test(s) of the fast tier over 5 s of CPU (make them cheaper or mark "
        "them slow)"
    )


def test_a_slow_test_may_cost_more_than_the_fast_tiers_share():
    tests = _record({"a": ([], 31.0), "b": ([], 1.0)}, 60.0, slow=("a",))["tests"]
    assert list(_tiers().fast(tests)) == ["b"] and _tiers().over(tests) == ["a"]
    assert _tiers().over(_tiers().fast(tests)) == []


def test_a_whole_suite_is_judged_on_its_wall_time_and_its_fast_tests_cpu(tmp_path, capsys):
    tiers = _tiers()
    tests = {"fast": (tiers.runnable(), 4.0), "mp": (["mesh.py"], 2000.0)}
    within = _record(tests, 440.0, slow=("mp",))  # 880 s of wall time
    status, lines = _main(tiers, tmp_path, within, capsys)
    assert status == 0, lines
    assert lines[0].startswith("2 tests recorded, 1 of them in the fast tier;")
    assert lines[-1].endswith(
        "in 4 s of CPU (budget 240 s), no test of it over 5 s; the suite in 14:40 of wall time"
    )
    status, lines = _main(tiers, tmp_path, _record(tests, 460.0, slow=("mp",)), capsys)
    assert status == 1
    assert lines[-1] == (
        "verdict: FAIL: the suite's 15:20 of wall time is over its budget of 15:00"
    )


def test_a_record_with_the_machines_speed_states_the_run_in_reference_workloads(tmp_path, capsys):
    tiers = _tiers()
    tests = {"fast": (tiers.runnable(), 40.0), "mp": (["mesh.py"], 2000.0)}
    record = _record(tests, 3000.0, slow=("mp",))
    record["run"]["reference_cpu_s"] = 4.0
    _, lines = _main(tiers, tmp_path, record, capsys)
    assert (
        "the machine: the reference workload took 4.00 s of CPU; the run's CPU is 750 "
        "workloads, its fast tier's 10 (compare runs on other machines by these)"
    ) in lines
    del record["run"]["reference_cpu_s"]  # a record of before: no such line
    _, lines = _main(tiers, tmp_path, record, capsys)
    assert not any(line.startswith("the machine:") for line in lines)


def test_the_recorder_measures_the_machine_or_takes_the_figure_given(monkeypatch):
    import reference_workload

    monkeypatch.setattr(reference_workload, "cpu_seconds", lambda: 2.25)
    monkeypatch.delenv("SPMD_TEST_REFERENCE_S", raising=False)
    recorder = types.SimpleNamespace(reference=None, reference_cost=0.0)
    conftest._Recorder.measure_the_machine(recorder)
    assert recorder.reference == 2.25
    monkeypatch.setenv("SPMD_TEST_REFERENCE_S", "3.5")
    conftest._Recorder.measure_the_machine(recorder)
    assert recorder.reference == 3.5
    for bad in ("fast", "0", "-4.8", "nan", "inf"):
        monkeypatch.setenv("SPMD_TEST_REFERENCE_S", bad)
        with pytest.raises(pytest.UsageError) as raised:
            conftest._Recorder.measure_the_machine(recorder)
        assert f"Received: SPMD_TEST_REFERENCE_S={bad!r}" in str(raised.value)
        assert "a number above 0" in str(raised.value)
        assert "python tests/reference_workload.py" in str(raised.value)


@pytest.mark.slow  # 4 s of CPU: it starts JAX and compiles, as its figure must
def test_the_reference_workload_trains_in_a_fresh_process_and_is_timed():
    spec = importlib.util.spec_from_file_location(
        "reference_workload", ROOT / "tests" / "reference_workload.py"
    )
    workload = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workload)
    seconds = workload.cpu_seconds(tries=1)  # check=True: the script's own assertion held
    assert 0.5 < seconds < 120, seconds


def test_every_fault_is_in_one_verdict():
    line = _tiers().verdict(["rules.py"], 241.0, costly=["t"], wall_s=901.0)
    assert line == (
        "verdict: FAIL: 1 module(s) of spmd/ run by no test of the fast tier; "
        "241 s of CPU is over the fast tier's budget of 240 s; "
        "1 test(s) of the fast tier over 5 s of CPU (make them cheaper or mark them slow); "
        "the suite's 15:01 of wall time is over its budget of 15:00"
    )


@pytest.mark.parametrize("argv", [["a.json", "b.json"], ["--help"], ["--fast", "a.json"]])
def test_more_than_one_record_prints_a_one_line_usage(argv, capsys):
    assert _tiers().main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("usage: python tests/tiers.py [--fast | RECORD]")


@pytest.mark.parametrize("argv", [[], ["--fast"]])
def test_without_a_record_it_runs_the_suite_or_the_fast_tier_recorded(argv, monkeypatch, capsys):
    tiers = _tiers()
    runs = []

    def record_run(path, tier_only=False):  # what a recorded run writes
        runs.append((path, tier_only))
        path.write_text(json.dumps(_record({"t": (tiers.runnable(), 4.0)}, 200.0)))
        return 0

    monkeypatch.setattr(tiers, "record_run", record_run)
    assert tiers.main(argv) == 0
    assert len(runs) == 1 and not runs[0][0].exists()  # a temporary record, removed after
    assert runs[0][1] is bool(argv)
    assert capsys.readouterr().out.splitlines()[-1].startswith("verdict: OK: ")


def test_a_failing_run_fails_the_verdict_whatever_its_budgets(monkeypatch, capsys):
    tiers = _tiers()

    def record_run(path, tier_only=False):
        path.write_text(json.dumps(_record({"t": (tiers.runnable(), 4.0)}, 200.0)))
        return 1

    monkeypatch.setattr(tiers, "record_run", record_run)
    assert tiers.main([]) == 1
    assert "the run failed (pytest exit status 1)" in capsys.readouterr().err


@pytest.mark.parametrize("text", [None, "not json", '{"t": ["mesh.py"]}'])
def test_a_path_holding_no_record_is_a_usage_error(text, tmp_path, capsys):
    path = tmp_path / "ran.json"
    if text is not None:
        path.write_text(text)
    assert _tiers().main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"no record of a test run at {str(path)!r}; usage: "
    )


@pytest.mark.slow  # 3 s of CPU (6 s with two workers): over the fast tier's share
@pytest.mark.parametrize("workers", [0, 2])
def test_the_recorder_writes_each_tests_modules_cpu_wall_and_tier(tmp_path, workers):
    """A pytest run under SPMD_TEST_RECORD writes a record tiers.py reads (the files a fast
    test runs, in its thread and the threads it starts; none for a slow test, which is not
    watched; none for the processes a test starts); under xdist the workers' parts are
    merged into it by the controller and removed."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import pytest\n"
        "import spmd._src.errors\n\n"
        "def test_spins():\n"
        "    spmd._src.errors.received(x=sum(i * i for i in range(3_000_000)))\n\n"
        "def test_what_a_test_starts_is_not_recorded():\n"
        "    assert 'SPMD_TEST_RECORD' not in __import__('os').environ\n\n"
        "def test_threads():\n"
        "    t = __import__('threading').Thread(target=spmd._src.errors.received, kwargs={'x': 1})\n"
        "    t.start()\n"
        "    t.join()\n\n"
        "@pytest.mark.slow\n"
        "def test_idles():\n"
        "    spmd._src.errors.received(x=1)  # a slow test is not watched: its 'ran' stays empty\n"
        "    __import__('time').sleep(0.3)\n"
    )
    record_path = tmp_path / "ran.json"
    env = {**os.environ, "SPMD_TEST_RECORD": str(record_path), "PYTHONPATH": str(ROOT)}
    env["SPMD_TEST_REFERENCE_S"] = "3.5"  # the machine's speed, given: not measured again
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["--rootdir", str(tmp_path), "--confcutdir", str(tmp_path), "-c", os.devnull]
    command += ["-p", "conftest", "-n", str(workers), "--dist", "load", str(probe)]
    env["PYTHONPATH"] += os.pathsep + str(ROOT / "tests")
    subprocess.run(command, env=env, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    record = json.loads(record_path.read_text())
    spins, threads, idles = (
        record["tests"][f"test_probe.py::{name}"]
        for name in ("test_spins", "test_threads", "test_idles")
    )
    assert spins["ran"] == threads["ran"] == ["_src/errors.py"] and idles["ran"] == []
    assert spins["cpu_s"] > 0.1 and idles["cpu_s"] < 0.2 and idles["wall_s"] >= 0.3
    assert (spins["slow"], idles["slow"]) == (False, True)
    assert record["run"]["cpu_s"] > spins["cpu_s"] and record["run"]["wall_s"] > idles["wall_s"]
    assert record["run"]["workers"] == workers
    assert record["run"]["reference_cpu_s"] == 3.5
    assert [path.name for path in tmp_path.glob("ran.json*")] == ["ran.json"]
