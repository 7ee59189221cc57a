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


@pytest.fixture(scope="session")
def one_device_batch_6(tmp_path_factory) -> dict:
    """The oracle of a global batch of 6: resume_worker.py on one process with one device."""
    folder = tmp_path_factory.mktemp("elastic_oracle_6")
    out = folder / "one.npz"
    run_processes(
        command(folder / "ckpt", out, "--batch", "6"), 1, devices_per_process=1, env=child_env()
    )
    return dict(np.load(out))
