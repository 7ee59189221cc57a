"""Running spmd's command line and Python programs as a user would, in child processes:
`python -m spmd ...`, `python SCRIPT ...`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from spmd._src.clusters import preload

ROOT = Path(__file__).resolve().parents[1]
# How the run compiles (tests/conftest.py sets it in XLA_FLAGS): XLA's CPU backend at
# optimization level 0, passed on to every program the tests start.
OPTIMIZATION_FLAG = "--xla_backend_optimization_level"


def child_env(*without: str) -> dict[str, str]:
    """This environment without any cluster description (TF_CONFIG, SPMD_*, but for
    SPMD_LAUNCH_PRELOAD: how the run starts workers) nor the variables named in
    `without`, with spmd importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "TF_CONFIG"
        and (not k.startswith("SPMD_") or k == "SPMD_LAUNCH_PRELOAD")
        and k not in without
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def program_env() -> dict[str, str]:
    """`child_env()` for a program that picks its own devices (an example, `spmd demo`):
    XLA_FLAGS only as the run compiles (its optimization level, tests/conftest.py), without
    a device count or any other XLA flag of the shell the run started in."""
    env = child_env("XLA_FLAGS")
    kept = [
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if flag.startswith(f"{OPTIMIZATION_FLAG}=")
    ]
    if kept:
        env["XLA_FLAGS"] = " ".join(kept)
    return env


def run_spmd(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python -m spmd ARGS` run to its end, in `env` (`child_env()` if not given)."""
    command = [sys.executable, "-m", "spmd", *args]
    return run_program(command, child_env() if env is None else env, timeout)


def start_program(
    command: list[str],
    env: dict[str, str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    stdout: Any = subprocess.PIPE,
    stderr: Any = subprocess.PIPE,
) -> subprocess.Popen[str] | preload.ForkedProcess:
    """`command` started as subprocess.Popen(..., text=True) starts it, its stdin
    /dev/null. A Python program (`python SCRIPT|-c|-m ...` by this interpreter) is forked
    from the run's warm interpreter where SPMD_LAUNCH_PRELOAD says so (tests/conftest.py)
    and it can run there as a fresh interpreter would (what
    tests/test_workers_forked_from_a_warm_interpreter.py checks against fresh starts):
    the seconds of CPU of importing JAX, flax, optax and orbax again are saved. A test of
    the fresh start itself calls subprocess."""
    forked = preload.start(command, env, cwd=cwd, stdout=stdout, stderr=stderr, text=True)
    if forked is not None:
        return forked
    return subprocess.Popen(
        command,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        text=True,
    )


def run_program(
    command: list[str],
    env: dict[str, str],
    timeout: float,
    *,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`command` run to its end as subprocess.run(..., capture_output=True, text=True,
    timeout=timeout) runs it (started by start_program): killed and
    subprocess.TimeoutExpired past `timeout` s."""
    process = start_program(command, env, cwd=cwd)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)
