"""Helpers for spmd's tests and users' own: assertions, and real multi-process clusters run locally."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from spmd._src.clusters.launch import GroupResult, ProcessResult, run_group
from spmd._src.errors import LaunchError, message, received

__all__ = [
    "ProcessResult",
    "assert_compiles_once",
    "assert_layout",
    "assert_trees_allclose",
    "run_processes",
]

_TAIL_LINES = 30  # lines of each failed process's stderr quoted in a LaunchError


def _command(script_or_code: str | os.PathLike[str] | Sequence[str]) -> list[str]:
    """[python, file] for a .py path, [python, -c, code] for code, or the command itself."""
    if isinstance(script_or_code, os.PathLike):
        return [sys.executable, os.fspath(script_or_code)]
    if isinstance(script_or_code, str):
        is_file = script_or_code.endswith(".py") and os.path.isfile(script_or_code)
        return (
            [sys.executable, script_or_code] if is_file else [sys.executable, "-c", script_or_code]
        )
    return list(script_or_code)


def _tail(text: str, lines: int = _TAIL_LINES) -> str:
    """The last `lines` lines of `text`, indented."""
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def _failure_message(result: GroupResult, timeout: float) -> str:
    """Says how the group failed, quoting each failed process's stderr."""
    what = f"timed out after {timeout:g} s" if result.timed_out else result.describe()
    quoted = result.failed or tuple(range(len(result.processes)))
    tails = "".join(
        f"\n--- stderr of process {i} (last {_TAIL_LINES} lines):\n"
        f"{_tail(result.processes[i].stderr)}"
        for i in quoted
    )
    return (
        message(
            "Every process of the group should exit with code 0.",
            received(outcome=what, returncodes=[p.returncode for p in result.processes]),
            "read the output below; pass check=False to inspect the results yourself.",
        )
        + tails
    )


def run_processes(
    script_or_code: str | os.PathLike[str] | Sequence[str],
    num_processes: int,
    devices_per_process: int | None = None,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    *,
    check: bool = True,
) -> list[ProcessResult]:
    """Runs a program as `num_processes` local processes of one spmd cluster.

    The same machinery as `spmd launch` (free loopback port, SPMD_* environment,
    every process stopped as soon as one fails), with each process's output
    captured instead of streamed. The program calls `spmd.initialize()` to join.

    Args:
      script_or_code: a path to a .py file, Python source code (run with
        `python -c`), or a whole command as a list of strings.
      num_processes: how many processes to start.
      devices_per_process: simulated CPU devices per process.
      timeout: seconds after which every process is stopped.
      env: variables to set on top of this process's environment, e.g.
        {"PYTHONPATH": ...}.
      check: raise a LaunchError quoting the failed processes' stderr unless every
        process exits with code 0.

    Returns:
      One ProcessResult (returncode, stdout, stderr) per process, in index order.

    Raises:
      LaunchError: with `check=True`, if a process failed or the timeout passed.

    Example:
      >>> code = "import spmd, jax; spmd.initialize(); print(jax.process_count())"
      >>> results = run_processes(code, num_processes=2, devices_per_process=2)  # doctest: +SKIP
      >>> [r.stdout.strip() for r in results]  # doctest: +SKIP
      ['2', '2']
    """
    result = run_group(
        _command(script_or_code),
        num_processes,
        devices_per_process=devices_per_process,
        env=env,
        timeout=timeout,
        capture=True,
    )
    if check and not result.ok:
        raise LaunchError(_failure_message(result, timeout))
    return list(result.processes)


def assert_trees_allclose(
    actual: Any, expected: Any, *, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Asserts two pytrees have the same structure and allclose leaves, naming the first bad path.

    Leaves may be numpy arrays, jax.Arrays (in any memory, on any devices of
    this process) or NNX objects' states.
    """
    import jax

    from spmd._src.rules import path_str
    from spmd._src.strategy.nnx_state import pure

    got, got_def = jax.tree_util.tree_flatten_with_path(pure(actual))
    want, want_def = jax.tree_util.tree_flatten_with_path(pure(expected))
    assert got_def == want_def, (
        f"tree structures differ:\n  actual:   {got_def}\n  expected: {want_def}"
    )
    for (path, a), (_, b) in zip(got, want, strict=True):
        np.testing.assert_allclose(
            np.asarray(jax.device_get(a)),
            np.asarray(jax.device_get(b)),
            rtol=rtol,
            atol=atol,
            err_msg=f"at {path_str(path)!r}",
        )


def assert_layout(tree: Any, shardings: Any) -> None:
    """Asserts every leaf of `tree` is laid out (and in the memory kind) as `shardings` says."""
    import jax

    from spmd._src.rules import path_str
    from spmd._src.strategy.nnx_state import pure

    leaves = jax.tree_util.tree_flatten_with_path(pure(tree))[0]
    for (path, leaf), sharding in zip(leaves, jax.tree.leaves(shardings), strict=True):
        where = path_str(path)
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (
            f"{where}: {leaf.sharding} != {sharding}"
        )
        assert leaf.sharding.memory_kind == sharding.memory_kind, (
            f"{where}: memory {leaf.sharding.memory_kind} != {sharding.memory_kind}"
        )


def assert_compiles_once(step: Any) -> None:
    """Asserts a `Step` compiled exactly one program over all the calls so far."""
    count = step.cache_size()
    assert count == 1, f"the step compiled {count} programs; expected 1 (shapes or layouts changed)"
