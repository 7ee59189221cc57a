"""Saves step 1, starts an async save of step 2 and dies (SIGKILL) while it is being written.

Usage: python ckpt_interrupt_worker.py CKPT_DIR
Leaves what a crash mid-save leaves: a committed step 1 and step 2's temporary folder.
"""

import os
import signal
import sys
import time

import spmd

spmd.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

state = {"w": jnp.ones((4, 4)), "big": jnp.zeros((32, 1024, 1024), jnp.uint8)}  # 32 MB
ckpt = spmd.CheckpointManager(sys.argv[1], async_save=True)
ckpt.save(1, state, data={"position": 1})
ckpt.wait()
ckpt.save(2, jax.tree.map(lambda x: x + 1, state), data={"position": 2})
deadline = time.monotonic() + 5
while time.monotonic() < deadline and not any(
    ".orbax-checkpoint-tmp" in n for n in os.listdir(sys.argv[1])
):
    time.sleep(0.001)
print("killing mid-save", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
