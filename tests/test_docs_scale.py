"""docs/scale.md's explain table is what bench/scale_explain.py computes now: docs and code can't drift."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import scale_explain

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "scale.md"


def _documented() -> dict[tuple[int, str], dict]:
    table = DOC.read_text().split("<!-- explain-table -->")[1].split("<!-- /explain-table -->")[0]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        devices, hosts, strategy, state, collectives, across, inside = cells
        kinds = dict(re.findall(r"([a-z-]+) ([\d,]+)", collectives))
        rows[int(devices), strategy] = {
            "hosts": int(hosts),
            "state_bytes": int(state.replace(",", "")),
            "collectives": {k: int(v.replace(",", "")) for k, v in kinds.items()},
            "across_hosts": int(across.replace(",", "")),
            "inside_host": int(inside.replace(",", "")),
        }
    return rows


def _check(fresh: list[dict]) -> None:
    documented = _documented()
    for row in fresh:
        expected = {
            k: row[k]
            for k in ("hosts", "state_bytes", "collectives", "across_hosts", "inside_host")
        }
        assert documented[row["devices"], row["strategy"]] == expected, row


def test_the_table_has_every_strategy_at_8_16_and_64_devices():
    assert sorted(_documented()) == sorted(
        (n, s) for n in (8, 16, 64) for s in ("data parallel", "HSDP", "FSDP")
    )


@pytest.mark.slow
@pytest.mark.cpu_mesh
def test_the_8_device_rows_match_a_fresh_explain():
    _check(scale_explain.rows(8))


def test_the_quoted_parameter_count_is_the_models():
    assert f"{scale_explain.parameter_count():,} parameters" in DOC.read_text()


@pytest.mark.bench
@pytest.mark.parametrize("devices", [16, 64])
def test_the_larger_rows_match_a_fresh_explain(devices):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-m", "bench.scale_explain", str(devices)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    _check(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_groups_parser_reads_each_replica_group_form():
    assert scale_explain.groups("x, replica_groups={{0,1},{2,3}}, y").tolist() == [[0, 1], [2, 3]]
    assert scale_explain.groups("replica_groups=[2,2]<=[2,2]T(1,0)").tolist() == [[0, 2], [1, 3]]
    line = "replica_groups=mesh['a'=4,'b'=1,'c'=2], device_ids=([2,4]T(1,0)) {'a'}, dims"
    assert scale_explain.groups(line).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="no replica_groups"):
        scale_explain.groups("all-reduce(x), channel_id=1")
