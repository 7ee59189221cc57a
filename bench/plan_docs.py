"""The plan tables of docs/planning.md, written by the plans that make them.

    python -m bench.plan_docs               # compile the plans, store them, rewrite the tables
    python -m bench.plan_docs --from-store  # rewrite the tables from bench/plan_docs.json only

Each table sits in docs/planning.md between `<!-- plan table NAME ... -->` and
`<!-- end of plan table NAME -->`. A run stores each plan (its printed table,
`Plan.to_dict()`, the date and the seconds it took) in bench/plan_docs.json;
tests/test_plan_docs_tables.py checks that the doc holds what the store gives.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "planning.md"
STORE = ROOT / "bench" / "plan_docs.json"


def _adam_mlp(widths: list[int]) -> tuple[Callable, Callable]:
    """An MLP of float32 matrices between these widths (tanh between), trained with Adam."""
    import jax
    import jax.numpy as jnp
    import optax

    def create(key):
        keys = jax.random.split(key, len(widths) - 1)
        params = {
            f"w{i}": jax.random.normal(k, (a, b)) * 0.01
            for i, (k, a, b) in enumerate(zip(keys, widths, widths[1:], strict=False))
        }
        return {"params": params, "opt": optax.adam(1e-3).init(params)}

    def step(state, x):
        def loss(p):
            h = x
            for i in range(len(widths) - 1):
                h = jnp.tanh(h @ p[f"w{i}"])
            return (h**2).mean()

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = optax.adam(1e-3).update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, value

    return create, step


def _mlp_on_two_v5e_pods():
    import jax
    import jax.numpy as jnp

    create, step = _adam_mlp([1024, 4096, 1024])
    return create, step, jax.ShapeDtypeStruct((1024, 1024), jnp.float32), "v5e:16x16", 2


def _too_big_for_plain_fsdp():
    import jax
    import jax.numpy as jnp

    create, step = _adam_mlp([16384] * 25)  # 24 matrices: 24 GiB of weights, 48 GiB of moments
    return create, step, jax.ShapeDtypeStruct((64, 16384), jnp.float32), "v5e:2x2", 1


# name -> what the plan is of (a function: create_fn, step, batch, target, slices)
PLANS: dict[str, Callable] = {
    "mlp-on-two-v5e-pods": _mlp_on_two_v5e_pods,
    "too-big-for-plain-fsdp": _too_big_for_plain_fsdp,
}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- plan table {name}: python -m bench.plan_docs -->", (
        f"<!-- end of plan table {name} -->"
    )


def block(entry: dict) -> str:
    """The markdown a stored plan is shown as (the table's padding cut at each line's end)."""
    table = "\n".join(line.rstrip() for line in entry["table"].splitlines())
    return "```\n" + table + "\n```"


def rewrite(doc: str, store: dict) -> str:
    """`doc` with every marked table replaced by the store's."""
    for name, entry in store.items():
        begin, end = _markers(name)
        pattern = re.compile(re.escape(begin) + r"\n.*?\n" + re.escape(end), re.S)
        if not pattern.search(doc):
            raise SystemExit(f"docs/planning.md has no table {name}: add {begin} ... {end}")
        text = f"{begin}\n{block(entry)}\n{end}"
        doc = pattern.sub(lambda _, text=text: text, doc)
    return doc


def run(name: str) -> dict:
    """Compiles one plan; its table, data, date and seconds."""
    import spmd
    from spmd._src.plan_compile import default_jobs

    create, step, batch, target, slices = PLANS[name]()
    start = time.perf_counter()
    _, plan = spmd.auto_strategy(create, step, batch, target, slices=slices, jobs=default_jobs())
    return {
        "table": str(plan),
        "plan": plan.to_dict(),
        "date": datetime.date.today().isoformat(),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-store", action="store_true", help="rewrite only, compile nothing")
    parser.add_argument("names", nargs="*", help=f"plans to compile (default all: {list(PLANS)})")
    args = parser.parse_args(argv)
    store = json.loads(STORE.read_text()) if STORE.exists() else {}
    if not args.from_store:
        for name in args.names or PLANS:
            store[name] = run(name)
            print(store[name]["table"], f"\n({store[name]['seconds']} s)", flush=True)
        STORE.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")
    DOC.write_text(rewrite(DOC.read_text(), store))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
