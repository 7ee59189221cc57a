"""Running spmd's command line as a user would: `python -m spmd ...` in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    return subprocess.run(
        [sys.executable, "-m", "spmd", *args],
        env=child_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
