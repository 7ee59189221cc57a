"""One worker of a multi-process training run; the tests compare its result to one process.

Usage: python train_worker.py STRATEGY OUT.npz [--devices N]
Every process trains the same model on the same global batches; process 0 saves
the final parameters (gathered from every process) and the losses to OUT.npz.
"""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("strategy")
parser.add_argument("out")
parser.add_argument("--devices", type=int, default=None)
args = parser.parse_args()

import spmd  # noqa: E402

info = spmd.initialize(local_device_count=args.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

STEPS, BATCH, FEATURES = 5, 16, 8
tx = optax.adam(1e-2)
STRATEGIES = {
    "multi_worker_mirrored": lambda: spmd.MultiWorkerMirroredStrategy(),
    "parameter_server": lambda: spmd.ParameterServerStrategy(
        spmd.partitioners.FixedShardsPartitioner(4)
    ),
}


def create_state(key):
    params = {"w": jax.random.normal(key, (FEATURES, 64)) * 0.3, "v": jnp.zeros((64, 1))}
    return {"params": params, "opt": tx.init(params)}


def train_step(state, x, y):
    def loss_fn(params):
        return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def global_batches():
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
        yield x, np.sin(x.sum(1, keepdims=True))


strategy = STRATEGIES[args.strategy]()
assert strategy.num_replicas_in_sync == jax.device_count() == 4, jax.device_count()
with strategy.scope():
    state = strategy.init(create_state, jax.random.key(0))
    step = strategy.step(train_step)
    losses = []
    for x, y in strategy.distribute_dataset(global_batches()):
        state, loss = step(state, x, y)
        losses.append(float(loss))
assert step.cache_size() == 1
params = jax.tree.map(
    lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), state["params"]
)
shard_rows = {s.data.shape[0] for s in state["params"]["w"].addressable_shards}
if info.is_chief:
    np.savez(
        args.out,
        w=params["w"],
        v=params["v"],
        losses=np.asarray(losses),
        shard_rows=np.asarray(sorted(shard_rows)),
        processes=jax.process_count(),
    )
print(f"process {jax.process_index()} of {jax.process_count()}: final loss {losses[-1]:.6f}")
