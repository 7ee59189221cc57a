"""Peers on the same model, batches and devices: Keras 3 (JAX backend) DataParallel.

Run: python bench/bench_peers.py [--quick]. A peer that is not installed gives a
row saying so (`pip install "spmd[bench]"` installs Keras). TensorFlow's
MirroredStrategy is measured when TensorFlow is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402

GLOBAL_BATCH, STEPS = 64, 20


def _skipped(peer: str, package: str) -> dict:
    return {
        "benchmark": "peers",
        "case": peer,
        "time/step": "",
        "ratio": "",
        "note": f"skipped: {package} is not installed",
    }


def _keras_time(model_name: str, steps: int) -> dict:
    """Keras 3 on JAX with DataParallel over every device: fit on the same batches."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax
    import keras
    import numpy as np

    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    x, y = common.batch(model_name, GLOBAL_BATCH)
    if model_name == "cnn":
        layers = [
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    else:
        layers = [keras.layers.Dense(16)]
    model = keras.Sequential([keras.Input(x.shape[1:]), *layers])
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)
    model.fit(
        xs[: GLOBAL_BATCH * 2], ys[: GLOBAL_BATCH * 2], batch_size=GLOBAL_BATCH, epochs=1, verbose=0
    )
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        model.fit(xs, ys, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
        samples.append((time.perf_counter() - start) / steps)
    samples.sort()
    return {"median": samples[1], "min": samples[0], "max": samples[2]}


def main(quick: bool = False) -> list[dict]:
    """Keras DataParallel fit vs spmd's Trainer-free step and the floor, per model."""
    import spmd
    from bench.bench_step import _floor_runner, _spmd_runner

    rows = []
    if importlib.util.find_spec("keras") is None:
        rows.append(_skipped("Keras 3 DataParallel (JAX backend)", "keras"))
    else:
        for model in ("cnn", "tiny"):
            x, y = common.batch(model, GLOBAL_BATCH)
            steps = 5 if quick else STEPS
            times = common.timeit(
                {
                    "floor": _floor_runner(model, x, y),
                    "spmd": _spmd_runner(spmd.MirroredStrategy(), model, x, y),
                },
                steps=steps,
                repeats=3,
            )
            keras_t = _keras_time(model, steps)
            for name, t in (
                ("spmd MirroredStrategy step", times["spmd"]),
                ("Keras 3 DataParallel fit", keras_t),
            ):
                rows.append(
                    {
                        "benchmark": "peers",
                        "case": f"{model}, {name}, 8 devices",
                        "time/step": common.fmt_time(t),
                        "ratio": common.ratio(t, times["floor"]),
                        "note": "ratio to the jax.jit floor",
                    }
                )
    rows.append(
        {
            "benchmark": "peers",
            "case": "TensorFlow MirroredStrategy custom loop",
            "note": "not measured here: TensorFlow is not installed on the benchmark machine"
            if importlib.util.find_spec("tensorflow") is None
            else "not measured: TensorFlow would compete with JAX for the same CPU cores in one process",
        }
    )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    common.set_cpu_devices(8)
    print(common.table(main(args.quick), ["case", "time/step", "ratio", "note"]))
