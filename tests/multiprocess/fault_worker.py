"""One process of a cluster that misbehaves on purpose: `python fault_worker.py SCENARIO`.

Scenarios (process ids come from SPMD_PROCESS_ID):
  join       join with initialization_timeout=8; print INIT_ERROR and the message on failure.
  listen     join, then print where the coordinator listens (process 0, from /proc/net/tcp*).
  raise      join; process 1 raises, process 0 blocks (a stand-in for a collective).
  early      exit_timeout=2; both take 2 psum steps, then process 0 ends while process 1
             takes a third (it waits for process 0 in that step's collective).
  gather     exit_timeout=2; both take 2 psum steps, then process 0 ends while process 1
             calls process_allgather (a collective outside a step) and waits there.
  export     exit_timeout=2, hang_timeout=2; both take 3 psum steps, then process 0 (the
             chief) runs its own code for 8 s (an export) and prints EXPORTED.
  block      join, print READY, block in the coordination service (a C++ wait, no GIL).
  block_save as block, with a PreemptionWatcher (a save to make) and grace_period=2.
  dead       as block, with heartbeat_timeout=10 (a test kills one process with SIGKILL).
  collective heartbeat_timeout=10; both take 2 psum steps and print READY, then process 0
             sleeps while process 1 waits for it in the third step's collective.
  collective1 as collective, with the roles swapped: process 1 sleeps, process 0 waits.
  train      take 3 psum steps and end.
  idle       heartbeat_timeout=10; both take 2 psum steps, print READY and sleep (between
             steps, in Python).
Each prints "PID <pid>" once joined. The process id is SPMD_PROCESS_ID's, else SLURM_PROCID's.
"""

import os
import sys
import time

import spmd
from spmd._src.errors import InitializationError

SCENARIO = sys.argv[1]
INDEX = os.environ.get("SPMD_PROCESS_ID", os.environ.get("SLURM_PROCID"))
SLEEPER = {"collective": "0", "collective1": "1"}.get(SCENARIO)  # who sleeps at step 2


def listening_addresses(port: int) -> list[str]:
    """The local addresses with a TCP socket listening on `port` (state 0A), as hex."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(f"{table.rsplit('/', 1)[1]}:{address}")
    return found


def steps() -> None:
    """Two steps of a psum on every process, then the scenario's wait (see the docstring)."""
    import jax.numpy as jnp

    strategy = spmd.MultiWorkerMirroredStrategy()
    step = strategy.step(lambda state, batch: (state + jnp.sum(batch), jnp.mean(batch)))
    state, batch = jnp.zeros(()), jnp.ones((strategy.num_replicas_in_sync, 2))
    for i in range(3):
        if i == 2 and SCENARIO in ("early", "gather"):
            print("READY", flush=True)
            if INDEX == "0":
                return  # ends early: its peer waits for it
            if SCENARIO == "gather":
                from jax.experimental import multihost_utils

                multihost_utils.process_allgather(jnp.ones(2))
                return
        if i == 2:
            print("READY", flush=True)
        if i == 2 and (SCENARIO == "idle" or INDEX == SLEEPER):
            time.sleep(60)
        state, loss = step(state, batch)
        print("STEP", i, float(loss), flush=True)
    if SCENARIO == "export" and INDEX == "0":
        time.sleep(8)  # the chief's own work after training: an export, an upload
        print("EXPORTED", flush=True)


def block(seconds: float) -> None:
    """Waits in the coordination service for a barrier nobody else enters (a C++ wait)."""
    from jax._src import distributed

    try:
        distributed.global_state.client.wait_at_barrier(f"never-{INDEX}", int(seconds * 1000))
    except Exception as e:  # the barrier timed out: nothing ended this process
        print("BLOCK ENDED", type(e).__name__, flush=True)


try:
    exit_timeout = 2 if SCENARIO in ("early", "gather", "export") else 30
    heartbeat = 10 if SCENARIO in ("dead", "collective", "collective1", "idle") else 100
    spmd.initialize(
        local_device_count=1,
        initialization_timeout=8,
        exit_timeout=exit_timeout,
        heartbeat_timeout=heartbeat,
        hang_timeout=2 if SCENARIO == "export" else None,
    )
except InitializationError as e:
    print("INIT_ERROR", str(e).replace("\n", " | "), flush=True)
    sys.exit(3)
print("PID", os.getpid(), flush=True)

if SCENARIO == "listen" and INDEX == "0":
    port = int(os.environ["SPMD_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
    print("LISTEN", " ".join(listening_addresses(port)), flush=True)
elif SCENARIO == "raise":
    if INDEX == "1":
        time.sleep(1)
        raise RuntimeError("process 1 broke")
    time.sleep(60)
elif SCENARIO in ("collective", "collective1", "idle", "train", "early", "gather", "export"):
    steps()
elif SCENARIO.startswith("block") or SCENARIO == "dead":
    if SCENARIO == "block_save":
        from spmd._src.checkpoint.preemption import PreemptionWatcher

        watcher = PreemptionWatcher(grace_period=2)
    print("READY", flush=True)
    block(60)
print("END", flush=True)
