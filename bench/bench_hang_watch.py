"""The hang watch's cost in the steady state: a step with and without the watch beside it.

Run: python bench/bench_hang_watch.py [--quick]
A worker process (hang_watch_worker.py) times the tiny model's step on 8 CPU
devices in turns: the hand-written jax.jit floor, spmd's step, and spmd's step
with process 0's watch doing its work every 0.25 s (the shortest interval; the
default is 5 s) over 100 processes' records. It adds no collective to the step;
a step call pays one list-item increment.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402

WORKER = Path(__file__).with_name("hang_watch_worker.py")


def _measure(steps: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, str(WORKER), str(steps), str(repeats), str(out)]
        subprocess.run(argv, env=env, check=True, timeout=600, capture_output=True)
        return json.loads(out.read_text())


def main(quick: bool = False) -> list[dict]:
    """Rows: the step against the floor without and with the watch, and the watch's own work."""
    found = _measure(50 if quick else 400, 3 if quick else 15)
    times, tick = found["times"], found["tick_s"]
    case = "tiny, MirroredStrategy, 8 devices"
    today = datetime.date.today().isoformat()
    floor = common.fmt_time(times["floor"])
    rows = [
        {
            "benchmark": "hang watch",
            "case": f"{case}, {label}",
            "floor": floor,
            "spmd": common.fmt_time(times[name]),
            "ratio": common.ratio(times[name], times["floor"]),
            "with / without the watch": common.ratio(times["on"], times["off"]) if on else "",
            "measured": today,
        }
        for name, label, on in (
            ("off", "no hang watch", False),
            ("on", "hang watch every 0.25 s, 100 processes' records", True),
        )
    ]
    share = ", ".join(f"{100 * tick / s:.2f}% of one core at {s:g} s" for s in (0.25, 5.0))
    rows.append(
        {
            "benchmark": "hang watch",
            "case": "process 0's work each interval (look at its main thread, publish, read and "
            "judge 100 records)",
            "spmd": f"{tick * 1e3:.2f} ms ({share}); a step call: +1 on a counter, "
            f"{found['count_s'] * 1e9:.0f} ns",
            "measured": today,
        }
    )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = main(args.quick)
    columns = ["case", "floor", "spmd", "ratio", "with / without the watch", "measured"]
    print(common.table(rows, columns))
