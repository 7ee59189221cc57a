"""What comparing numpy batches across processes costs a step: 2 processes x 4 devices,
each feeding the step the same numpy global batches, compared never (the floor), every
`compare_batch_every` calls (the default) and every call.

Run: python bench/bench_batch_values.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402

WORKER = Path(__file__).with_name("batch_values_worker.py")
MODELS = {"tiny": "one 16x16 dense layer (all dispatch)", "cnn": "the CNN"}


def main(quick: bool = False) -> list[dict]:
    """Seconds per step of each schedule, as ratios to the step that compares nothing."""
    from bench.bench_step import initial_state
    from spmd._src.strategy.step_checks import COMPARE_BATCH_EVERY
    from spmd.testing import run_processes

    steps, repeats = (4, 2) if quick else (100, 5)  # quick: 2 warm-up steps, 8 timed
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        for model in MODELS:
            common.write_leaves(initial_state(model), Path(tmp) / f"{model}.npz")
        run_processes(
            [sys.executable, str(WORKER), str(steps), str(repeats), str(out), tmp],
            2,
            devices_per_process=4,
            timeout=600,
            env={"PYTHONPATH": str(ROOT)},
        )
        results = json.loads(out.read_text())
    notes = {
        "never": "compare_batch_every=0: the floor",
        "default": f"compare_batch_every={COMPARE_BATCH_EVERY}: at each new signature and "
        f"every {COMPARE_BATCH_EVERY} calls",
        "every call": "compare_batch_every=1: a coordination-service round trip each call",
        "comparison alone": "host_prints + agree_on_values, no step: ratio to the floor's step",
    }
    rows = []
    for model, timings in results.items():
        floor = timings["never"]
        for name, t in timings.items():
            rows.append(
                {
                    "benchmark": "comparing numpy batches across processes",
                    "case": f"{MODELS[model]}, 2 processes x 4 devices, {name}",
                    "time/step": common.fmt_time(t),
                    "ratio": common.ratio(t, floor),
                    "note": notes[name],
                }
            )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(common.table(main(args.quick), ["case", "time/step", "ratio", "note"]))
