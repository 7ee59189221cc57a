"""Processes that feed a step numpy batches of one shape compare their values.

Each process's numpy arrays are the global batch, of which it keeps its own rows:
processes passing different values of the same shape would train on a mix (process 0
sees a sum its own batch does not have). They compare a fingerprint of the batch at
each new signature and every `compare_batch_every` calls in between; a mismatch is a
`BatchError` on every process naming the arguments that differ.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

import spmd
from spmd._src.strategy.step_checks import COMPARE_BATCH_EVERY
from spmd.testing import run_processes

WORKER = Path(__file__).with_name("batch_values_worker.py")
pytestmark = [pytest.mark.timeout(300)]
DIFFER = "BatchError: Every process passes a step the same global batch"


def _run(scenario: str, out: Path, processes: int = 2):
    return run_processes(
        [sys.executable, str(WORKER), scenario, str(out)],
        processes,
        devices_per_process=4 // processes,
        timeout=240,
        check=False,
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario, caught_at", [("first", 1), ("later", 7)])
def test_processes_feeding_different_values_each_get_a_batch_error(scenario, caught_at, tmp_path):
    """Differing from the first call: caught by the signature's agreement. Differing from
    the 5th, with compare_batch_every=3: caught at the 7th call, the next comparison."""
    out = tmp_path / "out.npz"
    for r in _run(scenario, out):
        output = r.stdout + r.stderr
        assert r.returncode == 3, (r.returncode, output[-3000:])
        assert DIFFER in r.stdout, output[-3000:]
        assert "differs=['images', 'labels']" in r.stdout, r.stdout[-3000:]
        assert "distribute_dataset" in r.stdout
        assert r.stdout.split("BatchError")[0].strip().endswith(f"call {caught_at}"), r.stdout
    assert not out.exists()


@pytest.mark.multiprocess
def test_processes_passing_strategy_run_different_values_each_get_a_batch_error(tmp_path):
    out = tmp_path / "out.npz"
    for r in _run("run", out):
        output = r.stdout + r.stderr
        assert r.returncode == 3, (r.returncode, output[-3000:])
        assert "BatchError: Every process passes strategy.run the same global batch" in r.stdout
        assert "differs=['split arguments']" in r.stdout, r.stdout[-3000:]
        assert r.stdout.split("BatchError")[0].strip().endswith("call 1"), r.stdout
    assert not out.exists()


@pytest.mark.multiprocess
def test_the_same_values_compared_every_call_train_as_one_process(tmp_path):
    two, one = tmp_path / "two.npz", tmp_path / "one.npz"
    for r in _run("same", two):
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    for r in _run("same", one, processes=1):
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got, want = dict(np.load(two)), dict(np.load(one))
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "100", None])
def test_compare_batch_every_is_an_integer_of_zero_or_more(bad):
    with pytest.raises(spmd.ConfigurationError) as error:
        spmd.MirroredStrategy().step(lambda state, x: (state, x.sum()), compare_batch_every=bad)
    text = str(error.value)
    assert "compare_batch_every must be a non-negative integer" in text, text
    assert "Received: compare_batch_every=" in text and "compare_batch_every=1" in text


def test_compare_batch_every_is_kept_by_the_step():
    strategy = spmd.MirroredStrategy()
    assert strategy.step(lambda s, x: (s, x)).compare_batch_every == COMPARE_BATCH_EVERY == 100
    assert strategy.step(compare_batch_every=0)(lambda s, x: (s, x)).compare_batch_every == 0
