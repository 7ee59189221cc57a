"""Models, data and the NNX update step that many test files share.

`MLP` is the classifier the Trainer tests fit; `LogicalMLP` is flax's GSPMD
guide's DotReluDot annotated with logical axis names; `labelled` makes the rows
they learn; `nnx_update` is one optimizer step of a `(model, optimizer)`
state, as a step function or its `nnx.jit` oracle runs it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

INIT = nnx.initializers.lecun_normal()


class MLP(nnx.Module):
    """`features` -> `hidden` (relu) -> `outputs` logits."""

    def __init__(
        self, rngs: nnx.Rngs, *, features: int = 6, hidden: int = 16, outputs: int = 3
    ) -> None:
        self.hidden = nnx.Linear(features, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, outputs, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.relu(self.hidden(x)))


class LogicalMLP(nnx.Module):
    """flax's GSPMD guide's DotReluDot, annotated for tensor parallelism with logical
    names: ("embed", "mlp") up, ("mlp", "embed") down; 8 features in and out."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(
            8, 16, kernel_init=nnx.with_partitioning(INIT, ("embed", "mlp")), rngs=rngs
        )
        self.w = nnx.Param(nnx.with_partitioning(INIT, ("mlp", "embed"))(rngs.params(), (16, 8)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.relu(self.up(x)) @ self.w[...]


def labelled(
    n: int, features: int = 6, classes: int = 3, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """`n` rows of standard normal float32 features, and int32 labels read off them:
    `x[:, 0] > 0` (2 classes), plus `x[:, 1] > 0.5` (3 classes)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    if classes == 3:
        y = y + (x[:, 1] > 0.5).astype(np.int32)
    return x, y


def mse(model: nnx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
    """The mean squared error of `model(x)` against `y`."""
    return jnp.mean((model(x) - y) ** 2)


def xent(model: nnx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
    """The mean cross-entropy of `model(x)`'s logits against integer labels `y`."""
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def nnx_update(
    model: nnx.Module, optimizer: nnx.Optimizer, loss: Callable[..., jax.Array], *args
) -> jax.Array:
    """One step of `optimizer` on `loss(model, *args)`, in place; returns the loss."""
    value, grads = nnx.value_and_grad(loss)(model, *args)
    optimizer.update(model, grads)
    return value


LM = {"vocab": 32, "length": 16, "width": 16, "heads": 4, "kv_heads": 2}


def lm_create(key: jax.Array, inner: str = "adamw") -> dict:
    """A one-block causal transformer LM's parameters (grouped-query attention through
    `spmd.attention`) and its optimizer state: {"params", "opt"}."""
    v, n, d, h, kh = (LM[k] for k in ("vocab", "length", "width", "heads", "kv_heads"))
    shapes = {
        "embed": (v, d), "pos": (n, d), "wq": (d, d), "wk": (d, d * kh // h),
        "wv": (d, d * kh // h), "wo": (d, d), "up": (d, 2 * d), "down": (2 * d, d), "out": (d, v),
    }  # fmt: skip
    keys = jax.random.split(key, len(shapes))
    params = {
        name: jax.random.normal(k, s) / np.sqrt(s[0])
        for k, (name, s) in zip(keys, shapes.items(), strict=True)
    }
    return {"params": params, "opt": INNER_LM[inner].init(params)}


INNER_LM = {"adamw": optax.adamw(1e-2), "sgd": optax.sgd(0.5)}


def lm_logits(p: dict, tokens: jax.Array) -> jax.Array:
    """[batch, length] tokens -> [batch, length, vocab] next-token logits."""
    import spmd

    b, n = tokens.shape
    h, kh = LM["heads"], LM["kv_heads"]
    x = p["embed"][tokens] + p["pos"][:n]
    q, k, v = ((x @ p[w]).reshape(b, n, heads, -1) for w, heads in
               (("wq", h), ("wk", kh), ("wv", kh)))  # fmt: skip
    x = x + spmd.attention(q, k, v, causal=True).reshape(b, n, -1) @ p["wo"]
    x = x + jax.nn.gelu(x @ p["up"]) @ p["down"]
    return x @ p["out"]


def lm_loss(p: dict, tokens: jax.Array) -> jax.Array:
    """The mean next-token cross-entropy of `tokens`."""
    logits = lm_logits(p, tokens)[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def lm_step(inner: str = "adamw") -> Callable:
    """One optimizer step of the LM on a [batch, length] token batch."""

    def train_step(state: dict, tokens: jax.Array) -> tuple[dict, dict]:
        loss, grads = jax.value_and_grad(lm_loss)(state["params"], tokens)
        updates, opt = INNER_LM[inner].update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    return train_step


def lm_batches(steps: int, batch: int = 8, seed: int = 0) -> list[np.ndarray]:
    """`steps` batches of token rows that count up by a row's own stride (learnable)."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, LM["vocab"], (steps, batch, 1))
    stride = rng.integers(1, 4, (steps, batch, 1))
    return list(((start + stride * np.arange(LM["length"])) % LM["vocab"]).astype(np.int32))


def oracle_compiled(fn: Callable, *args) -> Callable:
    """`fn` jitted on one device for `args`, compiled without LLVM's optimizations.

    The one-device oracle's HLO programs are the same; its CPU compile takes about half the
    time, and its float32 numbers move by about 1e-7 relative: far inside the oracle
    comparisons' tolerances (rtol 1e-5 or looser).
    """
    return jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})
