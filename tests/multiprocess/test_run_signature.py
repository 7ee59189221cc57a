"""strategy.run, reduce and gather with several processes, and a step's keyword arguments.

Each process's numpy arguments to `strategy.run` are the global batch (it keeps
its own rows), as a step's are: processes passing different shapes, dtypes or
static values (`training=True` on one, False on the other) get a `BatchError` on
every process, agreed at each change of signature as a step does, never replicas
computing on mixed data; the steady state asks the coordination service nothing.
`reduce` of host values of different shapes is a `BatchError` on every process
(was a wrong value on one and gloo aborting the other). `gather`'s result can be
read on every process. A step's static keyword values, the shapes of its
keyword arrays and the values of its keyword host values (`lr=0.1`) are part of
the signature processes agree on; a host value is agreed on again whenever it
changes.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from spmd.testing import run_processes

WORKER = Path(__file__).with_name("run_signature_worker.py")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    """Each process's outcome of every scenario of the worker, from one run of it."""
    results = run_processes([sys.executable, str(WORKER)], 2, devices_per_process=2, timeout=240)
    found = [
        json.loads(line.removeprefix("RESULT "))
        for r in results
        for line in r.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    assert len(found) == 2, [r.stdout[-2000:] for r in results]
    return found


def _batch_errors(outcomes: list[dict], scenario: str) -> list[str]:
    """The BatchError every process raised in `scenario` (asserting each raised one)."""
    for process, outcome in enumerate(outcomes):
        assert outcome[scenario][0] == "BatchError", (process, outcome[scenario])
    return [outcome[scenario][1] for outcome in outcomes]


@pytest.mark.parametrize(
    "scenario, shown",
    [
        ("run_rows", ["0: 'v: float32[8, 1]", "1: 'v: float32[16, 1]"]),
        ("run_dtype", ["0: 'v: float32[8, 1]", "1: 'v: int32[8, 1]"]),
        ("run_static_keyword", ["training=True", "training=False"]),
        ("run_keyword_value", ["scale: float64[] = 1.0", "scale: float64[] = 2.0"]),
    ],
)
def test_run_with_different_arguments_per_process_is_a_batch_error_on_every_process(
    outcomes, scenario, shown
):
    for text in _batch_errors(outcomes, scenario):
        assert "Every process passes strategy.run the same global batch signature" in text
        for part in shown:
            assert part in text, text


def test_run_agrees_at_each_change_of_signature_and_not_in_the_steady_state(outcomes):
    """A new lambda each call, five calls of 8 rows then one of 16: one agreement at the
    first call, none for the four alike (no coordination-service call), one at 16 rows;
    the values are the sums over the whole global batch."""
    for outcome in outcomes:
        status, phases = outcome["run_steady"]
        assert status == "ok", phases
        assert phases["sums"] == [28.0] * 5 + [120.0]
        assert phases["same"] == phases["first"], phases
        assert phases["new_shape"]["agreements"] == phases["same"]["agreements"] + 1, phases
        assert phases["new_shape"]["client_calls"] > phases["same"]["client_calls"], phases


def test_reduce_of_host_values_of_different_shapes_is_a_batch_error_on_every_process(outcomes):
    for text in _batch_errors(outcomes, "reduce_shapes"):
        assert "every process passes values of the same shapes and dtypes" in text
        assert "0: 'float32[3]', 1: 'float32[4]'" in text, text
    for outcome in outcomes:
        assert outcome["reduce_same"] == ["ok", [3.0, 3.0, 3.0]]


def test_gather_of_a_run_result_can_be_read_on_every_process(outcomes):
    """np.asarray of the gathered values on each process: each replica's sum of its two
    rows, then every row doubled, in replica order."""
    rows = np.arange(8, dtype=np.float32).reshape(-1, 1)
    sums = rows.reshape(4, 2).sum(axis=1).tolist()
    for outcome in outcomes:
        assert outcome["gather"] == ["ok", [sums, (rows * 2.0).tolist()]]


@pytest.mark.parametrize(
    "scenario, shown",
    [
        ("step_static_keyword", ["scale=1.0", "scale=2.0"]),
        ("step_keyword_shape", ["offset: float32[3]", "offset: float32[4]"]),
        ("step_keyword_value", ["offset: float32[] = float32(0.0)", "= float32(1.0)"]),
    ],
)
def test_a_step_with_different_keyword_arguments_per_process_is_a_batch_error(
    outcomes, scenario, shown
):
    for text in _batch_errors(outcomes, scenario):
        assert "Every process passes a step the same global batch signature" in text
        for part in shown:
            assert part in text, text


def test_a_step_with_the_same_keyword_arguments_trains_alike_on_every_process(outcomes):
    assert outcomes[0]["step_same_keywords"][0] == "ok"
    assert outcomes[0]["step_same_keywords"] == outcomes[1]["step_same_keywords"]


def test_a_keyword_host_value_is_agreed_on_only_when_it_changes(outcomes):
    """lr= the same every call: no agreement after the first; lr= a schedule's new value
    every call: one agreement each call, a coordination-service round trip (measured
    here on one machine: docs/multihost.md gives the figure)."""
    for outcome in outcomes:
        status, timing = outcome["schedule_cost"]
        assert status == "ok", timing
        assert timing["constant"]["agreements"] == 0, timing
        assert timing["schedule"]["agreements"] == 40, timing
        print(f"seconds per call: {timing}")


def test_a_strategy_over_one_process_devices_runs_apart_on_batches_of_its_own(outcomes):
    """MirroredStrategy() in a job of two processes: each runs on its own devices (and
    rows: 8 on one, 16 on the other); run and step agree on nothing with the other."""
    for process, outcome in enumerate(outcomes):
        assert outcome["local_strategy"] == ["ok", {"rows": 8.0 * (1 + process), "agreements": 0}]
