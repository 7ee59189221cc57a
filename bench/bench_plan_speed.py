"""How long a plan takes: compiled one candidate at a time, several at once, and from the cache.

    python -m bench.bench_plan_speed [--target v5e:2x4] [--jobs 2]

Plans the same Adam-trained MLP for a TPU slice three times in one process:
`jobs=1` (the floor: one compile after another), `jobs=N` (worker threads),
and again with the cache the second run filled (no compile). Prints each
wall time, the process's CPU time over it, and the ratio to the serial run.
Every plan's table must be the same. Not a test: times depend on the
machine and its load; docs/planning.md quotes a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time


def measure(target: str = "v5e:2x4", jobs: int = 2) -> dict:
    import jax
    import jax.numpy as jnp

    import spmd
    from bench.plan_docs import _adam_mlp

    create, step = _adam_mlp([1024] * 5)
    batch = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
    rows, tables = {}, set()
    with tempfile.TemporaryDirectory() as cache:
        for name, kwargs in (
            ("serial (jobs=1)", {"jobs": 1}),
            (f"jobs={jobs}, filling the cache", {"jobs": jobs, "cache_dir": cache}),
            ("from the cache", {"jobs": jobs, "cache_dir": cache}),
        ):
            wall, cpu = time.perf_counter(), time.process_time()
            _, plan = spmd.auto_strategy(create, step, batch, target, **kwargs)
            rows[name] = (time.perf_counter() - wall, time.process_time() - cpu)
            tables.add(str(plan))
    serial = rows["serial (jobs=1)"][0]
    return {
        "target": target,
        "candidates": len(plan.candidates),
        "same table": len(tables) == 1,
        "runs": {
            name: {"wall_s": round(w, 1), "cpu_s": round(c, 1), "vs serial": round(w / serial, 2)}
            for name, (w, c) in rows.items()
        },
    }


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5e:2x4")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    result = measure(args.target, args.jobs)
    print(json.dumps(result, indent=2))
    return 0 if result["same table"] else 1


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
