"""One process of the scale benchmark: initialize, a barrier, a small psum; seconds as JSON.

Usage: python bench/scale_worker.py OUT.json (under spmd.testing.run_processes)
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

start = time.perf_counter()
import spmd  # noqa: E402

imported = time.perf_counter()
spmd.initialize()
joined = time.perf_counter()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

multihost_utils.sync_global_devices("warm")
began = time.perf_counter()
multihost_utils.sync_global_devices("timed")
barrier = time.perf_counter() - began

strategy = spmd.MultiWorkerMirroredStrategy()
total = strategy.reduce("SUM", strategy.run(lambda: jnp.ones(())))  # compile, warm up
began = time.perf_counter()
for _ in range(5):
    total = jax.block_until_ready(strategy.reduce("SUM", strategy.run(lambda: jnp.ones(()))))
psum = (time.perf_counter() - began) / 5
if int(total) != jax.process_count():
    raise SystemExit(f"psum of ones over {jax.process_count()} processes gave {total}")
if jax.process_index() == 0:
    Path(sys.argv[1]).write_text(
        json.dumps(
            {
                "import": imported - start,
                "initialize": joined - imported,
                "barrier": barrier,
                "psum": psum,
            }
        )
    )
