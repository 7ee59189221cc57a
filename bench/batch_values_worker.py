"""One process of the batch-values benchmark: a step fed numpy batches directly, with the
processes comparing them never, on the default schedule and every call; timings as JSON.

Usage: python bench/batch_values_worker.py STEPS REPEATS OUT.json STATES (under
spmd.testing.run_processes)

STATES is a folder of each model's initial state, MODEL.npz (common.write_leaves): the
processes start from it without compiling the models' inits each.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import spmd  # noqa: E402

info = spmd.initialize()

import jax  # noqa: E402

from bench import common  # noqa: E402
from spmd._src.strategy import step_checks  # noqa: E402
from spmd._src.strategy.step_checks import COMPARE_BATCH_EVERY  # noqa: E402

steps, repeats, out, initial = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
strategy = spmd.MultiWorkerMirroredStrategy()
SCHEDULES = {"never": 0, "default": COMPARE_BATCH_EVERY, "every call": 1}


def runner(model: str, every: int, state):
    """run(n): n steps of `model` from `state` (its own: the step donates it), comparing
    the numpy batches every `every` calls."""
    apply = common.MODELS[model][1]
    step = strategy.step(common.make_train_step(apply), compare_batch_every=every)
    batches = [common.batch(model, 64, seed=i) for i in range(4)]  # numpy: the global batch
    box = {"state": state}

    def run(n: int) -> None:
        state = box["state"]
        for i in range(n):
            state, _ = step(state, *batches[i % len(batches)])
        box["state"] = jax.block_until_ready(state)

    return run


def comparison(model: str):
    """One comparison alone: the fingerprints of a batch, exchanged with the other process."""
    batch = common.batch(model, 64)

    def run(n: int) -> None:
        for _ in range(n):
            step_checks.agree_on_values(step_checks.host_prints(batch, ["x", "y"]))

    return run


results = {}
for model in ("tiny", "cnn"):
    like = jax.eval_shape(common.MODELS[model][0], jax.random.key(0))
    made = common.read_leaves(Path(initial) / f"{model}.npz", like)
    states = [strategy.put(made) for _ in SCHEDULES]  # each runner its own: the step donates it
    runners = {
        name: runner(model, every, state)
        for (name, every), state in zip(SCHEDULES.items(), states, strict=True)
    }
    runners["comparison alone"] = comparison(model)
    results[model] = common.timeit(runners, steps, repeats)
if info.is_chief:
    Path(out).write_text(json.dumps(results))
