"""spmd.pipeline's train step against the layer scan's on the same devices.

The floor is a hand-written jax.jit step running the layers as one
`jax.lax.scan`, data parallel over every device (parameters replicated, the
batch split). The pipelined steps split the same layers over a `stage` axis
(the rest of the devices data parallel) with `spmd.pipeline`; each row says its
schedule and the bubble `strategy.explain` names. On simulated CPU devices, which
share the machine's cores, a pipeline cannot win: the ratio measures what the
schedule costs (the bubble's idle stage-steps, the permutes, the loop), not the
memory it saves.

Run: python bench/bench_pipeline.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import common
else:
    from bench import common

LAYERS, WIDTH, BATCH = 8, 128, 64
CASES = (  # (stages, data, microbatches, repeats)
    (2, 4, 4, 1),
    (2, 4, 8, 1),
    (4, 2, 8, 1),
    (2, 4, 8, 2),
)


def _layer(p, h):
    import jax.numpy as jnp

    return jnp.tanh(h @ p["w"] + p["b"])


def _make_step(run_layers):
    import jax
    import jax.numpy as jnp
    import optax

    tx = optax.sgd(1e-2)

    def train_step(state, x, y):
        def loss(params):
            return jnp.mean((run_layers(params, x) - y) ** 2)

        value, grads = jax.value_and_grad(loss)(state)
        return optax.apply_updates(state, tx.update(grads, tx.init(state))[0]), value

    return train_step


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    params = {
        "w": (rng.normal(size=(LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
        "b": np.zeros((LAYERS, WIDTH), np.float32),
    }
    x, y = rng.normal(size=(2, BATCH, WIDTH)).astype(np.float32)
    return params, x, y


def _runner(step, state, x, y):
    import jax

    box = [state]

    def run(steps):
        state = box[0]
        for _ in range(steps):
            state, loss = step(state, x, y)
            loss.block_until_ready()  # XLA:CPU's short queue of collective steps
        box[0] = jax.block_until_ready(state)

    return run


def _floor(params, x, y):
    """The layer scan, data parallel over every device, by hand."""
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    scan = _make_step(lambda p, x: jax.lax.scan(lambda h, q: (_layer(q, h), None), x, p)[0])
    step = jax.jit(
        scan,
        in_shardings=(replicated, split, split),
        out_shardings=(replicated, replicated),
        donate_argnums=0,
    )
    state = jax.device_put(params, replicated)
    return _runner(step, state, *jax.device_put((x, y), split))


def _pipelined(params, x, y, stages, data, microbatches, repeats):
    """The same step with spmd.pipeline over a stage axis; its runner and schedule."""
    from jax.sharding import PartitionSpec as P

    import spmd

    mesh = spmd.make_mesh({"stage": stages, "data": data})
    strategy = spmd.Strategy(mesh, rules=[(r".*", P("stage"))], batch_axes=("data",))
    step = strategy.step(
        _make_step(
            lambda p, x: spmd.pipeline(_layer, p, x, microbatches=microbatches, repeats=repeats)
        )
    )
    state = strategy.put(params)
    [schedule] = strategy.explain(step, state, x, y).pipelines
    return _runner(step, state, x, y), schedule


def main(quick: bool = False) -> list[dict]:
    """Rows: each pipelined case against the scan floor, with its schedule and bubble."""
    params, x, y = _data()
    steps, repeats = (3, 3) if quick else (10, 7)
    cases = CASES[:2] if quick else CASES
    runners = {"floor": _floor(params, x, y)}
    schedules = {}
    for case in cases:
        runners[case], schedules[case] = _pipelined(params, x, y, *case)
    times = common.timeit(runners, steps, repeats)
    today = datetime.date.today().isoformat()
    return [
        {
            "benchmark": "pipeline",
            "case": f"{LAYERS} layers of {WIDTH}, batch {BATCH}: stage {s} x data {d}",
            "schedule": str(schedules[(s, d, m, r)]).split(", bubble")[0],
            "bubble": f"{schedules[(s, d, m, r)].bubble:.1%}",
            "scan, data x8": common.fmt_time(times["floor"]),
            "spmd.pipeline": common.fmt_time(times[(s, d, m, r)]),
            "ratio": common.ratio(times[(s, d, m, r)], times["floor"]),
            "measured": today,
        }
        for s, d, m, r in cases
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer cases, steps and repeats")
    args = parser.parse_args()
    common.set_cpu_devices(8)
    for row in main(args.quick):
        print(row)
