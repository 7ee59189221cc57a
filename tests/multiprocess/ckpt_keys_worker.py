"""Counts the coordination service's keys while a CheckpointManager is saved every step.

Usage: python ckpt_keys_worker.py CKPT_DIR OUT.json [--steps N] [--interval K]

Every process joins, then calls `save(step, state)` at steps 1..N (a checkpoint
every K steps: the others agree on nothing but preemption notices). Process 0
writes {"keys": {step: number of keys under "spmd/"}, "saved": steps, "names": the
keys at the end} to OUT.json, the keys counted once every process has finished
that step's save.
"""

import argparse
import json

parser = argparse.ArgumentParser()
parser.add_argument("ckpt_dir")
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--interval", type=int, default=5)
args = parser.parse_args()

import spmd  # noqa: E402

info = spmd.initialize()

import numpy as np  # noqa: E402

from spmd._src.clusters.jax_state import coordination_client  # noqa: E402

client = coordination_client()
state = spmd.MultiWorkerMirroredStrategy().put({"w": np.arange(8.0, dtype=np.float32)})
keys = {}
with spmd.CheckpointManager(
    args.ckpt_dir, max_to_keep=2, save_interval_steps=args.interval, async_save=False
) as ckpt:
    for step in range(1, args.steps + 1):
        ckpt.save(step, state)
        client.wait_at_barrier("keys-worker", 60_000)  # every process's save of `step` is done
        keys[step] = len(client.key_value_dir_get("spmd/"))
        client.wait_at_barrier("keys-worker", 60_000)  # counted before any process goes on
    saved = ckpt.all_steps()
if info.is_chief:
    with open(args.out, "w") as f:
        names = sorted(k for k, _ in client.key_value_dir_get("spmd/"))
        json.dump({"keys": keys, "saved": saved, "names": names}, f)
