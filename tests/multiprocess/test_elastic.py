"""Elastic jobs: a host lost for good shrinks the job, a later launch grows it back.

Each job is resume_worker.py: MultiWorkerMirroredStrategy over every process's
2 devices, a global batch of 8 whatever the process count, a checkpoint after
every step. The oracle is the same model, data and seed on one process: the
loss trajectory of a job that changed its process count must match it, and
every example must be trained on exactly once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import spmd
from spmd._src.cli.main import main
from spmd._src.clusters.launch import launch
from spmd.testing import run_processes

from .procs import child_env
from .resume_job import assert_same_trajectory
from .resume_job import command as job_command

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

FIT_WORKER = Path(__file__).with_name("elastic_trainer_worker.py")


def _events(output: str) -> list[dict]:
    """The chief's JSON lines, as spmd launch prints them ("[0] {...}")."""
    return [json.loads(line[4:]) for line in output.splitlines() if line.startswith("[0] {")]


def _fit_command(backup: Path, out: Path, *flags: str) -> list[str]:
    """elastic_trainer_worker.py: fit with a global batch of 6, backed up into `backup`."""
    return [sys.executable, str(FIT_WORKER), str(backup), str(out), *flags]


def _epoch_losses(events: list[dict]) -> dict[int, float]:
    """Each epoch's loss, as the attempt that ended the epoch logged it."""
    return {e["epoch"]: e["loss"] for e in events if e["event"] == "epoch"}


@pytest.fixture(scope="module")
def one_device_fit(tmp_path_factory):
    """The Trainer job's oracle for some flags: one process with one device, never interrupted."""
    made: dict[tuple, tuple[dict, dict]] = {}

    def oracle(*flags: str) -> tuple[dict, dict]:
        if flags not in made:
            folder = tmp_path_factory.mktemp("elastic_fit_oracle")
            out = folder / "one.npz"
            command = _fit_command(folder / "backup", out, *flags)
            results = run_processes(command, 1, devices_per_process=1, env=child_env())
            lines = results[0].stdout.splitlines()
            events = [json.loads(line) for line in lines if line.startswith("{")]
            made[flags] = dict(np.load(out)), _epoch_losses(events)
        return made[flags]

    return oracle


def _assert_fit_as_oracle(out: Path, events: list[dict], oracle: tuple[dict, dict]) -> None:
    """Each example trained on once an epoch; the parameters and epoch losses of the oracle."""
    want, want_losses = oracle
    got = dict(np.load(out))
    np.testing.assert_array_equal(got["['seen'].value"], np.full(36, 3.0))  # 3 epochs, once each
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(
        [_epoch_losses(events)[e] for e in range(3)], [want_losses[e] for e in range(3)], rtol=1e-5
    )


def test_a_process_lost_for_good_shrinks_the_job_with_the_same_global_batch(
    tmp_path, one_process, capfd
):
    """Process 1 dies (SIGKILL) at step 4 whenever there are 2: after its restart, 1 goes on."""
    out = tmp_path / "final.npz"
    command = job_command(tmp_path / "ckpt", out, "--fail-at", "4", "--fail-above", "1")
    code = launch(
        command,
        num_processes=2,
        devices_per_process=2,
        max_restarts=1,
        min_processes=1,
        timeout=240,
        env=child_env(),
    )
    output, errors = capfd.readouterr()
    assert code == 0, output + errors
    assert "relaunching on 1 (min_processes=1)" in errors, errors
    starts = [e for e in _events(output) if e["event"] == "start"]
    assert [e["processes"] for e in starts] == [2, 2, 1], starts
    # Each resumes from the newest complete checkpoint: that of step 4 (saved
    # asynchronously) may not be complete when process 1 dies at step 4.
    assert starts[0]["step"] == 0 and all(3 <= e["step"] <= 4 for e in starts[1:]), starts
    assert_same_trajectory(dict(np.load(out)), one_process)


@pytest.mark.parametrize(
    "how, replicas",
    [("--uneven", [6, 4, 2]), ("--dividing", [6, 3, 2])],
    ids=["padded", "devices_that_divide"],
)
def test_a_global_batch_of_6_trains_on_3_then_2_then_1_processes_as_on_one_device(
    tmp_path, one_device_batch_6, capfd, how, replicas
):
    """6 rows over 3, then 2, then 1 process of 2 devices: 4 devices do not divide 6.

    A process is lost for good at 3 processes (step 3) and at 2 (step 6).
    "padded": the custom loop opts into padding (InputOptions(uneven_batch="pad")):
    at 4 replicas each global batch is padded to 8 rows, 2 of them masked, and
    the mask weighs the loss and the count of each example trained on.
    "devices_that_divide": MultiWorkerMirroredStrategy(global_batch_size=6) takes
    3 of the 4 devices at 2 processes (2 in process 0, 1 in process 1), nothing
    padded. Either way every example is trained on exactly once and the losses
    and weights are the one-device oracle's.
    """
    out = tmp_path / "final.npz"
    flags = ("--batch", "6", how, "--fail-when", "3:3", "--fail-when", "6:2")
    command = job_command(tmp_path / "ckpt", out, *flags)
    code = launch(command, 3, 2, max_restarts=0, min_processes=1, timeout=240, env=child_env())
    output, errors = capfd.readouterr()
    assert code == 0, output + errors
    assert "relaunching on 2 (min_processes=1)" in errors, errors
    assert "relaunching on 1 (min_processes=1)" in errors, errors
    events = _events(output)
    assert [e["replicas"] for e in events if e["event"] == "mesh"] == replicas, events
    starts = [e for e in events if e["event"] == "start"]
    assert [e["processes"] for e in starts] == [3, 2, 1], starts
    assert 2 <= starts[1]["step"] <= 3 and 5 <= starts[2]["step"] <= 6, starts
    assert_same_trajectory(dict(np.load(out)), one_device_batch_6, batch=6)


def test_fit_with_a_global_batch_of_6_on_3_then_2_then_1_processes_equals_one_device(
    tmp_path, one_device_fit, capfd
):
    """Trainer.fit with Dropout and BackupAndRestore: a process lost at iteration 4 of 3
    processes and at iteration 10 of 2. fit pads the batch of 6 to 8 rows at 4 replicas
    on its own; each example is trained on once an epoch (the model counts the weight
    each gets), and the epoch losses and parameters are the one-device oracle's."""
    out = tmp_path / "final.npz"
    command = _fit_command(tmp_path / "backup", out, "--fail-when", "4:3", "--fail-when", "10:2")
    code = launch(command, 3, 2, max_restarts=0, min_processes=1, timeout=240, env=child_env())
    output, errors = capfd.readouterr()
    assert code == 0, output + errors
    events = _events(output)
    starts = [(e["processes"], e["step"]) for e in events if e["event"] == "start"]
    assert [n for n, _ in starts] == [3, 2, 1] and starts[0][1] == 0, starts
    assert 3 <= starts[1][1] <= 4 and 9 <= starts[2][1] <= 10, starts  # the newest backups
    assert [e["replicas"] for e in events if e["event"] == "mesh"] == [6, 4, 2], events
    _assert_fit_as_oracle(out, events, one_device_fit())


def test_fit_resumed_after_a_short_last_call_of_an_epoch_on_fewer_processes_equals_one_device(
    tmp_path, one_device_fit, capfd
):
    """steps_per_execution=4 over 6 batches an epoch: calls end at iterations 4, 6 (a short
    call, which reads past the data's end), 10, 12, ... 2 processes lose one at iteration 10,
    whose backup never completes: the one left resumes from the backup of iteration 6, the
    end of epoch 0, and trains epochs 1 and 2 only, as one device does."""
    out, spe = tmp_path / "final.npz", ("--steps-per-execution", "4")
    command = _fit_command(tmp_path / "backup", out, *spe, "--fail-when", "10:2")
    code = launch(command, 2, 2, max_restarts=0, min_processes=1, timeout=240, env=child_env())
    output, errors = capfd.readouterr()
    assert code == 0, output + errors
    events = _events(output)
    starts = [(e["processes"], e["step"]) for e in events if e["event"] == "start"]
    assert starts == [(2, 0), (1, 6)], starts
    assert [e["step"] for e in events if e["event"] == "done"] == [18], events
    _assert_fit_as_oracle(out, events, one_device_fit(*spe))


def test_fit_with_batchnorm_over_the_devices_that_divide_the_batch_shrinks_to_the_oracle(
    tmp_path, one_device_fit, capfd
):
    """A model with BatchNorm statistics cannot train on padded rows: over
    MultiWorkerMirroredStrategy(global_batch_size=6) it needs none. 3 processes of 2
    devices lose one at iteration 4; the 2 left take 3 devices (2 in process 0, 1 in
    process 1) and finish, as one device does, gathering the state on both."""
    out = tmp_path / "final.npz"
    command = _fit_command(tmp_path / "backup", out, "--dividing", "--fail-when", "4:3")
    code = launch(command, 3, 2, max_restarts=0, min_processes=2, timeout=240, env=child_env())
    output, errors = capfd.readouterr()
    assert code == 0, output + errors
    events = _events(output)
    assert [e["replicas"] for e in events if e["event"] == "mesh"] == [6, 3], events
    _assert_fit_as_oracle(out, events, one_device_fit("--dividing"))


def test_a_later_launch_on_more_processes_grows_the_job_back(tmp_path, one_process, capfd):
    """Steps 0-4 on one process, the rest on two: the checkpoint restores into the larger mesh."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "final.npz"
    small = launch(job_command(ckpt, out, "--stop-at", "5"), 1, 2, timeout=120, env=child_env())
    large = launch(job_command(ckpt, out), 2, 2, timeout=120, env=child_env())
    output, errors = capfd.readouterr()
    assert (small, large) == (0, 0), output + errors
    starts = [e for e in _events(output) if e["event"] == "start"]
    assert [(e["processes"], e["step"]) for e in starts] == [(1, 0), (2, 5)], starts
    assert_same_trajectory(dict(np.load(out)), one_process)


def test_min_processes_must_be_between_one_and_the_process_count(capsys):
    for bad in (0, 3, 1.5, True):
        with pytest.raises(spmd.ConfigurationError) as info:
            launch(["true"], num_processes=2, min_processes=bad)
        assert "min_processes" in str(info.value) and "from 1 to num_processes" in str(info.value)
    for argv in (["--min-processes", "3"], ["--min-processes", "0"]):  # usage errors: exit 2
        with pytest.raises(SystemExit) as exited:
            main(["launch", "-n", "2", *argv, "--", "true"])
        assert exited.value.code == 2
        assert "--min-processes" in capsys.readouterr().err
