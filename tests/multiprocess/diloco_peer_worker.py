"""A DiLoCo island's process that dies (SIGKILL) before the first sync; its peer syncs.

Usage: python diloco_peer_worker.py VICTIM HEARTBEAT_SECONDS [refused]
Two processes, one island each (sync_every=3). After the first inner step both
print READY; process VICTIM kills itself, the other takes its next inner steps
(no collective across islands) and reaches the sync, whose all-reduce across
islands finds the peer gone (gloo's connection to it refused, reset, or never made).
The survivor must end naming the dead process, never blaming itself. With `refused`
the survivor raises, at the sync, the error gloo gives when it connects to a peer that
already ended (the race where the peer died between publishing its address and
connecting), instead of running the sync.
"""

import os
import signal
import sys
import time

victim, heartbeat = int(sys.argv[1]), int(sys.argv[2])
refused = sys.argv[3:] == ["refused"]

import spmd  # noqa: E402

info = spmd.initialize(heartbeat_timeout=heartbeat)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def create(key):
    return {"params": {"w": jax.random.normal(key, (4, 2))}}


def train_step(state, x):
    grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(state["params"])
    return {"params": jax.tree.map(lambda p, g: p - 0.1 * g, state["params"], grads)}, {}


strategy = spmd.DiLoCo(spmd.MultiWorkerMirroredStrategy(), islands=2, sync_every=3)
state = strategy.init(create, jax.random.key(0))
step = strategy.step(train_step)
x = np.ones((strategy.num_replicas_in_sync * 2, 4), np.float32)
for t in range(1, 7):
    if t == 3 and refused:
        raise RuntimeError(
            "INTERNAL: Gloo AllReduce failed: [gloo/transport/tcp/pair.cc:144] "
            "connect [127.0.0.1]:41231: Connection refused"
        )
    state, _ = step(state, x)
    jax.block_until_ready(state)
    if t == 1:
        print(f"process {info.process_index}: READY", flush=True)
        if info.process_index == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1.0)  # the victim is gone before the survivor's next steps
print(f"process {info.process_index}: synced without its peer", flush=True)
sys.exit(3)
