"""DiLoCo written from the paper in plain JAX, on one device: the oracle of spmd.DiLoCo's tests.

Douillard et al. 2023, Algorithm 1: k islands each take H inner steps from the
global parameters on their own data; the outer gradient is the global parameters
minus each island's, averaged over islands; the outer optimizer (SGD with Nesterov
momentum) steps the global parameters; every island restarts from them and keeps
its inner optimizer state. Streaming DiLoCo: the parameters are cut into
fragments (contiguous runs of leaves), fragment f synchronised at steps
f*H/F (mod H), each with its own outer optimizer state: the outer optimizer,
wrapped in `optax.masked` to the fragment's leaves, sees the whole parameter tree
(an optimizer choosing leaves by path works as written). Islands are a Python loop.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

IN, HIDDEN, OUT = 8, 16, 4
INNER = {"sgd": optax.sgd(0.1), "adamw": optax.adamw(3e-2, weight_decay=1e-2)}
OUTER = optax.sgd(0.7, momentum=0.9, nesterov=True)


def create(key, inner="adamw"):
    k1, k2 = jax.random.split(key)
    params = {
        "dense": {
            "kernel": jax.random.normal(k1, (IN, HIDDEN)) / IN**0.5,
            "bias": jnp.zeros(HIDDEN),
        },
        "out": {
            "kernel": jax.random.normal(k2, (HIDDEN, OUT)) / HIDDEN**0.5,
            "bias": jnp.zeros(OUT),
        },
    }
    return {"params": params, "opt": INNER[inner].init(params)}


# `create` as one compiled program: the reference's start, the values `create` makes
# (op by op, each of its operations would be compiled on its own).
initial = jax.jit(create, static_argnames="inner")


def logits(p, x):
    h = jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"])
    return h @ p["out"]["kernel"] + p["out"]["bias"]


def make_step(inner="adamw"):
    """The inner step of the paper: each island's loss is the mean over its own rows."""
    tx = INNER[inner]

    def train_step(state, x, y):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    return train_step


def batches(steps, batch=32, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(batch, IN)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int32) + 2 * (x[:, 1] > 0).astype(np.int32)
        out.append((x, y))
    return out


def _sync(outer, fragment, treedef, islands):
    """Fragment `fragment`'s outer step as one program: (global leaves, each island's
    leaves, outer state) -> (global leaves with the fragment's stepped, outer state)."""

    def sync(global_leaves, island_leaves, outer_state):
        current = jax.tree.unflatten(treedef, global_leaves)
        deltas = jax.tree.unflatten(
            treedef,
            [
                sum(global_leaves[j] - island_leaves[i][j] for i in range(islands)) / islands
                for j in range(len(global_leaves))
            ],
        )
        updates, outer_state = outer.update(deltas, outer_state, current)
        new = jax.tree.leaves(optax.apply_updates(current, updates))
        stepped = [new[j] if j in fragment else global_leaves[j] for j in range(len(new))]
        return stepped, outer_state

    return jax.jit(sync)


def reference(state, train_step, data, islands, sync_every, fragments=1, outer=OUTER):
    """Runs DiLoCo on one device; returns (global params, [island states], [losses per step]).

    The inner step and each fragment's outer step are each one jitted program (the
    algorithm as written, compiled once rather than dispatched op by op)."""
    step = jax.jit(train_step)
    leaves, treedef = jax.tree.flatten(state["params"])
    frags = [list(f) for f in np.array_split(np.arange(len(leaves)), fragments)]
    masks = [jax.tree.unflatten(treedef, [j in f for j in range(len(leaves))]) for f in frags]
    outers = [optax.masked(outer, mask) for mask in masks]
    syncs = [_sync(o, set(f), treedef, islands) for o, f in zip(outers, frags, strict=True)]
    global_leaves = list(leaves)
    outer_states = [jax.jit(o.init)(state["params"]) for o in outers]
    isl = [state] * islands
    losses = []
    for t, (x, y) in enumerate(data, 1):
        rows = len(x) // islands
        step_losses = []
        for i in range(islands):
            part = slice(i * rows, (i + 1) * rows)
            isl[i], metrics = step(isl[i], x[part], y[part])
            step_losses.append(float(metrics["loss"]))
        losses.append(step_losses)
        for f, frag in enumerate(frags):
            if t % sync_every != f * sync_every // fragments:
                continue
            island_leaves = [jax.tree.leaves(s["params"]) for s in isl]
            global_leaves, outer_states[f] = syncs[f](global_leaves, island_leaves, outer_states[f])
            for i in range(islands):
                own = jax.tree.leaves(isl[i]["params"])
                for j in frag:
                    own[j] = global_leaves[j]
                isl[i] = {**isl[i], "params": jax.tree.unflatten(treedef, own)}
    return jax.tree.unflatten(treedef, global_leaves), isl, losses
