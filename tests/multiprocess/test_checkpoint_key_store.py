"""CheckpointManager.save at every step leaves the coordination service's key store as it was.

Real processes (3, one CPU device each, loopback coordinator): a save every
step, a checkpoint every 5; the keys under "spmd/" are counted after each step.
"""

import json
import sys
from pathlib import Path

import pytest

from spmd.testing import run_processes

from .procs import child_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
WORKER = Path(__file__).with_name("ckpt_keys_worker.py")


def test_the_key_store_does_not_grow_with_steps(tmp_path):
    out = tmp_path / "out.json"
    command = [sys.executable, str(WORKER), str(tmp_path / "ckpt"), str(out), "--steps", "20"]
    run_processes(command, 3, devices_per_process=1, env=child_env(), timeout=200)
    report = json.loads(out.read_text())
    assert report["saved"] == [15, 20]
    counts = set(report["keys"].values())
    assert len(counts) == 1, report  # the same count after step 1 as after step 20
    saves = [k for k in report["names"] if k.startswith("spmd/_src/checkpoint/")]
    assert len(saves) <= 3, report  # one agreement's keys (the last save's), one per process
