"""Placing a state on a mesh across processes from values each process holds whole."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from spmd._src.clusters.agreement import Agreement
from spmd._src.clusters.jax_state import coordination_client
from spmd._src.data.host_batches import fingerprint
from spmd._src.errors import BatchError, ConfigurationError, message, received
from spmd._src.placement import from_host, put_leaf
from spmd._src.rules import is_key, path_str

__all__ = ["buffers", "own_buffers", "place_state"]

# How long a process waits for the others to place the same state.
AGREE_TIMEOUT_S = 300.0
# Each placement that compares values takes the next number, in the same order on
# every process (they run the same program: the same puts in the same order).
_PLACEMENTS = itertools.count()


@dataclass(frozen=True)
class _HostKey:
    """A typed PRNG key array on the host: its key data and its implementation."""

    data: np.ndarray
    impl: Any


def place_state(tree: Any, shardings: Any) -> Any:
    """`tree` placed in `shardings` (a pytree of `NamedSharding` of the same structure).

    With several processes and a sharding across them, a leaf each process
    holds whole (host data, or an array on the process's own devices: a model
    built outside `strategy.scope()`) is the global value: each process puts
    the parts its devices hold. So that no process contributes another value,
    the processes first compare a fingerprint of each such leaf (CRC-32 of a
    sample of its rows), in one exchange through the coordination service.

    Every placed leaf owns its device memory (`own_buffers`): leaves that
    would share a buffer (one array at two paths, `{"params": p, "ema": p}`)
    are each given a copy, so that a step can donate them.

    Raises:
      ConfigurationError: the processes hold different values for a leaf
        (naming it), or one did not place its state within `AGREE_TIMEOUT_S`.
    """
    if jax.process_count() == 1:
        leaves, treedef = jax.tree.flatten(tree)
        placed = map(put_leaf, leaves, treedef.flatten_up_to(shardings))
        return treedef.unflatten(own_buffers(list(placed)))
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    targets = treedef.flatten_up_to(shardings)
    held = {
        i: _host_value(leaf)
        for i, ((_, leaf), sharding) in enumerate(zip(flat, targets, strict=True))
        if _held_whole(leaf, sharding)
    }
    if held:
        _check_same([path_str(flat[i][0]) for i in held], list(held.values()))
    leaves = [
        _from_host(held[i], sharding) if i in held else put_leaf(leaf, sharding)
        for i, ((_, leaf), sharding) in enumerate(zip(flat, targets, strict=True))
    ]
    return treedef.unflatten(own_buffers(leaves))


def buffers(x: Any) -> frozenset[int]:
    """The device buffers of this process's shards of `x` (empty for anything but a
    live concrete jax.Array): two arrays that share one cannot both be donated."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or x.is_deleted():
        return frozenset()
    return frozenset(shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards)


def own_buffers(leaves: list) -> list:
    """`leaves`, each that shares a device buffer with an earlier one replaced by a copy.

    Placing a state must not leave two leaves on one buffer: a step donates
    its state, and XLA given one buffer twice refuses the call (one device)
    or crashes the process (several). Two leaves are two values of a pytree
    state, which the step updates apart, so a copy is what they mean: a
    parameter EMA that starts as the parameters (`{"params": p, "ema": p}`),
    or an optimizer state whose `init` returns the parameters.
    """
    seen: set[int] = set()
    out = leaves
    for i, leaf in enumerate(leaves):
        held = buffers(leaf)
        if held.isdisjoint(seen):
            seen |= held
            continue
        if out is leaves:
            out = list(leaves)
        out[i] = jax.device_put(leaf, leaf.sharding, may_alias=False)
        seen |= buffers(out[i])
    return out


def _held_whole(leaf: Any, sharding: NamedSharding) -> bool:
    """Whether `leaf` is a whole value on this process for a sharding across processes."""
    if sharding.is_fully_addressable or isinstance(leaf, jax.core.Tracer):
        return False
    return not isinstance(leaf, jax.Array) or leaf.is_fully_addressable


def _host_value(leaf: Any) -> np.ndarray | _HostKey:
    if is_key(leaf):
        return _HostKey(np.asarray(jax.random.key_data(leaf)), jax.random.key_impl(leaf))
    return np.asarray(leaf)


def _from_host(value: np.ndarray | _HostKey, sharding: NamedSharding) -> jax.Array:
    """The global array of a value every process holds: each puts its devices' parts."""
    if isinstance(value, _HostKey):
        data = _from_host(value.data, sharding)  # the key's trailing data axis: replicated
        return jax.random.wrap_key_data(data, impl=value.impl)
    return from_host(value, sharding)


def _check_same(paths: list[str], values: list[np.ndarray | _HostKey]) -> None:
    """Raises unless every process holds the same `values` (compared by fingerprint)."""
    client = coordination_client()
    if client is None:
        return
    prints = [fingerprint(v.data if isinstance(v, _HostKey) else v) for v in values]
    # One prefix, an index per placement: process 0 deletes each placement's keys at the next.
    agreement = _SameValues(client, AGREE_TIMEOUT_S, "spmd/place", paths)
    try:
        agreement.agree(next(_PLACEMENTS), {"fingerprints": prints})
    except BatchError as error:
        raise ConfigurationError(str(error)) from None


class _SameValues(Agreement):
    """Every process holds the same value for each leaf it places whole."""

    def __init__(self, client: Any, timeout: float, prefix: str, paths: list[str]) -> None:
        super().__init__(client, timeout, prefix)
        self._paths = paths

    def compare(self, records: list[dict], index: int) -> None:
        prints = [r["fingerprints"] for r in records]
        if all(p == prints[0] for p in prints):
            return
        leaf = next(
            (i for i, column in enumerate(zip(*prints, strict=False)) if len(set(column)) > 1),
            min(map(len, prints)),
        )
        where = self._paths[leaf] if leaf < len(self._paths) else "(the number of leaves)"
        per_process = {p: (f[leaf] if leaf < len(f) else len(f)) for p, f in enumerate(prints)}
        raise BatchError(_different_values(where, per_process))

    def missing_message(self, process: int, index: int) -> str:
        return message(
            f"Every process places the state within {self._timeout:g} s of the others: "
            "the processes compare the values they place.",
            received(missing_process=process),
            "call strategy.put (or build the Trainer, or call the step) on every process, "
            "in the same order.",
        )


def _different_values(leaf: str, per_process: dict[int, Any]) -> str:
    return message(
        "With several processes, a state leaf each process holds whole (numpy data, or an "
        "array on the process's own devices: a model built outside strategy.scope()) is the "
        "global value, so every process must hold the same value.",
        received(leaf=leaf, fingerprint_per_process=per_process),
        "build the model from the same seed on every process (e.g. nnx.Rngs(0), not a seed "
        "that depends on the process), or create the state where it lives: "
        "`with strategy.scope(): state = strategy.init(create_fn, key)`.",
    )
