"""Flax NNX objects as train state: split into a graph and pure arrays, and back."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

__all__ = ["has_graph", "merge", "pure", "replace", "split", "update"]


def _is_object(x: Any) -> bool:
    """An NNX object with a graph (module, optimizer, Rngs); a bare Variable is a leaf's box."""
    return nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable)


def has_graph(tree: Any) -> bool:
    """Whether `tree` holds flax NNX objects (modules, optimizers); `nnx.State`s are pure."""
    return any(_is_object(x) for x in jax.tree.leaves(tree, is_leaf=_is_object))


def split(tree: Any) -> tuple[Any, Any]:
    """Returns (graphdef, pure state), or (None, tree) when `tree` holds no NNX object."""
    if not has_graph(tree):
        return None, tree
    return nnx.split(tree)


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
