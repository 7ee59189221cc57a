"""Elastic resume in one process: a job's mesh changes size between runs.

One process with 8 simulated devices stands in for processes that come and go:
a job trained on 4 devices resumes on 2 (a host lost for good), and the result
must equal the uninterrupted job on one device (the oracle).
"""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from commands import run_program

import spmd

ROOT = Path(__file__).resolve().parents[1]
FIT_WORKER = Path(__file__).with_name("elastic_fit_worker.py")


def _fit(devices: int, backup: Path | str, out: Path, kill_at: int, per_execution: int):
    command = [sys.executable, str(FIT_WORKER), str(devices), str(backup), str(out)]
    command += [str(kill_at), str(per_execution)]
    return run_program(command, dict(os.environ), 300, cwd=ROOT)


@pytest.mark.slow  # 21 s of CPU: over the fast tier's share (tests/tiers.py)
def test_fit_with_dropout_and_steps_per_execution_killed_on_4_devices_resumes_on_2(tmp_path):
    """Killed mid-epoch 2 (iteration 11 of 16, 3 batches per call), resumed on half the devices.

    Dropout's RNG state, Adam's moments and the data position travel in the
    backup: the final parameters and both epochs' losses equal one device's
    uninterrupted fit up to the order of floating-point sums.
    """
    oracle = _fit(1, "-", tmp_path / "oracle.npz", -1, 3)  # uninterrupted: no backup to write
    assert oracle.returncode == 0, oracle.stderr[-2000:]
    killed = _fit(4, tmp_path / "b1", tmp_path / "resumed.npz", 11, 3)
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = _fit(2, tmp_path / "b1", tmp_path / "resumed.npz", -1, 3)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    want, got = np.load(tmp_path / "oracle.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(want.files) == sorted(got.files) and len(want.files) == 5
    for key in want.files:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


def _numpy_dataset(strategy, batch: int, options=None):
    ids = np.arange(96, dtype=np.int32)
    return strategy.distribute_dataset(
        strategy.make_numpy_dataset(ids, batch, shuffle=True, seed=3), options
    )


@pytest.mark.cpu_mesh
def test_a_global_batch_the_smaller_mesh_cannot_split_is_padded_when_asked_else_named():
    """8 rows on 3 replicas (4 processes of 1 device, one lost).

    A custom loop that did not opt in gets an error naming the batch, the
    replicas and both ways out; one that did (uneven_batch="pad") goes on from
    the 4-replica position with the same examples, padded to 9 rows, 1 masked.
    """
    import jax

    strategy = spmd.MirroredStrategy(jax.devices()[:3])
    with pytest.raises(spmd.BatchError) as info:
        next(iter(_numpy_dataset(strategy, 8)))
    text = str(info.value)
    assert "global_batch_size=8" in text and "num_replicas_in_sync=3" in text, text
    assert 'uneven_batch="pad"' in text, text
    options = spmd.InputOptions(uneven_batch="pad")
    before = iter(_numpy_dataset(spmd.MirroredStrategy(jax.devices()[:4]), 8, options))
    next(before), next(before)
    saved, want = before.get_state(), next(before)
    after = _numpy_dataset(strategy, 8, options)
    after.set_state(saved)
    got = next(iter(after))
    np.testing.assert_array_equal(np.asarray(got.inputs[0])[:8], want.inputs[0])
    np.testing.assert_array_equal(got.mask, [1] * 8 + [0])


def test_a_position_restored_with_a_rounded_up_global_batch_is_an_error():
    """Following the batch error's advice (9 rows) on resume changes the examples a position means."""
    import jax

    it = iter(_numpy_dataset(spmd.MirroredStrategy(jax.devices()[:4]), 8))
    next(it), next(it)
    saved = it.get_state()
    resumed = _numpy_dataset(spmd.MirroredStrategy(jax.devices()[:3]), 9)
    with pytest.raises(spmd.ConfigurationError) as info:
        resumed.set_state(saved)
    assert "global_batch_size" in str(info.value) and "8 saved, 9 now" in str(info.value)


def _requeue_recipe() -> str:
    text = (ROOT / "docs" / "multihost.md").read_text()
    section = text.split("## A requeue loop across machines", 1)[1]
    return section.split("```sh", 1)[1].split("```", 1)[0]


def test_the_requeue_recipe_survives_a_lost_node_and_numbers_its_attempts():
    """docs/multihost.md says the scheduler's loop goes on with the nodes left.

    It can only with each of these: without `#SBATCH --no-kill` Slurm cancels
    the whole allocation when a node fails, so there is no next attempt;
    without `--nodes`, each `srun` asks for every node of the allocation, never
    fewer; without `--kill-on-bad-exit=1` a task that raised leaves the others
    running up to heartbeat_timeout (unless the cluster's KillOnBadExit says
    otherwise); and without SPMD_RESTART_COUNT `spmd._src.clusters.launch.restart_count()` is 0 on
    each attempt.
    """
    recipe = _requeue_recipe()
    assert "srun" in recipe and "for attempt" in recipe  # the recipe is the one meant
    for needed in ("--no-kill", "--kill-on-bad-exit", "SPMD_RESTART_COUNT", "--nodes"):
        assert needed in recipe.split("#SBATCH --ntasks-per-node")[1], needed
