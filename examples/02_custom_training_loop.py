"""The distributed training guide's custom training loop, with the per-replica view.

As in the guide: each replica computes its loss with `compute_average_loss` (divided
by the *global* batch) plus `scale_regularization_loss` of an L2 term, takes its own
gradients inside `strategy.run`, and the step sums them with
`strategy.reduce(SUM, ...)`; the dataset is distributed with `distribute_dataset`.
The losses and weights are checked against a plain one-device loop over the same
batches.

Run: python examples/02_custom_training_loop.py [--devices 8] [--steps 50]
"""

import argparse
import sys

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
parser.add_argument("--steps", type=int, default=50)
args = parser.parse_args()

import spmd  # noqa: E402

spmd.initialize(local_device_count=args.devices)  # first thing, in every process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

BATCH_SIZE_PER_REPLICA = 5
L2 = 1e-4  # the guide's kernel_regularizer=tf.keras.regularizers.L2(1e-4)
optimizer = optax.sgd(0.1)


def model(params, x):
    """The guide's Dense(1) layer: one logit per example."""
    return x @ params["kernel"] + params["bias"]


def per_example_loss(params, x, y):
    """BinaryCrossentropy(from_logits=True, reduction=NONE)."""
    return optax.sigmoid_binary_cross_entropy(model(params, x)[:, 0], y)


def replica_step(x, y, params):
    """The guide's train_step, on one replica's slice of the batch."""

    def loss_fn(params):
        loss = spmd.compute_average_loss(per_example_loss(params, x, y))
        return loss + spmd.scale_regularization_loss(L2 * jnp.sum(params["kernel"] ** 2))

    return jax.value_and_grad(loss_fn)(params)


def make_state():
    params = {"kernel": jnp.zeros((4, 1)), "bias": jnp.zeros(1)}
    return {"params": params, "opt": optimizer.init(params)}


def apply(state, grads):
    updates, opt = optimizer.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}


def dataset(global_batch_size, steps):
    """Global batches: 4 features, a label that is a noisy linear function of them."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        x = rng.normal(size=(global_batch_size, 4)).astype(np.float32)
        y = x @ [1.0, -2.0, 0.5, 0.0] + 0.3 * rng.normal(size=global_batch_size) > 0
        yield x, y.astype(np.float32)


strategy = spmd.MirroredStrategy()
global_batch_size = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
print(f"{strategy}: global batch {global_batch_size}")


@strategy.step
def distributed_train_step(state, x, y):
    per_replica = strategy.run(replica_step, args=(x, y), kwargs={"params": state["params"]})
    loss, grads = strategy.reduce(spmd.ReduceOp.SUM, per_replica, axis=None)
    return apply(state, grads), loss


with strategy.scope():
    state = strategy.init(make_state)
    losses = []
    for step, (x, y) in enumerate(
        strategy.distribute_dataset(dataset(global_batch_size, args.steps))
    ):
        state, loss = distributed_train_step(state, x, y)
        losses.append(float(loss))
        if step % 10 == 0:
            print(f"step {step}: loss {losses[-1]:.4f}")
params = jax.device_get(state["params"])


# The oracle: the same model and batches in one plain jitted loop, mean over the batch.
@jax.jit
def one_device_step(state, x, y):
    def loss_fn(params):
        loss = per_example_loss(params, x, y).mean()
        return loss + L2 * jnp.sum(params["kernel"] ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    return apply(state, grads), loss


oracle, oracle_losses = make_state(), []
for x, y in dataset(global_batch_size, args.steps):
    oracle, loss = one_device_step(oracle, x, y)
    oracle_losses.append(float(loss))

loss_gap = float(np.max(np.abs(np.array(losses) - np.array(oracle_losses))))
weight_gap = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(oracle["params"]), strict=True)
)
print(
    f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; largest difference from one device: "
    f"loss {loss_gap:.1e}, weights {weight_gap:.1e}"
)
sys.exit(0 if losses[-1] < losses[0] and loss_gap < 1e-5 and weight_gap < 1e-5 else 1)
