"""Processes that feed a step directly agree on each batch signature before its first call.

Each process's numpy arrays are the global batch (it keeps its own rows), so two
processes passing different shapes, dtypes or structures would train on mixed
data; every process gets a `BatchError` naming both signatures instead, within a
bound, also when one process goes back alone to a signature agreed on before. A process that never comes to the step is named by the hang watch
(`hang_timeout`), or within `SPMD_BATCH_AGREE_TIMEOUT` where that is set. Equal signatures train as one process does, and
agree at each change of signature: the steady state asks the coordination service
nothing.
"""

import json
import math
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import spmd
from spmd._src.clusters import hang_watch
from spmd._src.clusters.launch_results import CONFIGURATION_EXIT_CODE, HANG_EXIT_CODE
from spmd._src.clusters.spec import ENV_HANG_TIMEOUT
from spmd._src.strategy import step_checks
from spmd.testing import run_processes

WORKER = Path(__file__).with_name("batch_signature_worker.py")
pytestmark = [pytest.mark.timeout(300)]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "scenario, shown",
    [
        ("rows", ["float32[8, 3]", "float32[16, 3]"]),
        ("dtype", ["images: float32[8, 3]", "images: int32[8, 3]"]),
        ("structure", ["images: float32[8, 3]", "images: {float32[8, 3]}"]),
        ("ragged_on_one", ["labels: float32[8]", "labels: float32[5]"]),
    ],
)
def test_processes_feeding_different_batches_each_get_a_batch_error(scenario, shown, tmp_path):
    start = time.monotonic()
    results = run_processes(
        [sys.executable, str(WORKER), scenario, str(tmp_path / "out.npz")],
        2,
        devices_per_process=2,
        timeout=240,
        check=False,
    )
    assert time.monotonic() - start < 200
    for r in results:
        assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
        assert "BatchError: Every process passes a step the same global batch signature" in r.stdout
        for text in shown:
            assert text in r.stdout, r.stdout
    assert not (tmp_path / "out.npz").exists()


@pytest.mark.multiprocess
def test_processes_feeding_the_same_batches_train_as_one_process(tmp_path):
    two, one = tmp_path / "two.npz", tmp_path / "one.npz"
    run_processes([sys.executable, str(WORKER), "same", str(two)], 2, devices_per_process=2)
    run_processes([sys.executable, str(WORKER), "same", str(one)], 1, devices_per_process=4)
    got, want = dict(np.load(two)), dict(np.load(one))
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5)


@pytest.mark.multiprocess
def test_a_process_that_never_comes_to_the_step_is_named_within_the_bound(tmp_path):
    """Process 1 is alive but never calls the step: process 0's first call, which waits
    for every process's batch signature, ends within SPMD_BATCH_AGREE_TIMEOUT (3 s)
    with a BatchError naming process 1, rather than waiting in a collective."""
    results = run_processes(
        [sys.executable, str(WORKER), "absent", str(tmp_path / "out")],
        2,
        devices_per_process=2,
        timeout=240,
        env={step_checks.ENV_AGREE_TIMEOUT: "3"},
        check=False,
    )
    first = results[0]
    assert first.returncode == 3, (first.returncode, first.stdout, first.stderr)
    assert "within 3 s of the others" in first.stdout
    assert "missing_process=1" in first.stdout
    waited = float(re.search(r"waited ([\d.]+) s", first.stdout).group(1))
    assert 3.0 <= waited < 30.0, waited


@pytest.mark.multiprocess
def test_a_process_that_never_comes_to_the_step_is_named_by_the_hang_watch_by_default(tmp_path):
    """Without SPMD_BATCH_AGREE_TIMEOUT the agreement has no bound of its own: the
    process waiting for process 1's signature is waiting inside the step, so the hang
    watch names process 1 as hung (exit code 75, which a launcher restarts), never a
    BatchError blaming the batch (exit code 78, which it does not), even where the
    agreement's default bound (2 s here) is shorter than hang_timeout (3 s)."""
    results = run_processes(
        [sys.executable, str(WORKER), "absent", str(tmp_path / "out")],
        2,
        devices_per_process=2,
        timeout=240,
        env={ENV_HANG_TIMEOUT: "3", "AGREE_DEFAULT_S": "2"},
        check=False,
    )
    output = "".join(r.stdout + r.stderr for r in results)
    assert [r.returncode for r in results] == [HANG_EXIT_CODE] * 2, output[-3000:]
    assert "BatchError" not in output, output[-3000:]
    assert "process 1" in results[0].stdout + results[0].stderr, output[-3000:]
    assert "before its first step (hang_timeout=3 s)" in output, output[-3000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("step, alone", [("step", 0), ("step", 1), ("diloco_step", 1)])
def test_a_process_going_back_alone_to_an_earlier_signature_ends_every_process(
    step, alone, tmp_path
):
    """Both processes agree on 8 rows, then on 16; then process `alone` goes back to 8
    while the other keeps 16. The one that changed agrees again and, finding that its
    peer went on past that call with 16, raises a BatchError naming both signatures; its
    peer, waiting in a collective, ends naming that BatchError. Nothing trains on the
    mixed data, and no one waits for a timeout. A DiLoCo step agrees as a step does."""
    out = tmp_path / "out.npz"
    scenario = f"{step.removesuffix('step')}back_on_{alone}"
    start = time.monotonic()
    results = run_processes(
        [sys.executable, str(WORKER), scenario, str(out)],
        2,
        devices_per_process=2,
        timeout=240,
        check=False,
    )
    assert time.monotonic() - start < 120
    changed, kept = results[alone], results[1 - alone]
    output = changed.stdout + changed.stderr
    assert changed.returncode == CONFIGURATION_EXIT_CODE, (changed.returncode, output[-3000:])
    assert "BatchError: Every process passes a step the same global batch signature" in output
    assert f"{alone}: 'images: float32[8, 3], labels: float32[8]" in output, output[-3000:]
    assert (
        f"{1 - alone}: 'images: float32[16, 3], labels: float32[16] (2 arrays, "
        in output.replace("\n", " ")
    ), output[-3000:]
    assert "unchanged since its previous call of this step" in output, output[-3000:]
    follower = f"spmd: ending: process {alone} failed (BatchError: Every process passes a step"
    assert kept.returncode == CONFIGURATION_EXIT_CODE, (kept.returncode, kept.stderr[-3000:])
    assert follower in kept.stderr, kept.stderr[-3000:]
    assert not out.exists()


@pytest.mark.multiprocess
def test_processes_agree_at_each_change_of_batch_signature_and_not_in_the_steady_state(tmp_path):
    """13 steps over two signatures (8 rows, then 16, then 8 again): three agreements on
    each process, made at each call whose signature differs from the previous call's, a
    signature agreed on before included; the other steps make no coordination-service
    call."""
    out = tmp_path / "counts"
    run_processes(
        [sys.executable, str(WORKER), "steady", str(out)], 2, devices_per_process=2, timeout=240
    )
    for index in range(2):
        counts = json.loads(Path(f"{out}.{index}.json").read_text())
        signatures = counts["again"]["agreements"]
        assert len(signatures) == 3, signatures
        assert "float32[8, 3]" in signatures[0] and "float32[16, 3]" in signatures[1]
        assert "float32[8, 3]" in signatures[2]
        assert len(counts["first"]["agreements"]) == len(counts["eight"]["agreements"]) == 1
        assert len(counts["back"]["agreements"]) == 3
        calls = {phase: counts[phase]["client_calls"] for phase in counts}
        assert calls["first"] > 0
        assert calls["eight"] == calls["first"], calls  # 5 steps, no call
        assert calls["sixteen"] > calls["eight"], calls
        assert calls["back"] > calls["sixteen"], calls  # back to 8: agreed again
        assert calls["again"] == calls["back"], calls  # 4 steps, no call


def test_the_agreement_bound_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(step_checks.ENV_AGREE_TIMEOUT, raising=False)
    assert not hang_watch.RUNNING.is_set()  # one process: no hang watch
    assert step_checks.agree_timeout() == step_checks.AGREE_TIMEOUT_S == 300.0
    monkeypatch.setattr(hang_watch, "RUNNING", threading.Event())
    hang_watch.RUNNING.set()  # the watch bounds the wait: no bound of the agreement's own
    assert step_checks.agree_timeout() == math.inf
    monkeypatch.setenv(step_checks.ENV_AGREE_TIMEOUT, "2.5")
    assert step_checks.agree_timeout() == 2.5
    for bad in ("soon", "0", "-1", "nan"):
        monkeypatch.setenv(step_checks.ENV_AGREE_TIMEOUT, bad)
        with pytest.raises(spmd.ConfigurationError, match="SPMD_BATCH_AGREE_TIMEOUT"):
            step_checks.agree_timeout()
