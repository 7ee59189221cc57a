"""`spmd demo`: the seeds' tutorial CNN on real handwritten digits, over simulated devices."""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from spmd._src.cli.demo_command import (
    DEFAULT_DEVICES,
    EPOCHS,
    TARGET_ACCURACY,
    add_arguments,
    global_batch,
)
from spmd._src.clusters.initialize import ENV_DEVICES_PER_PROCESS, initialize
from spmd._src.errors import ConfigurationError, SpmdError, message, received
from spmd._src.strategy import strategies
from spmd._src.strategy.base import Strategy
from spmd._src.trainer.trainer import Trainer

__all__ = [
    "CNN",
    "Data",
    "load_digits",
    "load_npz",
    "main",
    "run",
]

LEARNING_RATE = 3e-3
HELD_OUT = 0.2  # the digits' share kept for validation
# With several processes each strategy must span every process's devices.
MULTI_PROCESS_STRATEGIES = ("multi_worker_mirrored", "parameter_server", "tpu")
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")

MSG_NO_SKLEARN = """\
spmd demo trains on scikit-learn's bundled handwritten digits (nothing is
downloaded), and scikit-learn is not installed.
{received}
To fix: install the demo's extra, or bring your own MNIST:

    pip install "spmd[demo]"              # or: pip install scikit-learn
    spmd demo --data mnist.npz            # x_train, y_train, x_test, y_test
"""


# ------------------------------------------------------------------ the model


class CNN(nnx.Module):
    """The tutorial's model: Conv 32 3x3 relu, flatten, Dense 64 relu, Dense 10 (logits).

    Args:
      height: image height.
      width: image width.
      rngs: the parameters' random numbers.
    """

    def __init__(self, height: int, width: int, *, rngs: nnx.Rngs) -> None:
        self.conv = nnx.Conv(1, 32, (3, 3), padding="VALID", rngs=rngs)
        self.hidden = nnx.Linear((height - 2) * (width - 2) * 32, 64, rngs=rngs)
        self.logits = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.conv(x))
        x = x.reshape(x.shape[0], -1)
        return self.logits(nnx.relu(self.hidden(x)))


# ------------------------------------------------------------------ the data


@dataclasses.dataclass(frozen=True)
class Data:
    """Images (N, H, W, 1) float32 in [0, 1] and labels (N,) int32, split in two.

    Attributes:
      name: "digits" or "npz" (which EPOCHS entry applies).
      description: how the summary names it.
    """

    name: str
    description: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def _images(x: np.ndarray, scale: float) -> np.ndarray:
    x = np.asarray(x, np.float32) / scale
    return x[..., None] if x.ndim == 3 else x


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits of `sklearn.datasets.load_digits`, as (images, labels)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ConfigurationError(MSG_NO_SKLEARN.format(received=received(sklearn=None)))
    # The file load_digits reads: going straight to it skips importing sklearn and
    # scipy (seconds on a small machine). The loader is the fallback.
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.float32)
        return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int32)
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    return digits.images.astype(np.float32), digits.target.astype(np.int32)


def load_digits(seed: int = 0) -> Data:
    """scikit-learn's handwritten digits (8x8, 0..16), 20% held out at random.

    Raises:
      ConfigurationError: scikit-learn is not installed.
    """
    images, labels = _bundled_digits()
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = len(labels) - int(len(labels) * HELD_OUT)
    train, test = order[:cut], order[cut:]
    x = _images(images, 16.0)
    return Data(
        "digits",
        f"scikit-learn's handwritten digits, 8x8: {len(train)} to train, {len(test)} held out",
        x[train],
        labels[train],
        x[test],
        labels[test],
    )


def _npz_error(path: str, expected: str, got: str) -> ConfigurationError:
    return ConfigurationError(
        message(
            f"--data {path}: {expected}",
            got,
            "pass an .npz like keras.datasets.mnist's: x_train (N, H, W) images, y_train (N,) "
            "labels 0..9, x_test and y_test likewise.",
        )
    )


def load_npz(path: str) -> Data:
    """An MNIST-style .npz: x_train, y_train, x_test, y_test (images 0..255, labels 0..9).

    Raises:
      ConfigurationError: the file is missing or unreadable, a key is missing,
        or the arrays have the wrong shapes.
    """
    if not os.path.isfile(path):
        raise _npz_error(path, "no such file.", received(data=path))
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in NPZ_KEYS if k not in npz.files]
            if missing:
                raise _npz_error(
                    path,
                    f"the file has no '{missing[0]}' array.",
                    received(missing=missing, keys=sorted(npz.files)),
                )
            arrays = {k: npz[k] for k in NPZ_KEYS}
    except (OSError, ValueError) as e:
        raise _npz_error(path, "not a readable .npz file.", received(error=str(e))) from None
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim not in (3, 4) or (x.ndim == 4 and x.shape[-1] != 1) or x.shape[1] < 3:
            raise _npz_error(
                path, f"x_{split} must hold images (N, H, W).", received(shape=x.shape)
            )
        if y.shape != (len(x),) or not np.issubdtype(y.dtype, np.integer):
            raise _npz_error(
                path,
                f"y_{split} must hold one integer label per image of x_{split}.",
                received(**{f"x_{split}.shape": x.shape, f"y_{split}.shape": y.shape}),
            )
    scale = float(max(arrays["x_train"].max(), 1))
    h, w = arrays["x_train"].shape[1:3]
    return Data(
        "npz",
        f"{path}, {h}x{w}: {len(arrays['y_train'])} to train, {len(arrays['y_test'])} held out",
        _images(arrays["x_train"], scale),
        arrays["y_train"].astype(np.int32),
        _images(arrays["x_test"], scale),
        arrays["y_test"].astype(np.int32),
    )


# ------------------------------------------------------------------ the command


def _strategy_key(name: str) -> str:
    """The by_name key of `name` ("MirroredStrategy" -> "mirrored"), checked."""
    key = name.lower().replace("-", "_").removesuffix("_strategy").removesuffix("strategy")
    if key not in strategies.NAMES:
        raise ConfigurationError(
            message(
                f"--strategy is one of {list(strategies.NAMES)}.",
                received(strategy=name),
                "pick one of those names, e.g. --strategy parameter_server.",
            )
        )
    return key


def _launch(args: argparse.Namespace) -> int:
    """Re-runs this demo as `args.processes` workers through spmd launch."""
    from spmd._src.clusters.launch import launch

    n, total = args.processes, args.devices or DEFAULT_DEVICES
    if total % n:
        raise ConfigurationError(
            message(
                "--devices is split evenly among the --processes.",
                received(devices=total, processes=n),
                f"pass --devices {n * max(total // n, 1)}, a multiple of {n}.",
            )
        )
    key = _strategy_key(args.strategy or "multi_worker_mirrored")
    _check_multi_process(key, n)
    _load(args)  # a bad file, or no scikit-learn, fails here once rather than in every worker
    child = [sys.executable, "-m", "spmd", "demo", "--strategy", key]
    for flag, value in (
        ("--epochs", args.epochs),
        ("--batch-size", args.batch_size),
        ("--data", args.data),
        ("--checkpoint-dir", args.checkpoint_dir),
    ):
        child += [flag, str(value)] if value is not None else []
    child += ["--fast"] if args.fast else []
    print(f"spmd demo: {n} worker processes of {total // n} devices each, through spmd launch")
    sys.stdout.flush()
    try:
        return launch(child, n, total // n)
    except KeyboardInterrupt:
        print("spmd demo: interrupted; stopped every worker.", file=sys.stderr)
        return 130


def _load(args: argparse.Namespace) -> Data:
    return load_npz(args.data) if args.data else load_digits()


def _check_multi_process(key: str, processes: int) -> None:
    if processes > 1 and key not in MULTI_PROCESS_STRATEGIES:
        raise ConfigurationError(
            message(
                f"With several processes the strategy must span them all: one of "
                f"{list(MULTI_PROCESS_STRATEGIES)}.",
                received(strategy=key, processes=processes),
                "pass --strategy multi_worker_mirrored (the default), or one process.",
            )
        )


def _device_count(args: argparse.Namespace) -> int | None:
    """--devices, else the launcher's per-process count, else DEFAULT_DEVICES."""
    if args.devices is not None:
        return args.devices
    return None if os.environ.get(ENV_DEVICES_PER_PROCESS) else DEFAULT_DEVICES


def run(args: argparse.Namespace) -> int:
    """Runs `spmd demo` with parsed arguments; returns the exit code.

    Raises:
      SpmdError: a bad option, missing scikit-learn or a bad .npz.
    """
    started = time.perf_counter()
    if args.processes and args.processes > 1:
        return _launch(args)
    key = _strategy_key(args.strategy) if args.strategy else None
    data = _load(args)  # fails fast, before joining any cluster
    info = initialize(local_device_count=_device_count(args))
    key = key or ("mirrored" if info.process_count == 1 else "multi_worker_mirrored")
    _check_multi_process(key, info.process_count)
    strategy = strategies.by_name(key)
    result = _train(strategy, data, args, info.is_chief)
    if info.is_chief:
        _summary(strategy, data, result, info.process_count, time.perf_counter() - started)
    return 0 if result.accuracy >= TARGET_ACCURACY else 1


@dataclasses.dataclass(frozen=True)
class _Result:
    accuracy: float  # on the held-out examples
    steps: int  # train steps taken
    epochs: int
    batch: int  # the global batch
    fit_seconds: float  # Trainer.fit, compiling included
    checkpoint: str | None  # where the state was saved, if it was


def _train(strategy: Strategy, data: Data, args: argparse.Namespace, chief: bool) -> _Result:
    """Fits the CNN, evaluates it on the held-out data, saves it if asked."""
    replicas = strategy.num_replicas_in_sync
    batch = global_batch(args.batch_size, replicas)
    default, fast = EPOCHS[data.name]
    epochs = args.epochs or (fast if args.fast else default)
    model = CNN(*data.x_train.shape[1:3], rngs=nnx.Rngs(0))
    params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    trainer = Trainer(
        model,
        optax.adam(LEARNING_RATE),
        "sparse_categorical_crossentropy",
        metrics=("accuracy",),
        strategy=strategy,
    )
    rounded = ""
    if args.batch_size and batch != args.batch_size:
        rounded = f" (--batch-size {args.batch_size} rounded up to a multiple of {replicas})"
    if chief:
        print(f"spmd demo: {data.description}; tutorial CNN, {params:,} parameters")
        print(
            f"spmd demo: {strategy.name}, {replicas} replicas, global batch {batch}{rounded}, "
            f"{epochs} epochs",
            flush=True,
        )
    fit_started = time.perf_counter()
    trainer.fit(
        (data.x_train, data.y_train),
        batch_size=batch,
        epochs=epochs,
        validation_data=(data.x_test, data.y_test),
    )
    seconds = time.perf_counter() - fit_started
    held_out = trainer.evaluate((data.x_test, data.y_test), batch_size=batch)
    steps = int(jax.device_get(trainer.state["step"]))
    saved = _save(args.checkpoint_dir, steps, trainer.state) if args.checkpoint_dir else None
    return _Result(held_out["accuracy"], steps, epochs, batch, seconds, saved)


def _save(directory: str, step: int, state: Any) -> str:
    """Saves the trained state as checkpoint `step` under `directory`; every process calls it."""
    from spmd._src.checkpoint.manager import CheckpointManager

    ckpt = CheckpointManager(os.path.abspath(directory), max_to_keep=1, async_save=False)
    try:
        ckpt.save(step, state, force=True)
        ckpt.wait()
    finally:
        ckpt.close()
    return os.path.join(os.path.abspath(directory), str(step))


def _summary(
    strategy: Strategy, data: Data, result: _Result, processes: int, seconds: float
) -> None:
    devices = strategy.devices
    platform = devices[0].platform if devices else "?"
    mesh = ", ".join(f"{k}={v}" for k, v in strategy.mesh.shape.items())
    met = "met" if result.accuracy >= TARGET_ACCURACY else "NOT met: train longer with --epochs"
    rows = [
        ("strategy", f"{strategy.name} (mesh {mesh})"),
        ("devices", f"{len(devices)} {platform} in {processes} process{'es' * (processes > 1)}"),
        ("replicas", f"{strategy.num_replicas_in_sync} in sync"),
        ("steps", f"{result.steps} ({result.epochs} epochs, global batch {result.batch})"),
        (
            "accuracy",
            f"{result.accuracy:.1%} on {len(data.y_test)} held-out examples "
            f"(target {TARGET_ACCURACY:.0%}: {met})",
        ),
        ("time", f"{seconds:.1f} s ({result.fit_seconds:.1f} s in fit, compiling included)"),
    ]
    if result.checkpoint:
        rows.append(("checkpoint", result.checkpoint))
    print("spmd demo: summary")
    for name, value in rows:
        print(f"  {name:<10} {value}")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `spmd demo [options]` (also `python -m spmd demo`).

    Args:
      argv: the options, without "demo" (default: sys.argv[1:]).

    Returns:
      0 if the held-out accuracy reached the target, 1 if not or on an error,
      2 on a usage error.
    """
    parser = argparse.ArgumentParser(prog="spmd demo")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except SpmdError as e:
        print(f"spmd demo: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
