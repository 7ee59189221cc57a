"""shared_filesystem=False: what process 0 cannot read, every process learns, in bounded time.

Real processes (2, two CPU devices each, loopback coordinator), no launcher.
The checkpoint lives on process 0's disk only; the other process gets every
value by broadcast. A damaged step there is skipped by both processes; a
step process 0 may not read is an error on both, never a hang in the
broadcast and never a step set aside.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from commands import start_program

from spmd._src.clusters.launch import free_port, process_env

from .procs import child_env as _env

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
WORKER = HERE / "ckpt_chief_worker.py"
TIMEOUT_S = 4  # the managers' coordination_timeout
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _job(phase: str, directory: Path, prefix: tuple[str, ...] = ()) -> dict[int, dict]:
    """Runs both processes of one phase; each one's JSON report and return code."""
    coordinator = f"127.0.0.1:{free_port()}"
    command = [*prefix, sys.executable, str(WORKER), phase, str(directory), str(TIMEOUT_S)]
    procs = [
        start_program(command, env=process_env(_env(), i, 2, coordinator, 2, 0)) for i in range(2)
    ]
    reports = {}
    try:
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=120)
            lines = [json.loads(x) for x in out.splitlines() if x.startswith('{"outcome"')]
            assert len(lines) == 1, out + err[-3000:]
            reports[i] = {**lines[0], "returncode": p.returncode}
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return reports


def test_a_step_damaged_on_process_0_is_skipped_by_every_process(tmp_path):
    assert all(r["outcome"] == "ok" for r in _job("save", tmp_path).values())
    os.truncate(tmp_path / "2" / "data" / "metadata", 10)
    reports = _job("restore", tmp_path)
    for report in reports.values():
        assert report["outcome"] == "ok", report
        assert (report["step"], report["position"]) == (1, {"batch": 10}), report
        assert report["values"] == [float(i + 1) for i in range(8)], report
    assert (tmp_path / "2.damaged").is_dir()


def test_a_step_process_0_may_not_read_is_an_error_on_every_process(tmp_path):
    assert all(r["outcome"] == "ok" for r in _job("save", tmp_path).values())
    prefix: tuple[str, ...] = ()
    for step in ("1", "2"):
        folder = tmp_path / step
        for p in [folder, *folder.rglob("*")]:
            p.chmod(0o700 if p.is_dir() else 0o600)
            if os.geteuid() == 0:
                os.chown(p, 65534, 65534)  # nobody
    if os.geteuid() == 0:  # root reads anything: run without the DAC override capabilities
        assert shutil.which("setpriv"), "needs setpriv (util-linux) to drop root's DAC override"
        caps = "-dac_override,-dac_read_search"
        prefix = ("setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}")
    reports = _job("restore", tmp_path, prefix)
    for report in reports.values():
        assert report["outcome"] == "CheckpointError", report
        assert "ermission" in report["message"] and "step=" in report["message"], report
        assert report["seconds"] < TIMEOUT_S + 10, report
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["1", "2"]
