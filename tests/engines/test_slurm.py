"""Slurm: docs/multihost.md's sbatch recipe, and `srun -n 2`, train as one process; its
evaluator recipe (a training step and an evaluator step) evaluates every checkpoint.

A one-node cluster of this machine (see slurm_cluster.py) runs the recipe as
written; the test fills in only the training command and, on the sbatch
command line (which overrides the script's #SBATCH lines), the counts of
this one CPU node.
"""

from __future__ import annotations

import json
import pickle
import re
import sys

import jax
import numpy as np
import pytest

import spmd
from tests.multiprocess.sidecar_job import BATCH, EPOCHS, ROWS, SAVE_EVERY, VAL, make_trainer

from .support import ENGINE_WORKER, ROOT, assert_every_task_trained

pytestmark = [pytest.mark.engines, pytest.mark.multiprocess]

PLACEHOLDER = "python train.py --epochs 30"  # the recipe's training command
ONE_CPU_NODE = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0"]
SIDECAR_JOB = ROOT / "tests" / "multiprocess" / "sidecar_job.py"
STEPS = list(range(SAVE_EVERY, EPOCHS * ROWS // BATCH + 1, SAVE_EVERY))  # sidecar_job's saves


def _recipe() -> str:
    """The first ```sh block of docs/multihost.md's Slurm section."""
    text = (ROOT / "docs" / "multihost.md").read_text()
    section = text.split("\n## Slurm\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```sh\n(.*?)^```", section, re.M | re.S)
    assert block is not None, "docs/multihost.md's Slurm section has no ```sh block"
    assert block.group(1).startswith("#!/bin/bash\n#SBATCH"), block.group(1)
    assert PLACEHOLDER in block.group(1), f"the recipe no longer runs `{PLACEHOLDER}`"
    return block.group(1)


def _train(out) -> str:
    return f"{sys.executable} {ENGINE_WORKER} {out} --devices 2"


def test_sbatch_recipe_from_the_docs_matches_one_process(slurm, one_process, tmp_path):
    out = tmp_path / "sbatch"
    script = tmp_path / "train.sbatch"
    script.write_text(_recipe().replace(PLACEHOLDER, _train(out)))
    log = tmp_path / "job.out"
    argv = ["sbatch", "--wait", *ONE_CPU_NODE, f"--output={log}", f"--chdir={ROOT}"]
    slurm.run([*argv, str(script)], timeout=180)
    assert_every_task_trained(out, log.read_text(), "slurm", one_process)


def test_srun_two_tasks_match_one_process(slurm, one_process, tmp_path):
    out = tmp_path / "srun"
    output = slurm.run(["srun", "-n", "2", "--chdir", str(ROOT), *_train(out).split()], timeout=180)
    assert_every_task_trained(out, output, "slurm", one_process)


# -- docs/multihost.md's evaluator recipe: a training step and an evaluator step in one job

EVALUATOR_SECTION = "\n## An evaluator beside the training job\n"
TRAIN_STEP = "srun --nodes=2 --ntasks-per-node=8 python train.py --ckpt /shared/run &"
EVALUATOR_STEP = (
    "srun --nodes=1 --ntasks=1 --gpus-per-task=1 python evaluate.py --ckpt /shared/run &"
)


def _evaluator_recipe() -> str:
    """The ```sh block of docs/multihost.md's evaluator section that is a batch script."""
    text = (ROOT / "docs" / "multihost.md").read_text()
    section = text.split(EVALUATOR_SECTION, 1)[1].split("\n## ", 1)[0]
    (script,) = [
        b for b in re.findall(r"^```sh\n(.*?)^```", section, re.M | re.S) if "#SBATCH" in b
    ]
    assert script.startswith("#!/bin/bash\n#SBATCH"), script  # sbatch refuses a script without #!
    for line in (TRAIN_STEP, EVALUATOR_STEP):
        assert line in script, f"the recipe no longer runs `{line}`"
    return script


def test_the_evaluator_recipe_from_the_docs_evaluates_every_step_of_the_training_step(
    slurm, tmp_path
):
    """The recipe's two steps at this one 2-CPU node's size: a 2-task training step, and a
    1-task step whose TF_CONFIG makes it the evaluator, reading while training writes. Changed:
    the node and GPU counts, the commands, and --overlap on the evaluator step (the training
    step holds this node's CPUs; on the recipe's cluster the evaluator has a node of its own)."""
    ckpt, oracle, out = tmp_path / "ckpt", tmp_path / "oracle", tmp_path / "eval.json"
    job = f"{sys.executable} {SIDECAR_JOB}"
    wait = f"--wait-for {out}.{STEPS[0]}"  # training waits at step 4 for the first evaluation
    script = (
        _evaluator_recipe()
        .replace(
            TRAIN_STEP, f"srun --nodes=1 --ntasks-per-node=2 {job} train {ckpt} {oracle} {wait} &"
        )
        .replace(
            EVALUATOR_STEP,
            f"srun --nodes=1 --ntasks=1 --overlap {job} evaluate {ckpt} {out} --timeout 300 &",
        )
    )
    (tmp_path / "job.sbatch").write_text(script)
    log = tmp_path / "job.out"
    argv = ["sbatch", "--wait", *ONE_CPU_NODE, f"--output={log}", f"--chdir={ROOT}"]
    argv.append("--export=ALL,SPMD_DEVICES_PER_PROCESS=2")
    slurm.run([*argv, str(tmp_path / "job.sbatch")], timeout=500)
    output = log.read_text()
    result = json.loads(out.read_text())
    assert (result["task_type"], result["process_count"]) == ("evaluator", 1)  # its own job
    assert f"the training run ended at step {STEPS[-1]}" in output, output[-3000:]
    history = {int(s): m for s, m in result["history"].items()}
    assert sorted(history) == STEPS, output[-3000:]
    ended = float((oracle / "ended").read_text())
    assert min(float(t) for t in result["times"].values()) < ended  # beside training, not after
    trainer = make_trainer(spmd.OneDeviceStrategy(jax.devices()[0]))
    trainer.build()
    for step in (STEPS[0], STEPS[-1]):  # trained by the 2-task step, evaluated as one device does
        trainer.load_state(pickle.loads((oracle / f"{step}.pkl").read_bytes()))
        for key, value in trainer.evaluate(VAL, batch_size=BATCH).items():
            np.testing.assert_allclose(history[step][key], value, rtol=1e-6, atol=1e-7)
