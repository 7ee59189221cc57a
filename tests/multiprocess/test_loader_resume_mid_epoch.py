"""A MaxText-style grain loader (ShardByJaxProcess) and a tf.data loop over 2 real processes,
crashed mid-epoch after a checkpoint and resumed: every process goes on at the exact record."""

import json
import os
import sys
from pathlib import Path

import pytest

from spmd.testing import run_processes

WORKER = Path(__file__).with_name("loader_resume_worker.py")
N = 192
pytestmark = pytest.mark.multiprocess


def _phase(phase, out, check):
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    results = run_processes(
        [sys.executable, str(WORKER), phase, str(out)],
        2,
        devices_per_process=2,
        timeout=300,
        env=env,
        check=check,
    )
    return results, [json.loads((out / f"{phase}-{i}.json").read_text()) for i in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    crashed, crash = _phase("crash", out, check=False)
    assert [r.returncode for r in crashed] == [3, 3]  # died mid-epoch, nothing closed
    _, resume = _phase("resume", out, check=True)
    return crash, resume


@pytest.mark.parametrize("loader", ["grain", "tf"])
def test_resume_after_a_crash_goes_on_at_the_exact_record(runs, loader):
    crash, resume = runs
    for crashed, resumed in zip(crash, resume, strict=True):
        assert resumed[loader]["step"] == 2
        assert crashed[loader]["first"] + resumed[loader]["resumed"] == resumed[loader]["oracle"]
        assert resumed[loader]["resumed"][0] == crashed[loader]["after"][0]


@pytest.mark.parametrize("loader", ["grain", "tf"])
def test_every_example_exactly_once_over_the_processes(runs, loader):
    _, resume = runs
    ids = [[i for batch in r[loader]["oracle"] for i in batch] for r in resume]
    assert set(ids[0]).isdisjoint(ids[1]) and sorted(ids[0] + ids[1]) == list(range(N))


def test_grain_shard_by_jax_process_is_found_as_each_pipelines_share(runs):
    crash, _ = runs
    assert [c["grain"]["policy"] for c in crash] == ["OFF", "OFF"]
    assert [c["tf"]["policy"] for c in crash] == ["DATA", "DATA"]
