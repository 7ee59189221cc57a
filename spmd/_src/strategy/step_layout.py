"""Where a step's arrays live: the checks and moves that put state and batches in the
layout (and memory kind) the compiled program takes them in."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from spmd._src.errors import ConfigurationError, message, received
from spmd._src.rules import path_str

if TYPE_CHECKING:
    from spmd._src.strategy.base import Strategy

__all__ = ["check_layout", "conform", "conform_all", "on_device", "placed", "put_leaf", "to_memory"]

_SHARDING = operator.attrgetter("sharding")


def check_layout(strategy: Strategy, pure: Any, shardings: list, is_nnx: bool) -> None:
    """Checks that the state's arrays are laid out as the program expects.

    The first call of a program places its state; later calls take the state
    the step returned. An array put in between with another layout (weights
    copied from a model another strategy placed, on the same devices) would
    reach jit raw: it is a ConfigurationError naming the leaf and the fix.

    Raises:
      ConfigurationError: a state array is laid out otherwise than the strategy says.
    """
    for leaf, sharding in zip(jax.tree.leaves(pure), shardings, strict=True):
        if _misplaced(leaf, sharding):
            break
    else:
        return
    flat = jax.tree_util.tree_flatten_with_path(pure)[0]
    path, leaf = next((p, x) for (p, x), s in zip(flat, shardings, strict=True) if _misplaced(x, s))
    fix = (
        "nnx.update(model, strategy.put(nnx.state(model))) for each NNX object of the state"
        if is_nnx
        else "state = strategy.put(state)"
    )
    if strategy._keeps_placed:  # put keeps the layout of a leaf no rule or annotation covers
        fix += (
            "; a leaf that no rule or annotation lays out keeps the layout it arrives with, "
            "so move it to the expected sharding (jax.device_put(leaf, expected)) or add a "
            "rule for its path"
        )
    raise ConfigurationError(
        message(
            f"The state must be placed by this step's strategy, {strategy!r}; an array was "
            "put into it with another layout than the step's program takes (e.g. weights "
            "copied from a model another strategy placed).",
            received(leaf=path_str(path), sharding=leaf.sharding, expected=sharding),
            f"place it with this strategy first: {fix}.",
        )
    )


def placed(leaves: list, shardings: list) -> list:
    """The state's leaves, those that are arrays laid out otherwise moved to `shardings`.

    `check_layout` has refused another layout on the same mesh; what is left
    to move is an array on one device (put there by `jnp`, or committed to a
    device) or in another memory kind (a fresh array in a host-placed state),
    which jit would move itself or refuse with its own error. An array on the
    mesh's only device is moved too: jit would trace the program again for its
    single-device sharding.
    """
    out = leaves
    for i, (x, sharding) in enumerate(zip(leaves, shardings, strict=True)):
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or x.is_deleted():
            continue
        current = x.sharding
        if current is sharding or (
            isinstance(current, NamedSharding)  # one device's array is retraced, not placed
            and current.mesh == sharding.mesh
            and current.memory_kind == sharding.memory_kind
            and current.is_equivalent_to(sharding, x.ndim)
        ):
            continue
        if out is leaves:
            out = list(leaves)
        out[i] = jax.device_put(x, sharding)
    return out


def _misplaced(x: Any, sharding: NamedSharding) -> bool:
    """Whether `x` is a concrete array on the step's devices but in another layout."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or x.is_deleted():
        return False
    current = x.sharding
    if current is sharding or not isinstance(current, NamedSharding):
        return False
    if current.mesh != sharding.mesh:
        return False  # another mesh: step_checks names the strategy that placed it
    return not current.is_equivalent_to(sharding, x.ndim)


def to_memory(tree: Any, shardings: Any, kind: str) -> Any:
    """Moves to memory `kind` the leaves a host placement keeps in `pinned_host`.

    The leaves the placement keeps on the devices (PRNG keys) are left as
    they are: a transfer of a key array inside the program fails to lower on
    GPU (its sharding has the key's rank, its buffer one more).
    """

    def move(leaf, sharding):
        if sharding.memory_kind != "pinned_host":
            return leaf
        return jax.device_put(leaf, sharding.with_memory_kind(kind))

    return jax.tree.map(move, tree, shardings)


def on_device(shardings: Any) -> Any:
    """The shardings in device memory: where the step computes on host-placed state."""
    return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)


def conform_all(leaves: list, shardings: list) -> list:
    """`_conform` over flat leaves, without the pytree machinery (the hot path)."""
    try:  # batches the input pipeline placed carry these very shardings
        if len(leaves) == len(shardings) and all(
            map(operator.is_, map(_SHARDING, leaves), shardings)
        ):
            return leaves
    except AttributeError:  # a leaf that is not an array
        pass
    out = leaves
    for i, (x, sharding) in enumerate(zip(leaves, shardings, strict=True)):
        current = getattr(x, "sharding", None)
        if current is not None and current is not sharding and current != sharding:
            if out is leaves:
                out = list(leaves)
            out[i] = conform(x, sharding)
    return out


def conform(x: Any, sharding: NamedSharding) -> Any:
    """`x` in `sharding`: concrete arrays laid out otherwise are moved; the rest pass."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.sharding != sharding:
        return jax.device_put(x, sharding)
    return x


def put_leaf(x: Any, sharding: NamedSharding) -> jax.Array:
    """Places one leaf; with several processes, host data is taken as the global value."""
    if isinstance(x, jax.Array) or jax.process_count() == 1:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
