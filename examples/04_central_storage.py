"""CentralStorageStrategy: variables kept in host memory, the compute on every device.

tf.distribute's CentralStorageStrategy puts the variables on the CPU and replicates
the computation over the local GPUs. Here the state lives in `pinned_host` memory
between steps; each step moves it to the devices, computes with the batch split, and
writes the update back. `strategy.explain` shows the difference in device memory
against MirroredStrategy, and both train to the same weights.

Run: python examples/04_central_storage.py [--devices 8] [--steps 20]
"""

import argparse
import sys

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

import spmd  # noqa: E402

spmd.initialize(local_device_count=args.devices)  # first thing, in every process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

GLOBAL_BATCH = 64
WIDTH = 512  # a hidden layer big enough for its bytes to show
tx = optax.sgd(0.01, momentum=0.9)


def create_state(key):
    k1, k2 = jax.random.split(key)
    params = {
        "hidden": {"kernel": jax.random.normal(k1, (16, WIDTH)) / 4, "bias": jnp.zeros(WIDTH)},
        "out": {"kernel": jax.random.normal(k2, (WIDTH, 1)) / WIDTH**0.5, "bias": jnp.zeros(1)},
    }
    return {"params": params, "opt": tx.init(params)}


def train_step(state, x, y):
    def loss_fn(params):
        hidden = jax.nn.relu(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
        pred = hidden @ params["out"]["kernel"] + params["out"]["bias"]
        return jnp.mean((pred[:, 0] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def batches(steps):
    rng = np.random.default_rng(0)
    w = rng.normal(size=16)
    for _ in range(steps):
        x = rng.normal(size=(GLOBAL_BATCH, 16)).astype(np.float32)
        yield x, np.tanh(x @ w / 4).astype(np.float32)


def train(strategy):
    with strategy.scope():
        state = strategy.init(create_state, jax.random.key(0))
        step = strategy.step(train_step)
        x, y = next(batches(1))
        print(strategy.explain(step, state, x, y))
        losses = []
        for x, y in strategy.distribute_dataset(batches(args.steps)):
            state, loss = step(state, x, y)
            losses.append(float(loss))
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state)}
    print(
        f"state between steps lives in: {sorted(kinds)}; loss {losses[0]:.4f} -> {losses[-1]:.4f}\n"
    )
    return jax.device_get(state["params"]), losses, kinds


central = spmd.CentralStorageStrategy()
params, losses, kinds = train(central)
mirrored_params, _, mirrored_kinds = train(spmd.MirroredStrategy())

gap = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(mirrored_params), strict=True)
)
print(f"largest weight difference from MirroredStrategy: {gap:.2e}")
ok = kinds == {"pinned_host"} and mirrored_kinds == {"device"} and losses[-1] < losses[0]
sys.exit(0 if ok and gap < 1e-5 else 1)
