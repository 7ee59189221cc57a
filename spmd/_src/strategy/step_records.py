"""The compiled step's internals as small named records: a program, a call, a trace's findings, the fast path."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

from spmd._src.strategy import nnx_state

__all__ = ["Call", "Hot", "Outcome", "Program", "Traced", "any_deleted", "hot", "signature"]

_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")
IS_DELETED = operator.methodcaller("is_deleted")


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

    __slots__ = ("traces", "value")

    def __init__(self) -> None:
        self.value: Traced | None = None
        self.traces = 0  # how many times jit traced (and so compiled) the program


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
      signature: the batch's `signature` when already computed (the fast path).
    """

    state: Any
    pure: Any
    leaves: list
    data_def: Any
    kwargs: dict
    static: tuple | None
    binding: nnx_state.Binding | None
    signature: tuple | None = None


class Hot:
    """What the last call of a Step returned and ran: the steady-state fast path.

    A plain class with slots, built once per call: the fast path pays for
    nothing it does not read.
    """

    __slots__ = (
        "binding",
        "data_def",
        "flat_state",
        "plain",
        "program",
        "signature",
        "state",
        "state_def",
        "state_leaves",
        "static",
    )

    def __init__(
        self,
        state: Any,
        state_leaves: list,
        data_def: Any,
        signature: tuple,
        static: tuple,
        program: Program,
        binding: nnx_state.Binding | None = None,  # for NNX state: its split, kept
        state_def: Any = None,  # for a pytree state: its structure and leaves, as returned
        flat_state: Any = (),
    ):
        self.state, self.state_leaves, self.data_def = state, state_leaves, data_def
        self.signature, self.static, self.program = signature, static, program
        self.binding, self.state_def, self.flat_state = binding, state_def, flat_state
        # A pytree state rebuilt from the program's leaves, no keyword arguments, one
        # process: the Step's inlined fast path (`Step._run_plain`) applies.
        self.plain = (
            binding is None and static == () and flat_state is state_leaves and not multiprocess()
        )

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
        leaves, treedef = flatten(state)
        return treedef == self.state_def and all(map(operator.is_, leaves, self.flat_state))


def hot(
    call: Call,
    program: Program,
    next_state: Any,
    new_leaves: Any,
    state_def: Any,
) -> Hot | None:
    """The fast path's record after a call that returned `next_state`; None when the
    state the caller holds is not what the program ran on (a read-only step given
    arrays the call had to place: each call places them again)."""
    if call.binding is not None:
        flat_state, state_def = (), None
    elif next_state is not call.state:  # rebuilt from these leaves: no flatten needed
        flat_state = new_leaves
    else:
        flat_state, state_def = flatten(next_state)
        if not all(map(operator.is_, flat_state, call.pure)):
            return None
    return Hot(
        next_state,
        arrays(next_state) if new_leaves is None else new_leaves,
        call.data_def,
        signature(call.leaves) if call.signature is None else call.signature,
        call.static,
        program,
        call.binding,
        state_def,
        flat_state,
    )


flatten = jax.tree_util.tree_flatten  # bound once: the fast paths call it every step


@functools.cache
def multiprocess() -> bool:
    """Whether this job has several processes (fixed once JAX has started)."""
    return jax.process_count() > 1


def spans_processes(mesh: Any) -> bool:
    """Whether `mesh` holds devices of several processes: its programs run on all of
    them together, so they agree on their arguments. A strategy over one process's
    devices (`MirroredStrategy()` in a job of several) runs apart on each."""
    try:
        return _spans_processes(mesh)
    except TypeError:  # an unhashable mesh: not cached
        return _spans_processes.__wrapped__(mesh)


@functools.lru_cache(maxsize=64)
def _spans_processes(mesh: Any) -> bool:
    return len({d.process_index for d in np.asarray(mesh.devices).flat}) > 1


def signature(leaves: list) -> tuple:
    """Shape and dtype of each batch leaf: what must match for the fast path."""
    try:  # arrays, numpy or jax: the common case, without a Python loop
        return tuple(map(_SHAPE_DTYPE, leaves))
    except AttributeError:
        return tuple(
            (x.shape, x.dtype) if hasattr(x, "dtype") else (np.shape(x), type(x)) for x in leaves
        )


def any_deleted(leaves: list) -> bool:
    """Whether an array of `leaves` (jax.Arrays) was deleted: donated to another call since."""
    return any(map(IS_DELETED, leaves))


def arrays(tree: Any) -> list:
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
