"""Pipeline parallelism: a stack of identical layers split over a `stage` mesh axis.

The schedule is GPipe's, made circular for repeats (MaxText's `pipeline.py`):
the batch is cut into microbatches; at each of `M * repeats + S - 1` iterations
every stage applies its layers to the microbatch it holds, then the activations
move one stage on by a collective permute. Stage `s` holds, for repeat `r`, the
layers `(r * S + s) * per_stage ... + per_stage`, so a microbatch leaving the
last stage comes back to stage 0 for its next repeat. It is one SPMD program:
XLA compiles the loop, the permutes and the data/FSDP/tensor collectives of the
layers as one step.
"""

from __future__ import annotations

import contextvars
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from spmd._src.errors import ConfigurationError, message, received
from spmd._src.markers import marked
from spmd._src.validate import positive_int

__all__ = ["PipelineCall", "PipelineSchedule", "calls_in", "pipeline", "schedules_in"]

P = PartitionSpec
U = P.UNCONSTRAINED
_SCOPE = "spmd_pipeline_stages{}_microbatches{}_repeats{}"
# The stage axis of the pipeline whose layer_fn is being traced: one nested in it
# cannot split its layers over the same axis (each stage runs its layers alone).
_PIPELINING: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "spmd_pipeline_axis", default=None
)
_SCOPE_RE = re.compile(r"spmd_pipeline_stages(\d+)_microbatches(\d+)_repeats(\d+)")
_CALL = "spmd_pipeline_layers{}_microbatches{}_repeats{}_over_{}"
_CALL_RE = re.compile(r"spmd_pipeline_layers(\d+)_microbatches(\d+)_repeats(\d+)_over_(\w+)")


class PipelineCall(NamedTuple):
    """What one `spmd.pipeline` call was given, found in a step traced on any mesh (one
    device too, where it runs the layers in order): `auto_strategy` sizes the stage axis
    by it.

    Attributes:
      axis: the mesh axis of the stages.
      layers: L, the stacked layers.
      microbatches: M.
      repeats: how many times a microbatch goes round the stages.
    """

    axis: str
    layers: int
    microbatches: int
    repeats: int

    def splits_over(self, stages: int) -> bool:
        """Whether `stages` stages can run this call (the checks `spmd.pipeline` makes)."""
        if self.layers % (stages * self.repeats):
            return False
        return self.repeats == 1 or self.microbatches >= stages


@dataclass(frozen=True)
class PipelineSchedule:
    """The schedule of one `spmd.pipeline` call, as `strategy.explain` reports it.

    Attributes:
      stages: S, the size of the stage axis.
      microbatches: M, the microbatches the batch is cut into.
      repeats: how many times a microbatch goes round the stages (circular).
    """

    stages: int
    microbatches: int
    repeats: int

    @property
    def iterations(self) -> int:
        """Stage-steps each stage takes: M * repeats + S - 1."""
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """The fraction of stage-steps spent idle: (S - 1) / (M * repeats + S - 1)."""
        return (self.stages - 1) / self.iterations

    def __str__(self) -> str:
        name = "GPipe" if self.repeats == 1 else f"circular GPipe, {self.repeats} repeats"
        return (
            f"{name}: {self.stages} stages x {self.microbatches} microbatches, "
            f"bubble {self.bubble:.1%} ((S-1)/(M*repeats+S-1))"
        )


def pipeline(
    layer_fn: Callable[[Any, jax.Array], jax.Array],
    stacked_params: Any,
    x: jax.Array,
    *,
    microbatches: int,
    axis: str | None = "stage",
    repeats: int = 1,
) -> jax.Array:
    """Applies a stack of layers to `x`, the layers split over the mesh axis `axis`.

    Equals `jax.lax.scan(lambda h, p: (layer_fn(p, h), None), x, stacked_params)[0]`,
    forward and gradients. Call it inside a step (`strategy.step`, a `Trainer`'s
    model): the current mesh must have `axis`. Its leaves' leading (layers) axis,
    placed `P(axis, ...)`, is split over the stages; the batch keeps its data
    sharding, and the layers their FSDP or tensor sharding. Examples must be
    independent of each other in `layer_fn` (the batch is cut into microbatches).

    Args:
      layer_fn: `layer_fn(one_layer_params, h) -> h`, the same shape and dtype out.
        It may use `jax.checkpoint` (remat) and sharding constraints.
      stacked_params: a pytree whose every leaf has the same leading layers axis,
        L = stages * repeats * layers_per_stage (as nnx.scan / nn.scan stack them).
      x: the activations, batch first.
      microbatches: M, how many pieces the batch is cut into; the bubble is
        (S - 1) / (M * repeats + S - 1). With repeats > 1, M >= S.
      axis: the mesh axis of the stages. None runs the layers in order on the
        current device(s) without a pipeline: the one-device oracle. A mesh
        without `axis` is an error unless it has exactly one device.
      repeats: how many times each microbatch goes round the stages (circular
        pipeline); each stage then holds `repeats` separate blocks of layers.

    Returns:
      The last layer's output, shaped as `x`.

    Raises:
      ConfigurationError: the leaves disagree on the layers axis, it does not
        divide by stages * repeats, the batch by `microbatches`, `layer_fn` is
        not callable or changes the activation's shape or dtype, `microbatches`
        or `repeats` is not an integer >= 1, a leaf is a random key (the
        layers' RNG state would not advance), the mesh lacks `axis`, or the
        call runs inside another pipeline's `layer_fn` over the same axis.

    Example:
      >>> y = spmd.pipeline(lambda p, h: jnp.tanh(h @ p["w"]), {"w": w}, x,
      ...                   microbatches=8)   # w: [layers, d, d], placed P("stage")
    """
    layers = _layers(stacked_params)
    _check_callable(layer_fn)
    _check_no_keys(stacked_params)
    microbatches = positive_int(microbatches, "microbatches")  # numpy integers too
    repeats = positive_int(repeats, "repeats")
    _check_batch(x, microbatches)
    _check_layer(layer_fn, stacked_params, x, microbatches)
    if axis is None:
        return _in_order(layer_fn, stacked_params, x)
    with jax.named_scope(_CALL.format(layers, microbatches, repeats, axis)):
        return _staged(layer_fn, stacked_params, x, layers, microbatches, axis, repeats)


def _staged(
    layer_fn: Callable,
    stacked_params: Any,
    x: jax.Array,
    layers: int,
    microbatches: int,
    axis: str,
    repeats: int,
) -> jax.Array:
    """The layers over the stages of `axis` (in order on a mesh of one device)."""
    stages = _stages(axis)
    if stages is None:
        return _in_order(layer_fn, stacked_params, x)
    _check_split(layers, stages, repeats, microbatches)
    _check_not_nested(axis)
    schedule = PipelineSchedule(stages, microbatches, repeats)
    token = _PIPELINING.set(axis)
    try:
        with jax.named_scope(_SCOPE.format(stages, microbatches, repeats)):
            return _run(layer_fn, stacked_params, x, schedule, axis)
    finally:
        _PIPELINING.reset(token)


def schedules_in(jaxpr: Any) -> tuple[PipelineSchedule, ...]:
    """The schedules of the `spmd.pipeline` calls a traced program makes, in order.

    One entry per distinct schedule: two calls with the same stages, microbatches
    and repeats (two stacks alike) are listed once.
    """
    return tuple(PipelineSchedule(*map(int, groups)) for groups in marked(jaxpr, _SCOPE_RE))


def calls_in(jaxpr: Any) -> tuple[PipelineCall, ...]:
    """The distinct `spmd.pipeline` calls (with a mesh axis) a traced program makes."""
    return tuple(
        PipelineCall(axis, int(layers), int(m), int(r))
        for layers, m, r, axis in marked(jaxpr, _CALL_RE)
    )


def _in_order(layer_fn: Callable, stacked_params: Any, x: jax.Array) -> jax.Array:
    return jax.lax.scan(lambda h, p: (layer_fn(p, h), None), x, stacked_params)[0]


def _run(
    layer_fn: Callable, stacked_params: Any, x: jax.Array, s: PipelineSchedule, axis: str
) -> jax.Array:
    """The circular GPipe loop, in the global view; see the module's docstring.

    The only traffic between stages is the permute of each iteration: the last
    stage's output reaches stage 0 by it too, which keeps it in its own copy of
    the finished microbatches (`done`, one per stage, only stage 0's read) for
    their next repeat and for the result.
    """
    stages, m, repeats = s.stages, s.microbatches, s.repeats
    weights = jax.tree.map(lambda w: _by_stage(w, repeats, stages, axis), stacked_params)
    feed = _microbatched(x, m)  # [M, mb, ...]
    stage_fn = jax.vmap(
        functools.partial(_stage, layer_fn, repeats), in_axes=(1, 0, 0), spmd_axis_name=axis
    )
    first = jnp.broadcast_to(feed[0], (stages, *feed.shape[1:]))
    done = jnp.zeros((stages, *feed.shape), feed.dtype)  # [S, M, mb, ...]
    carry = (_on_stages(first, axis), _on_stages(done, axis))

    def iteration(carry, t):
        held, done = carry
        moved = _on_stages(jnp.roll(held, 1, axis=0), axis)  # stage s-1 -> s: a permute
        done = _arrived(done, moved, t - stages, s, axis)  # stage 0 got the last stage's
        m0 = t % m
        fresh = jax.lax.dynamic_index_in_dim(feed, m0, keepdims=False)
        back = jax.lax.dynamic_index_in_dim(done, m0, axis=1, keepdims=False)
        incoming = jnp.where(t < m, fresh[None], back)
        is_first = jax.lax.broadcasted_iota(jnp.int32, moved.shape, 0) == 0
        inputs = _on_stages(jnp.where(is_first, incoming, moved), axis)
        repeat = jnp.clip((t - jnp.arange(stages)) // m, 0, repeats - 1)
        return (_on_stages(stage_fn(weights, repeat, inputs), axis), done), None

    (held, done), _ = jax.lax.scan(iteration, carry, jnp.arange(s.iterations))
    moved = _on_stages(jnp.roll(held, 1, axis=0), axis)
    done = _arrived(done, moved, s.iterations - stages, s, axis)
    return _unmicrobatched(done[0])


def _arrived(done: jax.Array, moved: jax.Array, k: jax.Array, s: PipelineSchedule, axis: str):
    """Keeps what the permute brought, where it is the last stage's microbatch step `k`."""
    slot = k % s.microbatches
    valid = (k >= 0) & (k < s.microbatches * s.repeats)
    old = jax.lax.dynamic_index_in_dim(done, slot, axis=1, keepdims=False)
    new = jnp.where(valid, moved, old)
    return _on_stages(jax.lax.dynamic_update_index_in_dim(done, new, slot, axis=1), axis)


def _stage(layer_fn: Callable, repeats: int, weights: Any, repeat: jax.Array, h: jax.Array):
    """One stage's layers for this iteration: its block of the repeat it is on."""
    if repeats > 1:
        weights = jax.tree.map(
            lambda w: jax.lax.dynamic_index_in_dim(w, repeat, keepdims=False), weights
        )
    else:
        weights = jax.tree.map(lambda w: w[0], weights)
    return _in_order(layer_fn, weights, h)


def _by_stage(w: jax.Array, repeats: int, stages: int, axis: str) -> jax.Array:
    """[L, ...] -> [repeats, stages, per_stage, ...], the stages axis on `axis`.

    With one repeat this keeps `P(axis)` on the leading axis as it is; with
    several, stage s holds the blocks s, S + s, ... (XLA moves them once a step
    from a `P(axis)` layout).
    """
    w = w.reshape(repeats, stages, w.shape[0] // (repeats * stages), *w.shape[1:])
    spec = P(None, axis, None, *([U] * (w.ndim - 3)))
    return jax.lax.with_sharding_constraint(w, spec)


def _on_stages(h: jax.Array, axis: str) -> jax.Array:
    return jax.lax.with_sharding_constraint(h, P(axis, *([U] * (h.ndim - 1))))


def _microbatched(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...]: microbatch i is rows i, i + M, ..., so each spans
    every data shard of a batch split on its leading axis."""
    x = x.reshape(x.shape[0] // m, m, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def _unmicrobatched(y: jax.Array) -> jax.Array:
    y = jnp.swapaxes(y, 0, 1)
    return y.reshape(y.shape[0] * y.shape[1], *y.shape[2:])


def _stages(axis: str | None) -> int | None:
    """The size of `axis` in the current mesh; None to run the layers in order."""
    if axis is None:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and axis in mesh.axis_names:
        _check_auto(mesh, axis)
        return mesh.shape[axis]
    if not mesh.empty and mesh.size == 1:
        return None
    raise ConfigurationError(
        message(
            f"spmd.pipeline splits the layers over the mesh axis {axis!r}, which the "
            "current mesh must have.",
            received(axis=axis, mesh=None if mesh.empty else dict(mesh.shape)),
            f"call it inside a step of a strategy whose mesh has {axis!r} (e.g. "
            f"spmd.make_mesh({{{axis!r}: 2, 'data': -1}})), or pass axis=None to run the "
            "layers in order without a pipeline (the one-device oracle).",
        )
    )


def _check_auto(mesh: Any, axis: str) -> None:
    """The stage axis is an Auto one: the loop is in the global view, XLA partitions it."""
    kind = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[axis]
    if kind != jax.sharding.AxisType.Auto:
        raise ConfigurationError(
            message(
                f"spmd.pipeline runs in the global view over an Auto mesh axis {axis!r} "
                "(XLA partitions the loop over it).",
                received(axis=axis, axis_type=str(kind)),
                "call it in a step (not inside strategy.run or a shard_map over "
                f"{axis!r}), on a mesh from spmd.make_mesh (Auto axes by default).",
            )
        )


def _layers(stacked_params: Any) -> int:
    """The leading layers axis every leaf shares."""
    leaves = jax.tree_util.tree_leaves_with_path(stacked_params)
    sizes = {jax.tree_util.keystr(path): (jnp.shape(leaf) or (None,))[0] for path, leaf in leaves}
    if not sizes or None in sizes.values() or len(set(sizes.values())) != 1:
        raise ConfigurationError(
            message(
                "stacked_params' leaves all carry the same leading layers axis.",
                received(leading_sizes=sizes),
                "stack one layer's parameters per layer (nnx.scan / nn.scan, or "
                "jax.tree.map(lambda *w: jnp.stack(w), *layers)).",
            )
        )
    return next(iter(sizes.values()))


def _check_callable(layer_fn: Any) -> None:
    if not callable(layer_fn):
        raise ConfigurationError(
            message(
                "layer_fn is a function: layer_fn(one_layer_params, h) -> h.",
                received(layer_fn=type(layer_fn).__name__),
                "pass the function that applies one layer (e.g. lambda p, h: "
                "nnx.merge(graphdef, p)(h) for an nnx.scan stack).",
            )
        )


def _check_no_keys(stacked_params: Any) -> None:
    """No random keys among the layers' parameters: `layer_fn` returns no new RNG
    state, so each layer would draw the same numbers for every microbatch (one
    dropout mask for all of them, unlike the scan's per row) and every step."""
    leaves = jax.tree_util.tree_leaves_with_path(stacked_params)
    keys = [
        jax.tree_util.keystr(path)
        for path, leaf in leaves
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key)
    ]
    if keys:
        raise ConfigurationError(
            message(
                "stacked_params holds the layers' parameters, without random keys: "
                "layer_fn returns no new RNG state, so every microbatch and every step "
                "would draw the same numbers (one dropout mask for all microbatches).",
                received(key_leaves=keys),
                "split the RNG state out of the stack (graphdef, params, rest = "
                "nnx.split(blocks, nnx.Param, ...); pipeline params only) and run the "
                "layers deterministic (nnx.Dropout(deterministic=True)), or keep "
                "dropout out of the pipelined layers.",
            )
        )


def _check_batch(x: jax.Array, microbatches: int) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or not x.shape:
        raise ConfigurationError(
            message(
                "x is one array, batch first (the activations the layers pass on).",
                received(x=type(x).__name__ if not hasattr(x, "shape") else f"shape {x.shape}"),
                "pass a single array with a leading batch axis; carry other inputs "
                "(masks, positions) in layer_fn's closure.",
            )
        )
    batch = x.shape[0]
    if batch % microbatches:
        raise ConfigurationError(
            message(
                "The batch (x's leading axis) divides into `microbatches` equal pieces.",
                received(batch=batch, microbatches=microbatches),
                "pick microbatches dividing the batch (per-microbatch batch = batch / M), "
                "or change the batch size.",
            )
        )


def _check_layer(layer_fn: Callable, stacked_params: Any, x: jax.Array, m: int) -> None:
    """`layer_fn` keeps a microbatch's shape and dtype (the stages pass it on)."""
    one = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape[1:], w.dtype), stacked_params)
    h = jax.ShapeDtypeStruct((x.shape[0] // m, *x.shape[1:]), x.dtype)
    out = jax.eval_shape(layer_fn, one, h)
    if getattr(out, "shape", None) != h.shape or getattr(out, "dtype", None) != h.dtype:
        raise ConfigurationError(
            message(
                "layer_fn(one_layer_params, h) returns an array of h's shape and dtype.",
                received(h=f"{h.dtype}{list(h.shape)}", returned=_aval(out)),
                "make each layer map the activation to the same shape and dtype (cast back "
                "with .astype(h.dtype); put embeddings and heads outside the pipeline).",
            )
        )


def _aval(out: Any) -> str:
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return f"{out.dtype}{list(out.shape)}"
    return repr(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", out))


def _check_not_nested(axis: str) -> None:
    if _PIPELINING.get() == axis:
        raise ConfigurationError(
            message(
                f"A pipeline over {axis!r} runs inside one stage of another pipeline over "
                f"{axis!r}: each stage applies its layers alone, with no {axis!r} to split.",
                received(axis=axis, outer_axis=axis),
                "pass axis=None to the inner spmd.pipeline (its layers in order, inside "
                "the stage), or pipeline one stack of all the layers.",
            )
        )


def _check_split(layers: int, stages: int, repeats: int, microbatches: int) -> None:
    if layers % (stages * repeats):
        raise ConfigurationError(
            message(
                "The layers split evenly: layers = stages * repeats * layers_per_stage.",
                received(layers=layers, stages=stages, repeats=repeats),
                "pick a stage axis size and repeats whose product divides the layers "
                f"(divisors of {layers}), or change the number of layers.",
            )
        )
    if repeats > 1 and microbatches < stages:
        raise ConfigurationError(
            message(
                "A circular pipeline (repeats > 1) has at least as many microbatches as "
                "stages: a microbatch back at stage 0 finds its next layers free.",
                received(microbatches=microbatches, stages=stages, repeats=repeats),
                f"pass microbatches >= {stages} (more also shrinks the bubble), or repeats=1.",
            )
        )
