"""A Keras user's fit on 2 processes x 2 devices, one process killed mid-epoch and the job
relaunched: it ends where one device ends, EarlyStopping included (keras_fit_worker.py)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from commands import child_env, run_program

from spmd._src.clusters.launch import launch

WORKER = Path(__file__).parent / "keras_fit_worker.py"
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Path:
    """The folder of one device's fit (oracle.json, oracle.npz), once for both signals."""
    folder = tmp_path_factory.mktemp("oracle")
    done = run_program([sys.executable, str(WORKER), str(folder), "--oracle"], child_env(), 300)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


@pytest.mark.slow  # 40 s of CPU: two launches of two processes (and the oracle once)
@pytest.mark.parametrize("signal", ["KILL", "TERM"])
def test_a_fit_killed_mid_epoch_resumes_to_one_devices_weights_and_stop(tmp_path, signal, oracle):
    command = [sys.executable, str(WORKER), str(tmp_path), "--kill-at", "35", "--signal", signal]
    code = launch(
        command,
        num_processes=2,
        devices_per_process=2,
        max_restarts=2,
        timeout=300,
        env=child_env(),
    )
    assert code == 0
    # one device stops after epoch 3 (40 steps): the job killed at step 35 resumes from
    # epoch 2's end (SIGKILL) or step 36 (SIGTERM) with EarlyStopping's wait and best
    for name in ("iterations", "stopped_epoch"):
        want = json.loads((oracle / "oracle.json").read_text())[name]
        assert json.loads((tmp_path / "job.json").read_text())[name] == want, name
    got, want = np.load(tmp_path / "job.npz"), np.load(oracle / "oracle.npz")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
