"""spmd.attention (context parallel) against jax.nn.dot_product_attention on the same devices.

Two tables:

- step time: forward and gradients of causal grouped-query attention over the
  eight devices: the floor is `jax.jit` of `jax.nn.dot_product_attention` with the
  batch split over all eight (data parallel, the whole sequence on each device);
  spmd.attention splits the same global batch over {data: 2, context: 4}.
- memory: `strategy.explain`'s peak per device of a training step whose
  attention is spmd.attention, on a v5p-16 (the TPU compiler, no TPU), as the
  context axis grows, one sequence per data replica.

Run: python bench/bench_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import common
else:
    from bench import common

HEADS, KV_HEADS, HEAD_DIM, WIDTH = 8, 2, 64, 512


def _qkv(batch: int, length: int):
    import jax

    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(batch, length, HEADS, HEAD_DIM)] + [(batch, length, KV_HEADS, HEAD_DIM)] * 2
    return [jax.random.normal(k, s) for k, s in zip(keys, shapes, strict=True)]


def _runner(attend, mesh, spec, args):
    """run(steps): forward and gradients of sum(attend(q, k, v)^2), args placed by `spec`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2), (0, 1, 2)))
    with jax.set_mesh(mesh):
        placed = jax.device_put(args, NamedSharding(mesh, spec))

    def run(steps):
        with jax.set_mesh(mesh):
            for _ in range(steps):
                out = grad(*placed)
            jax.block_until_ready(out)

    return run


def step_time(quick: bool) -> list[dict]:
    import jax
    from jax.sharding import PartitionSpec as P

    import spmd

    rows = []
    for length in (256,) if quick else (512, 1024):
        args = _qkv(8, length)
        data = spmd.make_mesh({"data": 8})
        context = spmd.make_mesh({"data": 2, "context": 4})
        plain = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        ours = lambda q, k, v: spmd.attention(q, k, v, causal=True)  # noqa: E731
        runners = {
            "floor": _runner(plain, data, P("data"), args),
            "spmd": _runner(ours, context, P("data", "context"), args),
        }
        t = common.timeit(runners, steps=2 if quick else 5, repeats=2 if quick else 5)
        rows.append(
            {
                "benchmark": "context-parallel attention: step time",
                "case": f"batch 8, length {length}, heads {HEADS}/{KV_HEADS}, causal",
                "floor (data 8)": common.fmt_time(t["floor"]),
                "spmd.attention (data 2 x context 4)": common.fmt_time(t["spmd"]),
                "ratio": common.ratio(t["spmd"], t["floor"]),
            }
        )
    return rows


def peak_bytes(length: int, context: int, devices) -> int:
    """explain's peak per device of a train step of one attention layer, batch 1 per replica."""
    import jax
    import jax.numpy as jnp

    import spmd

    def create(key):
        a, b = jax.random.split(key)
        width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        return {
            "wqkv": jax.random.normal(a, (WIDTH, width), jnp.bfloat16),
            "wo": jax.random.normal(b, (HEADS * HEAD_DIM, WIDTH), jnp.bfloat16),
        }

    def step(p, x):
        def loss(p):
            b, n, _ = x.shape
            qkv = (x @ p["wqkv"]).reshape(b, n, HEADS + 2 * KV_HEADS, HEAD_DIM)
            q, k, v = jnp.split(qkv, [HEADS, HEADS + KV_HEADS], axis=2)
            out = spmd.attention(q, k, v, causal=True).reshape(b, n, -1) @ p["wo"]
            return jnp.mean(out.astype(jnp.float32) ** 2)

        value, grads = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda w, g: w - 1e-3 * g, p, grads), {"loss": value}

    mesh = spmd.make_mesh({"data": 1, "context": context}, devices=list(devices)[:context])
    strategy = spmd.Strategy(mesh=mesh, batch_axes=("data",))
    state = strategy.abstract_state(create, jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, length, WIDTH), jnp.bfloat16)
    return strategy.explain(step, state, x).peak_bytes


def memory(quick: bool) -> list[dict]:
    import spmd

    topology = spmd.topology("v5p-16")
    # quick: 512, where context 4 already shows (0.41x); its compiles ~10 s of CPU, 2048's ~40.
    length = 512 if quick else 16384
    base, rows = None, []
    for context in (1, 4) if quick else (1, 2, 4, 8):
        peak = peak_bytes(length, context, topology)
        base = base or peak
        rows.append(
            {
                "benchmark": "context-parallel attention: memory per device (v5p-16, explain)",
                "case": f"length {length}, context {context}",
                "peak per device": f"{peak / 2**20:,.0f} MiB",
                "vs context 1": f"{peak / base:.2f}x",
            }
        )
    return rows


def main(quick: bool = False) -> list[dict]:
    """Every benchmark of this file, as table rows."""
    return step_time(quick) + memory(quick)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    common.set_cpu_devices(8)
    rows = main(args.quick)
    for name in dict.fromkeys(r["benchmark"] for r in rows):
        group = [r for r in rows if r["benchmark"] == name]
        columns = [c for c in group[0] if c != "benchmark"]
        print(f"## {name}\n\n{common.table(group, columns)}\n")
