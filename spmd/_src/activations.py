"""Activation layouts: a step's intermediate arrays named by logical axes, laid out per strategy.

A model names its activations' dimensions as MaxText does (`activation_batch`,
`activation_length`, `activation_embed`, `activation_heads`, `activation_mlp`,
`activation_vocab`) with `spmd.logical.constrain(x, names)`; the strategy's
`logical_axis_rules` map those names to mesh axes, as they map the names of
parameters' annotations. `spmd.auto_strategy` gives every candidate the rules
of its own layout (`activation_rules`): the batch over its batch axes, the
width, heads, MLP and vocabulary over its tensor axis, as MaxText's
`logical_axis_rules` (src/maxtext/configs/base.yml) map them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax.core import spmd as flax_spmd
from jax.extend import core
from jax.sharding import PartitionSpec

from spmd._src.errors import ConfigurationError, message, received
from spmd._src.logical import LogicalRules, to_spec

__all__ = ["ACTIVATIONS", "activation_rules", "constrain", "constrains_activations"]

# MaxText's logical names of a decoder's activations (src/maxtext/configs/base.yml).
BATCH = "activation_batch"
LENGTH = "activation_length"
EMBED = "activation_embed"
HEADS = "activation_heads"
MLP = "activation_mlp"
VOCAB = "activation_vocab"
ACTIVATIONS = (BATCH, LENGTH, EMBED, HEADS, MLP, VOCAB)


def activation_rules(
    sizes: Mapping[str, int], batch_axes: Sequence[str], tensor: str, context: str | None = None
) -> LogicalRules:
    """A candidate layout's rules for the activation names, as MaxText's map them.

    The batch splits over the candidate's batch axes; the residual stream's
    width (`activation_embed`), the heads, the MLP's hidden units and the
    vocabulary over its tensor axis (where it has more than one device); the
    length (`activation_length`) over its context axis where it has one of more
    than one device, else whole.

    Args:
      sizes: the candidate's mesh axes and their sizes.
      batch_axes: the axes its batch splits over.
      tensor: its tensor-parallel axis (of size 1, or absent, where it has none).
      context: its context-parallel axis (`spmd.attention`'s), or None.
    """
    batch = tuple(a for a in batch_axes if a in sizes)
    split = tensor if sizes.get(tensor, 1) > 1 else None
    length = context if context is not None and sizes.get(context, 1) > 1 else None
    return (
        (BATCH, batch or None),
        (LENGTH, length),
        (EMBED, split),
        (HEADS, split),
        (MLP, split),
        (VOCAB, split),
    )


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Lays out an activation by logical names, through the current strategy's rules.

    Inside a strategy's step (or its `scope()`) the names map to mesh axes by
    the strategy's `logical_axis_rules` (those of each `auto_strategy`
    candidate include `activation_rules`), and `x` is constrained to that
    layout with `jax.lax.with_sharding_constraint`. A name no rule maps is
    replicated; a mesh axis that does not divide its dimension, or that is
    manual there (inside `strategy.run`), is left out. Outside any strategy
    it returns `x` as it is. The numbers never change, only where they live
    (on one device, nowhere else).

    Args:
      x: an array of the step (an activation).
      names: one logical name (or None) per dimension of `x`, e.g.
        `("activation_batch", "activation_length", "activation_embed")`.

    Returns:
      `x`, constrained.

    Raises:
      ConfigurationError: `names` is not one name or None per dimension of `x`.

    Example:
      >>> h = spmd.logical.constrain(h, ("activation_batch", "activation_length",
      ...                                "activation_embed"))
    """
    _check_names(x, names)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    rules = tuple(flax_spmd.get_logical_axis_rules() or ())
    where = f"spmd.logical.constrain(x of shape {tuple(x.shape)})"
    spec = to_spec(tuple(names), rules, mesh, replicate_unmapped=True, path=where)
    manual = set(getattr(mesh, "manual_axes", ()))
    entries = [
        _usable(entry, dim, mesh.shape, manual) for entry, dim in zip(spec, x.shape, strict=True)
    ]
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*entries))


def _check_names(x: Any, names: Any) -> None:
    shape = getattr(x, "shape", None)
    ok = isinstance(names, tuple | list) and all(n is None or isinstance(n, str) for n in names)
    if ok and shape is not None and len(names) == len(shape):
        return
    raise ConfigurationError(
        message(
            "spmd.logical.constrain names each dimension of the array: a tuple of logical "
            "names (or None), one per dimension.",
            received(names=names, shape=shape),
            'write e.g. constrain(h, ("activation_batch", "activation_length", '
            '"activation_embed")) for an array of shape (batch, length, width).',
        )
    )


def _usable(entry: Any, dim: int, sizes: Mapping[str, int], manual: set[str]) -> Any:
    """A spec entry without manual axes, and without axes whose product does not divide `dim`."""
    axes = [a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a not in manual]
    kept, product = [], 1
    for a in axes:
        if dim % (product * sizes[a]) == 0:
            kept.append(a)
            product *= sizes[a]
    return None if not kept else kept[0] if len(kept) == 1 else tuple(kept)


def constrains_activations(jaxpr: Any) -> bool:
    """Whether a traced step lays out any of its intermediate arrays (a sharding constraint:
    `constrain`, flax's `nn.with_logical_constraint`, `jax.lax.with_sharding_constraint`).

    The constraints a strategy puts on the step's results (the new state, the
    metrics) are not the model's: a constraint whose result is a result of
    the whole program is not counted.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    results = {id(v) for v in jaxpr.outvars}
    return any(id(eqn.outvars[0]) not in results for eqn in _constraints(jaxpr)) or any(
        _constraints(sub) for sub in _inner(jaxpr)
    )


def _constraints(jaxpr: Any) -> list:
    """The sharding constraints of one program, its sub-programs' left out."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "sharding_constraint"]


def _inner(jaxpr: Any) -> list:
    """Every sub-program of `jaxpr`, at any depth."""
    found = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                if isinstance(item, core.ClosedJaxpr | core.Jaxpr):
                    found += [item, *_inner(item)]
    return found
