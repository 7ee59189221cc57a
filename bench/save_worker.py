"""One process of the per-step save benchmark: a train step with and without `save`, as JSON.

Usage: python bench/save_worker.py STEPS CKPT_DIR OUT.json (under spmd.testing.run_processes)

The tiny model's step (all dispatch and a gradient all-reduce over processes), in
turns: alone, and followed by `CheckpointManager.save(step, state)` at every step
with no checkpoint due (save_interval_steps beyond the run), which is what the
Trainer's BackupAndRestore costs at every batch between checkpoints: the
preemption notices' exchange. Process 0 writes the seconds per step of each turn,
and of the first and last quarter of the saving turns' steps.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import spmd  # noqa: E402

info = spmd.initialize()

import jax  # noqa: E402

from bench import common  # noqa: E402

steps, directory, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
strategy = spmd.MultiWorkerMirroredStrategy()
init, apply, _, _ = common.MODELS["tiny"]
state = strategy.init(init, jax.random.key(0))
step = strategy.step(common.make_train_step(apply))
batch = strategy.distribute_batch(common.batch("tiny", 8 * jax.process_count()))
ckpt = spmd.CheckpointManager(directory, save_interval_steps=10**9)
state, loss = step(state, *batch)  # compile
jax.block_until_ready(state)
count = 0


def turn(saving: bool) -> list[float]:
    """The seconds of each of `steps` steps (the step's result awaited every 10 steps)."""
    global state, count
    times = []
    for i in range(steps):
        start = time.perf_counter()
        state, loss = step(state, *batch)
        if saving:
            count += 1
            ckpt.save(count, state)
        if i % 10 == 9:
            jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)
    jax.block_until_ready(state)
    return times


turns = {"plain": [], "save": []}
for _ in range(3):
    for name in turns:
        turns[name].append(turn(name == "save"))
ckpt.close()
quarter = steps // 4
report = {name: [sum(t) / steps for t in runs] for name, runs in turns.items()}
report["first_quarter"] = [sum(t[:quarter]) / quarter for t in turns["save"]]
report["last_quarter"] = [sum(t[-quarter:]) / quarter for t in turns["save"]]
if info.is_chief:
    Path(out).write_text(json.dumps(report))
