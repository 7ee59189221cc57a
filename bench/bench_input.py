"""Input pipeline: prefetch overlap, and the feed's cost against a jax.jit loop on device data.

Run: python bench/bench_input.py [--quick]

The step is a small MLP's SGD update on 8 CPU devices; the loop reads each
step's result (blocks), as a loop that logs its loss does. The host pipeline
sleeps as long as one step takes, then hands over a numpy batch: with
prefetch the two overlap, and a step should cost the slower of the two,
not their sum.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common

GLOBAL_BATCH, WIDTH, LAYERS = 64, 256, 4


def _model():
    """(jitted step, placed weights, split sharding): a hand-written jax.jit SGD step."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("replica",), axis_types=(AxisType.Auto,))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    def step(ws, x):
        grads = jax.grad(loss)(ws, x)
        return [w - 1e-3 * g for w, g in zip(ws, grads, strict=True)]

    keys = jax.random.split(jax.random.key(0), LAYERS)
    ws = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH**0.5 for k in keys]
    ws = jax.device_put(ws, replicated)
    compiled = jax.jit(step, in_shardings=(replicated, split), out_shardings=replicated)
    return compiled, ws, split


def _batches(count: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.normal(size=(GLOBAL_BATCH, WIDTH)).astype(np.float32) for _ in range(count)]


def _host_pipeline(pool: list, steps: int, cost: float):
    """`steps` global batches, each costing `cost` seconds of host time first."""
    for i in range(steps):
        if cost:
            time.sleep(cost)
        yield pool[i % len(pool)]


def _runners(cost: float) -> dict:
    """name -> run(steps) -> seconds: the loops to time, for a host pipeline of `cost` s/batch.

    Each loop runs `steps + 1` steps and times the last `steps`: the first one
    (compiling nothing, but filling the pipeline) is the same for every epoch
    however long, so it is left out of the steady state.
    """
    import jax

    import spmd

    step, ws, split = _model()
    pool = _batches(8)
    resident = jax.device_put(pool[0], split)
    strategy = spmd.MirroredStrategy()
    box = [ws]

    def loop(batches, steps):
        w, start = box[0], None
        for i, x in enumerate(batches):
            w = jax.block_until_ready(step(w, x))
            start = time.perf_counter() if i == 0 else start
        box[0] = w
        return time.perf_counter() - start

    def floor(steps):
        return loop((resident for _ in range(steps + 1)), steps)

    def host_alone(steps):
        batches = _host_pipeline(pool, steps + 1, cost)
        next(batches)
        start = time.perf_counter()
        for _ in batches:
            pass
        return time.perf_counter() - start

    def fed(prefetch: int, batch_cost: float):
        options = spmd.InputOptions(prefetch=prefetch)

        def run(steps):
            batches = _host_pipeline(pool, steps + 1, batch_cost)
            return loop(strategy.distribute_dataset(batches, options), steps)

        return run

    return {
        "floor": floor,
        "host": host_alone,
        "spmd, prefetch=0": fed(0, cost),
        "spmd, prefetch=2": fed(2, cost),
        "feed, prefetch=0": fed(0, 0.0),
        "feed, prefetch=2": fed(2, 0.0),
    }


def _timeit(runners: dict, steps: int, repeats: int) -> dict[str, dict]:
    """Seconds per steady-state step of each runner: median, min and max over `repeats`.

    The runners take turns, so that drift in the machine's speed hits them alike.
    """
    import statistics

    for run in runners.values():
        run(2)  # warm up: compile, fill caches
    samples = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            samples[name].append(run(steps) / steps)
    return {
        name: {"median": statistics.median(t), "min": min(t), "max": max(t), "samples": t}
        for name, t in samples.items()
    }


def _step_time() -> float:
    """Seconds one step of the model takes on device-resident data (median of 20)."""
    import statistics

    import jax

    step, ws, split = _model()
    x = jax.device_put(_batches(1)[0], split)
    for _ in range(3):
        ws = jax.block_until_ready(step(ws, x))
    times = []
    for _ in range(20):
        start = time.perf_counter()
        ws = jax.block_until_ready(step(ws, x))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(quick: bool = False) -> list[dict]:
    """Prefetch overlap and feed overhead, as table rows."""
    cost = _step_time()
    times = _timeit(_runners(cost), steps=15 if quick else 30, repeats=3 if quick else 7)
    slower = max(times["floor"], times["host"], key=lambda t: t["median"])
    no_prefetch, prefetch = times["spmd, prefetch=0"], times["spmd, prefetch=2"]
    rows = [
        _row("step alone (jax.jit, device-resident data)", times["floor"]),
        _row(f"host pipeline alone ({cost * 1e3:.1f} ms/batch)", times["host"]),
        _row("spmd, no prefetch", no_prefetch, common.ratio(no_prefetch, slower), "≈ step + host"),
        _row(
            "spmd, prefetch=2",
            prefetch,
            common.ratio(prefetch, slower),
            f"target ≤ 1.10x; {no_prefetch['median'] / prefetch['median']:.2f}x the "
            "throughput of no prefetch",
        ),
    ]
    for depth in (0, 2):
        t = times[f"feed, prefetch={depth}"]
        overhead = (t["median"] - times["floor"]["median"]) * 1e6
        rows.append(
            _row(
                f"feed overhead, free host pipeline, prefetch={depth}",
                t,
                common.ratio(t, times["floor"]),
                f"{overhead:+.0f} µs/step vs the jax.jit loop",
            )
        )
    rows += _fingerprint_rows(cost)
    return rows


def _fingerprint_rows(step_s: float) -> list[dict]:
    """The DATA content check's host cost per global batch, against one step.

    Under DATA every process fingerprints each global batch (in the prefetch
    thread, beside the step): the bench's batch, and an ImageNet-sized one
    (256 x 224 x 224 x 3 uint8, 37 MiB: fingerprinted by sampled rows).
    """
    import statistics

    import numpy as np

    from spmd._src.data.sources import fingerprint

    images = np.random.default_rng(0).integers(0, 255, (256, 224, 224, 3), dtype=np.uint8)
    rows = []
    for name, batch in (("bench batch, 64 KiB", _batches(1)[0]), ("images, 37 MiB", images)):
        times = []
        for _ in range(30):
            start = time.perf_counter()
            fingerprint((batch, np.arange(len(batch))))
            times.append(time.perf_counter() - start)
        t = {"median": statistics.median(times), "min": min(times), "max": max(times)}
        rows.append(
            _row(
                f"DATA content fingerprint, {name}",
                t,
                f"{t['median'] / step_s:.1%} of this step",
                f"< 2% of any step over {t['median'] / 0.02 * 1e3:.1f} ms; runs in the "
                "prefetch thread, beside the step",
            )
        )
    return rows


def _row(case: str, t: dict, ratio: str = "", note: str = "") -> dict:
    """One table row; `ratio` is to the slower of step and host alone, or to the jax.jit loop."""
    return {
        "benchmark": "input pipeline",
        "case": case,
        "time/step": common.fmt_time(t),
        "ratio": ratio,
        "note": note,
        "median_s": t["median"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    common.set_cpu_devices(8)
    print(common.table(main(args.quick), ["case", "time/step", "ratio", "note"]))
