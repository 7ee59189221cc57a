"""Eight simulated CPU devices for the whole test session, set before JAX starts.

Also the test tiers: a test marked `multiprocess`, `engines` or `bench` is
`slow` too, so `python -m pytest -q -m "not slow"` is the fast tier; and with
`-q` pytest still prints one line per test file. Setting SPMD_TEST_RECORD to a
file path records, per test, which spmd/ files ran (see tests/tiers.py).
"""

import json
import os
import sys
import threading
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

SLOW_TOO = ("multiprocess", "engines", "bench")
SPMD = str(Path(__file__).resolve().parent.parent / "spmd") + os.sep


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    """Marks `slow` every test marked `multiprocess`, `engines` or `bench`."""
    for item in items:
        if any(item.get_closest_marker(name) for name in SLOW_TOO):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Per-file progress under `-q`: the file's path before its dots, not one wall of dots."""
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.showfspath = True
    if os.environ.get("SPMD_TEST_RECORD"):
        config.pluginmanager.register(_Recorder(os.environ["SPMD_TEST_RECORD"]))


class _Recorder:
    """Records which spmd/ files had a function called during each test (a profile hook)."""

    def __init__(self, path: str):
        self.path, self.seen, self.record = path, set(), {}
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)

    def _profile(self, frame, event, arg):
        if event == "call":
            self.seen.add(frame.f_code.co_filename)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.seen.clear()
        yield
        ran = {f[len(SPMD) :] for f in self.seen if f.startswith(SPMD)}
        self.record[item.nodeid] = sorted(ran)

    def pytest_sessionfinish(self, session):
        sys.setprofile(None)
        threading.setprofile(None)
        Path(self.path).write_text(json.dumps(self.record, indent=0, sort_keys=True))
