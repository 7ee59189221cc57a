"""`spmd launch --min-processes`: which process fails, and how, and what the job does.

Each job is resume_worker.py with --failing P and --hang:
MultiWorkerMirroredStrategy over 2 devices a process, a global batch
of 8, a checkpoint after every step. The oracle is one uninterrupted process
with 4 devices; a job that shrank must match it, each example trained once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from spmd._src.clusters.launch import launch

from .procs import child_env
from .resume_job import assert_same_trajectory
from .resume_job import command as job_command

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _shrink(tmp_path: Path, capfd, *flags: str) -> tuple[int, str, str]:
    """2 processes, no restarts, down to 1; `flags` say which process fails at step 4, how."""
    command = job_command(tmp_path / "ckpt", tmp_path / "final.npz", "--fail-at", "4", *flags)
    code = launch(command, 2, 2, max_restarts=0, min_processes=1, timeout=240, env=child_env())
    output, errors = capfd.readouterr()
    return code, output, errors


def test_the_coordinator_lost_for_good_shrinks_the_job_to_the_oracle(tmp_path, one_process, capfd):
    """Process 0 (the coordination service's host) is killed: the job goes on on 1 process."""
    code, output, errors = _shrink(tmp_path, capfd, "--failing", "0")
    assert code == 0, output + errors
    assert "relaunching on 1 (min_processes=1)" in errors, errors
    assert "first failure: process 0" in errors, errors
    assert_same_trajectory(dict(np.load(tmp_path / "final.npz")), one_process)


def test_a_hung_process_is_named_as_the_failure_and_the_job_shrinks(tmp_path, one_process, capfd):
    """Process 1 hangs (alive, heartbeating, never at step 4's collective).

    Process 0's save(step=5) waits 30 s for it, fails, and the job shrinks to 1
    process and matches the oracle. The process at fault is 1, which never
    arrived: the launcher names it as the first failure (not process 0, which
    waited), and the error leads with it (the `if is_chief:` misuse second).
    """
    code, output, errors = _shrink(tmp_path, capfd, "--hang")
    assert code == 0, output + errors
    assert_same_trajectory(dict(np.load(tmp_path / "final.npz")), one_process)
    assert "first failure: process 1" in errors, errors
    assert "process(es) [1] did not reach save(step=5) within 30 s (hung or slow)" in errors
