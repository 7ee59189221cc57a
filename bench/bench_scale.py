"""Pieces of a large job that one machine can measure: joining, a barrier, a psum, explain's bytes.

Run: python -m bench --only bench_scale [--quick]   (or python bench/bench_scale.py)
Loopback processes with one CPU device each (gloo collectives) join one
cluster: the seconds `import spmd` takes and then `spmd.initialize()` on process 0, one barrier through the coordination
service, and a small all-reduce across the processes. Then the bytes of a
small transformer's step by `explain`, on 8, 16 and 64 simulated devices, split
into the collectives that cross hosts and those that stay inside one
(bench/scale_explain.py). docs/scale.md extrapolates these.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("scale_worker.py")


def _join(processes: int) -> dict:
    from spmd.testing import run_processes

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        run_processes(
            [sys.executable, str(WORKER), str(out)],
            processes,
            devices_per_process=1,
            timeout=300,
            env={"PYTHONPATH": str(ROOT)},
        )
        return json.loads(out.read_text())


def _explain(devices: int, quick: bool = False) -> list[dict]:
    """scale_explain's rows for `devices` simulated devices: in a process of their own, or,
    with --quick when this process has that many CPU devices, here (one start-up fewer)."""
    import jax

    if quick and jax.default_backend() == "cpu" and jax.device_count() == devices:
        from bench import scale_explain

        return scale_explain.rows(devices)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.scale_explain", str(devices)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(quick: bool = False) -> list[dict]:
    """Join/barrier/psum seconds per process count, and explain's bytes per device count."""
    rows = []
    # quick: one cluster of 2 (each count is a cluster of that many started processes, 8 of
    # them ~15 s of CPU); how the figures grow with the count is the full run's
    for processes in (2,) if quick else (2, 4, 8, 16):
        t = _join(processes)
        rows.append(
            {
                "benchmark": "scale: processes on loopback",
                "processes": processes,
                "import spmd (s)": f"{t['import']:.2f}",
                "initialize (s)": f"{t['initialize']:.2f}",
                "barrier (ms)": f"{t['barrier'] * 1e3:.1f}",
                "psum (ms)": f"{t['psum'] * 1e3:.1f}",
            }
        )
    for devices in (8,) if quick else (8, 16, 64):
        for row in _explain(devices, quick):
            rows.append(
                {
                    "benchmark": "scale: explain bytes per device per step",
                    "devices": devices,
                    "hosts": row["hosts"],
                    "strategy": row["strategy"],
                    "state": row["state_bytes"],
                    "collectives": ", ".join(f"{k} {v}" for k, v in row["collectives"].items()),
                    "across hosts": row["across_hosts"],
                    "inside a host": row["inside_host"],
                }
            )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for row in main(args.quick):
        print(row)
