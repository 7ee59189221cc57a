"""The Trainer's model as pure functions, and the small pure helpers of its steps."""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmd._src.errors import ConfigurationError, message, received
from spmd._src.placement import put_batch
from spmd._src.rules import path_str

if TYPE_CHECKING:
    from spmd._src.strategy.base import Strategy

__all__ = [
    "Model",
    "averages",
    "cast",
    "example_weights",
    "first_nan",
    "forward_failed",
    "stack",
    "wrap_model",
    "written",
]

_TRAIN_VIEW = {"deterministic": False, "use_running_average": False}
_EVAL_VIEW = {"deterministic": True, "use_running_average": True}
# The parts of the train state a step writes, in `written`'s order, as errors name them.
WRITTEN = {
    "params": "the parameter",
    "opt_state": "the optimizer state",
    "rest": "the model's other state",
}


@dataclass
class Model:
    """The user's model as pure functions of (params, rest)."""

    params: Any
    rest: Any
    apply: Callable[[Any, Any, jax.Array, bool], tuple[jax.Array, Any]]
    module: nnx.Module | None
    graph: Any = None  # what `rest` and `params` are the state of: the module, and its rngs


def wrap_model(model: Any, seed: int, rngs: nnx.Rngs | None = None) -> Model:
    """An NNX module, or an (init, apply) pair with init(key) -> params, apply(params, x)."""
    if isinstance(model, nnx.Module):
        return _wrap_module(model, seed, rngs)
    if isinstance(model, tuple) and len(model) == 2 and all(map(callable, model)):
        init, forward = model
        params = init(jax.random.key(seed))
        return Model(params, {}, lambda p, r, x, training: (forward(p, x), r), None)
    raise ConfigurationError(
        message(
            "A Trainer model is a flax nnx.Module, or a pair (init, apply) with "
            "init(key) -> params and apply(params, x) -> outputs.",
            received(model=type(model).__name__),
            "pass an nnx.Module, or e.g. (lambda k: net.init(k, x0), net.apply) for linen.",
        )
    )


def _wrap_module(model: nnx.Module, seed: int, rngs: nnx.Rngs | None) -> Model:
    """An NNX module as pure functions: train and eval views (`nnx.view`) of one state.

    Dropout and BatchNorm see `deterministic` / `use_running_average` as Keras's
    `training` says. Rngs the module holds are state like any other; a module
    whose `__call__` takes `rngs` is called with `rngs` (by default
    `nnx.Rngs(seed)`), whose counts are carried from step to step.
    """
    takes_rngs = "rngs" in inspect.signature(model.__call__).parameters
    views = {
        training: nnx.view(model, raise_if_not_found=False, **kw)
        for training, kw in ((True, _TRAIN_VIEW), (False, _EVAL_VIEW))
    }
    graphdefs = {t: nnx.split(v, nnx.Param, ...)[0] for t, v in views.items()}
    _, params, rest = nnx.split(model, nnx.Param, ...)
    if not takes_rngs:

        def apply(params, rest, x, training):
            # fresh Variables at this trace level (inside grad), so layers may update them
            live = nnx.merge(graphdefs[training], params, rest, copy=True)
            return live(x), nnx.split(live, nnx.Param, ...)[2]

        return Model(params, rest, apply, model, model)

    rngs = rngs or nnx.Rngs(seed)
    rngs_def, rngs_state = nnx.split(rngs)

    def apply_rngs(params, rest, x, training):
        live = nnx.merge(graphdefs[training], params, rest["model"], copy=True)
        live_rngs = nnx.merge(rngs_def, rest["rngs"], copy=True)
        out = live(x, rngs=live_rngs)
        return out, {"model": nnx.split(live, nnx.Param, ...)[2], "rngs": nnx.state(live_rngs)}

    rest = {"model": rest, "rngs": rngs_state}
    return Model(params, rest, apply_rngs, model, (model, rngs))


def forward_failed(x: Any, error: Exception) -> str:
    """Why the model's forward pass failed on inputs of `x`'s shapes (a shape error of
    JAX's, raised as the step was traced), naming the layer it failed in where it can."""
    layer = _failing_layer(error)
    named = {"layer": layer} if layer else {}
    return message(
        "The model's forward pass runs on the inputs it is given; it failed on inputs of "
        f"these shapes{' at its layer ' + layer if layer else ''} (a layer's input size fixes "
        "the per-example shape the data must have).",
        received(x_shape=jax.tree.map(jnp.shape, x), **named, error=str(error)),
        "give the data the per-example shape the model was built for (for a Linear first "
        "layer, x.shape[-1] == in_features), or build the model for these inputs (e.g. "
        "nnx.Linear(x.shape[-1], ...)). JAX's error is this one's __cause__.",
    )


def _failing_layer(error: Exception) -> str | None:
    """The innermost NNX module whose method the error went through, e.g.
    "Linear(in_features=6)"; None where no module's frame is in its traceback."""
    layer = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        module = frame.f_locals.get("self")
        if isinstance(module, nnx.Module):
            layer = module
    if layer is None:
        return None
    sizes = ("in_features", "num_embeddings")
    fields = ", ".join(f"{k}={getattr(layer, k)}" for k in sizes if hasattr(layer, k))
    return f"{type(layer).__name__}({fields})"


# What made a step non-finite (`first_nan`): its loss, its loss through a non-finite sample
# (or class) weight, or its update of the written leaf `cause - NAN_UPDATE` (`written`).
NAN_LOSS, NAN_WEIGHT, NAN_UPDATE = 1, 2, 3


def cast(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def written(state: dict) -> list[tuple[str, Any]]:
    """('/'-joined path, leaf) of each floating-point leaf a train step writes: the
    parameters, the optimizer state and the model's other state, in that order."""
    leaves = []
    for part in WRITTEN:
        for key_path, leaf in jax.tree_util.tree_flatten_with_path(state.get(part))[0]:
            if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
                leaves.append((path_str((jax.tree_util.DictKey(part), *key_path)), leaf))
    return leaves


def first_nan(
    state: dict, loss_sum: jax.Array, new: dict | None = None, weight_sum: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The first step whose loss, or whose update of the state, was not finite, and which.

    Returns (step or -1, cause): cause is NAN_LOSS where the step's loss was NaN or
    infinite (NAN_WEIGHT where its weights' sum was too: a sample weight), NAN_UPDATE + i where its loss was finite but it made the i-th leaf
    of `written(new)` NaN or infinite (an infinite gradient, an overflowing update
    or optimizer moment, a statistic the model writes), 0 while all is finite.
    An element already non-finite in `state` (an optimizer's inf sentinel) is no
    alarm. One reduction per leaf, fused into one flag vector, then read with the
    step's flag: no host transfer of its own. A state loaded without these
    entries starts at (-1, 0).

    Args:
      state: the train state before the step.
      loss_sum: the step's summed loss.
      new: the parts of `WRITTEN` the step wrote; None checks the loss only.
      weight_sum: the step's summed loss weights (sample weights x padding mask).
    """
    seen = state.get("nan_step", jnp.full((), -1, jnp.int32))
    cause = state.get("nan_cause", jnp.zeros((), jnp.int32))
    bad_loss = ~jnp.isfinite(loss_sum)
    bad_update, leaf = jnp.zeros((), bool), jnp.zeros((), jnp.int32)
    if new is not None:
        after = [x for _, x in written(new)]
        before = [x for _, x in written({part: state.get(part) for part in new})]
        if [jnp.shape(x) for x in before] != [jnp.shape(x) for x in after]:
            before = [jnp.zeros(())] * len(after)  # another structure: every element counts
        if after:
            became = [
                jnp.isfinite(b) & ~jnp.isfinite(a) for b, a in zip(before, after, strict=True)
            ]
            flags = jnp.stack([jnp.any(x) for x in became])
            bad_update, leaf = jnp.any(flags), jnp.argmax(flags).astype(jnp.int32)
    new_flag = (seen < 0) & (bad_loss | bad_update)
    bad_weight = jnp.zeros((), bool) if weight_sum is None else ~jnp.isfinite(weight_sum)
    on_loss = jnp.where(bad_weight, NAN_WEIGHT, NAN_LOSS)
    now = jnp.where(bad_loss, on_loss, NAN_UPDATE + leaf).astype(jnp.int32)
    return jnp.where(new_flag, state["step"], seen), jnp.where(new_flag, now, cause)


def example_weights(y: Any, w: Any, mask: Any) -> tuple[jax.Array, jax.Array]:
    """(1 for each real example, 0 for padding; the loss's weights: sample weights x that)."""
    n = jax.tree.leaves(y)[0].shape[0]
    real = jnp.ones(n, jnp.float32) if mask is None else mask.astype(jnp.float32)
    return real, real if w is None else w.reshape(n).astype(jnp.float32) * real


def averages(sums: dict) -> dict[str, float]:
    """Each sum over the real examples' count (the loss too: Keras' sum_over_batch_size)."""
    count = float(np.sum(sums["count"]))  # DiLoCo's islands' sums add up (a leading axis)
    internal = ("count", "weight_sum")
    return {k: float(np.sum(v)) / max(count, 1.0) for k, v in sums.items() if k not in internal}


def stack(strategy: Strategy, group: list[tuple]) -> tuple:
    """K global batches as one, stacked on a new leading axis, split on axis 1."""
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *group)
    return put_batch(strategy.mesh, strategy.batch_axes, stacked, axis=1)
