"""The fed paths of the tiny model against the hand-written jax.jit floor, on 8 devices and 1.

Run: python bench/bench_feed.py [--quick]

The floor is a `jax.jit` step on a device-resident batch. "host CPU" is the
main thread's CPU time per step against the floor's (wall time on a loaded
machine moves with other work; this moves little). The paths: spmd's
step on placed batches; the step given a numpy batch per call; a
`distribute_dataset` iterator (prefetch on, a free host pipeline); and
`Trainer.fit` on arrays with default options; and `Trainer.fit` on a list of
batches whose every 4th is short (40 of 64 rows: padded to 64 and masked, as
Keras trains on it). The tiny model's step is all
dispatch, so every microsecond of Python per step shows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common

GLOBAL_BATCH = 64
TARGETS = {
    ("placed", 1): "≤ 1.2x",
    ("dataset", 8): "≤ 1.3x and ≤ numpy per call",
    ("dataset", 1): "≤ numpy per call",
    ("fit", 8): "≤ 1.25x",
}


def _floor(devices, x, y):
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    init, apply, _, _ = common.MODELS["tiny"]
    mesh = jax.make_mesh(
        (len(devices),), ("replica",), axis_types=(AxisType.Auto,), devices=devices
    )
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))
    step = jax.jit(
        common.make_train_step(apply),
        in_shardings=(replicated, split, split),
        out_shardings=(replicated, replicated),
        donate_argnums=0,
    )
    box = [jax.jit(init, out_shardings=replicated)(jax.random.key(0))]
    xs, ys = jax.device_put((x, y), split)

    def loop(batches):
        state, queued = box[0], []
        for xb, yb in batches:
            state, loss = step(state, xb, yb)
            queued.append(loss)  # the same short queue as spmd's step on CPU
            if len(queued) > 4:
                queued.pop(0).block_until_ready()
        box[0] = jax.block_until_ready(state)

    return {
        "floor": lambda steps: loop((xs, ys) for _ in range(steps)),
        # What a hand-written jax.jit loop pays to feed the same numpy batch: the
        # reference for spmd's fed paths.
        "jit numpy": lambda steps: loop((x, y) for _ in range(steps)),
        "jit device_put": lambda steps: loop(jax.device_put((x, y), split) for _ in range(steps)),
    }


def _runners(strategy, devices) -> dict:
    """name -> run(steps): the floor and each fed path, on `strategy`."""
    import jax
    import numpy as np

    import spmd

    init, apply, _, _ = common.MODELS["tiny"]
    x, y = common.batch("tiny", GLOBAL_BATCH)
    step = strategy.step(common.make_train_step(apply))
    box = [strategy.init(init, jax.random.key(0))]
    placed = strategy.distribute_batch((x, y))

    def loop(batches):
        state = box[0]
        for xb, yb in batches:
            state, _ = step(state, xb, yb)
        box[0] = jax.block_until_ready(state)

    trainer = spmd.Trainer(
        (lambda key: init(key)["params"], apply),
        common.TX,
        "sparse_categorical_crossentropy",
        strategy=strategy,
    )
    many = {}

    def fit(steps):
        if steps not in many:
            many[steps] = (np.concatenate([x] * steps), np.concatenate([y] * steps))
        trainer.fit(many[steps], batch_size=GLOBAL_BATCH, verbose=0, shuffle=False)

    def fit_partial(steps):  # Keras' partial batches: every 4th batch of 40 rows, padded
        short = (x[:40], y[:40])
        trainer.fit([short if i % 4 == 3 else (x, y) for i in range(steps)], verbose=0)

    return {
        **_floor(devices, x, y),
        "placed": lambda steps: loop(placed for _ in range(steps)),
        "numpy": lambda steps: loop((x, y) for _ in range(steps)),
        "dataset": lambda steps: loop(strategy.distribute_dataset((x, y) for _ in range(steps))),
        "fit": fit,
        "fit partial": fit_partial,
    }


def _host_timed(runners: dict) -> tuple[dict, dict]:
    """The runners, each also summing the calling thread's CPU time per step; and the
    median of those per-step figures (filled as the runners run).

    The main thread's CPU time is what a path costs the host, read apart from
    the devices' work and, unlike wall time, little moved by other load on the
    machine.
    """
    samples: dict[str, list[float]] = {name: [] for name in runners}
    medians: dict[str, float] = {}

    def timed(name, run):
        def run_timed(steps):
            start = time.thread_time()
            run(steps)
            samples[name].append((time.thread_time() - start) / steps)
            medians[name] = statistics.median(samples[name][1:] or samples[name])  # not the warm-up

        return run_timed

    return {name: timed(name, run) for name, run in runners.items()}, medians


NAMES = {
    "jit numpy": "hand-written jax.jit, numpy batch per call",
    "jit device_put": "hand-written jax.jit, jax.device_put per batch",
    "placed": "step, placed batches",
    "numpy": "step, numpy batch per call",
    "dataset": "distribute_dataset (prefetch=2)",
    "fit": "Trainer.fit (default options)",
    "fit partial": "Trainer.fit, list of batches, every 4th of 40 rows (padded)",
}


def fed_rows(strategy, devices, quick: bool) -> list[dict]:
    """Each fed path's time per step on `strategy` and ratio to the floor over `devices`."""
    runners, host = _host_timed(_runners(strategy, devices))
    # One device's steps take tens of microseconds: longer runs, so that a
    # scheduling hiccup is a small part of each figure.
    steps = (20 if quick else 300) * (1 if len(devices) > 1 else 5)
    times = common.timeit(runners, steps=steps, repeats=3 if quick else 11)
    count, rows = len(devices), []
    for name, label in NAMES.items():
        rows.append(
            {
                "benchmark": "fed paths, tiny model",
                "case": f"{label}, {count} device{'s' if count > 1 else ''}",
                "floor": common.fmt_time(times["floor"]),
                "time/step": common.fmt_time(times[name]),
                "ratio": common.ratio(times[name], times["floor"]),
                "host CPU": f"{host[name] / host['floor']:.2f}x",
                "target": TARGETS.get((name, count), ""),
            }
        )
    return rows


def main(quick: bool = False) -> list[dict]:
    """Each fed path's time per step and ratio to the floor, 8 devices and 1."""
    import jax

    import spmd

    return fed_rows(spmd.MirroredStrategy(), jax.devices(), quick) + fed_rows(
        spmd.OneDeviceStrategy(), jax.devices()[:1], quick
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    common.set_cpu_devices(8)
    print(
        common.table(
            main(args.quick), ["case", "floor", "time/step", "ratio", "host CPU", "target"]
        )
    )
