"""The multi-worker Keras tutorial's program as it is written: tf.data in, Keras' fit.

The tutorial maps a `scale` function over an unbatched dataset, shuffles it,
batches it by the global batch size and calls `model.fit(x=train_datasets,
epochs=3, callbacks=[ModelCheckpoint(filepath=...)])` under a strategy, each
worker reading its task index from TF_CONFIG. Here, as a Keras user would grow it:
the examples do not fill the last batch of an epoch (600 rows in batches of 64:
9 whole, then 24), the data carries sample weights, and fit weighs classes
(`class_weight`). Every number is checked against the same Trainer on one device.

Run: python examples/14_keras_tf_data_tutorial.py [--devices 8] [--epochs 2]
  or: spmd launch -n 2 --devices-per-process 4 -- python examples/14_keras_tf_data_tutorial.py
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

import spmd  # noqa: E402

spmd.initialize(local_device_count=args.devices)  # first thing, in every process

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import tensorflow as tf  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

EXAMPLES, GLOBAL_BATCH_SIZE, SIZE, BUFFER_SIZE = 600, 64, 12, 10000

# As the tutorial reads it: TF_CONFIG's task (spmd launch writes one for each process).
task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {"type": "worker", "index": 0})
assert task["index"] == spmd.cluster().process_index, (task, spmd.cluster())


class CNN(nnx.Module):
    """build_and_compile_cnn_model, narrower: Conv2D(16, 3, relu) -> Flatten -> Dense(32, relu)
    -> Dense(10)."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 16, (3, 3), padding="VALID", rngs=rngs)
        self.dense = nnx.Linear((SIZE - 2) ** 2 * 16, 32, rngs=rngs)
        self.logits = nnx.Linear(32, 10, rngs=rngs)  # the loss takes logits, not softmax

    def __call__(self, x):
        x = nnx.relu(self.conv(x)).reshape(x.shape[0], -1)
        return self.logits(nnx.relu(self.dense(x)))


def make_digits(n, seed):
    """MNIST's stand-in: uint8 images of ten noisy stroke patterns, labels 0..9."""
    templates = np.random.default_rng(0).random((10, SIZE, SIZE)) > 0.7
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.int64)
    images = (templates[labels] * 150 + rng.random((n, SIZE, SIZE)) * 100).astype(np.uint8)
    return images[..., None], labels


def scale(image, label, weight):
    """The tutorial's scale: uint8 (0, 255] to float (0., 1.]."""
    return tf.cast(image, tf.float32) / 255, label, weight


def train_datasets():
    images, labels = make_digits(EXAMPLES, seed=1)
    weights = np.where(labels % 2 == 0, 1.0, 0.5).astype(np.float32)  # per-example weights
    unbatched = tf.data.Dataset.from_tensor_slices((images, labels, weights)).map(scale)
    # seeded: every process (and the oracle) reads the same order
    return unbatched.shuffle(BUFFER_SIZE, seed=0).batch(GLOBAL_BATCH_SIZE)


def fit(strategy, checkpoint_dir=None):
    with strategy.scope():
        trainer = spmd.Trainer(
            CNN(nnx.Rngs(0)), optax.sgd(0.1), "sparse_categorical_crossentropy", ("accuracy",)
        )
    callbacks = [spmd.callbacks.ModelCheckpoint(filepath=checkpoint_dir)] if checkpoint_dir else []
    history = trainer.fit(
        train_datasets(),
        epochs=args.epochs,
        class_weight={c: 2.0 if c < 5 else 1.0 for c in range(10)},
        callbacks=callbacks,
        verbose=2,
    )
    return trainer, history


strategy = spmd.MultiWorkerMirroredStrategy()
print(f"task {task}: {strategy}, global batch {GLOBAL_BATCH_SIZE}")
# One folder every process names: the coordinator's address is the same in each.
run = (spmd.cluster().coordinator_address or f"pid{os.getpid()}").replace(":", "-")
directory = os.path.join(tempfile.gettempdir(), f"spmd-keras-tutorial-{run}")
trainer, history = fit(strategy, directory)
saved = spmd.CheckpointManager(directory, read_only=True)
restored = saved.restore(target=trainer.state)  # the tutorial's fault tolerance: a restart's start
saved_gap = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(
        jax.tree.leaves(jax.device_get(restored["params"])),
        jax.tree.leaves(trainer.host_state()["params"]),
        strict=True,
    )
)
saved.close()
multihost_utils.sync_global_devices("checkpoint read")
if spmd.cluster().is_chief:
    shutil.rmtree(directory)

test_images, test_labels = make_digits(300, seed=2)  # 300 rows: 4 batches of 64, then 44
test = tf.data.Dataset.from_tensor_slices((test_images.astype(np.float32) / 255, test_labels))
results = trainer.evaluate(test.batch(GLOBAL_BATCH_SIZE))
predicted = trainer.predict(test.map(lambda x, y: x).batch(GLOBAL_BATCH_SIZE))
print(f"held out: loss {results['loss']:.4f}, accuracy {results['accuracy']:.3f}")

# The oracle: the same program on one device.
oracle, oracle_history = fit(spmd.OneDeviceStrategy())
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
oracle_out = oracle.predict(test_images.astype(np.float32) / 255, batch_size=GLOBAL_BATCH_SIZE)
predict_gap = float(np.max(np.abs(predicted - oracle_out)))
print(
    f"largest difference from one device: loss {loss_gap:.1e}, weights {weight_gap:.1e}, "
    f"outputs {predict_gap:.1e}; checkpoint vs trained weights {saved_gap:.1e}"
)
learned = results["accuracy"] > 0.9 and history.history["loss"][-1] < history.history["loss"][0]
same = max(loss_gap, weight_gap, predict_gap) < 1e-4 and saved_gap == 0.0
sys.exit(0 if learned and same and predicted.shape == (300, 10) else 1)
