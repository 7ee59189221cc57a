"""Fixtures shared by the multi-process tests."""

from __future__ import annotations

import numpy as np
import pytest

from spmd.testing import run_processes

from .procs import child_env
from .resume_job import command


@pytest.fixture(scope="session")
def one_process(tmp_path_factory) -> dict:
    """The elastic tests' oracle: resume_worker.py as one process with 4 devices, never interrupted."""
    folder = tmp_path_factory.mktemp("elastic_oracle")
    out = folder / "one.npz"
    run_processes(command(folder / "ckpt", out), 1, devices_per_process=4, env=child_env())
    return dict(np.load(out))
