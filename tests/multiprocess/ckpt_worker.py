"""One worker of a fault-tolerant training run: resumes from its checkpoints, may kill itself.

Usage: python ckpt_worker.py CKPT_DIR OUT.npz [--steps N] [--kill-at K] [--signal KILL|TERM]
                             [--victim I] [--preemption auto|signal|jax] [--local]

With --local every process gets its own folder, CKPT_DIR/host<index>, as hosts
without a shared filesystem would (shared_filesystem=False).

Trains a small model under ParameterServerStrategy (its variables sharded over
every process's devices) on two inputs at once: batches that are a pure function
of their position, and spmd's own distributed dataset (shuffled numpy examples),
whose iterator position is saved too.
On the first attempt (SPMD_RESTART_COUNT 0) process `--victim` sends itself
`--signal` before step `--kill-at`. Every process prints one JSON line per
event ("start", "preempted", "done"); process 0 writes the final state to OUT.
The state counts how often each batch position ("seen") and each example of the
shuffled dataset ("seen_examples") was trained on, so a resumed run that
skipped or repeated a batch shows it.
"""

import argparse
import json
import os
import signal

parser = argparse.ArgumentParser()
parser.add_argument("ckpt_dir")
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--kill-at", type=int, default=None)
parser.add_argument("--signal", choices=["KILL", "TERM"], default="KILL")
parser.add_argument("--victim", type=int, default=1)
parser.add_argument("--preemption", default="auto")
parser.add_argument("--local", action="store_true", help="per-process paths, no shared folder")
args = parser.parse_args()

import spmd  # noqa: E402

info = spmd.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from spmd._src.clusters.launch import restart_count  # noqa: E402

if os.environ.get("CKPT_WORKER_JAX_CACHE"):  # the tests' cache, one folder per process
    cache = f"{os.environ['CKPT_WORKER_JAX_CACHE']}/process{info.process_index}"
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

BATCH, FEATURES = 8, 4
tx = optax.adam(1e-2)


class Batches:
    """Global batches that are a pure function of their position; saves and restores it."""

    def __init__(self):
        self.position = 0

    def __next__(self):
        rng = np.random.default_rng(self.position)
        x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
        index = np.full((BATCH,), self.position, np.int32)
        self.position += 1
        return x, np.sin(x.sum(1, keepdims=True)), index

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        self.position = state["position"]


class Both:
    """The two inputs' positions as one data position, as CheckpointManager takes it."""

    def __init__(self, *iterators):
        self.iterators = iterators

    def get_state(self) -> dict:
        return {str(i): it.get_state() for i, it in enumerate(self.iterators)}

    def set_state(self, state: dict) -> None:
        for i, it in enumerate(self.iterators):
            it.set_state(state[str(i)])


def create_state(key):
    k1, k2 = jax.random.split(key)
    params = {"w": jax.random.normal(k1, (FEATURES, 16)) * 0.5, "v": jnp.zeros((16, 1))}
    seen = jnp.zeros((args.steps,), jnp.int32)
    seen_examples = jnp.zeros((args.steps * BATCH,), jnp.int32)
    return {
        "params": params,
        "opt": tx.init(params),
        "key": k2,
        "seen": seen,
        "seen_examples": seen_examples,
    }


def train_step(state, x, y, index, extra, example):
    key, noise_key = jax.random.split(state["key"])
    x = x + 0.01 * jax.random.normal(noise_key, x.shape)  # the PRNG key matters bitwise
    x = x + 0.1 * extra  # and so does which shuffled batch came

    def loss_fn(params):
        return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    seen = state["seen"] + jnp.zeros_like(state["seen"]).at[index].add(1) // BATCH
    seen_examples = state["seen_examples"].at[example].add(1)
    params = optax.apply_updates(state["params"], updates)
    new = {"params": params, "opt": opt, "key": key, "seen": seen, "seen_examples": seen_examples}
    return new, loss


def say(event: str, **fields) -> None:
    fields.update(event=event, process=info.process_index, attempt=restart_count())
    print(json.dumps(fields), flush=True)


strategy = spmd.ParameterServerStrategy(spmd.partitioners.FixedShardsPartitioner(4))
examples = np.random.default_rng(7).normal(size=(args.steps * BATCH, FEATURES)).astype(np.float32)
numpy_data = (examples, np.arange(args.steps * BATCH, dtype=np.int32))
shuffled = strategy.distribute_dataset(
    strategy.make_numpy_dataset(numpy_data, BATCH, shuffle=True, seed=3)
)
batches, real = Batches(), iter(shuffled)
ckpt_dir = f"{args.ckpt_dir}/host{info.process_index}" if args.local else args.ckpt_dir
ckpt = spmd.CheckpointManager(
    ckpt_dir,
    max_to_keep=3,
    save_interval_steps=2,
    preemption=args.preemption,
    shared_filesystem=not args.local,
)
with strategy.scope():
    state, start = ckpt.restore_or_init(create_state, jax.random.key(0), data=Both(batches, real))
    spmd_position = real.get_state()["batch"]
    say(
        "start",
        step=start,
        position=batches.position,
        spmd_position=spmd_position,
        steps=ckpt.all_steps(),
    )
    step_fn = strategy.step(train_step)
    try:
        for step in range(start, args.steps):
            if restart_count() == 0 and info.process_index == args.victim and step == args.kill_at:
                os.kill(os.getpid(), getattr(signal, f"SIG{args.signal}"))
            x, y, index = next(batches)
            extra, example = next(real)
            state, loss = step_fn(state, x, y, index, extra, example)
            ckpt.save(step + 1, state, data=Both(batches, real))
    except spmd.Preempted as e:
        say("preempted", step=e.step, position=batches.position)
        raise
ckpt.close()
real.close()

state["key"] = jax.random.key_data(state["key"])
final = jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), state)
with spmd.CheckpointManager(ckpt_dir, shared_filesystem=not args.local) as view:
    say("done", position=batches.position, steps=view.all_steps())
if info.is_chief:
    arrays = {"w": final["params"]["w"], "v": final["params"]["v"], "mu": final["opt"][0].mu["w"]}
    seen = {"seen": final["seen"], "seen_examples": final["seen_examples"]}
    np.savez(args.out, key=final["key"], **seen, **arrays)
