"""Context (sequence) parallel attention: the length axis split over a mesh axis."""

from __future__ import annotations

import functools
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from spmd._src.errors import ConfigurationError, ContextError, message, received
from spmd._src.markers import marked

__all__ = ["AttentionCall", "attention", "calls_in"]

_CALL = "spmd_attention_q{}_kv{}_over_{}"
_CALL_RE = re.compile(r"spmd_attention_q(\d+)_kv(\d+)_over_(\w+)")
_FIX_SHAPES = "pass q, k and v as [batch, length, heads, head_dim] arrays."


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    axis: str = "context",
    scale: float | None = None,
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None = None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Dot-product attention whose sequence is split over the mesh axis `axis`.

    Equals `jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale)`
    on one device, forward and gradients. Under a mesh with an `axis` of size
    c > 1 (a strategy's scope, or a step, or `jax.set_mesh`), each device holds
    1/c of the queries, keys and values along the length; the call is a
    `jax.shard_map` manual over `axis` only, so the batch and heads stay split
    as XLA propagates them (data and tensor axes compose with it).

    The schedule is all-gathered K/V (MaxText's `ici_context_parallelism`):
    every device gathers the keys and values of the whole sequence, then
    attends with its own block of queries at their global positions. The
    gradient of the gather is a reduce-scatter (summed in float32 for narrower
    dtypes), so the K/V gradients come back split. Why not a ring of collective permutes: with K/V an order of
    magnitude smaller than the [length, length] scores (grouped-query heads make
    them smaller still), the gather costs one collective XLA can overlap, and
    the scores, the term that grows with the square of the length, fall by c on
    each device either way. The work is even across devices: each computes a
    [length / c, length] block, causal or not, as XLA's attention on one device
    computes the whole square and masks it; a ring that skips the blocks above
    the diagonal (with load-balanced chunks) would save up to half the FLOPs of
    causal attention, at the price of c permutes in sequence. Positions are
    the tokens' order along the length: keep them in order (no load-balancing
    reorder of the sequence in the input pipeline).

    Without `axis` in the current mesh, or with it of size 1, this is plain
    `jax.nn.dot_product_attention`.

    Args:
      q: queries, [batch, q_length, heads, head_dim].
      k: keys, [batch, kv_length, kv_heads, head_dim]; heads % kv_heads == 0
        (grouped-query attention when kv_heads < heads).
      v: values, the shape of `k`.
      causal: whether query i sees only keys 0..i (top-left aligned, as
        `jax.nn.dot_product_attention`'s `is_causal`).
      axis: the mesh axis the length is split over.
      scale: the logits' scale; 1 / sqrt(head_dim) when None.
      segment_ids: [batch, length] integers: a query sees only keys of its own
        segment (packed sequences). One array for self-attention, or a pair
        (q_segment_ids, kv_segment_ids).
      mask: a boolean [batch | 1, heads | 1, q_length, kv_length] array, True
        where a query may attend to a key (`jax.nn.dot_product_attention`'s
        `mask`), split over `axis` by its query rows; combined with `causal`
        and `segment_ids`.

    Returns:
      The attention output, the shape and dtype of `q`.

    Raises:
      ConfigurationError: q, k, v, segment_ids or mask are not shaped as above, or a
        length does not divide by the size of `axis`.
      ContextError: `axis` is already manual here (inside `strategy.run` or a
        `shard_map` over it).

    Example:
      >>> with spmd.Strategy(mesh=spmd.make_mesh({"data": 2, "context": 4})).scope():
      ...     out = jax.jit(lambda q, k, v: spmd.attention(q, k, v, causal=True))(q, k, v)
    """
    _check_shapes(q, k, v)
    q_seg, kv_seg = _segments(segment_ids, q, k)
    _check_mask(mask, q, k)
    with jax.named_scope(_CALL.format(q.shape[1], k.shape[1], axis)):
        return _split(q, k, v, causal, axis, scale, q_seg, kv_seg, mask)


class AttentionCall(NamedTuple):
    """What one `spmd.attention` call was given, found in a step traced on any mesh:
    `auto_strategy` sizes the context axis by it.

    Attributes:
      axis: the mesh axis the length is split over.
      q_length: the queries' length.
      kv_length: the keys' and values' length.
    """

    axis: str
    q_length: int
    kv_length: int

    def splits_over(self, size: int) -> bool:
        """Whether an `axis` of `size` devices splits both lengths evenly."""
        return self.q_length % size == 0 and self.kv_length % size == 0


def calls_in(jaxpr: Any) -> tuple[AttentionCall, ...]:
    """The distinct `spmd.attention` calls a traced program makes."""
    return tuple(AttentionCall(axis, int(q), int(kv)) for q, kv, axis in marked(jaxpr, _CALL_RE))


def _split(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    causal: bool,
    axis: str,
    scale: float | None,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    mask: jax.Array | None,
) -> jax.Array:
    """The attention with the length split over `axis` (whole where it has one device)."""
    size = _axis_size(axis)
    if size == 1:
        where = _mask(causal, q_seg, kv_seg, q.shape[1], 0, k.shape[1], mask)
        return jax.nn.dot_product_attention(q, k, v, mask=where, scale=scale)
    _check_divides(q, k, axis, size)
    extra = {"q_seg": q_seg, "kv_seg": kv_seg, "mask": mask}
    extra = {name: x for name, x in extra.items() if x is not None}
    # The length is dimension 1 of q, k, v and the segment ids; the mask's query rows are 2.
    specs = {name: P(None, None, axis) if name == "mask" else P(None, axis) for name in extra}

    def block(q, k, v, extra):
        k, v = _gather(k, axis), _gather(v, axis)
        kv_seg = extra.get("kv_seg")
        if kv_seg is not None:
            kv_seg = jax.lax.all_gather(kv_seg, axis, axis=1, tiled=True)
        offset = jax.lax.axis_index(axis) * q.shape[1]
        where = _mask(
            causal, extra.get("q_seg"), kv_seg, q.shape[1], offset, k.shape[1], extra.get("mask")
        )
        return jax.nn.dot_product_attention(q, k, v, mask=where, scale=scale)

    split = P(None, axis)
    # Inside a vmap over mesh axes (spmd.pipeline's stages) JAX splits the mapped dimension
    # of every spec over them and cannot tell the output's replication: the check is off there.
    vmapped = _vmap_split_axes()
    return jax.shard_map(
        block,
        in_specs=(split, split, split, specs),
        out_specs=split,
        axis_names=frozenset({axis}) | vmapped,
        check_vma=not vmapped,
    )(q, k, v, extra)


def _vmap_split_axes() -> frozenset[str]:
    """The mesh axes an enclosing `jax.vmap(..., spmd_axis_name=...)` splits its mapped
    dimension over (spmd.pipeline's stages): a shard_map inside it names them as well."""
    try:
        from jax._src import core  # private: guarded, JAX may move it

        return frozenset(core.get_axis_env().spmd_axis_names)
    except (ImportError, AttributeError):
        return frozenset()


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(x: jax.Array, axis: str) -> jax.Array:
    """The whole sequence of this device's block `x` (all-gathered along dimension 1)."""
    return jax.lax.all_gather(x, axis, axis=1, tiled=True)


def _gather_forward(x: jax.Array, axis: str) -> tuple[jax.Array, None]:
    return _gather(x, axis), None


def _gather_backward(axis: str, _: None, grad: jax.Array) -> tuple[jax.Array]:
    """Each device's gradient of its block: the devices' gradients summed (a reduce-scatter),
    in float32 where they are narrower, as the one-device attention accumulates them."""
    wide = jnp.promote_types(grad.dtype, jnp.float32)
    summed = jax.lax.psum_scatter(grad.astype(wide), axis, scatter_dimension=1, tiled=True)
    return (summed.astype(grad.dtype),)


_gather.defvjp(_gather_forward, _gather_backward)


def _mask(
    causal: bool,
    q_seg: jax.Array | None,
    kv_seg: jax.Array | None,
    q_len: int,
    offset: jax.Array | int,
    kv_len: int,
    given: jax.Array | None = None,
) -> jax.Array | None:
    """The mask of queries at `offset + arange(q_len)`: causal, segments and `given`, and-ed."""
    masks = [given]
    if causal:
        rows = offset + jnp.arange(q_len)
        masks.append((rows[:, None] >= jnp.arange(kv_len)[None, :])[None, None])
    if q_seg is not None:
        masks.append((q_seg[:, :, None] == kv_seg[:, None, :])[:, None])
    masks = [m for m in masks if m is not None]
    return functools.reduce(jnp.logical_and, masks) if masks else None


def _axis_size(axis: str) -> int:
    """The size of `axis` in the current mesh; 1 where there is no mesh or no such axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        return 1
    if dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[axis] == AxisType.Manual:
        raise ContextError(
            message(
                f"spmd.attention splits the length over the mesh axis {axis!r} itself, "
                "so it is called where that axis is not manual.",
                received(axis=axis, manual_axes=_manual(mesh)),
                "call spmd.attention in the global view (a step, jax.jit, a strategy's "
                f"scope), not inside strategy.run or a shard_map over {axis!r}.",
            )
        )
    return mesh.shape[axis]


def _manual(mesh: jax.sharding.AbstractMesh) -> tuple[str, ...]:
    return tuple(
        n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Manual
    )


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """q, k, v as [batch, length, heads, head_dim], K/V heads dividing Q's."""
    ranks = {name: jnp.ndim(x) for name, x in (("q", q), ("k", k), ("v", v))}
    if set(ranks.values()) != {4}:
        raise ConfigurationError(
            message(
                "spmd.attention takes q, k and v of rank 4: [batch, length, heads, head_dim].",
                received(**{f"{n}_shape": jnp.shape(x) for n, x in (("q", q), ("k", k), ("v", v))}),
                _FIX_SHAPES,
            )
        )
    shapes = received(q_shape=q.shape, k_shape=k.shape, v_shape=v.shape)
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ConfigurationError(
            message(
                "k and v have one shape, and q the same batch and head_dim as k.",
                shapes,
                _FIX_SHAPES,
            )
        )
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ConfigurationError(
            message(
                "The query heads are a multiple of the key/value heads (grouped-query "
                "attention shares each K/V head among heads // kv_heads query heads).",
                shapes,
                "give k and v a number of heads that divides q's.",
            )
        )
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise ConfigurationError(
            message(
                "q, k and v have one dtype.",
                received(q_dtype=q.dtype, k_dtype=k.dtype, v_dtype=v.dtype),
                "cast them to one dtype (e.g. all bfloat16) before the call.",
            )
        )


def _check_divides(q: jax.Array, k: jax.Array, axis: str, size: int) -> None:
    """Each device holds an equal, non-empty block of the queries and of the keys."""
    for name, length in (("q", q.shape[1]), ("k", k.shape[1])):
        if length == 0 or length % size:
            raise ConfigurationError(
                message(
                    f"The length of {name} divides by the size of the mesh axis {axis!r}: "
                    "each device holds an equal block of the sequence.",
                    received(**{f"{name}_length": length}, axis=axis, axis_size=size),
                    f"pad the sequence to a multiple of {size} (and mask the padding with "
                    "segment_ids), or choose a context axis whose size divides the length.",
                )
            )


def _check_mask(mask: jax.Array | None, q: jax.Array, k: jax.Array) -> None:
    """A boolean [batch | 1, heads | 1, q_length, kv_length] mask, or None."""
    if mask is None:
        return
    shape, dtype = jnp.shape(mask), jnp.result_type(mask)
    fits = len(shape) == 4 and shape[2:] == (q.shape[1], k.shape[1])
    if not fits or shape[0] not in (1, q.shape[0]) or shape[1] not in (1, q.shape[2]):
        raise ConfigurationError(
            message(
                "mask is [batch | 1, heads | 1, q_length, kv_length], its query and key "
                "lengths whole (the query rows are split over the context axis).",
                received(mask_shape=shape, q_shape=q.shape, k_shape=k.shape),
                "jnp.broadcast_to the mask's last two dimensions to (q_length, kv_length), "
                "or use causal=True / segment_ids, which need no mask array.",
            )
        )
    if dtype != jnp.bool_:
        raise ConfigurationError(
            message(
                "mask is boolean: True where a query may attend to a key.",
                received(mask_dtype=dtype),
                "pass mask.astype(bool), or an additive bias folded into q or the logits.",
            )
        )


def _segments(
    segment_ids: jax.Array | tuple[jax.Array, jax.Array] | None, q: jax.Array, k: jax.Array
) -> tuple[jax.Array | None, jax.Array | None]:
    """(q_segment_ids, kv_segment_ids), each [batch, its length], or (None, None)."""
    if segment_ids is None:
        return None, None
    q_seg, kv_seg = segment_ids if isinstance(segment_ids, tuple) else (segment_ids,) * 2
    want = {"q_segment_ids": q.shape[:2], "kv_segment_ids": k.shape[:2]}
    got = {"q_segment_ids": jnp.shape(q_seg), "kv_segment_ids": jnp.shape(kv_seg)}
    if got != want:
        raise ConfigurationError(
            message(
                f"segment_ids are [batch, length] integers: {want}.",
                received(**{f"{n}_shape": s for n, s in got.items()}),
                "pass one [batch, length] array for self-attention, or a pair "
                "(q_segment_ids, kv_segment_ids).",
            )
        )
    return q_seg, kv_seg
