"""Async checkpointing: how long a save blocks the training loop, against a synchronous save.

Run: python bench/bench_checkpoint.py [--quick]
The state is ~100 MB (float32), sharded over 8 simulated CPU devices
(ParameterServerStrategy). "Blocked" is the time `CheckpointManager.save`
takes to return; with async_save the arrays are copied to host memory and
written in background threads, which `wait()` joins outside the timed region.
"Checksum" is the part of a save that computes every array's checksum (on the
devices, then 8 bytes an array to the host), as a fraction of a synchronous save.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import common
else:
    from bench import common

STATE_MB = 100
TARGET = 0.05  # blocked time of an async save, as a fraction of a synchronous save
CHECKSUM_TARGET = 0.05  # the checksums' time, as a fraction of a synchronous save


def _state(megabytes: int) -> dict:
    """A train-state-like pytree of `megabytes` MB of float32, placed by ParameterServerStrategy."""
    import jax
    import jax.numpy as jnp

    import spmd

    rows = megabytes * 2**20 // (4 * 1024 * 4)  # four (rows, 1024) float32 leaves
    strategy = spmd.ParameterServerStrategy(spmd.partitioners.MinSizePartitioner())

    def create(key):
        keys = jax.random.split(key, 4)
        return {
            f"layer{i}": jax.random.normal(k, (rows, 1024), jnp.float32) for i, k in enumerate(keys)
        }

    return jax.block_until_ready(strategy.init(create, jax.random.key(0)))


def _blocked_seconds(
    state: dict, async_save: bool, repeats: int
) -> tuple[list[float], list[float]]:
    """Seconds each save blocked the caller, and seconds until each was committed."""
    from absl import logging as absl_logging

    import spmd

    blocked, committed = [], []
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax notes every wait for a previous save
    with tempfile.TemporaryDirectory() as directory:
        ckpt = spmd.CheckpointManager(directory, max_to_keep=2, async_save=async_save)
        for step in range(repeats + 1):  # the first save warms up Orbax; not counted
            start = time.perf_counter()
            ckpt.save(step, state)
            returned = time.perf_counter()
            ckpt.wait()
            done = time.perf_counter()
            if step:
                blocked.append(returned - start)
                committed.append(done - start)
        ckpt.close()
    absl_logging.set_verbosity(verbosity)
    return blocked, committed


def _checksum_seconds(state: dict, repeats: int) -> list[float]:
    """Seconds to checksum every array of `state`, as save does (first call compiles: not counted)."""
    from spmd.checkpoint.integrity import checksums

    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        checksums(state)
        if i:
            times.append(time.perf_counter() - start)
    return times


def _stats(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def async_save(quick: bool) -> list[dict]:
    """Blocked time of an async save and of a synchronous save of the same ~100 MB state."""
    import jax

    state = _state(STATE_MB)
    megabytes = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
    repeats = 3 if quick else 7
    sync_blocked, _ = _blocked_seconds(state, async_save=False, repeats=repeats)
    async_blocked, async_done = _blocked_seconds(state, async_save=True, repeats=repeats)
    sync, blocked, done = _stats(sync_blocked), _stats(async_blocked), _stats(async_done)
    checksum = _stats(_checksum_seconds(state, repeats))
    ratio = blocked["median"] / sync["median"]
    checksum_ratio = checksum["median"] / sync["median"]
    case = f"{megabytes:.0f} MB state, ParameterServerStrategy, {jax.device_count()} devices"
    return [
        {
            "benchmark": "checkpoint",
            "case": case,
            "synchronous save (blocked)": common.fmt_time(sync),
            "async save (blocked)": common.fmt_time(blocked),
            "async save (until committed)": common.fmt_time(done),
            "blocked / synchronous": f"{ratio:.3f}",
            "target": f"≤ {TARGET:.2f}",
            "met": "yes" if ratio <= TARGET else "no",
            "checksum": common.fmt_time(checksum),
            "checksum / synchronous": f"{checksum_ratio:.3f}",
            "checksum target": f"≤ {CHECKSUM_TARGET:.2f}",
            "checksum met": "yes" if checksum_ratio <= CHECKSUM_TARGET else "no",
        }
    ]


def main(quick: bool = False) -> list[dict]:
    """Every benchmark of this file, as table rows."""
    return async_save(quick)


COLUMNS = [
    "case",
    "synchronous save (blocked)",
    "async save (blocked)",
    "async save (until committed)",
    "blocked / synchronous",
    "target",
    "met",
    "checksum",
    "checksum / synchronous",
    "checksum target",
    "checksum met",
]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    common.set_cpu_devices(8)
    print(common.table(main(args.quick), COLUMNS))
