"""A hostile user's `spmd launch --min-processes`: which process fails, and how.

Each job is resume_worker.py with --failing P and --hang:
MultiWorkerMirroredStrategy over 2 devices a process, a global batch
of 8, a checkpoint after every step. The oracle is one uninterrupted process
with 4 devices; a job that shrank must match it, each example trained once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from spmd.clusters.launch import launch
from spmd.testing import run_processes

from .procs import child_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("resume_worker.py")
STEPS, BATCH = 10, 8


def _command(ckpt: Path, out: Path, *flags: str) -> list[str]:
    return [sys.executable, str(WORKER), str(ckpt), str(out), "--steps", str(STEPS), *flags]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("hostile_elastic_oracle")
    out = folder / "one.npz"
    run_processes(_command(folder / "ckpt", out), 1, devices_per_process=4, env=child_env())
    return dict(np.load(out))


def _assert_same_trajectory(got: dict, want: dict) -> None:
    np.testing.assert_array_equal(got["seen"], np.ones(STEPS * BATCH))  # none lost or repeated
    for key in ("losses", "w", "v"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


def _shrink(tmp_path: Path, capfd, *flags: str) -> tuple[int, str, str]:
    """2 processes, no restarts, down to 1; `flags` say which process fails at step 4, how."""
    command = _command(tmp_path / "ckpt", tmp_path / "final.npz", "--fail-at", "4", *flags)
    code = launch(command, 2, 2, max_restarts=0, min_processes=1, timeout=240, env=child_env())
    output, errors = capfd.readouterr()
    return code, output, errors


def test_the_coordinator_lost_for_good_shrinks_the_job_to_the_oracle(tmp_path, one_process, capfd):
    """Process 0 (the coordination service's host) is killed: the job goes on on 1 process."""
    code, output, errors = _shrink(tmp_path, capfd, "--failing", "0")
    assert code == 0, output + errors
    assert "relaunching on 1 (min_processes=1)" in errors, errors
    assert "first failure: process 0" in errors, errors
    _assert_same_trajectory(dict(np.load(tmp_path / "final.npz")), one_process)


def test_a_hung_process_is_named_as_the_failure_and_the_job_shrinks(tmp_path, one_process, capfd):
    """Process 1 hangs (alive, heartbeating, never at step 4's collective).

    Process 0's save(step=5) waits 30 s for it, fails, and the job shrinks to 1
    process and matches the oracle. The process at fault is 1, which never
    arrived: the launcher names it as the first failure (not process 0, which
    waited), and the error leads with it (the `if is_chief:` misuse second).
    """
    code, output, errors = _shrink(tmp_path, capfd, "--hang")
    assert code == 0, output + errors
    _assert_same_trajectory(dict(np.load(tmp_path / "final.npz")), one_process)
    assert "first failure: process 1" in errors, errors
    assert "process(es) [1] did not reach save(step=5) within 30 s (hung or slow)" in errors
