"""Compiling a plan's candidates: several at once, each program once per target (a disk cache).

The compiler releases Python's lock while it compiles, so worker threads
compile candidates side by side; tracing and lowering stay on the caller's
thread. A compile of a large model holds gigabytes, so the default count
of workers is bounded by free memory as well as by cores.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from spmd._src import plan_cache
from spmd._src.explain import CompilerOutput, compile_lowered

__all__ = ["COMPILE_MEMORY", "compile_programs", "default_jobs"]

# What one candidate's compile held at its peak (1.6 GiB, the whole process) for a 32B decoder on
# v5p-128 (docs/planning.md, "What a plan costs"): the bound on workers per free memory.
COMPILE_MEMORY = 2 << 30


def _available_memory() -> int | None:
    """Bytes of memory free for new work (Linux's MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def default_jobs() -> int:
    """Workers for a plan: one per core, no more than free memory holds compiles of
    `COMPILE_MEMORY`, at least one."""
    cores = os.cpu_count() or 1
    free = _available_memory()
    by_memory = cores if free is None else free // COMPILE_MEMORY
    return max(1, min(cores, by_memory))


def _compile(lowered: Any) -> tuple[CompilerOutput | BaseException, float]:
    start = time.perf_counter()
    try:
        output: CompilerOutput | BaseException = compile_lowered(lowered)
    except Exception as e:  # the compiler's own error: the caller drops the candidate
        output = e
    return output, time.perf_counter() - start


def compile_programs(
    programs: Sequence[tuple[Any, str]],
    jobs: int,
    cache_dir: Path | None,
    compile_fn: Callable[[Any], tuple[CompilerOutput | BaseException, float]] = _compile,
) -> Iterator[tuple[int, CompilerOutput | BaseException, float | None]]:
    """Compiles `(lowered, cache key)` programs, yielding each as it finishes.

    Args:
      programs: each lowered program with its `plan_cache.cache_key`.
      jobs: how many compile at once.
      cache_dir: where compiler outputs are kept between runs; None for none.
      compile_fn: the compile itself (a test counts its calls).

    Yields:
      (index into `programs`, the compiler's output or its error, seconds the
      compile took or None where the output came from the cache). Errors are
      not cached; a refusal for want of HBM is an output, and is.
    """
    todo = []
    for i, (lowered, key) in enumerate(programs):
        cached = plan_cache.load(cache_dir, key)
        if cached is not None:
            yield i, cached, None
        else:
            todo.append((i, lowered, key))
    if not todo:
        return
    pool = ThreadPoolExecutor(max_workers=max(1, min(jobs, len(todo))))
    try:
        futures = {pool.submit(compile_fn, lowered): (i, key) for i, lowered, key in todo}
        for future in as_completed(futures):
            i, key = futures[future]
            output, seconds = future.result()
            if isinstance(output, CompilerOutput):
                _store(cache_dir, key, output)
            yield i, output, seconds
    finally:
        # Ctrl-C, or a caller that stops early: the queued compiles are dropped, not run, and
        # the running ones are not waited for (each may take minutes; their outputs are lost).
        pool.shutdown(wait=False, cancel_futures=True)


def _store(cache_dir: Path | None, key: str, output: CompilerOutput) -> None:
    """Keeps a compiler output; a cache that cannot be written costs time, not the plan."""
    try:
        plan_cache.store(cache_dir, key, output)
    except OSError as e:
        warnings.warn(
            f"spmd.auto_strategy: the plan cache {cache_dir} cannot be written ({e}); the "
            "plan goes on, and a later plan compiles this candidate again. Pass a writable "
            "cache_dir (spmd plan --cache-dir DIR), or None ('') for no cache.",
            stacklevel=2,
        )
