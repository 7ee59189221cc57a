"""A train state as a checkpoint tree: leaves by '/'-joined path, PRNG keys as key data."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Sharding

from spmd._src.errors import CheckpointError, message, received
from spmd._src.strategy import nnx_state
from spmd._src.strategy.base import get_strategy

__all__ = [
    "Flat",
    "abstract_leaf",
    "check_match",
    "flatten",
    "is_key",
    "nest",
    "target_shardings",
    "to_saveable",
    "unnest",
    "wrap_keys",
]

Flat = dict[str, Any]  # '/'-joined pytree path -> leaf
ROOT = "value"  # the name of a state that is a single array, which has no path
_SHOWN = 8  # paths quoted per kind of difference in a mismatch error


def path_name(keys: tuple) -> str:
    """'params/dense/kernel' for a jax key path; ROOT for the empty path."""
    names = [jax.tree_util.keystr((k,), simple=True) for k in keys]
    return "/".join(names) or ROOT


def flatten(tree: Any) -> tuple[Flat, Callable[[Flat], Any]]:
    """The leaves of a state by path, and a function that rebuilds the state from such leaves.

    NNX objects are read as `nnx.to_pure_dict(nnx.state(tree))`, so their paths
    are attribute names ('model/linear/kernel'); rebuilding writes the new
    leaves into the objects in place and returns them.

    Args:
      tree: a pytree (dicts, lists, optax states, flax structs) or NNX objects.

    Returns:
      (path -> leaf, rebuild) where `rebuild(path -> leaf)` gives `tree`'s form.
    """
    graphdef, pure = nnx_state.split(tree)
    nnx_tree = pure if graphdef is not None else None
    if nnx_tree is not None:
        pure = nnx.to_pure_dict(nnx_tree)
    pairs, treedef = jax.tree_util.tree_flatten_with_path(pure)
    paths = [path_name(p) for p, _ in pairs]
    flat = dict(zip(paths, (leaf for _, leaf in pairs), strict=True))
    _check_unique(paths, len(flat))

    def rebuild(values: Flat) -> Any:
        rebuilt = jax.tree.unflatten(treedef, [values[p] for p in paths])
        if nnx_tree is None:
            return rebuilt
        nnx.replace_by_pure_dict(nnx_tree, rebuilt)
        nnx_state.update(tree, nnx_tree)
        return tree

    return flat, rebuild


def _check_unique(paths: list[str], distinct: int) -> None:
    if distinct == len(paths):
        return
    raise CheckpointError(
        message(
            "Every leaf of a state must have its own path.",
            received(repeated=sorted({p for p in paths if paths.count(p) > 1})[:_SHOWN]),
            "give the containers distinct keys (a dict key '0' beside a list index 0 "
            "name the same path).",
        )
    )


def nest(flat: Flat) -> dict:
    """Nested dicts from '/'-joined paths: the tree Orbax writes, one folder per path part."""
    root: dict = {}
    for path, leaf in flat.items():
        *parents, last = path.split("/")
        node = root
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    found = unnest(root)
    if set(found) != set(flat):
        clashing = sorted(p for p in flat if p not in found)
        raise CheckpointError(
            message(
                "State paths must not clash when split at '/'.",
                received(paths=clashing[:_SHOWN]),
                "rename dict keys that contain '/', or that equal a sibling's path.",
            )
        )
    return root


def unnest(tree: Mapping, is_leaf: Callable[[Any], bool] | None = None) -> Flat:
    """The inverse of `nest`: path -> leaf of a nested mapping."""
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {path_name(p): leaf for p, leaf in pairs}


def is_key(x: Any) -> bool:
    """Whether `x` (an array or ShapeDtypeStruct) is a typed PRNG key array."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def to_saveable(flat: Flat) -> tuple[Flat, dict[str, str]]:
    """Leaves Orbax can write: typed PRNG keys become their key data, scalars arrays.

    Returns:
      (path -> array, path -> PRNG implementation name of each key leaf).
    """
    keys = {p: str(jax.random.key_impl(x)) for p, x in flat.items() if is_key(x)}
    arrays = {
        p: jax.random.key_data(x) if p in keys else x if hasattr(x, "dtype") else np.asarray(x)
        for p, x in flat.items()
    }
    return arrays, keys


def sharding_of(leaf: Any) -> Sharding | None:
    """A leaf's sharding: a jax.Array's, a ShapeDtypeStruct's (maybe None); None for numpy."""
    if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        return leaf.sharding
    return None


def target_shardings(target: Any, flat: Flat) -> dict[str, Sharding]:
    """Each target leaf's sharding; leaves without one take the current strategy's."""
    shardings = {p: sharding_of(leaf) for p, leaf in flat.items()}
    if all(s is not None for s in shardings.values()):
        return shardings

    tree = get_strategy().state_sharding(target)
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    by_strategy = unnest(tree, is_leaf=lambda x: isinstance(x, Sharding))
    return {p: s if s is not None else by_strategy[p] for p, s in shardings.items()}


def abstract_leaf(leaf: Any, sharding: Sharding) -> jax.ShapeDtypeStruct:
    """What Orbax restores a target leaf as: its shape and dtype (key data for keys), placed."""
    if is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    x = leaf if hasattr(leaf, "dtype") else np.asarray(leaf)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def wrap_keys(values: Flat, target: Flat) -> Flat:
    """Key data back into typed PRNG keys wherever the target has a key."""
    return {
        p: jax.random.wrap_key_data(v, dtype=target[p].dtype) if is_key(target[p]) else v
        for p, v in values.items()
    }


def check_restored_dtypes(saved: dict[str, tuple], values: Flat, step: int) -> None:
    """Raises a CheckpointError naming arrays restored in another dtype than saved.

    With 64-bit mode off, jax holds a float64/int64 array as float32/int32:
    the values are not the saved ones, though the files are intact, so this
    is not damage (a checksum mismatch) and must not be skipped as such.

    Args:
      saved: path -> (shape, dtype) of the checkpoint.
      values: path -> restored array.
      step: the checkpoint's step, for the message.
    """
    differ = {
        p: f"saved {np.dtype(saved[p][1])}, restored {np.dtype(v.dtype)}"
        for p, v in values.items()
        if p in saved and np.dtype(saved[p][1]) != np.dtype(v.dtype)
    }
    if not differ:
        return
    raise CheckpointError(
        message(
            "A restored array has the dtype it was saved with (the checkpoint is intact; "
            "jax cannot hold that dtype now).",
            received(
                step=step,
                dtype_differs=_clip([f"{p}: {d}" for p, d in sorted(differ.items())]),
                jax_enable_x64=bool(jax.config.jax_enable_x64),
            ),
            "turn 64-bit mode on before restoring (jax.config.update('jax_enable_x64', "
            "True)) as when it was saved, or restore without a target (numpy, as saved) "
            "and cast the 64-bit leaves to 32 bits yourself.",
        )
    )


def check_match(
    saved: dict[str, tuple],
    wanted: dict[str, tuple],
    step: int,
    partial: bool = False,
    diloco: bool = False,
) -> None:
    """Raises a CheckpointError naming the paths where a checkpoint and a target differ.

    Args:
      saved: path -> (shape, dtype) of the checkpoint.
      wanted: path -> (shape, dtype) the target asks for.
      step: the checkpoint's step, for the message.
      partial: the target may leave out paths of the checkpoint.
      diloco: the target is a `DiLoCoState`: where it differs from the
        checkpoint only in the island count (the leading axis of its `islands`
        leaves), the message says to restore with `strategy.restore(...,
        islands=<saved>)`.
    """
    missing = sorted(set(wanted) - set(saved))
    extra = [] if partial else sorted(set(saved) - set(wanted))
    differ = [
        p
        for p in sorted(set(saved) & set(wanted))
        if tuple(saved[p][0]) != tuple(wanted[p][0]) or np.dtype(saved[p][1]) != wanted[p][1]
    ]
    if not (missing or extra or differ):
        return
    parts = {
        "in_target_not_in_checkpoint": missing,
        "in_checkpoint_not_in_target": extra,
        "shape_or_dtype_differs": [
            f"{p}: saved {_describe(*saved[p])}, target {_describe(*wanted[p])}" for p in differ
        ],
    }
    got = received(step=step, **{k: _clip(v) for k, v in parts.items() if v})
    counts = _island_counts(saved, wanted, differ) if diloco and not (missing or extra) else None
    fix = (
        "build the target with the same create function and model config as the saved "
        "run (e.g. strategy.abstract_state(create_fn, ...)), or restore with target=None "
        "to inspect the checkpoint as numpy arrays."
    )
    if counts is not None:
        found, target = counts
        fix = (
            f"this DiLoCo checkpoint holds {found} islands (the leading axis of "
            f"state.islands) and the target {target}: restore it with "
            f"strategy.restore(manager, create_fn, key, islands={found}), which restores it "
            f"into the strategy's {target} islands (each restarting from the global "
            "parameters; the inner steps since the last sync are dropped)."
        )
    raise CheckpointError(
        message(
            "The restore target must have the checkpoint's tree: the same paths, each with "
            "the saved shape and dtype.",
            got,
            fix,
        )
    )


def _island_counts(
    saved: dict[str, tuple], wanted: dict[str, tuple], differ: list[str]
) -> tuple[int, int] | None:
    """(saved, target) island counts where a DiLoCo checkpoint and its target differ in
    that alone: every differing leaf under `islands/`, of the same dtype and shape but
    for its leading (island) axis, one count on each side; else None."""
    counts = set()
    for p in differ:
        (was, was_dtype), (now, now_dtype) = saved[p], wanted[p]
        if (
            not p.startswith("islands/")
            or not was
            or len(was) != len(now)
            or tuple(was[1:]) != tuple(now[1:])
            or np.dtype(was_dtype) != np.dtype(now_dtype)
        ):
            return None
        counts.add((int(was[0]), int(now[0])))
    return counts.pop() if len(counts) == 1 else None


def _describe(shape: tuple, dtype: Any) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


def _clip(items: list[str]) -> list[str]:
    return items if len(items) <= _SHOWN else [*items[:_SHOWN], f"... {len(items) - _SHOWN} more"]
