"""The test tiers: `-m "not slow"` leaves out every slow kind of test, and per-file progress."""

import importlib.util
import json
from pathlib import Path

import conftest  # tests/conftest.py, as pytest imports it
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tiers():
    spec = importlib.util.spec_from_file_location("tiers", ROOT / "tests" / "tiers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Item:
    """What the collection hook reads and writes of a test item."""

    def __init__(self, *marks: str):
        self.marks = set(marks)

    def get_closest_marker(self, name):
        return name if name in self.marks else None

    def add_marker(self, mark):
        self.marks.add(mark.name)


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
    assert "strategy/step.py" in modules and "clusters/initialize.py" in modules
    assert "callbacks.py" not in modules and "data/__init__.py" not in modules
    # spmd/__init__.py imports each public name on first use (__getattr__): it has code to run.
    assert "__init__.py" in modules


def test_a_module_no_test_ran_is_reported_with_a_failing_verdict(tmp_path, capsys):
    tiers = _tiers()
    record = {"tests/test_a.py::test_x": ["mesh.py"], "tests/test_b.py::test_y": []}
    assert tiers.unrun(record, ["mesh.py", "rules.py"]) == ["rules.py"]
    path = tmp_path / "ran.json"
    path.write_text('{"t": ["mesh.py"]}')
    assert tiers.main([str(path)]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("verdict: FAIL: ")


def test_a_record_running_every_module_has_an_ok_verdict(tmp_path, capsys):
    tiers = _tiers()
    path = tmp_path / "ran.json"
    path.write_text(json.dumps({"t": tiers.runnable()}))
    assert tiers.main([str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("verdict: OK: ")
