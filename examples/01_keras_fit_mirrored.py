"""Keras-style fit with MirroredStrategy: the multi-worker tutorial's CNN, on one host.

The tutorial builds its model inside `strategy.scope()` and calls `model.fit` with
the global batch (64 per replica times the replicas). Here the model is a flax NNX
module, `spmd.Trainer` is `compile` + `fit`, and the result is checked against the
same Trainer on one device: same data order, same seed, the same weights.

Run: python examples/01_keras_fit_mirrored.py [--devices 8] [--epochs 3]
"""

import argparse
import sys

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()

import spmd  # noqa: E402

spmd.initialize(local_device_count=args.devices)  # first thing, in every process

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

BATCH_SIZE_PER_REPLICA = 8
SIZE = 12  # images are SIZE x SIZE, one channel


class CNN(nnx.Module):
    """The tutorial's build_and_compile_cnn_model: Conv2D(32, 3) -> Flatten -> Dense(64) -> Dense(10)."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 32, (3, 3), padding="VALID", rngs=rngs)
        self.dense = nnx.Linear((SIZE - 2) ** 2 * 32, 64, rngs=rngs)
        self.logits = nnx.Linear(64, 10, rngs=rngs)  # the Trainer's loss takes logits

    def __call__(self, x):
        x = nnx.relu(self.conv(x)).reshape(x.shape[0], -1)
        return self.logits(nnx.relu(self.dense(x)))


def make_digits(n, seed):
    """Ten noisy 'digits': each class is a fixed random stroke pattern plus pixel noise."""
    templates = np.random.default_rng(0).random((10, SIZE, SIZE)) > 0.7
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.int32)
    images = templates[labels] * 0.6 + rng.random((n, SIZE, SIZE))
    return images[..., None].astype(np.float32), labels


def fit(strategy, x, y, global_batch_size, epochs):
    with strategy.scope():  # as the tutorial: build and compile inside the scope
        trainer = spmd.Trainer(
            CNN(nnx.Rngs(0)),
            optax.adam(1e-3),
            loss="sparse_categorical_crossentropy",
            metrics=("accuracy",),
        )
    history = trainer.fit((x, y), batch_size=global_batch_size, epochs=epochs, verbose=2)
    return trainer, history


x_train, y_train = make_digits(1024, seed=1)
x_test, y_test = make_digits(256, seed=2)

strategy = spmd.MirroredStrategy()
# The tutorial's rule: the batch given to fit is global, per-replica batch x replicas.
global_batch_size = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
print(f"{strategy}: {strategy.num_replicas_in_sync} replicas, global batch {global_batch_size}")
trainer, history = fit(strategy, x_train, y_train, global_batch_size, args.epochs)
results = trainer.evaluate((x_test, y_test), batch_size=global_batch_size)
print(f"held out: loss {results['loss']:.4f}, accuracy {results['accuracy']:.3f}")

# The oracle: one device, the same global batch, so the same updates (up to the
# order of float additions, which Adam's normalisation can magnify near zero).
oracle, oracle_history = fit(
    spmd.OneDeviceStrategy(), x_train, y_train, global_batch_size, args.epochs
)
loss_gap = max(
    abs(a - b) for a, b in zip(history.history["loss"], oracle_history.history["loss"], strict=True)
)
weight_gap = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(
        jax.tree.leaves(trainer.host_state()["params"]),
        jax.tree.leaves(oracle.host_state()["params"]),
        strict=True,
    )
)
print(f"largest difference from one device: loss {loss_gap:.1e}, weights {weight_gap:.1e}")

learned = results["accuracy"] > 0.9 and history.history["loss"][-1] < history.history["loss"][0]
sys.exit(0 if learned and loss_gap < 1e-4 and weight_gap < 1e-3 else 1)
