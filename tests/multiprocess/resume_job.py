"""The elastic tests' job: resume_worker.py, its command line and its oracle check."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

WORKER = Path(__file__).with_name("resume_worker.py")
STEPS, BATCH = 10, 8


def command(ckpt: Path, out: Path, *flags: str) -> list[str]:
    """resume_worker.py training STEPS steps, checkpointing into `ckpt`, final state to `out`."""
    return [sys.executable, str(WORKER), str(ckpt), str(out), "--steps", str(STEPS), *flags]


def assert_same_trajectory(got: dict, want: dict, batch: int = BATCH) -> None:
    """Every example trained exactly once, and the losses and weights of the oracle."""
    np.testing.assert_array_equal(got["seen"], np.ones(STEPS * batch))  # none lost or repeated
    for key in ("losses", "w", "v"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
