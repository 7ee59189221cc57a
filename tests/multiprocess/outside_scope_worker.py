"""A Trainer of a model built outside `strategy.scope()`, on MultiWorkerMirroredStrategy.

Usage: python outside_scope_worker.py OUT.npz [--seed-by-process]
The model (Dropout's PRNG keys, BatchNorm's statistics) is built eagerly on this
process's first device and committed there, as a model moved or run before the
Trainer sees it is. Process 0 saves the losses and the trained parameters
(gathered) to OUT.npz. With --seed-by-process each process builds it from its
own seed: the processes hold different values, a clear error.
"""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--seed-by-process", action="store_true")
args = parser.parse_args()

import spmd  # noqa: E402

info = spmd.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.norm(jax.nn.relu(self.hidden(x)))))


model = Net(nnx.Rngs(info.process_index if args.seed_by_process else 0))
nnx.update(model, jax.device_put(nnx.state(model), jax.local_devices()[0]))  # committed here

rng = np.random.default_rng(0)
x = rng.normal(size=(128, 4)).astype(np.float32)
y = (x[:, 0] - x[:, 1] > 0).astype(np.int32)
strategy = spmd.MultiWorkerMirroredStrategy()
trainer = spmd.Trainer(
    model, optax.adam(1e-2), "sparse_categorical_crossentropy", strategy=strategy
)
history = trainer.fit((x, y), batch_size=32, epochs=2, shuffle=False, verbose=0)
state = trainer.host_state()
if info.is_chief:
    flat = jax.tree_util.tree_flatten_with_path(state["params"])[0]
    arrays = {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in flat}
    np.savez(
        args.out,
        losses=np.asarray(history.history["loss"]),
        processes=jax.process_count(),
        **arrays,
    )
