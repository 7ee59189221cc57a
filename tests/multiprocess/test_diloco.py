"""spmd.DiLoCo over real processes: islands split across processes first, equal to the paper."""

import json
import sys
from pathlib import Path

import pytest

from spmd.testing import run_processes

from .procs import child_env

WORKER = Path(__file__).with_name("diloco_worker.py")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def test_islands_across_two_processes_equal_the_paper_on_one_device():
    """1, 2 and 4 islands over 2 processes (one island over both; one per process; two
    per process), each equal to the paper's algorithm on one device at float32 rounding;
    also the ClusterCoordinator loop, run by both processes, over one island per process."""
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
        assert out["island_processes"] == [out["process"]]  # island i is process i
        assert out["one"]["mesh"] == {"island": 2, "host": 1, "replica": 2}
        assert out["two"]["mesh"] == {"island": 4, "replica": 1}
        assert out["across"]["mesh"] == {"island": 1, "host": 2, "replica": 2}  # spans both
        for run in (out["one"], out["two"], out["across"]):
            assert run["global"] and run["islands"] and run["losses"], run
            assert run["step"] == 7
        assert out["coordinated"] == {"global": True, "loss": True, "done": True}
