"""Does `spmd.auto_strategy`'s ranking on CPU devices match the candidates' measured step times?

    python -m bench.bench_plan [--devices 8] [--steps 20] [--quick]
    python -m bench --only bench_plan [--quick]   (its rows in docs/performance.md)

Ranks the candidate layouts of an MLP with AdamW on this process's simulated
CPU devices (the roofline with this machine's measured figures), then runs
each candidate's step and times it (median of --steps calls after two warm-up
calls), and prints both with the rank correlation (Spearman's rho) between
the estimate and the measurement. Not a test: timings depend on the machine
and its load. docs/planning.md quotes a run. `--quick` (the bench smoke
test) ranks and times two layouts of a narrow MLP for 3 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    if n < 2:
        return 1.0
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True))
    return 1 - 6 * d2 / (n * (n * n - 1))


def measure(width: int = 2048, steps: int = 20, only: list[str] | None = None) -> dict:
    """Ranks the layouts on this process's devices, times each; the estimates beside the times."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import spmd

    def create(key):
        k1, k2, k3 = jax.random.split(key, 3)
        params = {
            "w1": jax.random.normal(k1, (512, width)) * 0.02,
            "w2": jax.random.normal(k2, (width, width)) * 0.02,
            "w3": jax.random.normal(k3, (width, 512)) * 0.02,
        }
        return {"params": params, "opt": optax.adamw(1e-3).init(params)}

    def step(state, x):
        def loss(p):
            h = jnp.tanh(x @ p["w1"])
            h = jnp.tanh(h @ p["w2"])
            return ((h @ p["w3"] - x) ** 2).mean()

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = optax.adamw(1e-3).update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {
            "loss": value
        }

    batch = np.random.default_rng(0).normal(size=(256, 512)).astype(np.float32)
    shape = (jax.ShapeDtypeStruct(batch.shape, batch.dtype),)
    _, plan = spmd.auto_strategy(create, step, shape, only=only)
    print(plan)
    rows = []
    for candidate in plan.ranked:
        strategy = candidate.strategy
        train = strategy.step(step)
        state = strategy.init(create, jax.random.key(0))
        x = strategy.distribute_batch(batch)
        for _ in range(2):
            state, metrics = train(state, x)
        jax.block_until_ready(metrics)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            state, metrics = train(state, x)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - start)
        rows.append(
            {
                "layout": candidate.name,
                "estimate_ms": round(candidate.step_seconds * 1e3, 3),
                "measured_ms": round(statistics.median(times) * 1e3, 3),
            }
        )
    rho = _spearman([r["estimate_ms"] for r in rows], [r["measured_ms"] for r in rows])
    best_measured = min(rows, key=lambda r: r["measured_ms"])
    return {
        "spearman_rho": round(rho, 3),
        "estimated_best": rows[0]["layout"],
        "measured_best": best_measured["layout"],
        "estimated_best_measured_ms": rows[0]["measured_ms"],
        "measured_best_ms": best_measured["measured_ms"],
        "rows": rows,
    }


def main(quick: bool = False) -> list[dict]:
    """`python -m bench`'s rows: each layout's estimate beside its measured step."""
    if quick:
        result = measure(width=256, steps=3, only=["data parallel", "FSDP over 8"])
    else:
        result = measure()
    name = f"auto_strategy's estimate against the measured step (rank correlation {result['spearman_rho']})"
    return [
        {
            "benchmark": name,
            "layout": r["layout"],
            "estimate (ms)": f"{r['estimate_ms']:.3f}",
            "measured (ms)": f"{r['measured_ms']:.3f}",
            "chosen": "yes" if r["layout"] == result["estimated_best"] else "",
        }
        for r in result["rows"]
    ]


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="two layouts, narrow, 3 steps")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    if args.quick:
        result = measure(width=256, steps=3, only=["data parallel", "FSDP over 8"])
    else:
        result = measure(args.width, args.steps)
    print(f"{'layout':<20} {'estimate ms':>12} {'measured ms':>12}")
    for r in result["rows"]:
        print(f"{r['layout']:<20} {r['estimate_ms']:>12.3f} {r['measured_ms']:>12.3f}")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
