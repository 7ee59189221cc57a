"""Multi-process misuse of CheckpointManager is a named error within seconds, never a hang.

Real processes (2, two CPU devices each, loopback coordinator), no launcher:
each scenario of ckpt_misuse_worker.py must end every process that reached
the misused call with a CheckpointError naming the processes and the fix,
within the coordination timeout plus a few seconds.
"""

import json
import sys
import time
from pathlib import Path

import pytest
from commands import start_program

from spmd._src.clusters.launch import free_port, process_env

from .procs import child_env as _env

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
WORKER = HERE / "ckpt_misuse_worker.py"
TIMEOUT_S = 4  # the managers' coordination_timeout
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _job(scenario: str, directory: Path) -> dict[int, dict]:
    """Runs both processes; each one's JSON report (process 1 of chief_only is killed)."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
        start_program(
            [sys.executable, str(WORKER), scenario, str(directory), str(TIMEOUT_S)],
            env=process_env(_env(), i, 2, coordinator, 2, 0),
        )
        for i in range(2)
    ]
    reports = {}
    try:
        for i, p in enumerate(procs):
            if scenario == "chief_only" and i == 1:
                continue
            out, err = p.communicate(timeout=120)
            lines = [json.loads(x) for x in out.splitlines() if x.startswith('{"process"')]
            assert len(lines) == 1, out + err[-3000:]
            reports[i] = {**lines[0], "returncode": p.returncode}
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return reports


def _assert_named_error_in_time(report: dict, *fragments: str) -> None:
    assert report["outcome"] == "CheckpointError", report
    assert report["returncode"] == 1, report
    assert report["seconds"] < TIMEOUT_S + 10, report
    for fragment in fragments:
        assert fragment in report["message"], (fragment, report["message"])


def test_per_worker_directories_with_a_shared_filesystem_are_an_error(tmp_path):
    reports = _job("per_worker_dirs", tmp_path)
    for i in (0, 1):
        _assert_named_error_in_time(
            reports[i], "directory_by_process={0: ", "host1", "shared_filesystem=False"
        )
    written = [p.name for p in tmp_path.glob("host*/*")]
    assert written == [".spmd-lock"], written  # process 0's lock, nothing else


def test_a_save_entered_by_the_chief_only_is_an_error_naming_the_absent(tmp_path):
    reports = _job("chief_only", tmp_path)
    _assert_named_error_in_time(
        reports[0],
        f"process(es) [1] did not reach save(step=1) within {TIMEOUT_S} s (hung or slow)",
        "arrived=[0]",
        f"not_arrived_within_s={{{TIMEOUT_S}.0: [1]}}",
        "if is_chief:",
    )
    assert reports[0]["seconds"] >= TIMEOUT_S - 0.5  # waited the timeout, no longer
    assert not (tmp_path / "1").exists()


def test_processes_saving_different_steps_is_an_error(tmp_path):
    reports = _job("different_steps", tmp_path)
    for i in (0, 1):
        _assert_named_error_in_time(reports[i], "step_by_process={0: 1, 1: 2}")
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]


def test_agreed_use_saves_and_restores(tmp_path):
    start = time.monotonic()
    reports = _job("agreed", tmp_path)
    assert [reports[i]["outcome"] for i in (0, 1)] == ["ok", "ok"], reports
    assert time.monotonic() - start < 100
    assert (tmp_path / "1" / "state" / "_METADATA").exists()
