"""A writer and a reader of one checkpoint directory on an object store, as separate processes.

For tests/test_checkpoint_read_only.py, against a local GCS emulator (the test
sets the environment that points gcsfs and tensorstore at it).

Usage:
  python object_store_job.py write DIR --steps N [--keep K] [--pause S] [--no-final]
      saves steps 1..N (step s: w = s, b = arange(16) + s), each committed
      before the next, then marks N final (unless --no-final).
  python object_store_job.py read DIR OUT.json [--deadline S]
      a CheckpointManager(read_only=True) that polls DIR until the final step
      is marked and read (or the deadline): restores each step it lists once,
      and writes what it saw to OUT.json.
"""

import argparse
import json
import time

import jax.numpy as jnp
import numpy as np

import spmd


def state(step: int) -> dict:
    return {"w": jnp.full((8, 4), float(step)), "b": jnp.arange(16.0) + step}


def write(args) -> None:
    with spmd.CheckpointManager(args.dir, max_to_keep=args.keep) as writer:
        for step in range(1, args.steps + 1):
            writer.save(step, state(step))
            writer.wait()
            time.sleep(args.pause)
        if not args.no_final:
            writer.mark_final()


def read(args) -> None:
    reader = spmd.CheckpointManager(args.dir, read_only=True)
    seen = {"listings": [], "restored": {}, "unreadable": {}, "final": None}
    deadline = time.monotonic() + args.deadline
    while time.monotonic() < deadline:
        final = reader.final_step()  # before the listing: the mark comes after the last save
        steps = reader.all_steps()
        if not seen["listings"] or seen["listings"][-1] != steps:
            seen["listings"].append(steps)
        for step in steps:
            if str(step) in seen["restored"]:
                continue
            try:
                restored = reader.restore(step)
            except spmd.CheckpointError as error:  # removed by max_to_keep since the listing
                seen["unreadable"][str(step)] = str(error).splitlines()[1]
                continue
            seen["restored"][str(step)] = {k: np.asarray(v).tolist() for k, v in restored.items()}
        if final is not None:
            seen["final"] = final
            break
        time.sleep(0.1)
    seen["damaged"] = {str(s): why for s, why in reader.damaged_steps().items()}
    reader.close()
    with open(args.out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["write", "read"])
    parser.add_argument("dir")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--keep", type=int, default=None)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--no-final", action="store_true")
    parser.add_argument("--deadline", type=float, default=120.0)
    args = parser.parse_args()
    write(args) if args.mode == "write" else read(args)
