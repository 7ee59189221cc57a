"""A worker that dies (SIGKILL) while its peer works locally, so only heartbeats can tell.

Usage: python ckpt_heartbeat_worker.py VICTIM HEARTBEAT_SECONDS
Both processes run one collective, then process VICTIM kills itself and the
other keeps busy outside any collective until the coordination service notices
the missing heartbeats and ends it. The survivor never finishes on its own.
"""

import os
import signal
import sys
import time

victim, heartbeat = int(sys.argv[1]), int(sys.argv[2])

import spmd  # noqa: E402

info = spmd.initialize(heartbeat_timeout=heartbeat)

import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

multihost_utils.process_allgather(jnp.ones(()))  # both are up and connected
print(f"process {info.process_index}: ready", flush=True)
if info.process_index == victim:
    os.kill(os.getpid(), signal.SIGKILL)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:  # local work only: no collective would notice the death
    time.sleep(0.05)
print(f"process {info.process_index}: still alive after 120 s", flush=True)
sys.exit(3)
