"""The evaluator task beside a 2-process training run: real processes, the TF_CONFIG evaluator.

The first test runs docs/multihost.md's recipe: the training job under `spmd launch -n 2`,
the evaluator a process of its own with TF_CONFIG's evaluator task."""

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from commands import run_program, start_program

import spmd
from spmd.testing import run_processes

from .procs import child_env
from .sidecar_job import BATCH, EPOCHS, ROWS, SAVE_EVERY, VAL, make_trainer

pytestmark = pytest.mark.multiprocess
JOB = Path(__file__).with_name("sidecar_job.py")
STEPS = list(range(SAVE_EVERY, EPOCHS * ROWS // BATCH + 1, SAVE_EVERY))  # 2, 4, ..., 18
TF_CONFIG = {
    "cluster": {"worker": ["localhost:2222", "localhost:2223"], "evaluator": ["localhost:2224"]},
    "task": {"type": "evaluator", "index": 0},
}


def _evaluator(ckpt: Path, out: Path, timeout: float) -> subprocess.Popen:
    env = {**child_env(), "TF_CONFIG": json.dumps(TF_CONFIG), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, str(JOB), "evaluate", str(ckpt), str(out), "--timeout", str(timeout)]
    return start_program(command, env, stderr=subprocess.STDOUT)


def _launch(ckpt: Path, oracle: Path, *extra: str) -> subprocess.CompletedProcess:
    """The training job as docs/multihost.md starts it: `spmd launch -n 2` of the script."""
    program = [sys.executable, str(JOB), "train", str(ckpt), str(oracle), *extra]
    command = [sys.executable, "-m", "spmd", "launch", "-n", "2", "--devices-per-process", "2"]
    return run_program([*command, "--timeout", "400", "--", *program], child_env(), 450)


def _train(ckpt: Path, oracle: Path, *extra: str, check: bool = True):
    command = [sys.executable, str(JOB), "train", str(ckpt), str(oracle), *extra]
    return run_processes(
        command, 2, devices_per_process=2, env=child_env(), timeout=400, check=check
    )


def _oracle(state) -> dict:
    """Trainer.evaluate of a saved state, on one device of this process."""
    trainer = make_trainer(spmd.OneDeviceStrategy(jax.devices()[0]))
    trainer.build()
    trainer.load_state(state)
    return trainer.evaluate(VAL, batch_size=BATCH)


def _kill_after_first_evaluation(process: subprocess.Popen, out: Path, found: list) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        done = sorted(out.parent.glob(f"{out.name}.*"))
        if done:
            found.extend(done)
            os.kill(process.pid, signal.SIGKILL)
            return
        time.sleep(0.05)


def test_an_evaluator_follows_a_two_process_run_and_kill_9_of_another_costs_training_nothing(
    tmp_path,
):
    ckpt, oracle = tmp_path / "ckpt", tmp_path / "oracle"
    evaluator = _evaluator(ckpt, tmp_path / "eval.json", timeout=300)
    victim = _evaluator(ckpt, tmp_path / "victim.json", timeout=300)
    seen: list = []
    killer = threading.Thread(
        target=_kill_after_first_evaluation, args=(victim, tmp_path / "victim.json", seen)
    )
    killer.start()
    try:
        # Training waits at step 4 until the evaluator has evaluated step 2: they overlap.
        wait = str(tmp_path / f"eval.json.{STEPS[0]}")
        launched = _launch(ckpt, oracle, "--sleep", "0.2", "--wait-for", wait)
        assert launched.returncode == 0, (launched.stdout + launched.stderr)[-3000:]
        ended = float((oracle / "ended").read_text())
        output = evaluator.communicate(timeout=300)[0]
    finally:
        killer.join(timeout=60)
        for process in (evaluator, victim):
            if process.poll() is None:
                process.kill()
            process.wait(timeout=60)
    assert evaluator.returncode == 0, output[-3000:]
    assert victim.returncode == -signal.SIGKILL and seen, "the second evaluator was not killed"

    # Training lost nothing: every step is there, intact, and is the state it trained.
    reader = spmd.CheckpointManager(ckpt, read_only=True)
    assert reader.all_steps() == STEPS and reader.final_step() == STEPS[-1]
    states = {s: pickle.loads((oracle / f"{s}.pkl").read_bytes()) for s in STEPS}
    target = make_trainer(spmd.OneDeviceStrategy(jax.devices()[0]))
    target.build()
    for step in STEPS:
        restored = jax.device_get(reader.restore(step, target=target.state))
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(states[step]), strict=True):
            np.testing.assert_array_equal(got, want)

    # The evaluator: its own one-process job, every step once, each equal to one device's evaluate.
    result = json.loads((tmp_path / "eval.json").read_text())
    assert (result["task_type"], result["process_count"], result["devices"]) == ("evaluator", 1, 1)
    history = {int(s): m for s, m in result["history"].items()}
    assert sorted(history) == STEPS, output[-3000:]
    for step in STEPS:
        want = _oracle(states[step])
        for key, value in want.items():
            np.testing.assert_allclose(history[step][key], value, rtol=1e-6, atol=1e-7)
    assert history[STEPS[0]]["loss"] != history[STEPS[-1]]["loss"]
    first = min(float(t) for t in result["times"].values())
    assert first < ended, "the evaluator evaluated nothing while training ran"
    assert f"the training run ended at step {STEPS[-1]}" in output


def test_a_run_killed_mid_save_leaves_no_partial_step_to_evaluate(tmp_path):
    ckpt, oracle = tmp_path / "ckpt", tmp_path / "oracle"
    kill_at = 8
    results: list = []
    wait = str(tmp_path / "eval.json.2")  # training waits at step 4 for the evaluator's first
    args = ("--kill-at", str(kill_at), "--sleep", "0.2", "--wait-for", wait)
    training = threading.Thread(
        target=lambda: results.extend(_train(ckpt, oracle, *args, check=False))
    )
    training.start()
    deadline = time.monotonic() + 300
    while not (ckpt / "2").exists() and training.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)  # the evaluator's timeout counts from its start: start it at step 2
    evaluator = _evaluator(ckpt, tmp_path / "eval.json", timeout=8)  # reads while it dies
    try:
        training.join(timeout=400)
        output = evaluator.communicate(timeout=300)[0]
    finally:
        if evaluator.poll() is None:
            evaluator.kill()
        evaluator.wait(timeout=60)
    assert results, "the training run did not end"
    assert all(r.returncode != 0 for r in results)  # killed: no final step marked
    assert evaluator.returncode == 0, output[-3000:]
    leftovers = sorted(p.name for p in ckpt.iterdir() if p.name.startswith(f"{kill_at}"))
    assert leftovers, "the kill came before the save of step 8 began: nothing partial to read"
    reader = spmd.CheckpointManager(ckpt, read_only=True)
    assert reader.all_steps() == [2, 4, 6] and reader.final_step() is None, leftovers
    history = json.loads((tmp_path / "eval.json").read_text())["history"]
    assert sorted(int(s) for s in history) == [2, 4, 6], output[-3000:]
    assert "(timeout)" in output
    states = {s: pickle.loads((oracle / f"{s}.pkl").read_bytes()) for s in (2, 4, 6)}
    for step, metrics in history.items():
        np.testing.assert_allclose(metrics["loss"], _oracle(states[int(step)])["loss"], rtol=1e-6)
    after = sorted(p.name for p in ckpt.iterdir() if p.name.startswith(f"{kill_at}"))
    assert after == leftovers  # the reader cleaned nothing up: that is the writer's job


def test_an_evaluator_of_two_processes_agrees_on_each_step(tmp_path):
    """An evaluator job of its own with 2 processes (4 devices) over a finished run's steps."""
    ckpt, oracle = tmp_path / "ckpt", tmp_path / "oracle"
    _train(ckpt, oracle)
    out = tmp_path / "eval.json"
    command = [sys.executable, str(JOB), "evaluate", str(ckpt), str(out), "--timeout", "60"]
    run_processes(command, 2, devices_per_process=2, env=child_env(), timeout=400)
    result = json.loads(out.read_text())
    assert (result["process_count"], result["devices"]) == (2, 4)
    history = {int(s): m for s, m in result["history"].items()}
    assert sorted(history) == STEPS
    for step in (STEPS[0], STEPS[-1]):
        state = pickle.loads((oracle / f"{step}.pkl").read_bytes())
        for key, value in _oracle(state).items():
            np.testing.assert_allclose(history[step][key], value, rtol=1e-6, atol=1e-7)
