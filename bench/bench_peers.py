"""Peers on the same model, batches and replicas: Keras 3 (JAX), TensorFlow, torch DDP.

Run: python bench/bench_peers.py [--quick]. Keras 3 DataParallel (JAX backend)
runs in this process; TensorFlow's MirroredStrategy (a custom loop and Keras
`fit`) and torch DistributedDataParallel over gloo each run alone in their own
process (bench/peers_worker.py; with --quick the TensorFlow rows share one, and
the floor and spmd's step are bench_step's figures of the same run). A peer
that is not installed gives a row saying so: `pip install -e ".[bench]"`
installs Keras and TensorFlow (CPU), and `pip install torch --index-url
https://download.pytorch.org/whl/cpu` torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("peers_worker.py")
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


PEERS = (  # (worker name, row name, package)
    ("tf-loop", "TensorFlow MirroredStrategy custom loop", "tensorflow"),
    ("tf-fit", "TensorFlow MirroredStrategy Keras fit", "tensorflow"),
    ("torch-ddp", "torch DDP over gloo, 8 processes", "torch"),
)


def _peer_times(peers: list[str], models: list[str], steps: int) -> dict[str, dict | str]:
    """ "PEER MODEL" -> its seconds per step, or why it could not run: every pair in one
    process of their own, one after another."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("XLA_FLAGS", None)
    pairs = [f"{p} {m}" for m in models for p in peers]
    try:
        done = subprocess.run(
            [sys.executable, str(WORKER), ",".join(peers), ",".join(models), str(steps)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    except subprocess.TimeoutExpired:
        return dict.fromkeys(pairs, "failed: no result in 900 s")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return dict.fromkeys(pairs, f"failed (exit {done.returncode}): {last[:160]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(model: str, name: str, t: dict | str, floor: dict) -> dict:
    if isinstance(t, str):
        return {"benchmark": "peers", "case": f"{model}, {name}", "note": t}
    return {
        "benchmark": "peers",
        "case": f"{model}, {name}, 8 replicas",
        "time/step": common.fmt_time(t),
        "ratio": common.ratio(t, floor),
        "note": "ratio to the jax.jit floor",
    }


def _spmd_and_floor(model: str, quick: bool) -> dict[str, dict]:
    """The floor and spmd's step on `model`: with --quick, bench_step's figures of this run."""
    import spmd
    from bench.bench_step import _floor_runner, _spmd_runner, overhead_times

    if quick:
        return overhead_times(model, quick)
    x, y = common.batch(model, GLOBAL_BATCH)
    return common.timeit(
        {
            "floor": _floor_runner(model, x, y),
            "spmd": _spmd_runner(spmd.MirroredStrategy(), model, x, y),
        },
        steps=STEPS,
        repeats=3,
    )


def main(quick: bool = False) -> list[dict]:
    """Every installed peer against spmd's step and the floor, on the same model and batches.

    With --quick: the floor and spmd's step are bench_step's of the same run, and the
    TensorFlow rows run in one process (one TensorFlow start-up).
    """
    rows = []
    has_keras = importlib.util.find_spec("keras") is not None
    if not has_keras:
        rows.append(_skipped("Keras 3 DataParallel (JAX backend)", "keras"))
    rows += [
        _skipped(name, package)
        for _, name, package in PEERS
        if importlib.util.find_spec(package) is None
    ]
    steps, models = 5 if quick else STEPS, ["cnn", "tiny"]
    installed = [p for p, _, package in PEERS if importlib.util.find_spec(package) is not None]
    together = [p for p in installed if p.startswith("tf-")] if quick else []
    peer_times = _peer_times(together, models, steps) if together else {}
    for model in models:
        times = _spmd_and_floor(model, quick)
        rows.append(_row(model, "spmd MirroredStrategy step", times["spmd"], times["floor"]))
        if has_keras:
            keras_t = _keras_time(model, steps)
            rows.append(_row(model, "Keras 3 DataParallel fit (JAX)", keras_t, times["floor"]))
        for peer, name, _ in PEERS:
            if peer in installed:
                found = peer_times if peer in together else _peer_times([peer], [model], steps)
                rows.append(_row(model, name, found[f"{peer} {model}"], times["floor"]))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    common.set_cpu_devices(8)
    print(common.table(main(args.quick), ["case", "time/step", "ratio", "note"]))
