"""The collectives of a small transformer's step, split into those that cross hosts and those that don't.

`python -m bench.scale_explain N` prints the rows for N simulated CPU devices
as JSON. docs/scale.md quotes them; tests/test_docs_scale.py recomputes them.
The mesh is (host, replica): 2 hosts for 8 devices, N/8 hosts of 8 above; a
device belongs to host `position // devices_per_host`, as `make_mesh` orders
them (hosts outermost).
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

import numpy as np

VOCAB, WIDTH, LAYERS, SEQ = 512, 128, 2, 64
MATRICES = r".*(qkv|out|up|down|embed)$"
_GROUPS = re.compile(
    r"replica_groups=(?P<groups>\{[\d,{}]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|mesh\[[^\]]*\](?:, device_ids=\(\[[\d,]+\](?:T\([\d,]+\))?\))? \{[^}]*\})"
)
_COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all)(-start)?\(")


def parameter_count() -> int:
    """Parameters of the model: tied embedding, per layer qkv, out, up, down and two norms."""
    return VOCAB * WIDTH + LAYERS * (12 * WIDTH * WIDTH + 2 * WIDTH)


def create(key: Any) -> dict:
    """Parameters and Adam state."""
    import jax
    import jax.numpy as jnp
    import optax

    keys = jax.random.split(key, 1 + LAYERS)
    params: dict[str, Any] = {"embed": jax.random.normal(keys[0], (VOCAB, WIDTH)) * 0.02}
    shapes = {"qkv": (WIDTH, 3 * WIDTH), "out": (WIDTH, WIDTH), "up": (WIDTH, 4 * WIDTH)}
    shapes["down"] = (4 * WIDTH, WIDTH)
    for i in range(LAYERS):
        ks = jax.random.split(keys[i + 1], len(shapes))
        layer = {
            n: jax.random.normal(k, s) * 0.02 for (n, s), k in zip(shapes.items(), ks, strict=True)
        }
        params[f"layer{i}"] = {**layer, "norm1": jnp.ones(WIDTH), "norm2": jnp.ones(WIDTH)}
    return {"params": params, "opt": optax.adam(1e-3).init(params)}


def _forward(params: dict, tokens: Any) -> Any:
    import jax
    import jax.numpy as jnp

    x = params["embed"][tokens]
    for i in range(LAYERS):
        layer = params[f"layer{i}"]
        q, k, v = jnp.split((x * layer["norm1"]) @ layer["qkv"], 3, -1)
        x = x + jax.nn.softmax(q @ k.swapaxes(-1, -2) / math.sqrt(WIDTH), -1) @ v @ layer["out"]
        x = x + jax.nn.gelu((x * layer["norm2"]) @ layer["up"]) @ layer["down"]
    return x @ params["embed"].T


def train_step(state: dict, tokens: Any) -> tuple[dict, Any]:
    """One Adam step of next-token cross-entropy."""
    import jax
    import optax

    def loss(params):
        logits = _forward(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    value, grads = jax.value_and_grad(loss)(state["params"])
    updates, opt = optax.adam(1e-3).update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, value


def strategies(num_devices: int) -> dict[str, Any]:
    """Data parallel, HSDP (sharded inside a host, replicated across) and FSDP over every device."""
    from jax.sharding import PartitionSpec as P

    import spmd

    hosts = 2 if num_devices <= 8 else num_devices // 8
    mesh = spmd.make_mesh({"host": hosts, "replica": num_devices // hosts})
    batch = ("host", "replica")
    return {
        "data parallel": spmd.Strategy(mesh, batch_axes=batch),
        "HSDP": spmd.Strategy(mesh, rules=[(MATRICES, P("replica", None))], batch_axes=batch),
        "FSDP": spmd.Strategy(mesh, rules=[(MATRICES, P(batch, None))], batch_axes=batch),
    }


def groups(line: str) -> np.ndarray:
    """The replica groups of one HLO collective, as a (groups, size) array of mesh positions."""
    match = _GROUPS.search(line)
    if match is None:
        raise ValueError(f"no replica_groups this parser reads in: {line[:300]}")
    text = match["groups"]
    if text.startswith("{"):
        rows = [
            [int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", text[1:-1])
        ]
        return np.asarray(rows)
    if text.startswith("["):
        shape, dims, perm = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text).groups()
        return _iota(dims, perm).reshape([int(s) for s in shape.split(",")])
    axes = re.findall(r"'(\w+)'=(\d+)", text.split("]")[0])
    sizes = [int(s) for _, s in axes]
    ids = re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", text)
    order = _iota(*ids.groups()) if ids else np.arange(math.prod(sizes))
    order = order.reshape(sizes)
    grouped = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in text.split("{", 1)[1]]
    rest = [i for i in range(len(sizes)) if i not in grouped]
    return order.transpose(rest + grouped).reshape(-1, math.prod(sizes[i] for i in grouped))


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    array = np.arange(math.prod(shape)).reshape(shape)
    return (array.transpose([int(p) for p in perm.split(",")]) if perm else array).reshape(-1)


def split_by_network(hlo: str, devices_per_host: int) -> dict[str, dict[str, int]]:
    """Bytes each device produces per step, by kind, for collectives inside one host or across hosts."""
    from spmd._src.explain import parse_collectives

    out: dict[str, dict[str, int]] = {"across hosts": {}, "inside a host": {}}
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if not match or "-done(" in line:
            continue
        hosts = groups(line) // devices_per_host
        where = "across hosts" if (hosts != hosts[:, :1]).any() else "inside a host"
        found = parse_collectives(line)
        for kind, collective in found.items():
            out[where][kind] = out[where].get(kind, 0) + collective.bytes
    return out


def rows(num_devices: int) -> list[dict[str, Any]]:
    """One row per strategy: explain's totals and the same bytes split by network."""
    import jax
    import jax.numpy as jnp

    tokens = jax.ShapeDtypeStruct((2 * num_devices, SEQ + 1), jnp.int32)
    result = []
    for name, strategy in strategies(num_devices).items():
        report = strategy.explain(
            train_step, strategy.abstract_state(create, jax.random.key(0)), tokens
        )
        per_host = strategy.mesh.shape["replica"]
        split = split_by_network(report.hlo, per_host)
        result.append(
            {
                "devices": num_devices,
                "hosts": strategy.mesh.shape["host"],
                "strategy": name,
                "state_bytes": report.state_bytes,
                "collectives": {k: c.bytes for k, c in sorted(report.collectives.items())},
                "across_hosts": sum(split["across hosts"].values()),
                "inside_host": sum(split["inside a host"].values()),
            }
        )
    return result


if __name__ == "__main__":
    import jax

    jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
    print(json.dumps(rows(int(sys.argv[1]))))
