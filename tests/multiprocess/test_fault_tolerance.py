"""Kill a worker, relaunch, lose nothing: real processes, real signals, loopback only.

Each run is `spmd launch -n 2 --devices-per-process 2` (through `spmd._src.clusters.launch.launch`)
of ckpt_worker.py: ParameterServerStrategy over both processes, a checkpoint
every 2 steps, batches that are a function of their position. An uninterrupted
run is the oracle: a run that was killed and relaunched must end bitwise equal.
"""

import json
import os
import pickletools
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from commands import run_program, start_program

import spmd
from spmd._src.clusters.launch import free_port, launch, process_env, run_group
from spmd._src.clusters.launch_results import HANG_EXIT_CODE

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
WORKER = HERE / "ckpt_worker.py"
STEPS = 8
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]
_CACHE: dict[str, str] = {}  # where ckpt_worker.py keeps JAX's compilation cache


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """Relaunched workers reuse what the first ones compiled: same programs, less waiting.

    Each process keeps its own cache folder (JAX writes cache files without a
    lock, so processes must not share one).
    """
    _CACHE["CKPT_WORKER_JAX_CACHE"] = str(tmp_path_factory.mktemp("jax_cache"))
    yield
    _CACHE.clear()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("SPMD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, **_CACHE}


def _run(tmp: Path, *flags: str, max_restarts: int = 0) -> tuple[int, Path]:
    """Launches the worker; returns the exit code and the final state's file."""
    out = tmp / "final.npz"
    command = [sys.executable, str(WORKER), str(tmp / "ckpt"), str(out), "--steps", str(STEPS)]
    code = launch(
        [*command, *flags],
        num_processes=2,
        devices_per_process=2,
        max_restarts=max_restarts,
        timeout=150,
        env=_env(),
        grace_period=2,
    )
    return code, out


def _events(text: str) -> list[dict]:
    """The worker's JSON lines out of the launcher's "[i] ..." output."""
    lines = (re.sub(r"^\[\d+\] ", "", line) for line in text.splitlines())
    return [json.loads(line) for line in lines if line.startswith('{"')]


def _launched(tmp: Path, capfd, *flags: str, max_restarts: int = 0):
    """Launches the worker; returns (exit code, its JSON events, the launcher's report, out)."""
    code, out = _run(tmp, *flags, max_restarts=max_restarts)
    captured = capfd.readouterr()
    return code, _events(captured.out), captured.err, out


def _of(events: list[dict], event: str, attempt: int) -> list[dict]:
    found = [e for e in events if e["event"] == event and e["attempt"] == attempt]
    return sorted(found, key=lambda e: e["process"])


def _assert_bitwise_equal(got_path: Path, want_path: Path) -> None:
    got, want = dict(np.load(got_path)), dict(np.load(want_path))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert np.array_equal(got[name], want[name]), f"{name} differs from the uninterrupted run"
    assert got["seen"].tolist() == [1] * STEPS, "a batch was skipped or trained on twice"
    assert got["seen_examples"].tolist() == [1] * len(got["seen_examples"]), "spmd's iterator"


def _is_pickle(data: bytes) -> bool:
    """Whether `data` parses as one complete pickle (read only, nothing executed)."""
    try:
        ops = list(pickletools.genops(data))
    except Exception:
        return False
    return bool(ops) and ops[-1][0].name == "STOP" and ops[-1][2] == len(data) - 1


def _assert_no_pickles(directory: Path) -> None:
    files = [p for p in directory.rglob("*") if p.is_file()]
    assert files, f"no checkpoint files under {directory}"
    pickles = [str(p) for p in files if _is_pickle(p.read_bytes())]
    assert not pickles, f"checkpoint files that are pickles: {pickles}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The oracle: the same job, never interrupted."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    out = tmp / "final.npz"
    command = [sys.executable, str(WORKER), str(tmp / "ckpt"), str(out), "--steps", str(STEPS)]
    result = run_group(
        command, 2, devices_per_process=2, env=_env(), timeout=150, capture=True, grace_period=2
    )
    assert result.ok, result.describe() + "".join(p.stderr[-3000:] for p in result.processes)
    _assert_no_pickles(tmp / "ckpt")
    return out


def test_sigkill_mid_run_relaunch_is_bitwise_equal(tmp_path, capfd, uninterrupted):
    code, events, report, out = _launched(
        tmp_path, capfd, "--kill-at", "5", "--signal", "KILL", max_restarts=2
    )
    assert code == 0, report
    assert "process 1 was killed by SIGKILL" in report
    assert "restarting all 2 processes (restart 1 of 2)" in report
    starts = _of(events, "start", attempt=1)
    assert len(starts) == 2 and starts[0]["step"] == starts[1]["step"]
    resumed = starts[0]["step"]
    assert 2 <= resumed <= 5 and resumed % 2 == 0  # a complete checkpoint, never a later one
    assert all(s["position"] == resumed for s in starts)  # the data position came back with it
    assert all(s["spmd_position"] == resumed for s in starts)  # spmd's own iterator's too
    assert [e["position"] for e in _of(events, "done", attempt=1)] == [STEPS, STEPS]
    _assert_bitwise_equal(out, uninterrupted)


@pytest.mark.parametrize("local", [False, True], ids=["shared-fs", "no-shared-fs"])
def test_sigterm_saves_one_agreed_step_then_resumes(tmp_path, capfd, uninterrupted, local):
    flags = ["--kill-at", "3", "--signal", "TERM", *(["--local"] if local else [])]
    code, events, report, out = _launched(tmp_path, capfd, *flags)
    assert code == 0, report
    assert re.search(r"process \d was preempted \(exit code 42\)", report), report
    assert "(preemption 1 of" in report  # a relaunch that does not use up --max-restarts
    stopped = _of(events, "preempted", attempt=0)
    assert len(stopped) == 2, f"every process must save and stop; got {stopped}: {report}"
    # Caught during step 3 on process 1 alone: every process saves right after it, as step 4.
    assert [e["step"] for e in stopped] == [4, 4]
    starts = _of(events, "start", attempt=1)
    assert [s["step"] for s in starts] == [4, 4]
    assert [s["spmd_position"] for s in starts] == [4, 4]
    assert all(4 in s["steps"] for s in starts)  # every process's view has it
    _assert_bitwise_equal(out, uninterrupted)
    if local:  # only process 0's own folder holds checkpoints
        assert not (tmp_path / "ckpt" / "host1").exists()
        _assert_no_pickles(tmp_path / "ckpt" / "host0")


def test_interrupted_save_is_ignored(tmp_path):
    directory = tmp_path / "ckpt"
    worker = HERE / "ckpt_interrupt_worker.py"
    result = run_program([sys.executable, str(worker), str(directory)], _env(), 120)
    assert result.returncode == -9, result.stderr[-3000:]
    assert any(".orbax-checkpoint-tmp" in p.name for p in directory.iterdir())
    with spmd.CheckpointManager(directory) as ckpt:
        assert ckpt.latest_step() == 1
        assert ckpt.all_steps() == [1]
        assert ckpt.restore_data() == {"position": 1}
        assert ckpt.save(2, {"w": np.ones((4, 4), np.float32)}) is True  # step 2 saves anew
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
    names = sorted(p.name for p in directory.iterdir())
    assert names == [".spmd-lock", "1", "2"]  # the leftover is gone; the managers' lock stays
    _assert_no_pickles(directory)


def test_dead_worker_ends_the_others_within_the_heartbeat_timeout(tmp_path):
    """Two 2-process jobs side by side: in one the coordinator dies, in the other a worker.
    The survivor ends naming the dead process, with spmd's message and exit code 75."""
    heartbeat = 3
    worker = HERE / "ckpt_heartbeat_worker.py"
    jobs, logs = {}, {}
    for victim in (0, 1):
        coordinator = f"127.0.0.1:{free_port()}"
        jobs[victim] = []
        for i in range(2):
            logs[victim, i] = tmp_path / f"job{victim}-process{i}.log"
            with open(logs[victim, i], "w") as log:
                jobs[victim].append(
                    start_program(
                        [sys.executable, str(worker), str(victim), str(heartbeat)],
                        env=process_env(_env(), i, 2, coordinator, 1, 0),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
    procs = {(victim, i): p for victim, job in jobs.items() for i, p in enumerate(job)}
    ended: dict[tuple[int, int], float] = {}
    try:
        deadline = time.monotonic() + 150
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for key, p in procs.items():
                if key not in ended and p.poll() is not None:
                    ended[key] = time.monotonic()
            time.sleep(0.05)
    finally:
        for p in procs.values():
            p.kill()
    for victim in (0, 1):
        dead, survivor = (victim, victim), (victim, 1 - victim)
        assert procs[dead].returncode == -9
        assert survivor in ended, f"the survivor hung after process {victim} died"
        out = logs[survivor].read_text()
        assert procs[survivor].returncode == HANG_EXIT_CODE, out[-2000:]
        assert f"spmd: ending: process {victim} failed (gone: " in out, out[-2000:]
        assert "Traceback" not in out and "bad_cast" not in out, out[-2000:]
        assert ended[survivor] - ended[dead] < heartbeat + 15
