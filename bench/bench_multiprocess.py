"""2 processes x 4 devices against 1 process x 8 devices: the same CNN, the same losses.

Run: python bench/bench_multiprocess.py [--quick]
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


def _run(processes: int, devices: int, steps: int) -> dict:
    from spmd.testing import run_processes

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        run_processes(
            [sys.executable, str(WORKER), str(steps), str(out)],
            processes,
            devices_per_process=devices,
            timeout=300,
            env={"PYTHONPATH": str(ROOT)},
        )
        return json.loads(out.read_text())


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
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(common.table(main(args.quick), ["case", "time/step", "ratio", "note"]))
