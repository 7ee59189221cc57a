"""BackupAndRestore and ModelCheckpoint in one two-process fit: two writers, every save committed.

TensorFlow's multi-worker Keras pair of callbacks, in real processes (2, one
CPU device each, loopback coordinator): both save at the same steps, each
through its own CheckpointManager, asynchronously or not. Each process then
restores both directories' last step and finds the trained state, bit for bit.
"""

import json
import sys
from pathlib import Path

import pytest

from spmd.testing import run_processes

from .procs import child_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
WORKER = Path(__file__).with_name("two_writers_worker.py")


@pytest.mark.parametrize(
    "options",
    [("--save-freq", "epoch"), ("--save-freq", "5", "--sync")],
    ids=["per-epoch-async", "every-5-batches-sync"],
)
def test_both_callbacks_commit_every_save(tmp_path, options):
    backup, ckpt, out = tmp_path / "backup", tmp_path / "ckpt", tmp_path / "out.json"
    command = [sys.executable, str(WORKER), str(backup), str(ckpt), str(out), *options]
    run_processes(command, 2, devices_per_process=1, env=child_env(), timeout=240)
    report = json.loads(out.read_text())
    assert report["steps"] == {str(backup): [10, 15], str(ckpt): [10, 15]}  # max_to_keep 2
    assert report["final"] == {str(backup): 15, str(ckpt): 15}
