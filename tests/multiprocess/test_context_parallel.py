"""spmd.attention over real processes: a `context` axis spanning two processes."""

import json
import sys
from pathlib import Path

import pytest

from spmd.testing import run_processes

from .procs import child_env

WORKER = Path(__file__).with_name("context_parallel_worker.py")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def test_a_context_axis_across_two_processes_equals_one_device():
    """Context 4 over 2 processes of 2 devices: attention's gradients, and an LM's losses
    and parameters after 3 steps, equal one device's on each process."""
    results = run_processes(
        [sys.executable, str(WORKER)], 2, devices_per_process=2, timeout=360, env=child_env()
    )
    outs = [
        json.loads(line.removeprefix("RESULT "))
        for r in results
        for line in r.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    assert [o["process"] for o in outs] == [0, 1]
    for out in outs:
        assert out["context_processes"] == [0, 1]
        assert out["attention"] and out["lm"], out
    assert outs[0]["losses"] == outs[1]["losses"]
