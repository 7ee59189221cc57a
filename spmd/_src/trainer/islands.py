"""The Trainer's state on DiLoCo islands: its entries read and reset as one state's."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmd._src.errors import BatchError, ConfigurationError, message, received
from spmd._src.placement import put_leaf
from spmd._src.strategy.diloco import DiLoCo
from spmd._src.strategy.islands import DiLoCoState

__all__ = ["check_batch_size", "check_options", "entry", "reset", "single", "synchronous"]


def synchronous(strategy: Any) -> Any:
    """The strategy that splits the Trainer's batches and evaluates: a DiLoCo's synchronous
    strategy (its mesh, the batch over islands first), else the strategy itself."""
    return strategy.synchronous if isinstance(strategy, DiLoCo) else strategy


def check_options(strategy: Any, steps_per_execution: int, grad_accum_steps: int) -> None:
    """Raises where a Trainer option has no DiLoCo form yet.

    Raises:
      ConfigurationError: steps_per_execution or grad_accum_steps above 1 with DiLoCo.
    """
    if not isinstance(strategy, DiLoCo):
        return
    for name, value in (
        ("steps_per_execution", steps_per_execution),
        ("grad_accum_steps", grad_accum_steps),
    ):
        if value != 1:
            raise ConfigurationError(
                message(
                    f"A Trainer on spmd.DiLoCo runs one batch per step call ({name}=1): each "
                    "call is every island's inner step, and the sync follows every H-th.",
                    received(**{name: value}, strategy=strategy),
                    f"leave {name} at 1 (a larger global batch gives each island more rows).",
                )
            )


def check_batch_size(strategy: Any, batch_size: Any) -> None:
    """Raises where fit's global batch would not split evenly over DiLoCo's replicas.

    Elsewhere the Trainer pads such a batch with masked rows; on islands the
    padding could fill one island's rows, which would still step its optimizer.

    Raises:
      BatchError: batch_size does not divide by islands x replicas per island.
    """
    if not isinstance(strategy, DiLoCo) or not isinstance(batch_size, int):
        return
    replicas = strategy.num_replicas_in_sync
    if batch_size % replicas:
        raise BatchError(
            message(
                f"On spmd.DiLoCo fit's global batch splits evenly over the {replicas} "
                f"replicas ({strategy.islands} islands x {strategy.replicas_per_island}): "
                "each island steps its own optimizer on its rows, and padding could fill "
                "one island's rows.",
                received(batch_size=batch_size, num_replicas_in_sync=replicas),
                f"pass a batch_size that is a multiple of {replicas}, e.g. "
                f"{-(-batch_size // replicas) * replicas}.",
            )
        )


def entry(state: Any, name: str, default: Any = None) -> Any:
    """The Trainer state's entry `name` as one state holds it.

    Of a `DiLoCoState`: "params" the global parameters; "metrics" the islands'
    sums (a leading island axis, which `averages` adds up); "nan_step" the
    first step at which some island went non-finite (-1: none) and
    "nan_cause" that island's cause; the other entries island 0's.
    """
    if not isinstance(state, DiLoCoState):
        return state.get(name, default)
    if name not in state.islands:
        return default
    if name == "params":
        return state.params
    if name == "metrics":
        return state.islands["metrics"]
    if name in ("nan_step", "nan_cause"):
        return _first_nan(state.islands["nan_step"], state.islands["nan_cause"])[name]
    return jax.tree.map(lambda x: x[0], state.islands[name])


def single(state: Any) -> dict:
    """The state a Trainer's evaluate and predict steps read ("params", "rest"): the
    global parameters and island 0's other state, of a `DiLoCoState`."""
    if not isinstance(state, DiLoCoState):
        return state
    return {"params": state.params, "rest": entry(state, "rest")}


def reset(state: Any, name: str, value: Any) -> Any:
    """`state` with entry `name` set to `value` (every island's, of a `DiLoCoState`),
    placed as the entry was."""
    if not isinstance(state, DiLoCoState):
        state[name] = _like(value, state[name])
        return state
    old = state.islands[name]
    value = jax.tree.map(lambda v, o: jnp.broadcast_to(v, o.shape), value, old)
    return state._replace(islands={**state.islands, name: _like(value, old)})


@jax.jit
def _first_nan(steps: jax.Array, causes: jax.Array) -> dict:
    bad = steps >= 0
    first = jnp.min(jnp.where(bad, steps, jnp.iinfo(steps.dtype).max))
    island = jnp.argmax(bad & (steps == first))
    return {
        "nan_step": jnp.where(bad.any(), first, -1),
        "nan_cause": jnp.where(bad.any(), causes[island], 0),
    }


def _like(values: Any, placed: Any) -> Any:
    """`values` placed as the arrays `placed` are (a reset of part of the train state,
    without resolving the strategy's rules again). The values go through the host: a
    device_put of one device's array to a sharding over several processes makes an array
    whose shards are not its devices' (Orbax cannot save it)."""
    return jax.tree.map(lambda v, a: put_leaf(np.asarray(v), a.sharding), values, placed)
