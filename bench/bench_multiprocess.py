"""2 processes x 4 devices against 1 process x 8 devices: the same CNN, the same losses;
and what `CheckpointManager.save` adds to each step at 2, 4 and 8 processes.

Run: python bench/bench_multiprocess.py [--quick]

The save rows: the tiny model's step (one CPU device a process), alone and followed
by `save(step, state)` with no checkpoint due, in turns (bench/save_worker.py):
what BackupAndRestore adds to every batch between its checkpoints. The ratio is
the median over turns of (step + save) / step; "growth" is the saving turns' last
quarter of steps against their first quarter (1.0: no growth with steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402

WORKER = Path(__file__).with_name("mp_worker.py")
SAVE_WORKER = Path(__file__).with_name("save_worker.py")


def _run(processes: int, devices: int, steps: int) -> dict:
    from bench.bench_step import initial_state
    from spmd.testing import run_processes

    with tempfile.TemporaryDirectory() as tmp:
        out, initial = Path(tmp) / "result.json", Path(tmp) / "state.npz"
        common.write_leaves(initial_state("cnn"), initial)
        run_processes(
            [sys.executable, str(WORKER), str(steps), str(out), str(initial)],
            processes,
            devices_per_process=devices,
            timeout=300,
            env={"PYTHONPATH": str(ROOT)},
        )
        return json.loads(out.read_text())


def _save_run(processes: int, steps: int) -> dict:
    from spmd.testing import run_processes

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(SAVE_WORKER), str(steps), str(Path(tmp) / "ckpt"), str(out)]
        run_processes(
            command, processes, devices_per_process=1, timeout=600, env={"PYTHONPATH": str(ROOT)}
        )
        return json.loads(out.read_text())


def save_rows(quick: bool = False) -> list[dict]:
    """Per-step cost of save() with no checkpoint due, at 2, 4 and 8 processes (2 with --quick)."""
    rows = []
    for processes in (2,) if quick else (2, 4, 8):
        run = _save_run(processes, 20 if quick else 200)
        ratio = statistics.median(s / p for s, p in zip(run["save"], run["plain"], strict=True))
        growth = statistics.median(
            last / first
            for first, last in zip(run["first_quarter"], run["last_quarter"], strict=True)
        )
        added = statistics.median(s - p for s, p in zip(run["save"], run["plain"], strict=True))
        rows.append(
            {
                "benchmark": "checkpoint save per step",
                "case": f"tiny step + save(), no checkpoint due, {processes} processes (gloo)",
                "time/step": common.fmt_time(
                    {
                        "median": statistics.median(run["save"]),
                        "min": min(run["save"]),
                        "max": max(run["save"]),
                    }
                ),
                "ratio": f"{ratio:.3f}x",
                "note": f"added {added * 1e3:.2f} ms/step; growth {growth:.2f}",
            }
        )
    return rows


def main(quick: bool = False) -> list[dict]:
    """Throughput of 2 x 4 against 1 x 8, and the largest loss difference between them."""
    steps, repeats = (4, 1) if quick else (10, 3)
    one = [_run(1, 8, steps) for _ in range(repeats)]
    two = [_run(2, 4, steps) for _ in range(repeats)]

    def stats(runs):
        values = [r["seconds_per_step"] for r in runs]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    gap = max(abs(a - b) for a, b in zip(one[0]["losses"], two[0]["losses"], strict=True))
    t1, t2 = stats(one), stats(two)
    return [
        {
            "benchmark": "multi-process",
            "case": "CNN, MultiWorkerMirroredStrategy, 1 process x 8 devices",
            "time/step": common.fmt_time(t1),
            "ratio": "1.000x",
            "note": "",
        },
        {
            "benchmark": "multi-process",
            "case": "CNN, MultiWorkerMirroredStrategy, 2 processes x 4 devices (gloo)",
            "time/step": common.fmt_time(t2),
            "ratio": common.ratio(t2, t1),
            "note": f"largest loss difference over {steps - 1} steps: {gap:.1e}",
        },
        *save_rows(quick),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(common.table(main(args.quick), ["case", "time/step", "ratio", "note"]))
