"""Running spmd's command line as a user would: `python -m spmd ...` in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(*without: str) -> dict[str, str]:
    """This environment without any cluster description (TF_CONFIG, SPMD_*) nor the
    variables named in `without`, with spmd importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "TF_CONFIG" and not k.startswith("SPMD_") and k not in without
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
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
