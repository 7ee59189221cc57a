"""Trainer.predict on 2 processes x 2 devices: every row, in input order, on every process."""

import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from spmd.testing import run_processes

from .predict_worker import CASES, Linear, rows
from .procs import child_env

WORKER = Path(__file__).with_name("predict_worker.py")
pytestmark = pytest.mark.multiprocess


def test_predict_gives_every_row_in_order_on_every_process(tmp_path):
    """Against the same model on one device: batches the 4 replicas split, batches of 6
    and 5 rows (padded to 8), and a short last batch."""
    run_processes(
        [sys.executable, str(WORKER), str(tmp_path)],
        2,
        devices_per_process=2,
        timeout=180,
        env=child_env(),
    )
    model = Linear(nnx.Rngs(0))
    for name, (count, _, _) in CASES.items():
        want = np.asarray(model(rows(count)))
        for process in range(2):
            got = np.load(tmp_path / f"{name}.{process}.npy")
            assert got.shape == (count, 2), (name, process, got.shape)
            np.testing.assert_allclose(
                got, want, rtol=1e-6, atol=1e-6, err_msg=f"{name}, {process}"
            )
