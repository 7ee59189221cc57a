"""What a Strategy checks of its arguments: the mesh's rules, placement and a step's options."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from spmd._src.errors import ConfigurationError, message, received, warn

__all__ = [
    "check_batch_axis",
    "check_donate",
    "check_host_memory",
    "check_rule",
    "check_rules_list",
    "static_names",
    "warn_if_one_process_of_many",
]

ONE_PROCESS_OF_MANY = (
    "This strategy's mesh holds only process {me}'s {n} device(s), but {count} processes "
    "joined this job: each process trains on its own, with its own state and no all-reduce "
    "between them (a strategy over local devices, as tf.distribute's MirroredStrategy in "
    "each worker). To train one model over every process, use "
    "spmd.MultiWorkerMirroredStrategy() (or a mesh of jax.devices(), not "
    "jax.local_devices())."
)


def check_rules_list(rules: Any) -> tuple[tuple[str, Any], ...]:
    """The rules as a tuple of (regex, spec) pairs, each regex compiled once to check it.

    Raises:
      ConfigurationError: `rules` is not a sequence of pairs, a regex is not a
        string or does not compile, or a spec is not a PartitionSpec, None or a
        partitioner (a callable).
    """
    if isinstance(rules, str | bytes) or not isinstance(rules, Sequence | tuple | list):
        _bad_rule(rules, "rules is a sequence of (regex, spec) pairs")
    out = []
    for rule in rules:
        if isinstance(rule, str | bytes) or not isinstance(rule, Sequence) or len(rule) != 2:
            _bad_rule(rule, "each rule is a (regex, spec) pair")
        pattern, spec = rule
        if not isinstance(pattern, str):
            _bad_rule(rule, "a rule's regex is a string")
        try:
            re.compile(pattern)
        except re.error as error:
            _bad_rule(rule, f"a rule's regex compiles ({error})")
        if not (spec is None or isinstance(spec, PartitionSpec) or callable(spec)):
            _bad_rule(rule, "a rule's spec is a PartitionSpec, None (replicate) or a partitioner")
        out.append((pattern, spec))
    return tuple(out)


def _bad_rule(rule: Any, expected: str) -> None:
    raise ConfigurationError(
        message(
            f"Strategy rules are (regex, spec) pairs over '/'-joined state paths: {expected}.",
            received(rule=rule),
            'write e.g. rules=[(r".*/kernel", P(None, "model")), (r".*", None)]; '
            "escape regex characters such as '(' with a backslash.",
        )
    )


def check_donate(donate: Any) -> Any:
    if donate is not None and not isinstance(donate, bool):
        raise ConfigurationError(
            message(
                "donate is True or False.",
                received(donate=donate, type=type(donate).__name__),
                "pass donate=True (reuse the state's buffers) or donate=False.",
            )
        )
    return donate


def static_names(names: Any) -> tuple[str, ...]:
    """static_argnames as a tuple: one name, as jax.jit takes it, or a sequence of names."""
    names = (names,) if isinstance(names, str) else names
    try:
        names = tuple(names)
    except TypeError:
        names = (names,)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise ConfigurationError(
            message(
                "static_argnames names keyword arguments: a string or a sequence of strings.",
                received(static_argnames=names),
                'pass e.g. static_argnames=("training",) or static_argnames="training".',
            )
        )
    return names


def check_batch_axis(axis: Any) -> int:
    if isinstance(axis, bool) or axis not in (0, 1):
        raise ConfigurationError(
            message(
                "batch_axis is 0 (one batch per call) or 1 (K batches stacked for one call).",
                received(batch_axis=axis),
                "pass batch_axis=0, or batch_axis=1 for data of shape (K, batch, ...); "
                "move another batch axis to the front first (jnp.moveaxis).",
            )
        )
    return int(axis)


def check_rule(rule: tuple, mesh: Mesh) -> None:
    """A (regex, spec) rule whose PartitionSpec names each mesh axis at most once."""
    spec = rule[1] if len(rule) == 2 else None
    if not isinstance(spec, PartitionSpec):
        return
    named = [a for part in spec for a in ((part,) if isinstance(part, str) else part or ())]
    unknown = [a for a in named if a not in mesh.shape]
    repeated = sorted({a for a in named if named.count(a) > 1})
    if unknown or repeated:
        raise ConfigurationError(
            message(
                "A rule's PartitionSpec names axes of the mesh, each at most once "
                "(an array cannot be split twice over one axis).",
                received(rule=rule[0], spec=spec, mesh_axes=mesh.axis_names),
                f"use each of {mesh.axis_names} at most once, e.g. P(None, 'model'); "
                "split one array dimension over two axes as P(('data', 'model'),).",
            )
        )


def check_host_memory(mesh: Mesh, placement: str = "host") -> None:
    """Raises unless the mesh's devices offer `pinned_host` memory, which `placement` uses."""
    device = mesh.devices.flat[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" not in kinds:
        what = "the state" if placement == "host" else "the optimizer state"
        raise ConfigurationError(
            message(
                f"placement={placement!r} keeps {what} in `pinned_host` memory, which this "
                "backend does not offer.",
                received(platform=device.platform, memory_kinds=sorted(kinds), placement=placement),
                "use placement='device' (e.g. MirroredStrategy, or a Strategy with FSDP rules "
                "to spread the optimizer state over the devices) on this backend.",
            )
        )


def warn_if_one_process_of_many(mesh: Mesh, name: str | None) -> None:
    """Warns when a strategy spans only this process's devices in a job of several."""
    if name in ("DefaultStrategy", "OneDeviceStrategy") or jax.process_count() == 1:
        return
    me = jax.process_index()
    devices = list(mesh.devices.flat)
    if all(getattr(d, "process_index", me) == me for d in devices):
        warn(ONE_PROCESS_OF_MANY.format(me=me, n=len(devices), count=jax.process_count()))
