"""Runs every benchmark and writes docs/performance.md.

Run: python -m bench [--quick] [--output docs/performance.md]
Each figure is the median of several runs with min–max, and a ratio to the
hand-written jax.jit floor measured in the same run. Absolute times on a shared
2-core machine are noise; the ratios are the result.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
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
HIDDEN = {"benchmark", "median_s"}


def _columns(rows: list[dict]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in HIDDEN and key not in columns]
    return columns


def render(rows: list[dict], seconds: float, quick: bool) -> str:
    """The markdown page: one table per benchmark, in the order they ran."""
    import jax

    lines = [
        "# Performance",
        "",
        "Written by `python -m bench`" + (" --quick" if quick else "") + f" in {seconds:.0f} s on "
        f"{platform.machine()}, jax {jax.__version__}, {jax.device_count()} simulated CPU devices. "
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (CI smoke)")
    parser.add_argument("--only", nargs="*", default=None, help="module names to run")
    parser.add_argument("--output", default=str(ROOT / "docs" / "performance.md"))
    args = parser.parse_args(argv)
    common.set_cpu_devices(8)
    start, rows = time.perf_counter(), []
    for name in args.only or MODULES:
        name = name if name.startswith(("bench_", "plan_")) else f"bench_{name}"
        module = importlib.import_module(f"bench.{name}")
        print(f"running {name} ...", flush=True)
        rows += module.main(args.quick)
    text = render(rows, time.perf_counter() - start, args.quick)
    Path(args.output).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
