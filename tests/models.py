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
