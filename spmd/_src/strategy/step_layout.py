"""Whether a step's state is laid out as its compiled program takes it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import NamedSharding

from spmd._src.errors import ConfigurationError, message, received
from spmd._src.rules import path_str

if TYPE_CHECKING:
    from spmd._src.strategy.base import Strategy

__all__ = ["check_layout"]


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
