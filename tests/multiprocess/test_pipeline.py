"""spmd.pipeline with the stage axis spanning two real processes (jax.distributed, gloo)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from spmd.testing import run_processes

from .procs import child_env

WORKER = Path(__file__).with_name("pipeline_worker.py")
pytestmark = pytest.mark.multiprocess


def test_stages_on_two_processes_train_like_one_device():
    results = run_processes(
        [sys.executable, str(WORKER)], 2, devices_per_process=2, timeout=300, env=child_env()
    )
    outs = [
        json.loads(line.removeprefix("RESULT "))
        for r in results
        for line in r.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    assert len(outs) == 2
    assert [o["stages_here"] for o in outs] == [[0], [1]]  # one stage per process
    assert outs[0]["stage_spec"].startswith("P('stage'")
    assert outs[0]["losses"] == outs[1]["losses"]
    np.testing.assert_allclose(outs[0]["losses"], outs[0]["oracle"], rtol=2e-5, atol=2e-6)
