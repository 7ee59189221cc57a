"""Quickstart: the same train step on any strategy, checked against one device.

Run: python examples/quickstart.py [--strategy mirrored] [--devices 8] [--steps 50]
"""

import argparse
import sys

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--strategy", default="mirrored", help="mirrored, parameter_server, ...")
parser.add_argument("--devices", type=int, default=None, help="simulated CPU devices (default 8)")
parser.add_argument("--steps", type=int, default=50)
args = parser.parse_args()

import spmd  # noqa: E402

# Every process, before any JAX computation: joins the cluster under `spmd launch`
# or TF_CONFIG; on CPU it also sets the simulated device count.
info = spmd.initialize(local_device_count=args.devices)

import jax  # noqa: E402

if info.process_count == 1 and args.devices is None:
    jax.config.update("jax_num_cpu_devices", 8)  # a laptop's CPU as 8 devices

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

GLOBAL_BATCH = 64
tx = optax.adam(1e-2)


def create_state(key):
    k1, k2 = jax.random.split(key)
    params = {
        "hidden": {"kernel": jax.random.normal(k1, (2, 32)), "bias": jnp.zeros(32)},
        "out": {"kernel": jax.random.normal(k2, (32, 2)) * 0.1, "bias": jnp.zeros(2)},
    }
    return {"params": params, "opt": tx.init(params)}


def train_step(state, x, y):
    def loss_fn(params):
        hidden = jnp.tanh(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
        logits = hidden @ params["out"]["kernel"] + params["out"]["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {
        "loss": loss,
        "accuracy": accuracy,
    }


def two_moons(steps):
    """Global batches of a two-class toy problem: points inside or outside a circle."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        x = rng.uniform(-1, 1, size=(GLOBAL_BATCH, 2)).astype(np.float32)
        y = (np.linalg.norm(x, axis=1) < 0.7).astype(np.int32)
        yield x, y


def train(strategy):
    with strategy.scope():
        state = strategy.init(create_state, jax.random.key(0))
        step = strategy.step(train_step)
        for x, y in strategy.distribute_dataset(two_moons(args.steps)):
            state, metrics = step(state, x, y)
    return jax.device_get(state["params"]), {k: float(v) for k, v in metrics.items()}


STRATEGIES = {  # --strategy: each tf.distribute strategy with its defaults
    "default": spmd.get_strategy,
    "mirrored": spmd.MirroredStrategy,
    "multi_worker_mirrored": spmd.MultiWorkerMirroredStrategy,
    "tpu": spmd.TPUStrategy,
    "central_storage": spmd.CentralStorageStrategy,
    "one_device": spmd.OneDeviceStrategy,
    "parameter_server": lambda: spmd.ParameterServerStrategy(
        spmd.partitioners.MinSizePartitioner()
    ),
}
if args.strategy not in STRATEGIES:
    sys.exit(f"--strategy is one of {sorted(STRATEGIES)}; received {args.strategy!r}")
strategy = STRATEGIES[args.strategy]()
if info.is_chief:
    print(f"{strategy} with {strategy.num_replicas_in_sync} replicas")
params, metrics = train(strategy)
if info.is_chief:
    print(
        f"after {args.steps} steps: loss {metrics['loss']:.4f}, accuracy {metrics['accuracy']:.3f}"
    )

oracle_params, oracle_metrics = train(spmd.OneDeviceStrategy())
gap = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(oracle_params), strict=True)
)
if info.is_chief:
    print(f"largest parameter difference from one device: {gap:.2e}")
sys.exit(0 if gap < 1e-4 else 1)
