"""Input distribution over 2 real processes x 2 devices: every example once, exact metrics,
positions that resume, and bad input as a clear error on every process."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from spmd.testing import run_processes

WORKER = Path(__file__).with_name("data_worker.py")
N, FEATURES, CLASSES = 1001, 5, 3
FILES, ROWS_PER_FILE = 4, 96
pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Runs the worker once on 2 processes; returns the data and each process's results."""
    data, out = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("out")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=N).astype(np.int32)
    w = rng.normal(size=(FEATURES, CLASSES)).astype(np.float32)
    np.savez(data / "eval.npz", x=x, y=y, w=w)
    for i in range(FILES):
        ids = np.arange(i * ROWS_PER_FILE, (i + 1) * ROWS_PER_FILE, dtype=np.int32)
        np.savez(data / f"part-{i}.npz", id=ids)
    processes = run_processes(
        [sys.executable, str(WORKER), str(data), str(out)], 2, devices_per_process=2, timeout=120
    )
    results = [json.loads((out / f"process-{i}.json").read_text()) for i in range(2)]
    return {"x": x, "y": y, "w": w, "results": results, "processes": processes}


def _union_is_everything(run, key, n):
    ids = [r[key]["ids"] for r in run["results"]]
    assert all(ids), f"a process received no examples under {key}"
    everything = sorted(ids[0] + ids[1])
    assert everything == list(range(n)), f"{key}: missing or repeated examples"


@pytest.mark.parametrize(
    "key, n",
    [
        ("numpy_data", N),
        ("file", FILES * ROWS_PER_FILE),
        ("file_data", FILES * ROWS_PER_FILE),
        ("function", 320),
    ],
)
def test_every_example_exactly_once(run, key, n):
    _union_is_everything(run, key, n)


def test_policies_and_contexts(run):
    first, second = run["results"]
    assert first["replicas"] == 4
    assert [first["numpy_data"]["policy"], first["file"]["policy"]] == ["DATA", "FILE"]
    assert first["file_data"]["policy"] == "DATA"
    assert first["context"] == [2, 0, 4] and second["context"] == [2, 1, 4]
    chief, other = (p.stderr for p in run["processes"])
    assert "AutoShardPolicy.AUTO chose FILE" in chief
    assert "AutoShardPolicy.AUTO" not in other  # said once, by the chief


def test_exact_metrics_over_1001_examples(run):
    logits = run["x"].astype(np.float64) @ run["w"]
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want_loss = np.mean(-logp[np.arange(N), run["y"]])
    want_accuracy = np.mean(np.argmax(logits, -1) == run["y"])
    for result in run["results"]:
        totals = result["numpy_data"]["totals"]
        assert totals["count"] == N
        assert totals["average"] == pytest.approx(want_loss, rel=1e-5)
        assert totals["correct"] / N == want_accuracy


def test_position_resumes_with_the_next_batch(run):
    states = [r["position"]["state"] for r in run["results"]]
    assert states[0] == states[1]  # one state for every process: save it once
    assert states[0]["batch"] == 3
    for result in run["results"]:
        assert result["position"]["next"] == result["position"]["want"]


@pytest.mark.parametrize(
    "case, kinds, words",
    [
        ("fewer_files", {"ConfigurationError"}, ["num_files=1", "num_input_pipelines=2"]),
        ("not_divisible", {"BatchError"}, ["global_batch_size=66"]),
        ("not_divisible_function", {"BatchError"}, ["global_batch_size=30"]),
        ("ragged", {"BatchError"}, ["[60, 64]"]),
        ("disagree_count", {"BatchError"}, ["end of data", "batch_index=3"]),
        ("disagree_shape", {"BatchError"}, ["[32] of global 32", "[64] of global 64"]),
        ("disagree_failure", {"BatchError", "OSError"}, ["lost its disk"]),
        ("disagree_content", {"BatchError"}, ["contents must be the same", "batch_index=2"]),
        ("disagree_seed", {"BatchError"}, ["contents must be the same", "batch_index=0"]),
    ],
)
def test_bad_input_is_an_error_on_every_process(run, case, kinds, words):
    errors = [r[case] for r in run["results"]]
    assert {e["type"] for e in errors} <= kinds and None not in {e["type"] for e in errors}
    for error in errors:
        assert error["seconds"] < 10, f"{case} took {error['seconds']:.1f} s to fail"
        for word in words:
            assert word in error["message"], error["message"]


def test_content_check_can_be_switched_off(run):
    assert [r["unchecked_content"]["type"] for r in run["results"]] == [None, None]
