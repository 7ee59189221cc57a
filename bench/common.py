"""Shared pieces of the benchmarks: timing, the models, markdown tables."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def set_cpu_devices(count: int = 8) -> None:
    """Simulated CPU devices; must run before JAX starts its backend."""
    jax.config.update("jax_num_cpu_devices", count)


CACHE_VARIABLE = "JAX_COMPILATION_CACHE_DIR"


def share_compilations() -> str:
    """One persistent XLA compilation cache for this process and every process it starts.

    For the smoke runs (`--quick`), whose CPU time is mostly compiling: a program
    compiled once in the run (the same floor or step in several modules, the same
    step under several schedules, in a worker process) is read back rather than
    compiled again. A compiled program runs the same read from the cache, and
    every compile happens in a warm-up, outside the timed turns. A folder the
    environment already names (the tests' run-wide one) is used as it is; else a
    fresh one, removed when this process ends. Must run before the first compile.

    Returns:
      The cache's folder, also in os.environ[CACHE_VARIABLE] for the processes this
      one starts.
    """
    import atexit
    import os
    import shutil
    import tempfile

    folder = os.environ.get(CACHE_VARIABLE)
    if not folder:
        folder = tempfile.mkdtemp(prefix="spmd-bench-xla-")
        os.environ[CACHE_VARIABLE] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    # every program, however small or quick to compile (no minimum compile time or size)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
    )
    jax.config.update(
        "jax_persistent_cache_min_entry_size_bytes",
        int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]),
    )
    return folder


OPTIMIZATION_FLAG = "--xla_backend_optimization_level"


def compile_unoptimized() -> None:
    """XLA's CPU backend at optimization level 0 for this process and every process it
    starts, unless XLA_FLAGS already sets a level: for the smoke run (`--quick`), which
    checks that every table is made, not its figures, and spends most of its CPU time
    compiling (about 10% less CPU and wall time for the whole quick run). The test suite
    runs it so already (tests/conftest.py). Must run before the backend starts."""
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    if OPTIMIZATION_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {OPTIMIZATION_FLAG}=0".strip()


def without_shared_compilations(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process that must compile everything itself (one whose first call's
    time, compiles included, is the figure): no persistent compilation cache."""
    return {key: value for key, value in env.items() if key != CACHE_VARIABLE}


def timeit(runners: dict[str, Callable[[int], Any]], steps: int, repeats: int) -> dict[str, dict]:
    """Seconds per step of each `run(steps)` (which must block until done).

    The runners take turns, so that drift in the machine's speed hits them alike.

    Returns:
      name -> {"median", "min", "max"} seconds per step, and "samples" (one per
      repeat, in turn order: `ratio` pairs each with the floor's of the same turn).
    """
    for run in runners.values():
        run(max(2, steps // 4))  # warm up: compile, fill caches
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run(steps)
            samples[name].append((time.perf_counter() - start) / steps)
    return {
        name: {"median": statistics.median(s), "min": min(s), "max": max(s), "samples": s}
        for name, s in samples.items()
    }


def scaled(t: dict, factor: float) -> dict:
    """A `timeit` figure with every time (samples included) times `factor`."""
    return {
        key: [v * factor for v in value] if key == "samples" else value * factor
        for key, value in t.items()
    }


def ratio(t: dict, floor: dict) -> str:
    """The ratio to the floor, as '1.01x': the median of the ratios of each turn's
    figure to the floor's of the same turn when `timeit` measured both (a drift in
    the machine's speed between turns cancels), else the ratio of the medians."""
    ours, theirs = t.get("samples"), floor.get("samples")
    if ours and theirs and len(ours) == len(theirs):
        return f"{statistics.median(a / b for a, b in zip(ours, theirs, strict=True)):.3f}x"
    return f"{t['median'] / floor['median']:.3f}x"


def fmt_time(t: dict[str, float]) -> str:
    """A timing as 'median (min–max)' in microseconds or milliseconds."""
    scale, unit = (1e6, "µs") if t["median"] < 1e-3 else (1e3, "ms")
    return f"{t['median'] * scale:.1f} {unit} ({t['min'] * scale:.1f}–{t['max'] * scale:.1f})"


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table of `rows` with these columns."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_leaves(tree: Any, path: str | Path) -> None:
    """`tree`'s leaves as numpy arrays in an .npz file, in flattening order: how the bench
    hands a state to the processes it starts (`read_leaves` there)."""
    np.savez(path, *[np.asarray(leaf) for leaf in jax.tree.leaves(tree)])


def read_leaves(path: str | Path, like: Any) -> Any:
    """The tree `write_leaves` wrote to `path`, in the structure of `like` (e.g. the
    `jax.eval_shape` of the function that made it)."""
    with np.load(path) as saved:
        leaves = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


# -- models: the seeds' tutorial CNN (compute-bound) and a tiny dense model (dispatch-bound)

TX = optax.sgd(0.01, momentum=0.9)


def cnn_init(key: jax.Array) -> dict:
    """Conv 32 3x3 -> Dense 64 -> Dense 10 on 28x28x1 images, with its optimizer state."""
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "conv": {"kernel": jax.random.normal(k1, (3, 3, 1, 32)) * 0.1, "bias": jnp.zeros(32)},
        "dense": {
            "kernel": jax.random.normal(k2, (26 * 26 * 32, 64)) * 0.01,
            "bias": jnp.zeros(64),
        },
        "out": {"kernel": jax.random.normal(k3, (64, 10)) * 0.1, "bias": jnp.zeros(10)},
    }
    return {"params": params, "opt": TX.init(params)}


def cnn_apply(params: dict, x: jax.Array) -> jax.Array:
    h = jax.lax.conv_general_dilated(
        x, params["conv"]["kernel"], (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    h = jax.nn.relu(h + params["conv"]["bias"]).reshape(x.shape[0], -1)
    h = jax.nn.relu(h @ params["dense"]["kernel"] + params["dense"]["bias"])
    return h @ params["out"]["kernel"] + params["out"]["bias"]


def tiny_init(key: jax.Array) -> dict:
    """One 16x16 dense layer: the step is all dispatch, no compute."""
    params = {"kernel": jax.random.normal(key, (16, 16)) * 0.1, "bias": jnp.zeros(16)}
    return {"params": params, "opt": TX.init(params)}


def tiny_apply(params: dict, x: jax.Array) -> jax.Array:
    return x @ params["kernel"] + params["bias"]


def make_train_step(apply: Callable) -> Callable:
    """A classification train step (state, x, y) -> (state, loss) for `apply`."""

    def train_step(state, x, y):
        def loss_fn(params):
            logits = apply(params, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = TX.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    return train_step


MODELS = {
    "cnn": (cnn_init, cnn_apply, (28, 28, 1), 10),
    "tiny": (tiny_init, tiny_apply, (16,), 16),
}


def batch(model: str, size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A global batch of random inputs and labels for `model`."""
    _, _, shape, classes = MODELS[model]
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(size, *shape)).astype(np.float32)
    return x, rng.integers(0, classes, size=size).astype(np.int32)
