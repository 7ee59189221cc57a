"""One process of the multi-process benchmark: the CNN for a few steps, timings as JSON.

Usage: python bench/mp_worker.py STEPS OUT.json STATE.npz (under spmd.testing.run_processes)

STATE.npz holds the CNN's initial state (common.write_leaves): every run starts from
the same values without compiling the CNN's init in each of its processes.
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

steps, out, initial = int(sys.argv[1]), sys.argv[2], sys.argv[3]
strategy = spmd.MultiWorkerMirroredStrategy()
init, apply, _, _ = common.MODELS["cnn"]
state = strategy.put(common.read_leaves(initial, jax.eval_shape(init, jax.random.key(0))))
step = strategy.step(common.make_train_step(apply))
batches = [strategy.distribute_batch(common.batch("cnn", 64, seed=i)) for i in range(steps)]
losses = []
state, loss = step(state, *batches[0])  # compile
jax.block_until_ready(state)
start = time.perf_counter()
for batch in batches[1:]:
    state, loss = step(state, *batch)
    losses.append(loss)
jax.block_until_ready(state)
seconds = (time.perf_counter() - start) / (steps - 1)
if info.is_chief:
    Path(out).write_text(
        json.dumps({"seconds_per_step": seconds, "losses": [float(x) for x in losses]})
    )
