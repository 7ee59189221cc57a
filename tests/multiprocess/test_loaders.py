"""grain and tf.data over 2 real processes x 2 devices: each loader's own sharding, every
example exactly once, and grain's state saved and restored by CheckpointManager."""

import json
import os
import sys
from pathlib import Path

import pytest

from spmd.testing import run_processes

WORKER = Path(__file__).with_name("loaders_worker.py")
N = 192
pytestmark = pytest.mark.multiprocess


def _run(which, tmp_path_factory):
    data, out = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("out")
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    run_processes(
        [sys.executable, str(WORKER), which, str(data), str(out)],
        2,
        devices_per_process=2,
        timeout=300,
        env=env,
    )
    return [json.loads((out / f"process-{i}.json").read_text()) for i in range(2)]


@pytest.fixture(scope="module")
def grain_run(tmp_path_factory):
    return _run("grain", tmp_path_factory)


def _flat(batches):
    return [i for batch in batches for i in batch]


@pytest.mark.parametrize("key", ["loader", "sliced"])
def test_grain_every_example_exactly_once(grain_run, key):
    ids = [_flat(r[key]["batches"]) for r in grain_run]
    assert all(ids) and set(ids[0]).isdisjoint(ids[1])
    assert sorted(ids[0] + ids[1]) == list(range(N))


def test_grain_shards_by_the_input_pipelines(grain_run):
    assert [r["shard"] for r in grain_run] == [[0, 2], [1, 2]]
    assert {r["loader"]["policy"] for r in grain_run} == {"OFF"}  # found the sampler's sharding


@pytest.mark.parametrize("key", ["loader", "sliced"])
def test_grain_resume_continues_at_the_exact_example(grain_run, key):
    for result in grain_run:
        resume = result[f"resume_{key}"]
        assert resume["resumed"] == resume["rest"]
        assert resume["first"] + resume["rest"] == result[key]["batches"]
        assert sorted(resume["per_pipeline"]) == ["0", "1"]  # every pipeline's grain state
    loader = grain_run[0]["resume_loader"]["per_pipeline"]
    assert loader["0"] != loader["1"]  # each process restores its own
