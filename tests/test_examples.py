"""Every program in examples/ runs, in one process and under `spmd launch`."""

import subprocess
import sys
from pathlib import Path

import pytest
from commands import program_env, run_program

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# Each example is a program of its own, run in a process of its own (forked from the run's
# warm interpreter, tests/commands.start_program; quickstart.py also fresh, as a user types
# it): slow, out of the fast tier.
pytestmark = pytest.mark.slow
# Arguments that keep each example short in CI; an example missing here runs as is.
FAST_ARGS = {
    "quickstart.py": ["--steps", "10"],
    "01_keras_fit_mirrored.py": ["--epochs", "2"],
    "02_custom_training_loop.py": ["--steps", "20"],
    "03_multi_worker_tf_config.py": ["--epochs", "2"],
    "04_central_storage.py": ["--steps", "10"],
    "07_sharded_transformer_lm.py": ["--steps", "10"],
    "08_flax_mnist_tutorial.py": ["--steps", "20"],
    "10_diloco.py": ["--steps", "150"],
    "11_sidecar_evaluator.py": ["--epochs", "2"],
    "12_pipeline_parallel_lm.py": ["--steps", "10"],
    "13_context_parallel_lm.py": ["--steps", "10"],
    "14_keras_tf_data_tutorial.py": ["--epochs", "2", "--devices", "4"],
}
# Examples that start several processes themselves.
MULTIPROCESS = {"03_multi_worker_tf_config.py", "11_sidecar_evaluator.py"}


def _run(command, timeout=240, fresh=False):
    """`command` (python ARGS) run from the repository's root; `fresh`: by a fresh
    interpreter, never forked."""
    if fresh:
        result = subprocess.run(
            command, cwd=ROOT, env=program_env(), capture_output=True, text=True, timeout=timeout
        )
    else:
        result = run_program(command, program_env(), timeout, cwd=ROOT)
    assert result.returncode == 0, (
        f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout


def _launch(devices_per_process, example, *args, timeout=240):
    """`spmd launch -n 2 --devices-per-process D -- python examples/EXAMPLE ARGS`."""
    launch = ["-m", "spmd", "launch", "-n", "2", "--devices-per-process", str(devices_per_process)]
    return _run(
        [sys.executable, *launch, "--", sys.executable, str(EXAMPLES / example), *args], timeout
    )


@pytest.mark.parametrize(
    "example",
    [
        pytest.param(name, marks=[pytest.mark.multiprocess] if name in MULTIPROCESS else [])
        for name in sorted(p.name for p in EXAMPLES.glob("*.py"))
    ],
)
def test_example_runs(example):
    _run([sys.executable, str(EXAMPLES / example), *FAST_ARGS.get(example, [])])


def test_quickstart_runs_in_a_fresh_interpreter():
    # As a user types it: `python examples/quickstart.py`, nothing forked.
    out = _run([sys.executable, str(EXAMPLES / "quickstart.py"), "--steps", "5"], fresh=True)
    assert "largest parameter difference from one device" in out


@pytest.mark.parametrize("strategy", ["parameter_server", "central_storage"])
def test_quickstart_on_other_strategies(strategy):
    out = _run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--strategy", strategy, "--steps", "5"]
    )
    assert "largest parameter difference from one device" in out


@pytest.mark.multiprocess
def test_quickstart_under_launch():
    out = _launch(2, "quickstart.py", "--strategy", "multi_worker_mirrored", "--steps", "5")
    assert "[0] MultiWorkerMirroredStrategy(mesh=(host=2, replica=2)" in out


@pytest.mark.multiprocess
def test_keras_tf_data_tutorial_under_launch():
    """Each process reads its task index from the TF_CONFIG spmd launch wrote; the tf.data
    pipeline's partial batches, sample and class weights over 2 processes as on one device."""
    out = _launch(2, "14_keras_tf_data_tutorial.py", "--devices", "2", "--epochs", "2", timeout=400)
    assert "[1] task {'type': 'worker', 'index': 1}" in out
    assert "[0] largest difference from one device" in out


@pytest.mark.multiprocess
def test_diloco_example_under_launch():
    """Islands cut across the two processes; the checkpoint in one folder both see. 60
    steps, not the plain run's 150: each step of both trainings crosses processes (gloo)
    and costs ~0.1 s of CPU, and what this run adds to the plain one (islands and a
    checkpoint across processes) needs no more; DiLoCo is ~2 points above synchronous
    training there (90.0% and 92.2% held out), well within the example's 5."""
    out = _launch(4, "10_diloco.py", "--steps", "60", timeout=400)
    assert "[0] OK: DiLoCo within 5 points" in out


def test_the_transformer_example_plans_for_a_tpu_slice(tmp_path):
    # The README's command, on a 4-chip slice and one layout (v5p-256's 14 take minutes here).
    command = [sys.executable, "-m", "spmd", "plan", "--target", "v5e:2x2"]
    command += [str(EXAMPLES / "07_sharded_transformer_lm.py"), "--only", "FSDP 2 x TP 2"]
    out = _run([*command, "--cache-dir", str(tmp_path)], timeout=600)
    assert "auto_strategy for v5e:2x2 (4 v5e chips): 1 ranked, 0 dropped" in out
    assert "FSDP 2 x TP 2" in out and "data=1 x fsdp=2 x model=2" in out
