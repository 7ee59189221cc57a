"""A transient network partition kills the job; the relaunched job resumes and loses nothing.

Two hosts in network namespaces train with a checkpoint after every step. One
host's link goes down for 20 s, then up: with the heartbeat timeout lowered to
10 s, the job fails. A requeue loop, as docs/multihost.md's Slurm recipe runs
it (start every host's process again, until one attempt succeeds), relaunches
it; the job resumes from its newest checkpoint and ends bitwise equal to an
uninterrupted run of the same job.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from spmd.testing import run_processes

from .support import ROOT, SUBNET, clean_env, finish, load, start

pytestmark = [pytest.mark.engines, pytest.mark.multiprocess, pytest.mark.timeout(240)]

WORKER = ROOT / "tests" / "multiprocess" / "resume_worker.py"
HEARTBEAT = 10  # seconds: spmd.initialize(heartbeat_timeout=...), lowered from 100
OUTAGE = 20  # seconds the link stays down
STEPS, CUT = 14, 3  # the link goes down once step CUT is done
ATTEMPTS = 3  # the requeue loop's bound


def _worker_args(ckpt: Path, out: Path, sleep: float) -> list[str]:
    flags = ["--steps", str(STEPS), "--heartbeat", str(HEARTBEAT), "--sleep", str(sleep)]
    return [sys.executable, str(WORKER), str(ckpt), str(out), *flags]


def _start_job(hosts: list[str], argv: list[str], attempt: int) -> list[subprocess.Popen]:
    """Every host's process of one attempt (TF_CONFIG; a new port per attempt)."""
    workers = [f"{SUBNET}.{i + 1}:{2222 + attempt}" for i in range(len(hosts))]
    procs = []
    for index, ns in enumerate(hosts):
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        env = {**clean_env(), "TF_CONFIG": json.dumps(config)}
        procs.append(start(["ip", "netns", "exec", ns, *argv, "--devices", "1"], env))
    return procs


def _cut_after(chief: subprocess.Popen, host: str, step: int) -> str:
    """Waits for `step` to be done, then takes `host`'s link down for OUTAGE s, then up."""
    seen, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:
        line = chief.stdout.readline()
        seen.append(line)
        if not line or (line.startswith("{") and json.loads(line).get("step") == step):
            break
    assert line, "the job ended before the link went down:\n" + "".join(seen)
    subprocess.run(["ip", "-n", host, "link", "set", "veth0", "down"], check=True, timeout=10)
    time.sleep(OUTAGE)
    subprocess.run(["ip", "-n", host, "link", "set", "veth0", "up"], check=True, timeout=10)
    return "".join(seen)


def _events(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def test_transient_partition_then_requeue_resumes_bitwise(two_hosts, tmp_path):
    oracle = tmp_path / "oracle.npz"
    run_processes(
        _worker_args(tmp_path / "oracle_ckpt", oracle, 0.0), 2, devices_per_process=1, timeout=120
    )
    out, codes, outputs = tmp_path / "resumed.npz", [], []
    argv = _worker_args(tmp_path / "ckpt", out, 0.3)
    for attempt in range(ATTEMPTS):  # the requeue loop
        began = time.monotonic()
        procs = _start_job(two_hosts, argv, attempt)
        before = _cut_after(procs[0], two_hosts[1], CUT) if attempt == 0 else ""
        outputs.append(before + finish(procs, timeout=3 * HEARTBEAT + 60)[0])
        codes.append([p.returncode for p in procs])
        print(f"attempt {attempt}: codes {codes[-1]} after {time.monotonic() - began:.1f} s")
        if codes[-1] == [0, 0]:
            break
    text = "\n=== next attempt ===\n".join(outputs)
    assert codes[0] != [0, 0], f"the partition did not end the job:\n{text}"
    assert codes[-1] == [0, 0], f"no attempt succeeded: {codes}\n{text}"
    start = next(e for e in _events(outputs[-1]) if e["event"] == "start")
    # Resumed from the newest complete checkpoint: the one of step CUT was still being
    # written when the link went down, the one before it is complete.
    assert CUT <= start["step"] <= CUT + 1, text
    got, want = load(out), load(oracle)
    for name in ("w", "v", "losses", "seen"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_array_equal(got["seen"], np.ones(STEPS * 8))  # no example lost or repeated
