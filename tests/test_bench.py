"""The benchmark command runs (a smoke run: few steps, no timing asserted) and writes its page."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(args, timeout, **env):
    """Runs `python *args` in the repository, without the tests' XLA_FLAGS; fails if it fails."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.bench
def test_bench_quick_writes_the_performance_page(tmp_path):
    out = tmp_path / "performance.md"
    only = ["bench_step", "bench_feed", "bench_input", "bench_multiprocess"]
    run_bench(["-m", "bench", "--quick", "--output", str(out), "--only", *only], timeout=900)
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
def test_bench_quick_measures_the_step_with_and_without_the_hang_watch(tmp_path):
    out = tmp_path / "performance.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    argv = [sys.executable, "-m", "bench", "--quick", "--output", str(out)]
    result = subprocess.run(
        [*argv, "--only", "bench_hang_watch"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [row] = [line for line in out.read_text().splitlines() if "hang watch every 0.25 s" in line]
    ratios = [cell.strip() for cell in row.split("|") if cell.strip().endswith("x")]
    assert len(ratios) == 2, row  # against the floor, and against the step without the watch


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


@pytest.mark.bench
def test_bench_gpu_quick_runs_every_section_on_cpu(tmp_path):
    # The one-accelerator benchmarks (issue 15) as a CPU smoke run: every section gives rows.
    out = tmp_path / "performance-gpu.md"
    args = ["-m", "bench.bench_gpu", "--quick", "--output", str(out)]
    run_bench(args, timeout=600, JAX_PLATFORMS="cpu")
    text = out.read_text()
    assert "FAILED" not in text
    for section in (
        "## step overhead (1 device)",
        "## steps_per_execution (1 device)",
        "## fed paths, tiny model (1 device)",
        "## MFU, examples/07 transformer LM, bf16",
        "## CentralStorageStrategy (1 device)",
    ):
        body = text.split(section, 1)[1].split("\n## ", 1)[0]
        assert body.count("| 1x cpu |") >= 2, section  # rows, each naming its device
    assert "x |" in text  # ratios were computed


@pytest.mark.bench
@pytest.mark.parametrize("task", ["digits", "lm"])
def test_bench_diloco_quick_writes_its_table(tmp_path, task):
    # DiLoCo against synchronous training (docs/diloco.md's tables) as a smoke run.
    page = tmp_path / "diloco.md"
    page.write_text((ROOT / "docs" / "diloco.md").read_text())
    args = ["bench/bench_diloco.py", "--task", task, "--quick", "--output", str(page)]
    run_bench(args, timeout=600, JAX_PLATFORMS="cpu")
    table = page.read_text().split(f"<!-- bench_diloco {task} table: begin -->", 1)[1]
    table = table.split(f"<!-- bench_diloco {task} table: end -->", 1)[0]
    assert "| synchronous (MirroredStrategy) | - | - |" in table
    assert "| DiLoCo | 2 | 10 |" in table


@pytest.mark.bench
def test_bench_quick_plans_on_cpu_devices_and_for_a_tpu_slice(tmp_path):
    # bench_plan (estimate against measured step, CPU) and plan_maxtext (a 1.9 B decoder
    # for a v5e:2x2, compiled with the TPU compiler) in their quick modes.
    pytest.importorskip("libtpu", reason="the TPU compiler (the tpu-compile extra)")
    out = tmp_path / "performance.md"
    args = ["-m", "bench", "--quick", "--output", str(out), "--only", "bench_plan", "plan_maxtext"]
    run_bench(args, timeout=900)
    text = out.read_text()
    ranking = text.split("## auto_strategy's estimate against the measured step", 1)[1]
    ranking = ranking.split("\n## ", 1)[0]
    assert "| data parallel |" in ranking and "| FSDP over 8 |" in ranking
    assert "| yes |" in ranking  # the layout auto_strategy chose
    decoder = text.split("## planning a MaxText-shaped decoder for a TPU slice (no TPU)", 1)[1]
    assert "| v5e:2x2 | 1.88 B | does not fit |" in decoder and "| pass |" in decoder


@pytest.mark.bench
def test_bench_quick_measures_the_pipelined_step_against_the_scan(tmp_path):
    out = tmp_path / "performance.md"
    run_bench(
        ["-m", "bench", "--quick", "--output", str(out), "--only", "bench_pipeline"], timeout=600
    )
    rows = [line for line in out.read_text().splitlines() if "GPipe: 2 stages" in line]
    assert len(rows) == 2 and all("x |" in row and "%" in row for row in rows)


@pytest.mark.bench
def test_bench_quick_times_context_parallel_attention_and_its_memory(tmp_path):
    # spmd.attention against jax.nn.dot_product_attention (CPU devices), and its peak per
    # device as the context axis grows (v5p-16, the TPU compiler), in the quick mode.
    out = tmp_path / "performance.md"
    run_bench(["-m", "bench", "--quick", "--output", str(out), "--only", "attention"], timeout=900)
    text = out.read_text()
    assert "## context-parallel attention: step time" in text and "x |" in text
    assert "| length 2048, context 4 |" in text
