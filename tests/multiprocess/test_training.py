"""Real multi-process training: 2 processes x 2 devices equal 1 process x 4 devices."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from commands import start_program

from spmd._src.clusters.launch import free_port
from spmd.testing import run_processes

WORKER = Path(__file__).with_name("train_worker.py")
pytestmark = pytest.mark.multiprocess


def _one_process(strategy: str, tmp_path: Path) -> dict:
    out = tmp_path / "one.npz"
    run_processes([sys.executable, str(WORKER), strategy, str(out)], 1, devices_per_process=4)
    return dict(np.load(out))


def _assert_same_training(got: dict, want: dict) -> None:
    assert int(got["processes"]) == 2 and int(want["processes"]) == 1
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["v"], want["v"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["multi_worker_mirrored", "parameter_server"])
def test_launch_two_processes_match_one_process(strategy, tmp_path):
    out = tmp_path / "two.npz"
    run_processes(
        [sys.executable, str(WORKER), strategy, str(out)], 2, devices_per_process=2, timeout=180
    )
    got = dict(np.load(out))
    _assert_same_training(got, _one_process(strategy, tmp_path))
    if strategy == "parameter_server":
        assert got["shard_rows"].tolist() == [2]  # 8 rows over 4 shards, across both processes


def test_tf_config_by_hand_matches_one_process(tmp_path):
    """Two workers started by hand, each with its own TF_CONFIG, as in the seeds' tutorial."""
    workers = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    out = tmp_path / "tf_config.npz"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMD_")}
    procs = []
    for index in range(2):
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        procs.append(
            start_program(
                [sys.executable, str(WORKER), "multi_worker_mirrored", str(out), "--devices", "2"],
                env={**env, "TF_CONFIG": json.dumps(config)},
                stderr=subprocess.STDOUT,
            )
        )
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "process 1 of 2" in outputs[1]
    _assert_same_training(dict(np.load(out)), _one_process("multi_worker_mirrored", tmp_path))
