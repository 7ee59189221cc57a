"""Step overhead against a hand-written jax.jit step, and strategies side by side.

Run: python bench/bench_step.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import common
else:
    from bench import common

GLOBAL_BATCH = 64


def _init_apply(model: str):
    """(init, apply) of a model of common.MODELS, or of "mlp" (the 4x1024 MLP below)."""
    return (_big_init, _big_apply) if model == "mlp" else common.MODELS[model][:2]


@functools.cache
def initial_state(model: str):
    """The model's state from key 0, as numpy: made once (one create program compiled) and
    placed by each runner, the floor's and spmd's alike."""
    import jax

    return jax.device_get(jax.jit(_init_apply(model)[0])(jax.random.key(0)))


def _floor_runner(model: str, x, y, devices=None):
    """The hand-written floor: jax.jit with NamedShardings, donation, device-resident data,
    over `devices` (every device by default)."""
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    apply = _init_apply(model)[1]
    devices = jax.devices() if devices is None else devices
    mesh = jax.make_mesh(
        (len(devices),), ("replica",), axis_types=(AxisType.Auto,), devices=devices
    )
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))
    state = jax.device_put(initial_state(model), replicated)
    step = jax.jit(
        common.make_train_step(apply),
        in_shardings=(replicated, split, split),
        out_shardings=(replicated, replicated),
        donate_argnums=0,
    )
    x, y = jax.device_put((x, y), split)
    box = [state]

    def run(steps):
        state, queued = box[0], []
        for _ in range(steps):
            state, loss = step(state, x, y)
            # XLA:CPU aborts when too many collective steps are queued (see
            # spmd._src.strategy.step.CPU_MAX_IN_FLIGHT): the floor keeps the same short queue.
            queued.append(loss)
            if len(queued) > 4:
                queued.pop(0).block_until_ready()
        box[0] = jax.block_until_ready(state)

    return run


def _spmd_runner(strategy, model: str, x, y):
    import jax

    state = strategy.put(initial_state(model))
    step = strategy.step(common.make_train_step(_init_apply(model)[1]))
    x, y = strategy.distribute_batch((x, y))
    box = [state]

    def run(steps):
        state = box[0]
        for _ in range(steps):
            state, loss = step(state, x, y)
        box[0] = jax.block_until_ready(state)

    return run


@functools.cache
def overhead_times(model: str, quick: bool) -> dict[str, dict]:
    """`common.timeit` of the floor and spmd's MirroredStrategy step on `model`, 8 devices.

    Cached: the quick run's peers table (bench_peers) reads this same run's figures
    instead of compiling and timing the same two steps again.
    """
    import spmd

    steps = {"cnn": 5 if quick else 20, "tiny": 50 if quick else 500}[model]
    x, y = common.batch(model, GLOBAL_BATCH)
    return common.timeit(
        {
            "floor": _floor_runner(model, x, y),
            "spmd": _spmd_runner(spmd.MirroredStrategy(), model, x, y),
        },
        steps=steps,
        repeats=3 if quick else 7,
    )


def step_overhead(quick: bool) -> list[dict]:
    """spmd's MirroredStrategy step vs the hand-written floor, CNN and tiny model."""
    rows = []
    for model in ("cnn", "tiny"):
        times = overhead_times(model, quick)
        rows.append(
            {
                "benchmark": "step overhead",
                "case": f"{model}, MirroredStrategy, 8 devices",
                "floor": common.fmt_time(times["floor"]),
                "spmd": common.fmt_time(times["spmd"]),
                "ratio": common.ratio(times["spmd"], times["floor"]),
                "target": "≤ 1.02x" if model == "cnn" else "≤ 1.05x",
            }
        )
    return rows


def steps_per_execution(
    quick: bool, strategy=None, label: str = "MirroredStrategy, 8 devices", devices=None
) -> list[dict]:
    """The tiny model with K batches per compiled call (a scan), against the floor's one,
    on `strategy` (MirroredStrategy by default) and the floor over the same `devices`."""
    import jax
    import numpy as np

    import spmd

    strategy = strategy or spmd.MirroredStrategy()
    init, apply, _, _ = common.MODELS["tiny"]
    train_step = common.make_train_step(apply)
    x, y = common.batch("tiny", GLOBAL_BATCH)
    runners = {"floor": _floor_runner("tiny", x, y, devices)}
    for k in (1, 8, 32):

        def many(state, xs, ys):
            return jax.lax.scan(lambda s, b: train_step(s, *b), state, (xs, ys))

        step = strategy.step(many, batch_axis=1)
        data = strategy.distribute_batch((np.stack([x] * k), np.stack([y] * k)), axis=1)
        box = [strategy.init(init, jax.random.key(0))]

        def run(steps, k=k, step=step, data=data, box=box):
            state = box[0]
            for _ in range(max(1, steps // k)):
                state, _ = step(state, *data)
            box[0] = jax.block_until_ready(state)

        runners[f"K={k}"] = run
    # each runner reports seconds per call of `steps // k` calls; normalise to per step
    times = common.timeit(runners, steps=64 if quick else 256, repeats=3 if quick else 7)
    rows = []
    for name, t in times.items():
        if name == "floor":
            continue
        k = int(name[2:])
        n = 64 if quick else 256
        per_step = common.scaled(t, n / (max(1, n // k) * k))
        rows.append(
            {
                "benchmark": "steps_per_execution",
                "case": f"tiny, {name}, {label}",
                "floor": common.fmt_time(times["floor"]),
                "spmd": common.fmt_time(per_step),
                "ratio": common.ratio(per_step, times["floor"]),
                "target": "≤ 0.33x at K=32 (≥ 3x throughput)" if k == 32 else "",
            }
        )
    return rows


def _big_init(key, width: int = 1024):
    """A 4-layer `width`-wide MLP with momentum: ~8.4 M parameters, ~67 MB of state at 1024
    (the full run), a quarter of that at the quick run's 512."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(key, 4)
    params = {
        f"layer{i}": {
            "kernel": jax.random.normal(k, (width, width)) * 0.03,
            "bias": jnp.zeros(width),
        }
        for i, k in enumerate(keys)
    }
    return {"params": params, "opt": common.TX.init(params)}


def _big_apply(params, x):
    import jax

    for i in range(4):
        x = jax.nn.relu(x @ params[f"layer{i}"]["kernel"] + params[f"layer{i}"]["bias"])
    return x


def strategies_side_by_side(quick: bool) -> list[dict]:
    """Step time and per-device state bytes for each strategy on a model large enough to matter."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import spmd

    strategies = {
        "Mirrored": spmd.MirroredStrategy(),
        "CentralStorage": spmd.CentralStorageStrategy(),
        "ParameterServer (MinSize 256 KiB)": spmd.ParameterServerStrategy(
            spmd.partitioners.MinSizePartitioner()
        ),
        "2-D data x model": spmd.Strategy(
            spmd.make_mesh({"data": -1, "model": 2}),
            rules=[(r".*kernel", P(None, "model"))],
            batch_axes=("data",),
        ),
    }
    # quick: the same strategies, rows and columns, smaller (a 1 MiB kernel still makes
    # ParameterServerStrategy's MinSizePartitioner split it in four)
    width = 512 if quick else 1024
    create = functools.partial(_big_init, width=width)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH, width)).astype(np.float32)
    y = rng.integers(0, width, size=GLOBAL_BATCH).astype(np.int32)
    train_step = common.make_train_step(_big_apply)
    # the state made once and placed by each strategy (what init would make, without
    # compiling a create program per layout: the table is about the step and its state)
    made = jax.device_get(jax.jit(create)(jax.random.key(0)))
    runners, reports = {}, {}
    for name, strategy in strategies.items():
        reports[name] = strategy.explain(
            train_step, strategy.abstract_state(create, jax.random.key(0)), x, y
        )
        state = strategy.put(made)
        step = strategy.step(train_step)
        data = strategy.distribute_batch((x, y))

        def run(steps, state=[state], step=step, data=data):  # noqa: B006 - a box per runner
            for _ in range(steps):
                state[0], _ = step(state[0], *data)
            jax.block_until_ready(state[0])

        runners[name] = run
    times = common.timeit(runners, steps=2 if quick else 5, repeats=2 if quick else 5)
    base = reports["Mirrored"].state_bytes
    rows = []
    for name, report in reports.items():
        device_mb = report.state_bytes / 2**20
        rows.append(
            {
                "benchmark": "strategies",
                "case": name,
                "step": common.fmt_time(times[name]),
                "ratio": common.ratio(times[name], times["Mirrored"]),
                "state/device": f"{device_mb:.1f} MiB"
                + (f" ({report.state_bytes / base:.3f} of mirrored)" if base else ""),
                "state/host": f"{report.state_host_bytes / 2**20:.1f} MiB",
                "temporaries": f"{report.temp_bytes / 2**20:.1f} MiB",
                "collectives": ", ".join(
                    f"{c.kind} x{c.count}" for c in report.collectives.values()
                )
                or "none",
            }
        )
    return rows


def _nnx_runners(strategy, x, y) -> dict:
    """The same small MLP trained three ways: NNX objects and a pytree under spmd, and nnx.jit."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(x.shape[1], 32, rngs=rngs)
            self.l2 = nnx.Linear(32, y.shape[1], rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))

    tx = optax.adam(1e-3)

    def nnx_create():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    def nnx_update(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)
        return loss

    graphdef = nnx.split(MLP(nnx.Rngs(0)))[0]

    def pytree_create():
        params = nnx.state(MLP(nnx.Rngs(0)))
        return {"params": params, "opt": tx.init(params)}

    def pytree_step(state, x, y):
        def loss_fn(params):
            return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    # each state made eagerly and placed by the strategy (what init would make, without a
    # create program compiled per state and strategy: the rows are about the step's calls)
    nnx_state, jit_state = strategy.put(nnx_create()), nnx_create()
    nnx_step, jit_step = strategy.step(lambda s, x, y: nnx_update(*s, x, y)), nnx.jit(nnx_update)
    box = [strategy.put(pytree_create())]
    py_step = strategy.step(pytree_step)
    xs, ys = strategy.distribute_batch((x, y))

    def run_pytree(steps):
        state = box[0]
        for _ in range(steps):
            state, loss = py_step(state, xs, ys)
        box[0] = jax.block_until_ready(state)

    def run_nnx(steps):
        for _ in range(steps):
            loss = nnx_step(nnx_state, xs, ys)
        jax.block_until_ready(loss)

    def run_jit(steps):
        for _ in range(steps):
            loss = jit_step(*jit_state, xs, ys)
        jax.block_until_ready(loss)

    return {"pytree": run_pytree, "nnx": run_nnx, "nnx.jit": run_jit}


def nnx_state_overhead(quick: bool) -> list[dict]:
    """Per-call cost of a step whose state is NNX objects, against a pytree state and nnx.jit."""
    import numpy as np

    import spmd

    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH, 16)).astype(np.float32)
    y = rng.normal(size=(GLOBAL_BATCH, 4)).astype(np.float32)
    rows = []
    for name, strategy in (
        ("OneDeviceStrategy", spmd.OneDeviceStrategy()),
        ("MirroredStrategy, 8 devices", spmd.MirroredStrategy()),
    ):
        times = common.timeit(
            _nnx_runners(strategy, x, y), steps=20 if quick else 500, repeats=3 if quick else 7
        )
        rows.append(
            {
                "benchmark": "NNX state",
                "case": f"small MLP, adam, {name}",
                "pytree": common.fmt_time(times["pytree"]),
                "NNX": common.fmt_time(times["nnx"]),
                "nnx.jit": common.fmt_time(times["nnx.jit"]),
                "NNX / pytree": common.ratio(times["nnx"], times["pytree"]),
                "NNX / nnx.jit": common.ratio(times["nnx"], times["nnx.jit"]),
                "target": "≤ 1.2x pytree, < 1x nnx.jit",
            }
        )
    return rows


def main(quick: bool = False) -> list[dict]:
    """Every benchmark of this file, as table rows."""
    return (
        step_overhead(quick)
        + nnx_state_overhead(quick)
        + steps_per_execution(quick)
        + strategies_side_by_side(quick)
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    common.set_cpu_devices(8)
    rows = main(args.quick)
    overhead = [r for r in rows if r["benchmark"] in ("step overhead", "steps_per_execution")]
    print(common.table(overhead, ["case", "floor", "spmd", "ratio", "target"]))
    print()
    nnx_rows = [r for r in rows if r["benchmark"] == "NNX state"]
    print(
        common.table(
            nnx_rows,
            ["case", "pytree", "NNX", "nnx.jit", "NNX / pytree", "NNX / nnx.jit", "target"],
        )
    )
    print()
    side = [r for r in rows if r["benchmark"] == "strategies"]
    print(
        common.table(
            side,
            ["case", "step", "ratio", "state/device", "state/host", "temporaries", "collectives"],
        )
    )
