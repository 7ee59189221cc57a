"""DiLoCoState: the train state of spmd.DiLoCo, a pytree of four parts."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

__all__ = ["DiLoCoState"]


class DiLoCoState(NamedTuple):
    """A DiLoCo train state: a pytree that `spmd.CheckpointManager` saves and restores.

    Attributes:
      params: the global parameters (the `params` part of your state), kept on every
        island's devices, laid out as inside one island.
      outer: the outer optimizer's state, one per fragment.
      islands: your state, one per island: every leaf has a leading island axis,
        sharded over the mesh's `island` axis (inner optimizer state kept per island).
      step: inner steps taken (int32); the sync schedule counts from it.
    """

    params: Any
    outer: tuple
    islands: Any
    step: jax.Array
