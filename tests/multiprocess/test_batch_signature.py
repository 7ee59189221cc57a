"""Processes that feed a step directly agree on each batch signature before its first call.

Each process's numpy arrays are the global batch (it keeps its own rows), so two
processes passing different shapes, dtypes or structures would train on mixed
data; every process gets a `BatchError` naming both signatures instead, within a
bound. Equal signatures train as one process does.
"""

import sys
import time
from pathlib import Path

import numpy as np
import pytest

from spmd.testing import run_processes

WORKER = Path(__file__).with_name("batch_signature_worker.py")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    "scenario, shown",
    [
        ("rows", ["float32[8, 3]", "float32[16, 3]"]),
        ("dtype", ["images: float32[8, 3]", "images: int32[8, 3]"]),
        ("structure", ["images: float32[8, 3]", "images: {float32[8, 3]}"]),
        ("ragged_on_one", ["labels: float32[8]", "labels: float32[5]"]),
    ],
)
def test_processes_feeding_different_batches_each_get_a_batch_error(scenario, shown, tmp_path):
    start = time.monotonic()
    results = run_processes(
        [sys.executable, str(WORKER), scenario, str(tmp_path / "out.npz")],
        2,
        devices_per_process=2,
        timeout=240,
        check=False,
    )
    assert time.monotonic() - start < 200
    for r in results:
        assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
        assert "BatchError: Every process passes a step the same global batch signature" in r.stdout
        for text in shown:
            assert text in r.stdout, r.stdout
    assert not (tmp_path / "out.npz").exists()


def test_processes_feeding_the_same_batches_train_as_one_process(tmp_path):
    two, one = tmp_path / "two.npz", tmp_path / "one.npz"
    run_processes([sys.executable, str(WORKER), "same", str(two)], 2, devices_per_process=2)
    run_processes([sys.executable, str(WORKER), "same", str(one)], 1, devices_per_process=4)
    got, want = dict(np.load(two)), dict(np.load(one))
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5)
