"""The compiled step's internals as small named records: a program, a call, a trace's findings, the fast path."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

from spmd.strategy import nnx_state

__all__ = ["Call", "Hot", "Outcome", "Program", "Traced", "any_deleted", "hot", "signature"]


@dataclass(frozen=True)
class Traced:
    """What tracing the step found out about its return, which only the trace can tell.

    Attributes:
      returns: "state", "tuple" or "metrics" for a pytree state (see
        `_split_output`); None for NNX state.
      state_def: the new state's structure (None when the step only reads it).
      graphdef: for NNX state, the objects' graph after the step.
      same_graph: whether that graph is the one the step was given.
    """

    returns: str | None
    state_def: Any
    graphdef: Any = None
    same_graph: bool = True


class Outcome:
    """The one slot a traced step writes its `Traced` into.

    Tracing runs inside jit's first call of a program (and again on a retrace),
    so the record cannot be a return value of `_compile`: the caller reads it
    after each call, when it is always set.
    """

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Traced | None = None


class Program(NamedTuple):
    """One compiled program of a Step, with its flat shardings and its trace's record."""

    compiled: Callable
    data_shardings: list
    state_shardings: list
    traced: Outcome


class Call(NamedTuple):
    """One call's arguments as the program takes them.

    Attributes:
      state: the state as passed (a pytree, or NNX objects).
      pure: its arrays as the program takes them (the pytree, or NNX's flat list).
      leaves: the batch's flat leaves; data_def their structure.
      kwargs: the non-static keyword arguments.
      static: the static keyword arguments' cache key, None when some are not static.
      binding: for NNX state, its split (kept while nothing else touches it).
    """

    state: Any
    pure: Any
    leaves: list
    data_def: Any
    kwargs: dict
    static: tuple | None
    binding: nnx_state.Binding | None


@dataclass(frozen=True)
class Hot:
    """What the last call of a Step returned and ran: the steady-state fast path."""

    state: Any
    state_leaves: list
    data_def: Any
    signature: tuple
    static: tuple
    program: Program
    binding: nnx_state.Binding | None = None  # for NNX state: its split, kept
    state_def: Any = None  # for a pytree state: its structure and leaves, as returned
    flat_state: tuple = ()

    def holds(self, state: Any) -> bool:
        """Whether `state` is what the last call returned, untouched since.

        For a pytree state its structure and every leaf are compared too (one
        flatten): a dict that gained a key or had a leaf replaced in place goes
        through the checked path.
        """
        if self.binding is not None:
            return self.binding.matches(state)
        if state is not self.state:
            return False
        leaves, treedef = jax.tree.flatten(state)
        return treedef == self.state_def and all(map(operator.is_, leaves, self.flat_state))


def hot(call: Call, program: Program, next_state: Any, new_leaves: Any, state_def: Any) -> Hot:
    """The fast path's record after a call that returned `next_state`."""
    if call.binding is not None:
        flat_state, state_def = (), None
    elif next_state is not call.state:  # rebuilt from these leaves: no flatten needed
        flat_state = new_leaves
    else:
        flat_state, state_def = jax.tree.flatten(next_state)
    return Hot(
        next_state,
        arrays(next_state) if new_leaves is None else new_leaves,
        call.data_def,
        signature(call.leaves),
        call.static,
        program,
        call.binding,
        state_def,
        tuple(flat_state),
    )


def signature(leaves: list) -> tuple:
    """Shape and dtype of each batch leaf: what must match for the fast path."""
    return tuple(
        (x.shape, x.dtype) if hasattr(x, "dtype") else (np.shape(x), type(x)) for x in leaves
    )


def any_deleted(leaves: list) -> bool:
    """Whether an array of `leaves` (jax.Arrays) was deleted: donated to another call since."""
    return any(x.is_deleted() for x in leaves)


def arrays(tree: Any) -> list:
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
