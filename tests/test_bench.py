"""The benchmark command runs (a smoke run: few steps, no timing asserted) and writes its page."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bounds import bound
from commands import program_env, run_program

ROOT = Path(__file__).resolve().parents[1]
# Idle-machine bounds of the smoke runs (`run_bench`): the whole quick run, and the others.
QUICK_S, SMOKE_S = 600, 300


def run_bench(args, seconds, **env):
    """Runs `python *args` in the repository (forked from the run's warm interpreter where
    it can be: tests/commands.run_program), compiling as the run does (`program_env`: its
    optimization level, no other XLA flag; a smoke run asserts no timing, and each ratio's
    floor compiles the same way, at about 30% less CPU); fails if it fails.

    `seconds` bounds it on an idle machine, and is given the run's headroom
    (tests/bounds.py): in a parallel run the benchmarks start first, beside the
    multi-process tests, and get a share of the cores. Each test's own time limit
    (its timeout marker, given the same headroom) is a minute more on an idle
    machine, so that this bound, which names the command, ends a run that hangs."""
    env = {**program_env(), **env}  # spmd and bench/ importable from the repository
    result = run_program([sys.executable, *args], env, bound(seconds), cwd=ROOT)  # forked
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


SECTIONS = (  # every table of the quick page, by the module that writes it
    "## step overhead",  # bench_step
    "## NNX state",
    "## steps_per_execution",
    "## strategies",
    "## fed paths, tiny model",  # bench_feed
    "## input pipeline",  # bench_input
    "## checkpoint",  # bench_checkpoint
    "## multi-process",  # bench_multiprocess
    "## checkpoint save per step",
    "## comparing numpy batches across processes",  # bench_batch_values
    "## hang watch",  # bench_hang_watch
    "## peers",  # bench_peers
    "## scale: processes on loopback",  # bench_scale
    "## scale: explain bytes per device per step",
    "## pipeline",  # bench_pipeline
    "## auto_strategy's estimate against the measured step",  # bench_plan
    "## planning a MaxText-shaped decoder for a TPU slice (no TPU)",  # plan_maxtext
    "## context-parallel attention: step time",  # bench_attention
    "## context-parallel attention: memory per device (v5p-16, explain)",
)
RATIOS = (  # the tables whose rows carry a ratio ("1.023x") to a floor or baseline
    "## step overhead",
    "## NNX state",
    "## steps_per_execution",
    "## strategies",
    "## fed paths, tiny model",
    "## input pipeline",
    "## checkpoint",
    "## multi-process",
    "## checkpoint save per step",
    "## comparing numpy batches across processes",
    "## hang watch",
    "## peers",
    "## pipeline",
    "## context-parallel attention: step time",
    "## context-parallel attention: memory per device (v5p-16, explain)",
)


def section(text: str, heading: str) -> str:
    """The body of the table under `heading` (a heading the page must have)."""
    assert f"\n{heading}" in text, heading
    return text.split(f"\n{heading}", 1)[1].split("\n## ", 1)[0]


def rows_of(body: str) -> list[list[str]]:
    """The cells of each row of the markdown table in `body` (its header row first)."""
    lines = [line for line in body.splitlines() if line.startswith("|") and "---|" not in line]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def seconds(cell: str) -> tuple[float, float, float]:
    """(median, min, max) of a 'median (min–max)' time cell, in its unit."""
    found = re.fullmatch(r"([\d.]+) (?:µs|ms) \(([\d.]+)–([\d.]+)\)", cell)
    assert found, cell
    return tuple(float(v) for v in found.groups())


@pytest.mark.bench
@pytest.mark.timeout(QUICK_S + 60)
def test_bench_quick_runs_every_module_and_writes_every_table(tmp_path):
    # The smoke run of the benchmarks, once: every module of bench/__main__.py's MODULES,
    # every table with its ratios computed; its time is printed against its budget, never
    # asserted. It needs the TPU compiler (the tpu-compile extra: plan_maxtext, attention's
    # memory) and TensorFlow (the test extra: the peers' TensorFlow rows).
    # One lane (--jobs 1): in the suite every core is busy already, and two lanes cost a
    # quarter more CPU; test_the_quick_runs_lanes_merge_into_one_page runs two.
    out = tmp_path / "performance.md"
    args = ["-m", "bench", "--quick", "--jobs", "1", "--output", str(out)]
    printed = run_bench(args, QUICK_S).stdout
    print("\n".join(line for line in printed.splitlines() if re.search(r" s CPU\)?\.?$", line)))
    text = out.read_text()
    assert re.search(
        r"--quick` in \d+ s \(the smoke run, compiled at XLA's optimization level 0; "
        r"its budget: \d+ s",
        text,
    )
    assert re.search(r"total: \d+ s wall \(budget \d+ s[^)]*\), \d+ s CPU", printed)
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    for heading in SECTIONS:  # some headings end with a figure: "(rank correlation 1.0)"
        assert any(h == heading or h.startswith(f"{heading} (") for h in headings), heading
    for heading in RATIOS:
        assert re.search(r"\| \d+\.\d+x \|", section(text, heading)), heading
    measured = text.split("\n## On a GPU", 1)[0]  # the rest is docs/performance-gpu.md
    assert "failed" not in measured.lower()  # no row of a benchmark that could not run

    # the step with and without the hang watch: against the floor, and against each other
    [row] = [line for line in text.splitlines() if "hang watch every 0.25 s" in line]
    ratios = [cell.strip() for cell in row.split("|") if cell.strip().endswith("x")]
    assert len(ratios) == 2, row

    # TensorFlow's peers (custom loop and Keras fit, both models) trained and report a time
    # per step and its ratio to the floor
    header, *peers = rows_of(section(text, "## peers"))
    for model in ("cnn", "tiny"):
        for peer in ("custom loop", "Keras fit"):
            case = f"{model}, TensorFlow MirroredStrategy {peer}, 8 replicas"
            [row] = [dict(zip(header, cells, strict=True)) for cells in peers if cells[0] == case]
            median, low, high = seconds(row["time/step"])
            assert 0 < low <= median <= high, row
            assert re.fullmatch(r"\d+\.\d+x", row["ratio"]), row

    # auto_strategy's ranking (CPU devices) and plan_maxtext's 1.9 B decoder on a v5e:2x2
    ranking = section(text, "## auto_strategy's estimate against the measured step")
    assert "| data parallel |" in ranking and "| FSDP over 8 |" in ranking
    assert "| yes |" in ranking  # the layout auto_strategy chose
    decoder = section(text, "## planning a MaxText-shaped decoder for a TPU slice (no TPU)")
    assert "| v5e:2x2 | 1.88 B | does not fit |" in decoder and "| pass |" in decoder

    # the pipelined step against the scan: two GPipe rows, each with its ratio and bubble
    rows = [line for line in text.splitlines() if "GPipe: 2 stages" in line]
    assert len(rows) == 2 and all("x |" in row and "%" in row for row in rows)

    # context-parallel attention: the step against the floor, its memory as context grows
    memory = section(text, "## context-parallel attention: memory per device (v5p-16, explain)")
    header, *cases = rows_of(memory)
    by_case = {cells[0]: dict(zip(header, cells, strict=True)) for cells in cases}
    assert by_case["length 512, context 1"]["vs context 1"] == "1.00x"
    assert float(by_case["length 512, context 4"]["vs context 1"].rstrip("x")) < 1, by_case


@pytest.mark.bench
@pytest.mark.timeout(SMOKE_S + 60)
def test_bench_gpu_quick_runs_every_section_on_cpu(tmp_path):
    # The one-accelerator benchmarks (issue 15) as a CPU smoke run: every section gives rows.
    out = tmp_path / "performance-gpu.md"
    args = ["-m", "bench.bench_gpu", "--quick", "--output", str(out)]
    run_bench(args, SMOKE_S, JAX_PLATFORMS="cpu")
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
@pytest.mark.timeout(SMOKE_S + 60)
@pytest.mark.parametrize("task", ["digits", "lm"])
def test_bench_diloco_quick_writes_its_table(tmp_path, task):
    # DiLoCo against synchronous training (docs/diloco.md's tables) as a smoke run.
    page = tmp_path / "diloco.md"
    page.write_text((ROOT / "docs" / "diloco.md").read_text())
    args = ["bench/bench_diloco.py", "--task", task, "--quick", "--output", str(page)]
    run_bench(args, SMOKE_S, JAX_PLATFORMS="cpu")
    table = page.read_text().split(f"<!-- bench_diloco {task} table: begin -->", 1)[1]
    table = table.split(f"<!-- bench_diloco {task} table: end -->", 1)[0]
    assert "| synchronous (MirroredStrategy) | - | - |" in table
    assert "| DiLoCo | 2 | 10 |" in table


def test_bench_only_refuses_an_unknown_module_and_names_the_known_ones(capsys):
    from bench.__main__ import MODULES, main

    with pytest.raises(SystemExit):
        main(["--quick", "--only", "step", "bench_nope"])
    error = capsys.readouterr().err
    assert "Received: --only step bench_nope" in error
    assert all(name in error for name in MODULES)


def test_quick_run_over_its_budget_warns_and_names_the_slowest_modules():
    # Timing is reported, never asserted: over the budget is a WARNING line, not a failure.
    from bench.__main__ import QUICK_BUDGET_S, summary

    spent = {"bench_a": (1.0, 1.0), "bench_b": (QUICK_BUDGET_S, 90.0), "bench_c": (3.0, 2.0)}
    spent["bench_d"] = (2.0, 2.0)
    total, warning = summary(spent, quick=True)
    assert (
        total
        == f"total: {QUICK_BUDGET_S + 6:.0f} s wall (budget {QUICK_BUDGET_S} s on an idle 2-core machine), 95 s CPU"
    )
    assert warning.startswith("WARNING: the quick run took")
    assert (
        f"Slowest: bench_b {QUICK_BUDGET_S} s (90 s CPU), bench_c 3 s (2 s CPU), bench_d 2 s"
        in warning
    )
    assert summary({"bench_a": (1.0, 1.0)}, quick=True) == [
        f"total: 1 s wall (budget {QUICK_BUDGET_S} s on an idle 2-core machine), 1 s CPU"
    ]
    assert summary(spent, quick=False) == [f"total: {QUICK_BUDGET_S + 6:.0f} s wall, 95 s CPU"]


def test_bench_output_in_a_missing_folder_is_refused_before_any_benchmark(capsys, tmp_path):
    from bench.__main__ import main

    page = tmp_path / "missing" / "performance.md"
    with pytest.raises(SystemExit):
        main(["--quick", "--only", "step", "--output", str(page)])
    assert f"Received: --output {page}" in capsys.readouterr().err


def test_the_quick_runs_lanes_hold_every_module_once_with_peers_beside_step():
    # bench_peers' quick rows read bench_step's figures of the same process: one lane.
    from bench.__main__ import LANES, MODULES, lanes

    assert sorted(name for lane in LANES for name in lane) == sorted(MODULES)
    [with_peers] = [lane for lane in LANES if "bench_peers" in lane]
    assert "bench_step" in with_peers
    assert lanes(list(MODULES), 1) == [list(MODULES)]
    two = lanes(list(MODULES), 2)
    assert len(two) == 2 and sorted(n for lane in two for n in lane) == sorted(MODULES)
    assert all(lane == sorted(lane, key=MODULES.index) for lane in two)  # the page's order
    assert lanes(["plan_maxtext", "bench_step"], 2) == [["bench_step"], ["plan_maxtext"]]
    assert lanes(["plan_maxtext"], 2) == [["plan_maxtext"]]


@pytest.mark.parametrize(
    "flags, want",
    [
        (None, "--xla_backend_optimization_level=0"),
        ("--xla_dump_to=/tmp/d", "--xla_dump_to=/tmp/d --xla_backend_optimization_level=0"),
        ("--xla_backend_optimization_level=2", "--xla_backend_optimization_level=2"),
    ],
)
def test_the_smoke_run_compiles_at_level_0_unless_the_flags_set_a_level(monkeypatch, flags, want):
    from bench import common

    if flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", flags)
    common.compile_unoptimized()
    assert os.environ["XLA_FLAGS"] == want


def test_a_lane_that_fails_is_named_with_its_exit_status(tmp_path):
    from bench.__main__ import _lane_result

    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match=r"failed \(exit 3\); its output is above"):
        _lane_result(child, tmp_path / "lane.json")


def test_jobs_below_one_is_refused(capsys):
    from bench.__main__ import main

    with pytest.raises(SystemExit):
        main(["--quick", "--jobs", "0"])
    error = capsys.readouterr().err
    assert "--jobs is how many lanes of modules run at once, 1 or more" in error
    assert "Received: --jobs 0" in error


def test_lanes_without_quick_are_refused(capsys):
    # The full run's figures are each taken on a machine the module has to itself.
    from bench.__main__ import main

    with pytest.raises(SystemExit):
        main(["--jobs", "2", "--only", "step"])
    error = capsys.readouterr().err
    assert "--jobs above 1 is for the smoke run (--quick)" in error
    assert "Received: --jobs 2 without --quick" in error


def test_the_total_of_lanes_run_at_once_is_the_runs_wall_time():
    from bench.__main__ import QUICK_BUDGET_S, summary

    spent = {"bench_a": (70.0, 80.0), "bench_b": (60.0, 70.0)}
    assert summary(spent, quick=True, wall=75.0) == [
        f"total: 75 s wall (budget {QUICK_BUDGET_S} s on an idle 2-core machine), 150 s CPU"
    ]


@pytest.mark.bench
@pytest.mark.timeout(SMOKE_S + 60)
def test_the_quick_runs_lanes_merge_into_one_page(tmp_path):
    # Two cheap modules of different lanes, each run by its own process: one page, the
    # tables in MODULES' order, each module's time printed once, one total.
    from bench.__main__ import LANES

    assert "bench_pipeline" in LANES[1] and "bench_plan" in LANES[0]
    out = tmp_path / "performance.md"
    args = ["-m", "bench", "--quick", "--only", "pipeline", "plan", "--output", str(out)]
    printed = run_bench(args, SMOKE_S).stdout
    text = out.read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[0] == "## pipeline" and headings[1].startswith("## auto_strategy's estimate")
    for name in ("bench_pipeline", "bench_plan"):
        assert len(re.findall(rf"^{name}: [\d.]+ s wall, [\d.]+ s CPU$", printed, re.M)) == 1
    assert len(re.findall(r"^total: ", printed, re.M)) == 1
