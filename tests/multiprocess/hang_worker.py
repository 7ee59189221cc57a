"""A training loop in which one process stops making progress: `python hang_worker.py SCENARIO`.

Scenarios (process ids from SPMD_PROCESS_ID; every process takes 30 steps of a
psum-ing step, then prints DONE):
  sleep   process 1 sleeps 120 s in its loop before step 4 (alive, no progress).
  sleep0  the same in process 0 (which hosts the coordination service and judges).
  slow    process 1 sleeps 0.4 s before every step: slow, but it advances.
  lock    process 1 waits on a lock nobody releases before step 4 (a deadlocked loader).
  loader  Trainer.fit on a generator that, in process 1, stops delivering before batch 6
          (spmd's prefetching thread waits in it; both main threads wait on that thread).
  first   process 1 sleeps 120 s before its first step (between initialize and the loop).
  fifo    Trainer.fit on a loader whose first read, in process 1, opens the FIFO FILE
          (argv[2]) that nobody writes: a hung filesystem read before the first batch.
  restore every process saves step 1 in the folder argv[2], then restores it; process 1's
          read opens the FIFO argv[3] (a hung read in the restore, before any step).
  run     a pmap port: each step is a strategy.run whose replicas all-reduce; process 1
          sleeps 120 s before step 4.
  limit   as sleep, with spmd.initialize(hang_timeout=3) (and no SPMD_HANG_TIMEOUT).
  callback 2 devices a process; each step's replicas call a jax.pure_callback, which in
          process 1 blocks 120 s at step 4 (on a runtime thread, while both main threads
          wait in JAX at the same step count).
  export  every process takes its 30 steps; then process 0 (the chief) runs its own code for
          8 s (an export) and prints EXPORTED, while process 1 is at its end.
The hang timeout comes from SPMD_HANG_TIMEOUT (spmd launch --hang-timeout), except in `limit`.
"""

import os
import sys
import threading
import time

import spmd

SCENARIO = sys.argv[1]
INDEX = int(os.environ["SPMD_PROCESS_ID"])
STALLER = 0 if SCENARIO == "sleep0" else 1  # the process that stops making progress
spmd.initialize(
    local_device_count=2 if SCENARIO == "callback" else 1,
    hang_timeout=3 if SCENARIO == "limit" else None,
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

strategy = spmd.MultiWorkerMirroredStrategy()


@strategy.step
def step(state, batch):
    return state + jnp.sum(batch), jnp.mean(batch)


def stall_here() -> None:
    if SCENARIO in ("sleep", "sleep0", "run", "limit"):
        time.sleep(120)
    elif SCENARIO == "lock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire(timeout=120)  # the second acquire never succeeds: a loader's deadlock


def read_fifo(path: str) -> None:
    with open(path) as f:  # a FIFO nobody writes: open() blocks, as a read from a hung mount
        f.read()


def fit_on_a_stalling_loader() -> None:
    import numpy as np
    import optax
    from flax import nnx

    class Linear(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            return self.dense(x)[:, 0]

    def batches():
        rng = np.random.default_rng(0)
        for i in range(30):
            if INDEX == 1 and i == 6 and SCENARIO == "loader":
                time.sleep(120)  # the source stopped delivering
            if INDEX == 1 and i == 0 and SCENARIO == "fifo":
                read_fifo(sys.argv[2])
            yield rng.random((8, 4), np.float32), rng.random((8,), np.float32)

    with strategy.scope():
        trainer = spmd.Trainer(Linear(nnx.Rngs(0)), optax.sgd(0.1), loss="mse")
    trainer.fit(batches(), epochs=1, verbose=0)
    print("DONE", flush=True)
    sys.exit(0)


def restore_with_a_hung_read(directory: str, fifo: str) -> None:
    """Saves step 1 on every process, then restores it; process 1's read never returns."""
    from spmd._src.checkpoint import store

    ckpt = spmd.CheckpointManager(directory)
    state = strategy.init(lambda: jnp.zeros((4,)))
    ckpt.save(1, state)
    ckpt.wait()
    if INDEX == 1:
        restore_placed = store.SharedStore.restore_placed

        def hung(self, *args, **kwargs):
            read_fifo(fifo)
            return restore_placed(self, *args, **kwargs)

        store.SharedStore.restore_placed = hung
    ckpt.restore(1, state)
    print("DONE", flush=True)
    sys.exit(0)


def run_loop() -> None:
    """Steps as a pmap port takes them: strategy.run, the replicas all-reducing, then reduce."""

    def replica_step(x):
        return spmd.get_replica_context().all_reduce("SUM", jnp.sum(x))

    batch = jnp.ones((strategy.num_replicas_in_sync, 2))
    for i in range(30):
        if INDEX == STALLER and i == 4:
            stall_here()
        total = strategy.reduce("MEAN", strategy.run(replica_step, args=(batch,)), axis=None)
        print("STEP", i, float(total), flush=True)
    print("DONE", flush=True)
    sys.exit(0)


def callback_loop() -> None:
    """Steps whose replicas each call back into Python (a feature lookup) and all-reduce."""

    def lookup(x, count):
        if INDEX == STALLER and int(count) == 4:
            time.sleep(120)  # a feature lookup from a hung service
        return x

    def replica_step(x, count):
        y = jax.pure_callback(lookup, jax.ShapeDtypeStruct(x.shape, x.dtype), x, count)
        return spmd.get_replica_context().all_reduce("SUM", jnp.sum(y))

    @strategy.step
    def looked_up(state, batch):
        total = strategy.reduce("SUM", strategy.run(replica_step, args=(batch, state[1])), None)
        return (state[0] + total, state[1] + 1), jnp.mean(batch) + 0 * total

    state = (jnp.zeros(()), jnp.zeros((), jnp.int32))
    batch = jnp.ones((strategy.num_replicas_in_sync, 2))
    for i in range(30):
        state, loss = looked_up(state, batch)
        print("STEP", i, float(loss), flush=True)
    print("DONE", flush=True)
    sys.exit(0)


if SCENARIO == "run":
    run_loop()
if SCENARIO == "callback":
    callback_loop()
if SCENARIO in ("loader", "fifo"):
    fit_on_a_stalling_loader()
if SCENARIO == "restore":
    restore_with_a_hung_read(sys.argv[2], sys.argv[3])
if SCENARIO == "first" and INDEX == 1:
    time.sleep(120)
state = jnp.zeros(())
batch = jnp.ones((strategy.num_replicas_in_sync, 2))
for i in range(30):
    if INDEX == STALLER and i == 4:
        stall_here()
    if INDEX == 1 and SCENARIO == "slow":
        time.sleep(0.4)
    state, loss = step(state, batch)
    print("STEP", i, float(loss), flush=True)
jax.block_until_ready(state)
if SCENARIO == "export" and INDEX == 0:
    time.sleep(8)  # the chief's own work after training: an export, an upload
    print("EXPORTED", flush=True)
print("DONE", flush=True)
