"""DiLoCo against synchronous data parallelism on the bundled digits: accuracy and bytes across islands.

Every run sees the same examples: the same global batches, in the same order,
for the same number of steps (synchronous: one step over the whole batch; DiLoCo:
each island steps on its slice). The model is `spmd demo`'s CNN, inner optimizer
Adam (the demo's), outer SGD with Nesterov momentum (0.7, 0.9) as in the paper.
Accuracy is the global parameters' on the held-out 20%; bytes across islands are
per device per step, read from the compiled programs (`DiLoCo.explain`).

Run: python bench/bench_diloco.py [--devices 4] [--epochs 10] [--output docs/diloco.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch", type=int, default=64, help="global batch")
parser.add_argument("--sync-every", type=int, nargs="+", default=[10, 25, 50])
parser.add_argument("--islands", type=int, nargs="+", default=[2, 4])
parser.add_argument("--seeds", type=int, default=3, help="runs per row (accuracy: their mean)")
parser.add_argument("--output", type=Path, help="write the table into this markdown file")
args = parser.parse_args()

import spmd  # noqa: E402

spmd.initialize(local_device_count=args.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from spmd.cli.demo import CNN, LEARNING_RATE, load_digits  # noqa: E402

BEGIN, END = "<!-- bench_diloco table: begin -->", "<!-- bench_diloco table: end -->"
data = load_digits()
height, width = data.x_train.shape[1:3]
graphdef, _ = nnx.split(CNN(height, width, rngs=nnx.Rngs(0)))
tx = optax.adam(LEARNING_RATE)


def create(key):
    params = nnx.state(CNN(height, width, rngs=nnx.Rngs(params=key)), nnx.Param)
    params = nnx.to_pure_dict(params)
    return {"params": params, "opt": tx.init(params)}


def _abstract():
    return CNN(height, width, rngs=nnx.Rngs(0))


def _model(params):
    abstract = nnx.eval_shape(_abstract)
    gdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(gdef, state)


def train_step(state, x, y):
    def loss_fn(p):
        logits = _model(p)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}


@jax.jit
def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(_model(params)(x), axis=-1) == y)


def batches(seed):
    rng = np.random.default_rng(seed)
    steps = len(data.y_train) // args.batch
    for _ in range(args.epochs):
        order = rng.permutation(len(data.y_train))
        for s in range(steps):
            rows = order[s * args.batch : (s + 1) * args.batch]
            yield data.x_train[rows], data.y_train[rows]


def held_out(params):
    params = jax.device_get(params)
    return float(accuracy(params, data.x_test, data.y_test))


def synchronous(seed):
    strategy = spmd.MirroredStrategy()
    state = strategy.init(create, jax.random.key(seed))
    step = strategy.step(train_step)
    for x, y in batches(seed):
        state, _ = step(state, x, y)
    return held_out(state["params"])


def diloco(seed, islands, sync_every):
    strategy = spmd.DiLoCo(islands=islands, sync_every=sync_every)
    state = strategy.init(create, jax.random.key(seed))
    step = strategy.step(train_step)
    for x, y in batches(seed):
        state, _ = step(state, x, y)
    return held_out(strategy.global_params(state)), strategy, step, state


def main():
    started = time.perf_counter()
    steps = args.epochs * (len(data.y_train) // args.batch)
    rows = []
    base = [synchronous(seed) for seed in range(args.seeds)]
    rows.append(("synchronous (MirroredStrategy)", "-", "-", base, None))
    for islands in args.islands:
        for h in args.sync_every:
            accs = []
            for seed in range(args.seeds):
                acc, strategy, step, state = diloco(seed, islands, h)
                accs.append(acc)
            x, y = data.x_train[: args.batch], data.y_train[: args.batch]
            report = strategy.explain(step, state, x, y)
            rows.append(("DiLoCo", islands, h, accs, report))
    lines = [
        f"{args.devices} simulated CPU devices, {steps} steps of {args.batch} examples "
        f"({args.epochs} epochs of {len(data.y_train)}), held-out accuracy over "
        f"{len(data.y_test)} examples, mean (min-max) of {args.seeds} seeds.",
        "",
        "| training | islands | H | held-out accuracy | vs synchronous | bytes across islands / step | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    base_mean = float(np.mean(base))
    for name, islands, h, accs, report in rows:
        mean = float(np.mean(accs))
        spread = f"{mean:.3f} ({min(accs):.3f}-{max(accs):.3f})"
        if report is None:
            cross, ratio = "all-reduce of the gradients", "1"
        else:
            sync_bytes = report.synchronous_bytes_across_islands_per_step
            cross = f"{report.bytes_across_islands_per_step:,.0f} B (synchronous: {sync_bytes:,} B)"
            ratio = f"{report.ratio:.3f}"
        lines.append(
            f"| {name} | {islands} | {h} | {spread} | {mean - base_mean:+.3f} | {cross} | {ratio} |"
        )
    table = "\n".join(lines)
    print(table)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.output is not None:
        text = args.output.read_text()
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        args.output.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")


if __name__ == "__main__":
    main()
