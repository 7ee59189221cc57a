"""The benchmark command runs (a smoke run: few steps, no timing asserted) and writes its page."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.bench
def test_bench_quick_writes_the_performance_page(tmp_path):
    out = tmp_path / "performance.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            "--output",
            str(out),
            "--only",
            "bench_step",
            "bench_feed",
            "bench_input",
            "bench_multiprocess",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out.read_text()
    for section in (
        "## step overhead",
        "## steps_per_execution",
        "## fed paths, tiny model",
        "## strategies",
        "## input pipeline",
        "## multi-process",
    ):
        assert section in text
    assert "x |" in text  # ratios were computed


@pytest.mark.bench
@pytest.mark.parametrize("peer", ["tf-loop", "tf-fit"])
def test_tensorflow_peer_trains_and_reports_its_step_time(peer):
    # TensorFlow is in the test extra, so the peers' TensorFlow rows run in CI.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peers_worker.py"), peer, "tiny", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    times = json.loads(result.stdout.strip().splitlines()[-1])
    assert 0 < times["min"] <= times["median"] <= times["max"]
