"""Partition rules over pytree paths, and the variable partitioners of tf.distribute."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd._src.errors import ConfigurationError, message, received, shown_as_public, warn
from spmd._src.logical import Annotation, LogicalRules, annotations, check_mapped, to_spec
from spmd._src.validate import positive_int

__all__ = [
    "FixedShardsPartitioner",
    "LayoutConflictWarning",
    "LeafLayout",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "Rule",
    "is_key",
    "matches",
    "path_str",
    "resolve_sources",
    "resolve_specs",
]

_UNMATCHED = object()


class Partitioner(Protocol):
    """Decides how many shards a variable is split into along its first axis.

    Called as tf.distribute calls it: `partitioner(shape, dtype)` returns one
    shard count per dimension, of which spmd uses the first. `round_up` says
    whether a count the mesh cannot make is rounded up (a size cap) or down.
    """

    round_up: bool

    def __call__(self, shape: Sequence[int], dtype: Any) -> list[int]: ...


# A rule maps a regex over the '/'-joined path to a spec, to None (replicate) or
# to a partitioner that picks the spec from the leaf's shape and dtype.
Rule = tuple[str, PartitionSpec | None | Partitioner]


def is_key(leaf: Any) -> bool:
    """Whether `leaf` (an array or `ShapeDtypeStruct`) is a typed PRNG key array."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _nbytes(shape: Sequence[int], dtype: Any, bytes_per_string: int) -> int:
    dtype = np.dtype(dtype)
    itemsize = bytes_per_string if dtype.kind in "OSU" else dtype.itemsize
    return math.prod(shape) * itemsize


def _check_positive(name: str, value: int | None, cls: str) -> None:
    if value is not None:
        positive_int(value, f"{cls}.{name}", fix=f"pass e.g. {cls}({name}=2).")


def _counts(shape: Sequence[int], num_shards: int) -> list[int]:
    if not shape:
        return []
    return [max(1, min(num_shards, shape[0]))] + [1] * (len(shape) - 1)


@dataclass(frozen=True)
class FixedShardsPartitioner:
    """Splits every variable into `num_shards` shards along its first axis.

    Args:
      num_shards: the number of shards; fewer if the first axis is shorter.
    """

    num_shards: int
    round_up = False

    def __post_init__(self):
        _check_positive("num_shards", self.num_shards, "FixedShardsPartitioner")

    def __call__(self, shape: Sequence[int], dtype: Any = np.float32) -> list[int]:
        return _counts(shape, self.num_shards)


@dataclass(frozen=True)
class MinSizePartitioner:
    """Shards a variable as much as it can while each shard keeps `min_shard_bytes`.

    Args:
      min_shard_bytes: the smallest shard worth making; smaller variables stay whole.
      max_shards: at most this many shards; by default as many as there are devices.
      bytes_per_string: the size assumed for one string element.
    """

    min_shard_bytes: int = 256 << 10
    max_shards: int | None = None
    bytes_per_string: int = 16
    round_up = False

    def __post_init__(self):
        _check_positive("min_shard_bytes", self.min_shard_bytes, "MinSizePartitioner")
        _check_positive("max_shards", self.max_shards, "MinSizePartitioner")

    def __call__(self, shape: Sequence[int], dtype: Any = np.float32) -> list[int]:
        shards = _nbytes(shape, dtype, self.bytes_per_string) // self.min_shard_bytes
        if self.max_shards is not None:
            shards = min(shards, self.max_shards)
        return _counts(shape, max(1, shards))


@dataclass(frozen=True)
class MaxSizePartitioner:
    """Shards a variable so that no shard is larger than `max_shard_bytes`.

    Args:
      max_shard_bytes: the largest shard allowed.
      max_shards: at most this many shards (a cap that wins over the size).
      bytes_per_string: the size assumed for one string element.
    """

    max_shard_bytes: int
    max_shards: int | None = None
    bytes_per_string: int = 16
    round_up = True

    def __post_init__(self):
        _check_positive("max_shard_bytes", self.max_shard_bytes, "MaxSizePartitioner")
        _check_positive("max_shards", self.max_shards, "MaxSizePartitioner")

    def __call__(self, shape: Sequence[int], dtype: Any = np.float32) -> list[int]:
        nbytes = _nbytes(shape, dtype, self.bytes_per_string)
        shards = -(-nbytes // self.max_shard_bytes)
        if self.max_shards is not None:
            shards = min(shards, self.max_shards)
        return _counts(shape, max(1, shards))


def path_str(path: tuple[Any, ...]) -> str:
    """Joins a pytree key path with '/': `params/dense/kernel`.

    The trailing `.value` of a flax NNX Variable is dropped, so rules read the
    same for NNX modules as for plain dicts of arrays.
    """
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _partitioned_spec(partitioner: Partitioner, leaf: Any, shard_axes: Sequence[tuple[str, int]]):
    """The spec that splits axis 0 into the achievable shard count nearest the request.

    `shard_axes` lists (name, size) innermost first; shard counts the mesh can
    make are products of a run of them from the inside, so shards stay close
    together (inside one host) before they span hosts.
    """
    shape = tuple(np.shape(leaf))  # a Python scalar (a step counter) has shape ()
    if not shape or is_key(leaf):  # keys are small and have no byte size: replicated
        return PartitionSpec()
    want = partitioner(shape, leaf.dtype)[0]
    options = [(1, ())]
    for name, size in shard_axes:
        count, names = options[-1]
        options.append((count * size, (name, *names)))
    fits = [(c, n) for c, n in options if shape[0] % c == 0]
    below = [o for o in fits if o[0] <= want]
    above = [o for o in fits if o[0] >= want]
    count, names = above[0] if partitioner.round_up and above else below[-1]
    if count == 1:
        return PartitionSpec()
    return PartitionSpec(names if len(names) > 1 else names[0])


def _check_spec(path: str, leaf: Any, spec: PartitionSpec, mesh: Mesh, source: str) -> None:
    shape = tuple(getattr(leaf, "shape", ()))
    by_rule = source.startswith("rule")
    what = f"The rule for '{path}'" if by_rule else f"The {source} of '{path}'"
    placed = source == "placed sharding"
    if len(spec) > len(shape):
        raise ConfigurationError(
            message(
                f"{what} gives a spec longer than the leaf's rank ({len(shape)}).",
                received(path=path, spec=spec, shape=shape),
                "give one entry per dimension at most, e.g. P('data') for a vector.",
            )
        )
    for dim, entry in zip(shape, spec, strict=False):
        names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        unknown = [n for n in names if n not in mesh.shape]
        if unknown:
            raise ConfigurationError(
                message(
                    f"{what} names mesh axes the mesh does not have.",
                    received(path=path, spec=spec, mesh_axes=tuple(mesh.shape)),
                    f"use only the axes {tuple(mesh.shape)}.",
                )
            )
        size = math.prod(mesh.shape[n] for n in names)
        if dim % size:
            fix = (
                "shard another dimension, pad the variable, or add an earlier rule "
                "that replicates it (spec None)."
                if by_rule
                else "add a rule for the path (a spec that divides, or None to replicate it), "
                "or place the leaf on a mesh whose axes divide it."
                if placed
                else "change the annotation, map its name to None (or another axis) in "
                "logical_axis_rules, pad the variable, or add a rule for the path that "
                "replicates it (spec None)."
            )
            raise ConfigurationError(
                message(
                    f"{what} splits a dimension of size {dim} over {size} devices "
                    f"(as {_trim(spec)}), which does not divide it.",
                    received(path=path, spec=spec, shape=shape, mesh=dict(mesh.shape)),
                    fix,
                )
            )


def resolve_specs(
    tree: Any,
    rules: Sequence[Rule],
    mesh: Mesh,
    *,
    strict: bool = False,
    shard_axes: Sequence[tuple[str, int]] = (),
    is_leaf: Callable[[Any], bool] | None = None,
    logical_axis_rules: LogicalRules = (),
    replicate_unmapped: bool = True,
    keep_placed: bool = False,
) -> Any:
    """Gives every leaf of `tree` its `PartitionSpec`: a rule, its annotation, or replicated.

    Precedence, per leaf: a rule giving a spec (or None) wins; else the leaf's
    flax annotation (`nnx.with_partitioning` names, through `logical_axis_rules`)
    if it shards anything; else a partitioner rule; else the annotation's
    (replicated) layout; else, with `keep_placed`, the layout the leaf arrives
    with (see `Placed`); else the default, replicated. A rule that overrides an
    annotation which would shard differently warns (`LayoutConflictWarning`).

    A rule's regex is matched with `re.fullmatch` on the '/'-joined path and on
    each of its '/'-suffixes, so `layers/0/kernel` also matches
    `0/layers/0/kernel` and `opt_state/0/mu/layers/0/kernel`.

    Args:
      tree: a pytree of arrays or `ShapeDtypeStruct`s (NNX Variables and linen
        `nn.Partitioned` / `nn.LogicallyPartitioned` boxes carry annotations).
      rules: ordered (regex, spec) pairs; the first that matches wins.
      mesh: the mesh the specs refer to.
      strict: if True, a leaf no rule matches and no annotation covers is an error.
      shard_axes: (name, size) innermost first, the axes partitioners split over.
      is_leaf: passed on to the pytree flattening.
      logical_axis_rules: (logical name, mesh axes) pairs for annotations.
      replicate_unmapped: annotation names neither mapped nor mesh axes are
        replicated; if False they are an error (one listing them all), unless
        the logical rules hold `(spmd.logical.REST, None)`.
      keep_placed: a leaf no rule or annotation lays out keeps the sharding it
        carries (an array's, or a `ShapeDtypeStruct`'s), read by its axis names.

    Returns:
      A pytree of `PartitionSpec`, the structure of `tree`.

    Raises:
      ConfigurationError: a rule, annotation or kept sharding does not fit its
        leaf, `strict` and nothing covers a leaf, or (`keep_placed`) a leaf no
        rule or annotation lays out is sharded over axes `mesh` lacks.
    """
    specs, _, treedef = _resolve(
        tree,
        rules,
        mesh,
        strict,
        shard_axes,
        is_leaf,
        logical_axis_rules,
        replicate_unmapped,
        keep_placed,
    )
    return jax.tree_util.tree_unflatten(treedef, specs)


def resolve_sources(
    tree: Any,
    rules: Sequence[Rule],
    mesh: Mesh,
    *,
    shard_axes: Sequence[tuple[str, int]] = (),
    logical_axis_rules: LogicalRules = (),
    replicate_unmapped: bool = True,
    keep_placed: bool = False,
) -> Any:
    """Like `resolve_specs`, but each leaf is a `LeafLayout`: its spec and where it came from."""
    specs, sources, treedef = _resolve(
        tree,
        rules,
        mesh,
        False,
        shard_axes,
        None,
        logical_axis_rules,
        replicate_unmapped,
        keep_placed,
    )
    layouts = [LeafLayout(spec, source) for spec, source in zip(specs, sources, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, layouts)


@dataclass(frozen=True)
class LeafLayout:
    """A leaf's `PartitionSpec` and its source: "rule '<regex>'", "annotation (...)",
    "partitioner (rule '<regex>')", "placed sharding" or "default"."""

    spec: PartitionSpec
    source: str


class LayoutConflictWarning(UserWarning):
    """A state rule overrides a flax annotation that would lay the leaf out differently."""


shown_as_public(LayoutConflictWarning)


def matches(regex: re.Pattern, path: str) -> bool:
    """Whether a rule's regex matches the '/'-joined `path` whole, or any '/'-suffix of it."""
    if regex.fullmatch(path):
        return True
    return any(regex.fullmatch(path[i + 1 :]) for i, c in enumerate(path) if c == "/")


def _resolve(
    tree, rules, mesh, strict, shard_axes, is_leaf, logical_rules, replicate_unmapped, keep_placed
):
    compiled = [(re.compile(pattern), pattern, spec) for pattern, spec in rules]
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    notes = annotations(tree) if is_leaf is None else [None] * len(leaves)
    paths = [path_str(key_path) for key_path, _ in leaves]
    notes = [
        note if note is not None and _fits_rank(path, leaf, note) else None
        for path, (_, leaf), note in zip(paths, leaves, notes, strict=True)
    ]
    if not replicate_unmapped:  # every unmapped name at once, not one per run
        pairs = [(path, note) for path, note in zip(paths, notes, strict=True) if note]
        check_mapped(pairs, logical_rules, mesh)
    specs, sources = [], []
    for path, (_, leaf), note in zip(paths, leaves, notes, strict=True):
        pattern, rule = next(
            ((p, spec) for regex, p, spec in compiled if matches(regex, path)), (None, _UNMATCHED)
        )
        annotated = noted = None
        if note is not None:
            annotated = note.names
            noted = to_spec(
                annotated,
                logical_rules,
                mesh,
                replicate_unmapped=replicate_unmapped,
                path=path,
                logical=note.logical,
            )
            noted = _trim(_dividing(noted, leaf, mesh) if note.inherited else noted)
        if rule is _UNMATCHED and noted is None and strict:
            raise ConfigurationError(
                message(
                    f"strict=True: every state leaf needs a rule, but '{path}' matched none.",
                    received(path=path, rules=[pattern for pattern, _ in rules]),
                    "add a rule for it, e.g. (r'.*', None) last to replicate the rest.",
                )
            )
        spec, source = _choose(path, leaf, rule, pattern, noted, annotated, shard_axes)
        if source == "default" and keep_placed:
            spec, source = _kept(path, leaf, mesh)
        _check_spec(path, leaf, spec, mesh, source)
        specs.append(_trim(spec))
        sources.append(source)
    return specs, sources, treedef


def _fits_rank(path: str, leaf: Any, note: Annotation) -> bool:
    """Whether an annotation has at most one name per dimension of its leaf.

    An optimizer moment of another rank than its parameter (adafactor's
    factored moments) does not take the parameter's annotation: False.

    Raises:
      ConfigurationError: a leaf's own annotation is longer than its rank.
    """
    rank = len(getattr(leaf, "shape", ()))
    if len(note.names) <= rank:
        return True
    if note.inherited:
        return False
    raise ConfigurationError(
        message(
            f"The annotation of '{path}' has {len(note.names)} names for a leaf of rank {rank} "
            "(one name per dimension at most).",
            received(path=path, annotation=note.names, shape=tuple(leaf.shape)),
            "write the annotation for this leaf's shape, e.g. "
            f"nnx.with_partitioning(init, {note.names[:rank]}) (or "
            "nn.with_logical_partitioning in linen).",
        )
    )


def _dividing(spec: PartitionSpec, leaf: Any, mesh: Mesh) -> PartitionSpec:
    """`spec` without the entries that do not divide their dimension (inherited layouts)."""
    shape = tuple(getattr(leaf, "shape", ()))
    entries = []
    for dim, entry in zip(shape, spec, strict=False):
        names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        entries.append(entry if dim % math.prod(mesh.shape[n] for n in names) == 0 else None)
    return PartitionSpec(*entries)


def _choose(path, leaf, rule, pattern, noted, annotated, shard_axes):
    """One leaf's spec and source, by the precedence `resolve_specs` documents."""
    if rule is None or isinstance(rule, PartitionSpec):
        spec = rule or PartitionSpec()
        if noted is not None and noted != _trim(spec):
            warn(
                f"The rule {pattern!r} lays out '{path}' as {_trim(spec)}, overriding its "
                f"annotation {annotated} (which gives {noted}). Rules win over annotations; "
                "drop the rule or the annotation to silence this.",
                LayoutConflictWarning,
            )
        return spec, f"rule {pattern!r}"
    if noted is not None and (len(noted) or rule is _UNMATCHED):
        return noted, f"annotation {annotated}"
    if rule is not _UNMATCHED:
        return _partitioned_spec(rule, leaf, shard_axes), f"partitioner (rule {pattern!r})"
    return PartitionSpec(), "default"


def _carried(leaf: Any) -> NamedSharding | None:
    """The `NamedSharding` on a concrete mesh that an array or `ShapeDtypeStruct` carries."""
    if isinstance(leaf, jax.core.Tracer) or not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        return None
    sharding = leaf.sharding
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
        return sharding
    return None


def _kept(path: str, leaf: Any, mesh: Mesh) -> tuple[PartitionSpec, str]:
    """The layout of a leaf no rule or annotation lays out: the sharding it carries,
    read on `mesh` by its axis names (an unboxed linen state's only annotation left).

    Raises:
      ConfigurationError: the leaf is sharded over axes `mesh` does not have, which
        no layout of this strategy can keep.
    """
    sharding = _carried(leaf)
    spec = PartitionSpec() if sharding is None else _trim(sharding.spec)
    if not len(spec):
        return PartitionSpec(), "default"
    names = [n for entry in spec for n in (entry if isinstance(entry, tuple) else (entry,)) if n]
    missing = [n for n in names if n not in mesh.shape]
    if not missing:
        return spec, "placed sharding"
    raise ConfigurationError(
        message(
            f"A state leaf that no rule or annotation lays out keeps the sharding it arrives "
            f"with; '{path}' arrives sharded over mesh axes {missing}, which this strategy's "
            "mesh does not have, so it could only be replicated, dropping its layout.",
            received(
                leaf=path,
                sharding=spec,
                its_mesh=dict(sharding.mesh.shape),
                mesh_axes=tuple(mesh.shape),
            ),
            "build the strategy on the mesh the state was placed on, add a rule for the path "
            "(a PartitionSpec over this mesh's axes, or None to replicate it), or keep flax "
            "linen's boxes (nn.LogicallyPartitioned) in the state so that logical_axis_rules "
            "lay it out.",
        )
    )


def _trim(spec: PartitionSpec) -> PartitionSpec:
    """Drops trailing None entries, the form jit gives back, so layouts compare equal."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)
