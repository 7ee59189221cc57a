"""Checkpoint saves: how long `save` blocks the training loop, against plain Orbax.

Run: python bench/bench_checkpoint.py [--quick]
Two states on 8 simulated CPU devices: ~100 MB of float32 in 4 leaves, sharded
(ParameterServerStrategy; 16 MB with --quick), and 10,000 small leaves of a deep
model's ten shapes, replicated (MirroredStrategy; 40 leaves with --quick). Each is saved by plain
Orbax (`orbax.checkpoint.CheckpointManager` with the PyTree handler spmd writes
its arrays with) and by `spmd.CheckpointManager`, each synchronously and with
async_save, in turns. "Blocked" is the time `save` takes to return; every save
is committed (`wait()`) outside the timed region before the next one. Steady
saves come after one save per manager (not counted); a first save runs in a
fresh process, where nothing is compiled or cached yet, plain Orbax's and spmd's
in turns. Ratios are medians of the ratios of each turn's pair. "Checksum" is
the part of spmd's async save that starts the arrays' checksums (their device
programs run beside Orbax's write), as a fraction of plain Orbax's synchronous save.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import common
else:
    from bench import common

STATE_MB, QUICK_STATE_MB = 100, 16
LEAVES, QUICK_LEAVES = 10_000, 40
TARGET = 0.05  # blocked time of an async save, as a fraction of a synchronous save (100 MB)
CHECKSUM_TARGET = 0.05  # the checksums' blocking time, as a fraction of a synchronous save
FIRST_TARGET = 2.0  # the first async save of many leaves, against plain Orbax's first
# A deep model's leaves: per block, four matrices, four vectors and two biases (d = 16).
_SHAPES = [(16, 48), (16, 16), (16, 64), (64, 16), (16,), (16,), (16,), (16,), (48,), (64,)]
_VARIANTS = ("orbax sync", "orbax async", "spmd sync", "spmd async")


def _state(case: str, size: int):
    """(state, description): `size` MB in 4 sharded leaves ("big"), or `size` small leaves ("many")."""
    import jax
    import numpy as np

    import spmd

    if case == "big":
        rows = size * 2**20 // (4 * 1024 * 4)  # four (rows, 1024) float32 leaves
        strategy = spmd.ParameterServerStrategy(spmd.partitioners.MinSizePartitioner())
        rng = np.random.default_rng(0)
        tree = {f"layer{i}": rng.standard_normal((rows, 1024), np.float32) for i in range(4)}
        name = "ParameterServerStrategy"
    else:
        strategy = spmd.MirroredStrategy()
        tree = {
            f"block{i // 10:04d}/p{i % 10}": np.full(_SHAPES[i % 10], i, np.float32)
            for i in range(size)
        }
        name = "MirroredStrategy"
    state = jax.block_until_ready(strategy.put(tree))
    megabytes = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
    leaves = len(jax.tree.leaves(state))
    return state, f"{megabytes:.0f} MB in {leaves:,} leaves, {name}, {jax.device_count()} devices"


class _Saver:
    """One variant's manager over a fresh folder: `save(step, state)` and `wait()`."""

    def __init__(self, variant: str, directory: str):
        import orbax.checkpoint as ocp

        import spmd

        self._orbax = variant.startswith("orbax")
        async_save = variant.endswith("async")
        if self._orbax:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=2, enable_async_checkpointing=async_save
            )
            self._manager = ocp.CheckpointManager(directory, options=options)
        else:
            self._manager = spmd.CheckpointManager(directory, max_to_keep=2, async_save=async_save)

    def save(self, step: int, state: dict) -> None:
        if self._orbax:
            import orbax.checkpoint as ocp

            args = ocp.args.Composite(state=ocp.args.PyTreeSave(state))
            self._manager.save(step, args=args)
        else:
            self._manager.save(step, state)

    def wait(self) -> None:
        if self._orbax:
            self._manager.wait_until_finished()
        else:
            self._manager.wait()

    def close(self) -> None:
        self.wait()
        self._manager.close()


def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


@contextlib.contextmanager
def _checksum_clock() -> Iterator[list[float]]:
    """Seconds of each checksum dispatch meanwhile (the part of a save that starts them)."""
    from spmd._src.checkpoint import integrity

    seconds: list[float] = []
    dispatch = integrity.dispatch

    def timed(arrays, version=integrity.FORMAT):
        start = time.perf_counter()
        try:
            return dispatch(arrays, version)
        finally:
            seconds.append(time.perf_counter() - start)

    integrity.dispatch = timed
    try:
        yield seconds
    finally:
        integrity.dispatch = dispatch


def steady(case: str, size: int, repeats: int) -> tuple[str, dict[str, list[float]], int]:
    """Blocked seconds of each variant's saves after its first, in turns ("checksum": those
    of the checksum dispatch in spmd's async saves), and how many checksum programs compiled."""
    from absl import logging as absl_logging

    from spmd._src.checkpoint import integrity

    state, description = _state(case, size)
    compiled = integrity.compile_count()
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax notes every save and wait
    blocked: dict[str, list[float]] = {v: [] for v in (*_VARIANTS, "checksum")}
    with tempfile.TemporaryDirectory() as root, _checksum_clock() as checksum:
        savers = {v: _Saver(v, os.path.join(root, v.replace(" ", "-"))) for v in _VARIANTS}
        for step in range(repeats + 1):
            for variant, saver in savers.items():
                seconds = _timed(lambda s=saver, i=step: s.save(i, state))
                saver.wait()
                if step:  # the first save of each manager warms it up
                    blocked[variant].append(seconds)
                    if variant == "spmd async":
                        blocked["checksum"].append(checksum[-1])
        for saver in savers.values():
            saver.close()
    absl_logging.set_verbosity(verbosity)
    return description, blocked, integrity.compile_count() - compiled


def first_save(case: str, size: int, variant: str, directory: str) -> None:
    """Prints the blocked seconds of `variant`'s first save in this (fresh) process, then
    ends it at once: only the blocking is measured, the commit is left unfinished.

    With its state placed it prints "ready" and waits for a line on stdin before it
    makes its manager and saves: the other processes of its turn start up meanwhile
    and wait for theirs (see `first_saves`).
    """
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)
    state, _ = _state(case, size)
    print("ready", flush=True)
    sys.stdin.readline()
    saver = _Saver(variant, directory)
    print(json.dumps(_timed(lambda: saver.save(1, state))), flush=True)
    os._exit(0)


def _next(child: subprocess.Popen, log: Path, wanted: Callable[[str], bool]) -> str:
    """The next line `child` prints that is `wanted` (other output is passed over); the end
    of its stderr in the error if it ends first."""
    for line in child.stdout:
        if wanted(line.strip()):
            return line.strip()
    child.wait()
    raise RuntimeError(
        f"{' '.join(child.args)} ended (exit {child.returncode}) before its result:\n"
        + log.read_text()[-3000:]
    )


def _is_number(line: str) -> bool:
    try:
        float(line)
    except ValueError:
        return False
    return True


def first_saves(case: str, size: int, repeats: int) -> dict[str, list[float]]:
    """Each async variant's first save, each in a fresh process, in turns.

    A turn starts its processes together (their start-ups overlap) and, once every
    one has its state placed, lets each save in turn, the next only once the last
    has ended: a save runs beside processes that only wait.
    """
    found: dict[str, list[float]] = {"orbax async": [], "spmd async": []}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env = common.without_shared_compilations(env)  # a first save compiles its own programs
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as root:
            children: dict[str, tuple[subprocess.Popen, Path]] = {}
            try:
                for variant in found:
                    name = variant.replace(" ", "-")
                    command = [sys.executable, __file__, "--first-save", case, str(size)]
                    log = Path(root, f"{name}.log")
                    with log.open("w") as err:
                        child = subprocess.Popen(
                            [*command, variant, os.path.join(root, name)],
                            env=env,
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            stderr=err,
                            text=True,
                        )
                    children[variant] = child, log
                for child, log in children.values():
                    _next(child, log, lambda line: line == "ready")
                for variant, (child, log) in children.items():
                    child.stdin.write("go\n")
                    child.stdin.flush()
                    found[variant].append(float(_next(child, log, _is_number)))
                    child.wait(timeout=60)
            finally:
                for child, _ in children.values():
                    child.kill()
                    child.wait()
    return found


def _paired(ours: list[float], theirs: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(ours, theirs, strict=True))


def _stats(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def _met(ratio: float, target: float) -> str:
    return "yes" if ratio <= target else "no"


def rows(case: str, size: int, repeats: int, first_repeats: int) -> list[dict]:
    """The table rows of one state: steady saves, first saves, checksums."""
    description, blocked, programs = steady(case, size, repeats)
    checksum = blocked.pop("checksum")
    first = first_saves(case, size, first_repeats)
    sync = blocked["orbax sync"]
    added = [a - b for a, b in zip(blocked["spmd async"], blocked["orbax async"], strict=True)]
    row = {"benchmark": "checkpoint", "case": description}
    row.update({v: common.fmt_time(_stats(s)) for v, s in blocked.items()})
    row["first: orbax async"] = common.fmt_time(_stats(first["orbax async"]))
    row["first: spmd async"] = common.fmt_time(_stats(first["spmd async"]))
    async_ratio = _paired(blocked["spmd async"], blocked["orbax async"])
    first_ratio = _paired(first["spmd async"], first["orbax async"])
    checksum_ratio = _paired(checksum, sync)
    own = _paired(blocked["spmd async"], blocked["spmd sync"])
    row.update(
        {
            "spmd / orbax, sync": f"{_paired(blocked['spmd sync'], sync):.2f}x",
            "spmd / orbax, async": f"{async_ratio:.2f}x",
            "first, spmd / orbax": f"{first_ratio:.2f}x",
            "added / sync": f"{_paired(added, sync):.3f}",
            "checksum": common.fmt_time(_stats(checksum)),
            "checksum / sync": f"{checksum_ratio:.3f}",
            "async / sync": f"{own:.3f}",
            "checksum programs": str(programs),
        }
    )
    targets = [f"checksum ≤ {CHECKSUM_TARGET:.2f}: {_met(checksum_ratio, CHECKSUM_TARGET)}"]
    if case == "big":
        targets.append(f"async / sync ≤ {TARGET:.2f}: {_met(own, TARGET)}")
    else:
        targets.append(f"first ≤ {FIRST_TARGET:.0f}x: {_met(first_ratio, FIRST_TARGET)}")
    row["targets"] = "; ".join(targets)
    return [{key: row[key] for key in ("benchmark", *COLUMNS)}]


def main(quick: bool = False) -> list[dict]:
    """Every benchmark of this file, as table rows."""
    big = rows("big", QUICK_STATE_MB if quick else STATE_MB, 3 if quick else 7, 1 if quick else 5)
    many = rows("many", QUICK_LEAVES if quick else LEAVES, 2, 1 if quick else 3)
    return big + many


COLUMNS = [
    "case",
    *_VARIANTS,
    "spmd / orbax, sync",
    "spmd / orbax, async",
    "first: orbax async",
    "first: spmd async",
    "first, spmd / orbax",
    "added / sync",
    "checksum",
    "checksum / sync",
    "async / sync",
    "checksum programs",
    "targets",
]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--first-save", nargs=4, metavar=("CASE", "SIZE", "VARIANT", "DIR"))
    args = parser.parse_args()
    common.set_cpu_devices(8)
    if args.first_save:
        case, size, variant, directory = args.first_save
        first_save(case, int(size), variant, directory)
    else:
        print(common.table(main(args.quick), COLUMNS))
