"""Flax NNX objects as train state: split into a graph and pure arrays, and back."""

from __future__ import annotations

import operator
from typing import Any

import jax
from flax import nnx
from flax.nnx import graphlib

__all__ = [
    "Binding",
    "has_graph",
    "inner_merge",
    "inner_split",
    "merge",
    "merge_back",
    "pure",
    "replace",
    "split",
    "update",
    "updating",
]

_RAW = operator.attrgetter("_raw_value")
_SET = object.__setattr__


def _is_object(x: Any) -> bool:
    """An NNX object with a graph (module, optimizer, Rngs); a bare Variable is a leaf's box."""
    return nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable)


def has_graph(tree: Any) -> bool:
    """Whether `tree` holds flax NNX objects (modules, optimizers); `nnx.State`s are pure."""
    return any(_is_object(x) for x in jax.tree.leaves(tree, is_leaf=_is_object))


def split(tree: Any, tag: Any = None) -> tuple[Any, Any]:
    """Returns (graphdef, pure state), or (None, tree) when `tree` holds no NNX object.

    With `tag`, inside `updating(tag)`, this is the outer split of flax's update
    context (what `nnx.jit` does): the objects are remembered, so that
    `merge_back` can update them in place after a step changed their structure.
    """
    if not has_graph(tree):
        return None, tree
    if tag is None or not _active(tag):
        return nnx.split(tree)
    with graphlib.split_context(tag) as ctx:
        return ctx.split(tree)


def updating(tag: Any) -> Any:
    """flax's update context for one call of a step (`nnx.update_context`)."""
    return graphlib.update_context(tag)


def _active(tag: Any) -> bool:
    return tag in graphlib.GRAPH_CONTEXT.update_context_stacks


def _outer_split_done(tag: Any) -> bool:
    return _active(tag) and graphlib.current_update_context(tag).outer_ref_outer_index is not None


def inner_merge(tag: Any, graphdef: Any, pure_state: Any) -> Any:
    """Inside the traced step: the NNX objects again, linked to the caller's objects."""
    if not _outer_split_done(tag):
        return nnx.merge(graphdef, pure_state)
    with graphlib.merge_context(tag, inner=True) as ctx:
        return ctx.merge(graphdef, pure_state)


def inner_split(tag: Any, graphdef: Any, live: Any) -> tuple[Any, Any, bool]:
    """Inside the traced step, after the function ran: (graphdef, pure state, unchanged).

    `unchanged` says that the objects kept the structure they came in with (no
    attribute rebound, no Variable added by `sow` or created lazily): then the
    new arrays are simply written back. Otherwise the returned graphdef is
    what `merge_back` needs to update the caller's objects as `nnx.jit` does.
    """
    if not _outer_split_done(tag):
        new_graphdef, new_state = nnx.split(live)
        return new_graphdef, new_state, new_graphdef == graphdef
    with graphlib.split_context(tag) as ctx:
        new_graphdef, new_state = ctx.split(live)
    return new_graphdef, new_state, new_graphdef.with_no_outer_index() == graphdef


def merge_back(tag: Any, graphdef: Any, pure_state: Any) -> None:
    """After a step that changed the objects' structure: updates the caller's objects.

    Runs inside the `updating(tag)` of the call whose `split(tree, tag)` made
    the input: attributes rebound, Variables added or removed inside the step
    are set on the original objects, in place, as `nnx.jit` does.
    """
    with graphlib.merge_context(tag, inner=False) as ctx:
        ctx.merge(graphdef, pure_state)


def merge(graphdef: Any, pure_state: Any) -> Any:
    """Inverse of `split`: NNX objects again, or the pure tree when there was no graph."""
    return pure_state if graphdef is None else nnx.merge(graphdef, pure_state)


def pure(tree: Any) -> Any:
    """The arrays of `tree`: `nnx.state` of NNX objects, the tree itself otherwise."""
    return split(tree)[1]


def update(tree: Any, pure_state: Any) -> None:
    """Writes new arrays into the NNX objects of `tree`, in place."""
    nnx.update(tree, pure_state)


def replace(tree: Any, pure_state: Any) -> Any:
    """`pure_state` in the form of `tree`: NNX objects updated in place, or the new tree."""
    if not has_graph(tree):
        return pure_state
    update(tree, pure_state)
    return tree


class Binding:
    """NNX objects split once, reused while nothing but the step has touched them.

    A step's NNX state is split into a graph and arrays on the first call. On
    later calls `matches` checks, without splitting again, that the objects are
    the same, that no module gained, lost or rebound an attribute (e.g. a
    `deterministic` flag), and that every Variable still holds the array the
    step wrote; `write` puts the step's new arrays into the Variables.
    """

    def __init__(self, tree: Any, pure_state: Any):
        self.tree = tree
        self.roots, self.top_def = jax.tree.flatten(tree, is_leaf=_is_object)
        self.variables = jax.tree.leaves(pure_state, is_leaf=_is_variable)
        self.nodes = [
            node for _, node in nnx.graph.iter_graph(tree) if not isinstance(node, nnx.Variable)
        ]
        self.snapshots = [_snapshot(node) for node in self.nodes]
        self.arrays = [v.get_raw_value() for v in self.variables]
        self.state_def = jax.tree.structure(pure_state)
        self.usable = all(
            isinstance(a, jax.Array) and not v.get_metadata().get("ref") and not v.hijax
            for v, a in zip(self.variables, self.arrays, strict=True)
        )

    def matches(self, tree: Any) -> bool:
        """Whether `tree` is still exactly what was bound (same objects, graph and arrays).

        Identity checks only, in C loops: the cost of a pytree step's own checks.
        """
        roots, top_def = jax.tree.flatten(tree, is_leaf=_is_object)
        if top_def != self.top_def or any(map(operator.is_not, roots, self.roots)):
            return False
        if any(map(operator.is_not, map(_RAW, self.variables), self.arrays)):
            return False
        for node, before in zip(self.nodes, self.snapshots, strict=True):
            now = _snapshot(node)
            if len(now) != len(before) or any(map(operator.is_not, now, before)):
                return False
        return True

    def write(self, arrays: list) -> None:
        """Puts the step's new arrays into the Variables, in place (as `nnx.update` would).

        Outside any trace, into plain (not ref, not hijax) Variables, this is
        what `Variable.set_raw_value` ends in, without its per-call trace checks.
        """
        if not self.usable:
            nnx.update(self.tree, jax.tree.unflatten(self.state_def, arrays))
            return
        for variable, array in zip(self.variables, arrays, strict=True):
            _SET(variable, "_raw_value", array)
        self.arrays = arrays


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _snapshot(node: Any) -> tuple:
    """What a graph node refers to: its attributes' values, or a container's items."""
    if isinstance(node, dict):
        return (*node.keys(), *node.values())
    if isinstance(node, list | tuple):
        return tuple(node)
    return tuple(vars(node).values()) if hasattr(node, "__dict__") else ()
