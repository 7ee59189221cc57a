"""DiLoCo against synchronous data parallelism at the same examples: held-out metric and bytes.

Every run sees the same examples: the same global batches, in the same order,
for the same number of steps (synchronous: one step over the whole batch; DiLoCo:
each island steps on its slice). Inner optimizer Adam, each island its own; outer
optimizer SGD with Nesterov momentum, (0.7, 0.9) as in the paper unless
--outer-lr / --outer-momentum say otherwise. The metric is the global
parameters' on held-out data; bytes across islands are per device per step, read
from the compiled programs (`DiLoCo.explain`). Two tasks:

- digits: `spmd demo`'s CNN on the bundled digits (its learning rate); held-out
  accuracy on the 20% held out.
- lm: examples/07's transformer LM, character level (bytes, vocabulary 128), on
  the source of Python's standard library (`Lib/*.py`, present wherever Python
  is): every tenth file by name held out. Held-out loss in nats per character,
  and its perplexity.

Run: python bench/bench_diloco.py [--task digits|lm] [--devices 4] [--quick]
     [--output docs/diloco.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--task", choices=("digits", "lm"), default="digits")
parser.add_argument("--devices", type=int, default=4, help="simulated CPU devices")
parser.add_argument("--epochs", type=int, default=10, help="digits: passes over the training set")
parser.add_argument("--steps", type=int, default=600, help="lm: global steps")
parser.add_argument("--batch", type=int, help="global batch (digits: 64 images; lm: 32 sequences)")
parser.add_argument("--sync-every", type=int, nargs="+", default=[10, 25, 50])
parser.add_argument("--islands", type=int, nargs="+", default=[2, 4])
parser.add_argument("--seeds", type=int, default=3, help="runs per row; the metric is their mean")
parser.add_argument("--outer-lr", type=float, default=0.7)
parser.add_argument("--outer-momentum", type=float, default=0.9)
parser.add_argument("--quick", action="store_true", help="a smoke run: few steps, one seed")
parser.add_argument("--output", type=Path, help="write the table into this markdown file")
args = parser.parse_args()

import spmd  # noqa: E402

spmd.initialize(local_device_count=args.devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from bench import common  # noqa: E402
from spmd._src.cli.demo import CNN, LEARNING_RATE, load_digits  # noqa: E402

if args.quick:  # the smoke run: explain's programs are the trained ones, read back
    common.share_compilations()

DIGITS_BATCH, DIGITS_TOLERANCE = 64, 0.01  # tolerance: held-out accuracy
LM_BATCH, LM_TOLERANCE = 32, 0.05  # tolerance: held-out loss, nats per character
LM_CONFIG = {"vocab": 128, "dim": 64, "heads": 4, "mlp": 256, "layers": 2, "seq": 64}
LM_LEARNING_RATE = 3e-3
LM_HELD_OUT_WINDOWS = 512
QUICK_STEPS = 20


@dataclasses.dataclass(frozen=True)
class Task:
    """What the bench trains, on what, and how it scores the result."""

    name: str  # the table's markers: <!-- bench_diloco {name} table: begin/end -->
    model: Callable[[jax.Array], nnx.Module]  # key -> the NNX model
    loss: Callable[..., jax.Array]  # (model, *batch) -> mean loss
    batches: Callable[[int], Iterator[tuple]]  # seed -> the global batches, in order
    evaluate: Callable[[nnx.Module], dict[str, jax.Array]]  # model -> held-out metrics
    learning_rate: float  # the inner Adam's
    metric: str  # the held-out metric compared with synchronous training
    sign: int  # +1: higher is better; -1: lower
    tolerance: float  # how far below synchronous (in `metric`) a row may land
    about: str  # the table's first line: what trained on what


def digits_task() -> Task:
    data = load_digits()
    height, width = data.x_train.shape[1:3]
    batch, epochs = args.batch or DIGITS_BATCH, 1 if args.quick else args.epochs
    per_epoch = len(data.y_train) // batch

    def batches(seed):
        rng = np.random.default_rng(seed)
        for _ in range(epochs):
            order = rng.permutation(len(data.y_train))
            for s in range(per_epoch):
                rows = order[s * batch : (s + 1) * batch]
                yield data.x_train[rows], data.y_train[rows]

    def loss(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    def evaluate(model):
        return {"accuracy": jnp.mean(jnp.argmax(model(data.x_test), axis=-1) == data.y_test)}

    return Task(
        "digits",
        lambda key: CNN(height, width, rngs=nnx.Rngs(params=key)),
        loss,
        batches,
        evaluate,
        LEARNING_RATE,
        "accuracy",
        +1,
        DIGITS_TOLERANCE,
        f"`spmd demo`'s CNN, inner Adam {LEARNING_RATE}; {epochs * per_epoch} steps of "
        f"{batch} examples ({epochs} epoch{'s' * (epochs != 1)} of {len(data.y_train)}); "
        f"held-out accuracy over {len(data.y_test)} examples",
    )


def stdlib_text() -> tuple[np.ndarray, np.ndarray, int]:
    """Python's `Lib/*.py` as byte tokens, non-ASCII bytes as 127: (train, held out, files)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    held = files[9::10]

    def tokens(chosen):
        text = b"\n".join(f.read_bytes() for f in chosen)
        return np.minimum(np.frombuffer(text, np.uint8), 127).astype(np.int32)

    return tokens([f for f in files if f not in held]), tokens(held), len(files)


def lm_task() -> Task:
    from bench.bench_gpu import example

    lm = example()
    batch, steps = args.batch or LM_BATCH, QUICK_STEPS if args.quick else args.steps
    cfg = lm.LMConfig(**LM_CONFIG, batch=batch)
    train, held, files = stdlib_text()
    span = cfg.seq + 1
    starts = np.linspace(0, len(held) - span, LM_HELD_OUT_WINDOWS).astype(int)
    windows = np.stack([held[s : s + span] for s in starts])

    def batches(seed):
        rng = np.random.default_rng(seed)
        for _ in range(steps):
            rows = rng.integers(0, len(train) - span, batch)
            yield (np.stack([train[s : s + span] for s in rows]),)

    def loss(model, tokens):
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def evaluate(model):
        value = loss(model, windows)
        return {"loss": value, "perplexity": jnp.exp(value)}

    def model(key):
        with nnx.use_eager_sharding(False):  # plain arrays: DiLoCo's islands lay them out
            return lm.TransformerLM(cfg, nnx.Rngs(params=key))

    sizes = ", ".join(f"{k}={v}" for k, v in LM_CONFIG.items())
    return Task(
        "lm",
        model,
        loss,
        batches,
        evaluate,
        LM_LEARNING_RATE,
        "loss",
        -1,
        LM_TOLERANCE,
        f"examples/07's transformer LM ({sizes}), inner Adam {LM_LEARNING_RATE}, character "
        f"level; {steps} steps of {batch} sequences of {cfg.seq + 1} characters drawn from "
        f"Python {sys.version.split()[0]}'s `Lib/*.py` ({files} files; every tenth held out: "
        f"{len(train):,} characters to train on, {len(held):,} held out); held-out loss in "
        f"nats per character over {LM_HELD_OUT_WINDOWS} windows spread over the held-out files",
    )


class Run:
    """One task's training: the state, the step and the held-out score, for any strategy."""

    def __init__(self, task: Task):
        self.task = task
        self.tx = optax.adam(task.learning_rate)
        with nnx.use_eager_sharding(False):
            self.graphdef, self.abstract = nnx.split(
                nnx.eval_shape(lambda: task.model(jax.random.key(0)))
            )
        self.score = jax.jit(lambda params: task.evaluate(self.model(params)))

    def create(self, key: jax.Array) -> dict:
        params = nnx.to_pure_dict(nnx.state(self.task.model(key), nnx.Param))
        return {"params": params, "opt": self.tx.init(params)}

    def model(self, params: Any) -> nnx.Module:
        state = jax.tree.map(lambda x: x, self.abstract)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def train_step(self, state: dict, *batch: jax.Array) -> tuple[dict, dict]:
        loss, grads = jax.value_and_grad(lambda p: self.task.loss(self.model(p), *batch))(
            state["params"]
        )
        updates, opt = self.tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    def train(self, strategy: Any, seed: int) -> tuple[dict[str, float], Any, Any]:
        """Trains from `seed`; returns the held-out metrics, the step and the final state."""
        state = strategy.init(self.create, jax.random.key(seed))
        step = strategy.step(self.train_step)
        for batch in self.task.batches(seed):
            state, _ = step(state, *batch)
        diloco = isinstance(strategy, spmd.DiLoCo)
        params = strategy.global_params(state) if diloco else state["params"]
        scores = self.score(jax.device_get(params))
        return {k: float(v) for k, v in scores.items()}, step, state


@dataclasses.dataclass
class Row:
    """One line of the table: a training's held-out metrics over seeds, and its bytes."""

    name: str
    islands: int | None = None
    sync_every: int | None = None
    scores: list[dict[str, float]] = dataclasses.field(default_factory=list)
    report: Any = None  # DiLoCo's IslandsExplanation

    def mean(self, metric: str) -> float:
        return float(np.mean([s[metric] for s in self.scores]))

    def spread(self, metric: str) -> str:
        values = [s[metric] for s in self.scores]
        if len(values) == 1:
            return f"{values[0]:.3f}"
        return f"{np.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def measure(
    task: Task, run: Run, seeds: int, islands: list[int], sync_every: list[int]
) -> list[Row]:
    """The synchronous row, then one DiLoCo row per (islands, H)."""
    outer = optax.sgd(args.outer_lr, momentum=args.outer_momentum or None, nesterov=True)
    rows = [Row("synchronous (MirroredStrategy)")]
    for seed in range(seeds):
        rows[0].scores.append(_timed(run.train, spmd.MirroredStrategy(), seed)[0])
    for k in islands:
        for h in sync_every:
            row = Row("DiLoCo", k, h)
            for seed in range(seeds):
                strategy = spmd.DiLoCo(islands=k, sync_every=h, outer_optimizer=outer)
                scores, step, state = _timed(run.train, strategy, seed)
                row.scores.append(scores)
            row.report = strategy.explain(step, state, *next(task.batches(0)))
            rows.append(row)
    return rows


def _timed(train: Callable, strategy: Any, seed: int) -> Any:
    started = time.perf_counter()
    out = train(strategy, seed)
    print(
        f"  {strategy!r} seed {seed}: {out[0]} ({time.perf_counter() - started:.0f} s)", flush=True
    )
    return out


def render(task: Task, rows: list[Row], seeds: int, gradient_bytes: int) -> str:
    metrics = list(rows[0].scores[0])
    base = rows[0].mean(task.metric)
    lines = [
        f"Measured {datetime.date.today()} on {args.devices} simulated CPU devices (jax "
        f"{jax.__version__}): {task.about}. Outer optimizer SGD, learning rate {args.outer_lr}, "
        f"Nesterov momentum {args.outer_momentum}. "
        + ("One seed. " if seeds == 1 else f"Mean (min-max) of {seeds} seeds. ")
        + f"Tolerance: DiLoCo's held-out {task.metric} within {task.tolerance} of synchronous "
        f"training's. Bytes per device per step; synchronous training all-reduces the "
        f"gradients, {gradient_bytes:,} B, every step.",
        "",
        "| training | islands | H | "
        + " | ".join(f"held-out {m}" for m in metrics)
        + " | vs synchronous | within tolerance | bytes across islands / step "
        "| vs the gradients | explain's ratio |",
        "| --- " * (len(metrics) + 8) + "|",
    ]
    for row in rows:
        gap = row.mean(task.metric) - base
        if row.report is None:
            cells = [row.name, "-", "-", *(row.spread(m) for m in metrics), "-", "-"]
            cells += [f"{gradient_bytes:,} B", "1", "1"]
        else:
            cross = row.report.bytes_across_islands_per_step
            cells = [row.name, row.islands, row.sync_every, *(row.spread(m) for m in metrics)]
            cells += [f"{gap:+.3f}", "yes" if task.sign * gap >= -task.tolerance else "**no**"]
            cells += [f"{cross:,.0f} B", f"{cross / gradient_bytes:.3f}", f"{row.report.ratio:.3f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def write(path: Path, name: str, table: str) -> None:
    """Puts the table between the task's markers in a markdown file."""
    begin, end = (
        f"<!-- bench_diloco {name} table: begin -->",
        f"<!-- bench_diloco {name} table: end -->",
    )
    text = path.read_text()
    head, found, rest = text.partition(begin)
    if not found or end not in rest:
        raise SystemExit(f"{path} has no '{begin}' ... '{end}' markers to write the table between.")
    path.write_text(f"{head}{begin}\n{table}\n{end}{rest.partition(end)[2]}")


def main() -> None:
    started = time.perf_counter()
    task = lm_task() if args.task == "lm" else digits_task()
    run = Run(task)
    seeds = 1 if args.quick else args.seeds
    islands, sync_every = (
        (args.islands[:1], args.sync_every[:1])
        if args.quick
        else (
            args.islands,
            args.sync_every,
        )
    )
    rows = measure(task, run, seeds, islands, sync_every)
    params = jax.eval_shape(run.create, jax.random.key(0))["params"]
    table = render(
        task, rows, seeds, sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    )
    print(table)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.output is not None:
        write(args.output, task.name, table)


if __name__ == "__main__":
    main()
