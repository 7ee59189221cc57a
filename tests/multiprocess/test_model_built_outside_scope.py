"""A Trainer whose model was built outside `strategy.scope()`, on 2 processes x 2 devices:
it trains as one process x 4 devices does; processes holding different values are a clear
error naming the leaf."""

import sys
from pathlib import Path

import numpy as np
import pytest

from spmd.testing import run_processes

from .procs import child_env

WORKER = Path(__file__).with_name("outside_scope_worker.py")
pytestmark = pytest.mark.multiprocess


def _run(out: Path, processes: int, devices: int, *flags: str, check: bool = True):
    command = [sys.executable, str(WORKER), str(out), *flags]
    return run_processes(
        command, processes, devices_per_process=devices, timeout=240, env=child_env(), check=check
    )


def test_a_model_built_outside_the_scope_trains_as_on_one_process(tmp_path):
    _run(tmp_path / "two.npz", 2, 2)
    _run(tmp_path / "one.npz", 1, 4)
    two, one = dict(np.load(tmp_path / "two.npz")), dict(np.load(tmp_path / "one.npz"))
    assert int(two.pop("processes")) == 2 and int(one.pop("processes")) == 1
    assert sorted(two) == sorted(one) and len(one) > 4
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_processes_holding_different_models_are_an_error_naming_the_leaf(tmp_path):
    results = _run(tmp_path / "out.npz", 2, 2, "--seed-by-process", check=False)
    assert all(r.returncode != 0 for r in results)
    error = results[0].stderr  # process 0 compares; its peer may be stopped as it fails
    assert "ConfigurationError: With several processes, a state leaf" in error, error[-3000:]
    assert "Received: leaf='params/hidden/kernel', fingerprint_per_process={0: '" in error
    assert "build the model from the same seed on every process" in error
