"""One process of the multi-process predict checks; writes its predictions to OUT/<case>.<i>.npy.

Usage: python predict_worker.py OUT_DIR

Every process builds the same Trainer of a 3 -> 2 linear model over
MultiWorkerMirroredStrategy and predicts the same rows (`rows(...)`) in each
case of CASES: arrays with a batch the replicas split, one they do not (padded),
a short last batch, and an iterable of batches.
"""

import sys

import spmd

info = spmd.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

CASES = {  # name: (rows, batch_size, given as a list of batches)
    "dividing": (16, 8, False),
    "padded": (16, 6, False),
    "short_last_batch": (13, 8, False),
    "batches_padded": (13, 5, True),
}


class Linear(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


def rows(count: int) -> np.ndarray:
    return np.random.default_rng(count).normal(size=(count, 3)).astype(np.float32)


if __name__ == "__main__":
    strategy = spmd.MultiWorkerMirroredStrategy()
    with strategy.scope():
        trainer = spmd.Trainer(Linear(nnx.Rngs(0)), optax.sgd(0.1), "mse")
    for name, (count, batch, as_batches) in CASES.items():
        x = rows(count)
        if as_batches:
            got = trainer.predict([(x[i : i + batch],) for i in range(0, count, batch)])
        else:
            got = trainer.predict(x, batch_size=batch)
        np.save(f"{sys.argv[1]}/{name}.{jax.process_index()}.npy", got)
