"""Runs every benchmark and writes docs/performance.md.

Run: python -m bench [--quick] [--output docs/performance.md]
Each figure is the median of several runs with min–max, and a ratio to the
hand-written jax.jit floor measured in the same run. Absolute times on a shared
2-core machine are noise; the ratios are the result.

`--quick` is the smoke run (tests/test_bench.py runs it): every module, every
table with its ratios, few steps and repeats, within QUICK_BUDGET_S of wall time
on an idle 2-core machine; its processes share one persistent compilation cache
(common.share_compilations), so that a program is compiled once per run, and
compile at XLA's optimization level 0 (common.compile_unoptimized), and its
modules run in two lanes at once (LANES: this process and one more, `--jobs 1`
for one lane), which keeps both cores busy while a module waits for the
processes it starts. It prints each module's wall and CPU seconds and, at the
end, its total against the budget; over budget, a WARNING naming the slowest
modules (timing is reported, never a failure). The full run takes one module at
a time (more lanes are refused without --quick): each figure is measured on a
machine it has to itself.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

MODULES = (
    "bench_step",
    "bench_feed",
    "bench_input",
    "bench_checkpoint",
    "bench_multiprocess",
    "bench_batch_values",
    "bench_hang_watch",
    "bench_peers",
    "bench_scale",
    "bench_pipeline",
    "bench_plan",
    "plan_maxtext",
    "bench_attention",
)
# The quick run's lanes, about equal in wall time (seconds in the quick run of 2026-12-03
# evening: 154 and 147; CPU 129 and 164: the first lane's modules wait on their processes).
# bench_peers reads bench_step's figures of its own process.
LANES = (
    ("bench_step", "bench_peers", "bench_checkpoint", "bench_plan"),
    (
        "bench_hang_watch",
        "bench_feed",
        "bench_input",
        "bench_multiprocess",
        "bench_batch_values",
        "bench_scale",
        "bench_pipeline",
        "plan_maxtext",
        "bench_attention",
    ),
)
HIDDEN = {"benchmark", "median_s"}
QUICK_BUDGET_S = 120  # the smoke run's wall time on an idle 2-core machine


def _columns(rows: list[dict]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in HIDDEN and key not in columns]
    return columns


def render(rows: list[dict], seconds: float, quick: bool) -> str:
    """The markdown page: one table per benchmark, in the order they ran."""
    import jax

    command = "python -m bench --quick" if quick else "python -m bench"
    budget = (
        " (the smoke run, compiled at XLA's optimization level 0; its budget: "
        f"{QUICK_BUDGET_S} s on an idle 2-core machine)"
    )
    budget = budget if quick else ""
    lines = [
        "# Performance",
        "",
        f"Written by `{command}` in {seconds:.0f} s{budget} on {platform.machine()}, "
        f"jax {jax.__version__}, {jax.device_count()} simulated CPU devices. "
        "Every figure is a median with min–max over several runs; the ratio is against the "
        "hand-written `jax.jit` floor (or the baseline named) measured in the same run. "
        "Absolute times on a shared 2-core machine are noise: read the ratios.",
        "",
    ]
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["benchmark"], []).append(row)
    for name, group in groups.items():
        lines += [f"## {name}", "", common.table(group, _columns(group)), ""]
    gpu = ROOT / "docs" / "performance-gpu.md"
    if gpu.exists():  # written by `python -m bench.bench_gpu` on an accelerator
        body = gpu.read_text().split("\n", 1)[1].replace("\n## ", "\n### ")
        lines += [
            "## On a GPU (`python -m bench.bench_gpu`, docs/performance-gpu.md)",
            body.strip(),
            "",
        ]
    notes = ROOT / "bench" / "NOTES.md"
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    return "\n".join(lines)


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process and of its children waited for."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def summary(
    spent: dict[str, tuple[float, float]], quick: bool, wall: float | None = None
) -> list[str]:
    """The run's closing lines: its total wall and CPU seconds, against the budget when quick.

    Args:
      spent: module name -> (wall seconds, CPU seconds, children included).
      quick: whether this was the smoke run, which has a wall-time budget.
      wall: the run's wall seconds, where its modules ran in lanes at once; by default
        the sum of the modules' (one at a time).

    Returns:
      One line of totals; with --quick over QUICK_BUDGET_S, a WARNING line naming
      the three slowest modules after it.
    """
    cpu = sum(c for _, c in spent.values())
    wall = sum(w for w, _ in spent.values()) if wall is None else wall
    budget = f" (budget {QUICK_BUDGET_S} s on an idle 2-core machine)" if quick else ""
    lines = [f"total: {wall:.0f} s wall{budget}, {cpu:.0f} s CPU"]
    if quick and wall > QUICK_BUDGET_S:
        slowest = sorted(spent.items(), key=lambda item: -item[1][0])[:3]
        named = ", ".join(f"{name} {w:.0f} s ({c:.0f} s CPU)" for name, (w, c) in slowest)
        lines.append(
            f"WARNING: the quick run took {wall:.0f} s, over its {QUICK_BUDGET_S} s budget "
            f"(a loaded machine stretches wall time; the CPU seconds say more). Slowest: {named}."
        )
    return lines


def lanes(names: list[str], jobs: int) -> list[list[str]]:
    """`names` in the order given, split into at most `jobs` lanes (LANES', each keeping
    its modules together); one lane for `jobs` 1."""
    if jobs == 1:
        return [names]
    split = [[n for n in names if n in lane] for lane in LANES[:jobs]]
    return [lane for lane in split if lane]


def _run_modules(names: list[str], quick: bool) -> tuple[dict, dict]:
    """Each module's rows and its (wall, CPU) seconds, one module at a time in this process."""
    rows, spent = {}, {}
    for name in names:
        wall, cpu = time.perf_counter(), _cpu_seconds()
        module = importlib.import_module(f"bench.{name}")
        print(f"running {name} ...", flush=True)
        rows[name] = module.main(quick)
        spent[name] = (time.perf_counter() - wall, _cpu_seconds() - cpu)
        print(f"{name}: {spent[name][0]:.1f} s wall, {spent[name][1]:.1f} s CPU", flush=True)
    return rows, spent


def _start_lane(names: list[str], quick: bool, folder: str) -> tuple[subprocess.Popen, Path]:
    """A process that runs `names` and writes their rows and seconds to a file of `folder`
    (it prints its progress beside this process's)."""
    out = Path(folder, f"lane-{names[0]}.json")
    command = [sys.executable, "-m", "bench", "--jobs", "1", "--lane-output", str(out)]
    command += ["--quick"] * quick + ["--only", *names]
    return subprocess.Popen(command, cwd=ROOT), out


def _lane_result(child: subprocess.Popen, out: Path) -> tuple[dict, dict]:
    """The rows and seconds a lane's process wrote, once it has ended; its failure named."""
    if child.wait() != 0 or not out.exists():
        raise RuntimeError(
            f"the lane `{' '.join(child.args[2:])}` failed (exit {child.returncode}); "
            "its output is above. To run it alone: the same command without --lane-output."
        )
    found = json.loads(out.read_text())
    return found["rows"], {name: tuple(s) for name, s in found["spent"].items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (CI smoke)")
    parser.add_argument("--only", nargs="*", default=None, help="module names to run")
    parser.add_argument("--output", default=str(ROOT / "docs" / "performance.md"))
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="lanes of modules run at once (default: 2 with --quick, else 1)",
    )
    parser.add_argument("--lane-output", default=None, help=argparse.SUPPRESS)  # a lane's JSON
    args = parser.parse_args(argv)
    names = [n if n.startswith(("bench_", "plan_")) else f"bench_{n}" for n in args.only or ()]
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        parser.error(
            f"--only takes benchmark modules of this command, each with main(quick): "
            f"{', '.join(MODULES)} (the bench_ prefix may be left out). "
            f"Received: --only {' '.join(args.only)}"
        )
    if not Path(args.output).parent.is_dir():  # known before minutes of benchmarks, not after
        parser.error(
            "--output is the page to write, in a folder that exists. "
            f"Received: --output {args.output} (no folder {Path(args.output).parent})"
        )
    jobs = args.jobs if args.jobs is not None else (len(LANES) if args.quick else 1)
    if jobs < 1:
        parser.error(
            f"--jobs is how many lanes of modules run at once, 1 or more. "
            f"Received: --jobs {args.jobs}"
        )
    if jobs > 1 and not args.quick:  # the page's figures would be taken beside another lane
        parser.error(
            "--jobs above 1 is for the smoke run (--quick): the full run measures each "
            f"module on a machine it has to itself. Received: --jobs {args.jobs} without "
            "--quick. To fix: leave --jobs out, or add --quick."
        )
    common.set_cpu_devices(8)
    if args.quick:  # before the lanes start: they share the cache and the level
        common.share_compilations()
        common.compile_unoptimized()
    start = time.perf_counter()
    chosen = names or list(MODULES)
    own, *others = lanes(chosen, jobs)
    with tempfile.TemporaryDirectory(prefix="spmd-bench-lanes-") as folder:
        started = [_start_lane(lane, args.quick, folder) for lane in others]
        try:
            rows_of, spent = _run_modules(own, args.quick)
        except BaseException:  # this lane's error is the one to see: the others stop
            for child, _ in started:
                child.kill()
                child.wait()
            raise
        for lane_rows, lane_spent in [_lane_result(*lane) for lane in started]:
            rows_of.update(lane_rows)
            spent.update(lane_spent)
    if args.lane_output:
        Path(args.lane_output).write_text(json.dumps({"rows": rows_of, "spent": spent}))
        return 0
    rows = [row for name in chosen for row in rows_of[name]]
    text = render(rows, time.perf_counter() - start, args.quick)
    Path(args.output).write_text(text)
    print(text)
    spent = {name: spent[name] for name in chosen}
    print("\n".join(summary(spent, args.quick, wall=time.perf_counter() - start)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
