"""spmd.DiLoCo over real processes: islands split across processes first, equal to the paper."""

import json
import sys
from pathlib import Path

import pytest
from bounds import bound
from commands import start_program

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


@pytest.mark.slow  # 12 s of CPU each: two interpreters, then the survivor waits for the watch
@pytest.mark.parametrize("sync", ["run", "refused"])
def test_an_island_killed_before_the_first_sync_is_named_by_its_peer(tmp_path, sync):
    """Process 1 (island 1) is SIGKILLed after its first inner step; process 0 takes its
    next inner steps alone and reaches the sync. It ends naming process 1 (code 75),
    never blaming itself for the sync's broken all-reduce; also where that all-reduce
    fails at once with gloo's "Connection refused" (`refused`)."""
    import subprocess

    from spmd._src.clusters.launch import free_port, process_env
    from spmd._src.clusters.launch_results import HANG_EXIT_CODE

    worker = Path(__file__).with_name("diloco_peer_worker.py")
    coordinator, log = f"127.0.0.1:{free_port()}", tmp_path / "survivor.log"
    env = child_env()
    with open(log, "w") as out, open(tmp_path / "victim.log", "w") as victim_out:
        procs = [
            start_program(
                [sys.executable, str(worker), "1", "10", *([sync] if sync == "refused" else [])],
                env=process_env(env, i, 2, coordinator, 1, 0),
                stdout=f,
                stderr=subprocess.STDOUT,
            )
            for i, f in enumerate((out, victim_out))
        ]
        try:  # ~15 s alone: the heartbeat (10 s) names the victim
            codes = [p.wait(timeout=bound(90)) for p in procs]
        except subprocess.TimeoutExpired:
            codes = [p.poll() for p in procs]
        finally:
            for p in procs:
                p.kill()
    text = log.read_text()
    assert None not in codes, (
        f"still running after {bound(90):g} s: {codes}\n--- survivor:\n{text[-3000:]}"
        f"\n--- victim:\n{(tmp_path / 'victim.log').read_text()[-1500:]}"
    )
    assert codes == [HANG_EXIT_CODE, -9], (codes, text[-3000:])
    assert "process 0: READY" in text and "synced without its peer" not in text, text[-3000:]
    assert "spmd: ending: process 1 failed (gone: " in text, text[-3000:]
    assert "Traceback" not in text and "process 0 failed" not in text, text[-3000:]
