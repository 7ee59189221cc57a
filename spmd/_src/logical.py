"""Flax sharding annotations and logical axis rules, resolved to a strategy's mesh.

A flax model says how its variables split with names: `nnx.with_partitioning(init,
("embed", "mlp"))` or `nnx.Param(..., out_sharding=...)` in NNX, and the boxes
`nn.with_logical_partitioning` / `nn.with_partitioning` make in linen
(`nn.LogicallyPartitioned`, `nn.Partitioned`). The names are either
mesh axes or logical names that `logical_axis_rules` map to mesh axes (flax
linen's and MaxText's convention): `[("mlp", "model"), ("embed", None)]`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
from flax import nnx
from flax.core import meta as flax_meta
from flax.core import spmd as flax_spmd
from flax.linen.spmd import LogicallyPartitioned
from flax.nnx.training.optimizer import OptState
from jax.sharding import Mesh, PartitionSpec

from spmd._src.errors import ConfigurationError, message, received

__all__ = [
    "REST",
    "Annotation",
    "LogicalRules",
    "annotation",
    "annotations",
    "check_mapped",
    "check_rules",
    "is_box",
    "flax_context",
    "to_spec",
]

# (logical name, mesh axis | tuple of mesh axes | None), first rule for a name wins.
LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]

# The logical name of the rule `(REST, None)`: every name no other rule maps is
# replicated (as MaxText's configs leave `layers`, `kv` or `relpos_buckets` unsharded).
REST = "*"


def is_box(x: Any) -> bool:
    """Whether `x` carries a leaf's annotation: an NNX Variable or a linen box, any flax
    `meta.AxisMetadata` (`nn.Partitioned`, `nn.LogicallyPartitioned`, the `NNXMeta` of
    `nnx.bridge.to_linen`, or a box of the user's own)."""
    return isinstance(x, nnx.Variable | flax_meta.AxisMetadata)


def _axes(target: Any) -> tuple[str, ...]:
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def check_rules(rules: LogicalRules, mesh: Mesh) -> tuple[tuple[str, Any], ...]:
    """Checks that every rule is a (name, mesh axes) pair naming axes of `mesh`.

    Returns:
      The rules as a tuple of pairs.

    Raises:
      ConfigurationError: a rule is malformed or names an axis the mesh lacks.
    """
    checked = []
    for rule in rules:
        ok = isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)
        targets = _axes(rule[1]) if ok else ()
        if not ok or not all(isinstance(a, str) for a in targets):
            raise ConfigurationError(
                message(
                    "A logical axis rule is a pair (logical name, mesh axis or tuple of mesh "
                    "axes or None).",
                    received(rule=rule),
                    'write e.g. ("mlp", "model"), ("batch", ("host", "replica")) or '
                    '("embed", None).',
                )
            )
        if rule[0] == REST and targets:
            raise ConfigurationError(
                message(
                    "The rule (REST, None) replicates every logical name no other rule maps; "
                    "REST cannot map to mesh axes (every dimension so named would split over "
                    "them).",
                    received(rule=tuple(rule)),
                    "write (spmd.logical.REST, None), and a rule of its own for each name "
                    "to shard.",
                )
            )
        if len(set(targets)) != len(targets):
            raise ConfigurationError(
                message(
                    f"The logical axis rule for '{rule[0]}' names a mesh axis twice (an array "
                    "dimension cannot be split twice over one axis).",
                    received(rule=tuple(rule)),
                    f"name each mesh axis once, e.g. ('{rule[0]}', '{targets[0]}').",
                )
            )
        checked.append(
            (rule[0], rule[1] if rule[1] is None or isinstance(rule[1], str) else targets)
        )
    _check_axes_exist(checked, mesh)
    return tuple(checked)


def _check_axes_exist(rules: Sequence[tuple[str, Any]], mesh: Mesh) -> None:
    """Every mesh axis the rules name is an axis of `mesh`; all that are not, in one error."""
    bad = [(name, t) for name, t in rules if any(a not in mesh.shape for a in _axes(t))]
    if not bad:
        return
    missing = sorted({a for _, t in bad for a in _axes(t) if a not in mesh.shape})
    if len(bad) == 1:
        expected = (
            f"The logical axis rule for '{bad[0][0]}' names mesh axes the mesh does not "
            f"have: {missing}."
        )
    else:
        expected = (
            f"Every mesh axis a logical axis rule names is an axis of the mesh; {len(bad)} "
            f"rules name axes it does not have: {missing}."
        )
    sizes = ", ".join(f"'{a}': 1" for a in missing)
    raise ConfigurationError(
        message(
            expected,
            received(rules=tuple(bad), mesh_axes=tuple(mesh.shape)),
            f"map each to axes of {tuple(mesh.shape)} (or None to replicate), or give the "
            f"mesh those axes with size 1, as MaxText's meshes hold every axis it names: "
            f"spmd.make_mesh({{..., {sizes}}}).",
        )
    )


def annotation(variable: Any, path: str = "") -> tuple | None:
    """The sharding names a flax Variable or linen box was annotated with, or None.

    Reads `out_sharding` (what `nnx.with_partitioning` and `Param(out_sharding=...)`
    set, and what `nnx.bridge` makes of linen's `with_partitioning` and
    `with_logical_partitioning`), or a linen box's `names` (what
    `nn.get_partition_spec` reads); names the Variable's own `sharding_rules`
    (a `nn.LogicallyPartitioned`'s own `rules`) map are mapped first. The
    `NNXMeta` box of `nnx.bridge.to_linen` is read as the Variable it holds;
    any other flax box by its `get_partition_spec()`, as `nn.get_partition_spec`
    reads it.

    Args:
      variable: an NNX Variable or a flax `meta.AxisMetadata` box.
      path: where it is in the state, for errors.

    Raises:
      ConfigurationError: a box has no sharding spmd can read (no
        `get_partition_spec`, or one that fails), or its names are not a
        tuple of names (str, None, or a tuple of str per dimension).
    """
    if isinstance(variable, flax_meta.Partitioned):
        names, local = variable.names, getattr(variable, "rules", None)
    elif isinstance(variable, nnx.Variable):
        names, local = _variable_names(variable.get_metadata())
    elif isinstance(variable, flax_meta.AxisMetadata):
        names, local = _box_names(variable, path)
    else:
        return None
    if names is None or (isinstance(names, tuple | list | PartitionSpec) and not names):
        return None
    if isinstance(names, jax.sharding.NamedSharding):
        names = names.spec
    _check_names(names, path, variable)
    local = dict(local or ())  # the Variable's own logical rules
    return tuple(local.get(n, n) if isinstance(n, str) else n for n in names)


def _variable_names(metadata: dict) -> tuple[Any, Any]:
    """(names, its own logical rules) of an NNX Variable's metadata."""
    names = metadata.get("out_sharding") or metadata.get("sharding_names")
    return names, metadata.get("sharding_rules")


def _box_names(box: flax_meta.AxisMetadata, path: str) -> tuple[Any, Any]:
    """(names, its own logical rules) of a flax box other than `nn.Partitioned`."""
    metadata = getattr(box, "metadata", None)
    if hasattr(box, "to_nnx_variable") and isinstance(metadata, dict):
        return _variable_names(metadata)  # NNXMeta: the NNX Variable's metadata, as it is
    kind = f"{type(box).__module__}.{type(box).__qualname__}"
    if not callable(getattr(box, "get_partition_spec", None)):
        raise ConfigurationError(
            message(
                f"Every flax box (meta.AxisMetadata) in a state says how its leaf is sharded "
                f"through get_partition_spec(), as nn.get_partition_spec reads it; the box "
                f"at '{path}' has none, so its layout is unknown (it would be replicated "
                "unnoticed).",
                received(path=path, box=kind),
                "give the box a get_partition_spec() returning a PartitionSpec of logical "
                "names or mesh axes (nn.Partitioned's is one to follow), unbox it "
                "(nn.meta.unbox) and lay the leaf out with a rule, or use nn.Partitioned / "
                "nn.LogicallyPartitioned.",
            )
        )
    try:
        spec = box.get_partition_spec()
    except Exception as error:
        raise ConfigurationError(
            message(
                f"A flax box says how its leaf is sharded through get_partition_spec(); the "
                f"box at '{path}' raised instead.",
                received(path=path, box=kind, error=f"{type(error).__name__}: {error}"),
                "make get_partition_spec() return a PartitionSpec of logical names or mesh "
                "axes, or unbox the leaf (nn.meta.unbox) and lay it out with a rule.",
            )
        ) from error
    return spec, None


def _check_names(names: Any, path: str, box: Any) -> None:
    """An annotation is a sequence of per-dimension entries: a name, None, or names."""

    def entry_ok(entry: Any) -> bool:
        if entry is None or isinstance(entry, str):
            return True
        return isinstance(entry, tuple | list) and all(isinstance(a, str) for a in entry)

    if isinstance(names, tuple | list | PartitionSpec) and all(map(entry_ok, names)):
        return
    kind = type(box).__name__
    bare = f"('{names}',)" if isinstance(names, str) else "('embed', 'mlp')"
    raise ConfigurationError(
        message(
            f"The annotation of '{path}' ({kind}) is a tuple with one entry per dimension of "
            "its leaf: a logical name or mesh axis (str), None (replicated), or a tuple of "
            "names (one dimension split over several axes).",
            received(path=path, names=names),
            f"write the names as a tuple, e.g. {bare}"
            + (" (a bare string is read letter by letter)" if isinstance(names, str) else "")
            + ", in nnx.with_partitioning(init, names) or nn.with_logical_partitioning.",
        )
    )


class Annotation(NamedTuple):
    """A leaf's annotation: its names, whether it is inherited from a parameter, and
    whether its names are logical only.

    `nnx.Optimizer` gives each optimizer moment its parameter's metadata; a
    moment of another shape (adafactor's factored `v_row` / `v_col`) does not
    take the layout its parameter's annotation describes. A linen
    `nn.LogicallyPartitioned` box names logical axes, mapped by the rules alone:
    a name no rule maps is not read as a mesh axis of that name, as
    `nn.logical_to_mesh_sharding` reads it.
    """

    names: tuple
    inherited: bool
    logical: bool = False


def annotations(tree: Any) -> list[Annotation | None]:
    """One annotation (or None) per array leaf of `tree`, in `jax.tree.leaves` order.

    Raises:
      ConfigurationError: a box cannot be read, or its names are malformed (`annotation`).
    """
    out: list[Annotation | None] = []
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_box_or_optimizer_state)[0]
    for key_path, item in flat:
        if is_box(item):
            out += _annotated(key_path, item, isinstance(item, OptState))
        elif _is_optimizer_state(item):
            # An optax state's boxes are its parameters' (optax maps over the boxed
            # params): a moment of another shape does not take its parameter's layout.
            inner = jax.tree_util.tree_flatten_with_path(item, is_leaf=is_box)[0]
            for inner_path, leaf in inner:
                path = key_path + inner_path
                out += _annotated(path, leaf, True) if is_box(leaf) else [None]
        else:
            out.append(None)
    return out


def _annotated(key_path: tuple, box: Any, inherited: bool) -> list[Annotation | None]:
    """The annotation of each array leaf of `box`."""
    names = annotation(box, jax.tree_util.keystr(key_path, simple=True, separator="/"))
    note = None if names is None else Annotation(names, inherited, _is_logical(box))
    return [note] * len(jax.tree.leaves(box))


def _is_logical(box: Any) -> bool:
    """Whether a box's names are logical names only (linen's `nn.LogicallyPartitioned`);
    not where the box has rules of its own, which turn its names into mesh axes."""
    return isinstance(box, LogicallyPartitioned) and not getattr(box, "rules", None)


def _is_optimizer_state(x: Any) -> bool:
    """An optax state (`ScaleByAdamState`, `FactoredState`, ...): a NamedTuple of optax's."""
    return isinstance(x, tuple) and type(x).__module__.split(".")[0] == "optax"


def _box_or_optimizer_state(x: Any) -> bool:
    return is_box(x) or _is_optimizer_state(x)


def to_spec(
    names: tuple,
    rules: LogicalRules,
    mesh: Mesh,
    *,
    replicate_unmapped: bool,
    path: str = "",
    logical: bool = False,
) -> PartitionSpec:
    """The mesh `PartitionSpec` of an annotation, through the logical axis rules.

    As `nn.logical_to_mesh_axes` maps them: the rules are taken in order, and
    each maps the first dimension of its name not yet mapped, if none of its
    mesh axes is taken yet; so an earlier rule wins a mesh axis over a later one,
    whichever dimension comes first (MaxText's `mlp` rule takes `fsdp_transpose`
    before its `embed` rules are read). A name no rule mapped is then a mesh
    axis of that name (unless the names are `logical` only, as a linen
    `nn.LogicallyPartitioned` box's are: flax replicates it), or replicated (its
    rules' axes all taken, or `replicate_unmapped`, or the rules hold
    `(REST, None)`), else an error.

    Raises:
      ConfigurationError: a name is neither mapped nor a mesh axis (and not
        replicated), or names two dimensions (flax rejects it too).
    """
    slots = [(i, name) for i, entry in enumerate(names) for name in _axes(entry)]
    _check_no_repeated_names(slots, names, path)
    mapped: dict[tuple[int, str], list[str]] = {}
    used: set[str] = set()
    for alias, target in rules:
        free = [slot for slot in slots if slot[1] == alias and slot not in mapped]
        axes = list(_axes(target))
        if free and not used.intersection(axes):
            mapped[free[0]] = axes
            used.update(axes)
    for slot in slots:
        if slot not in mapped:
            mapped[slot] = _map_unruled(
                slot[1], rules, mesh, used, replicate_unmapped, names, path, logical
            )
            used.update(mapped[slot])
    entries = []
    for i in range(len(names)):
        axes = [a for slot in slots if slot[0] == i for a in mapped[slot]]
        entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*entries)


def _check_no_repeated_names(slots: list, names: tuple, path: str) -> None:
    """An annotation names each logical name (or mesh axis) for one dimension at most."""
    seen: dict[str, int] = {}
    for dim, name in slots:
        if seen.setdefault(name, dim) != dim:
            raise ConfigurationError(
                message(
                    f"The annotation of '{path}' names '{name}' for two dimensions: a "
                    "logical name (or mesh axis) lays out one dimension (flax's "
                    "nn.logical_to_mesh_sharding raises a ValueError too).",
                    received(path=path, annotation=names),
                    f"name each dimension differently, e.g. ('{name}', None), or give the "
                    "second its own logical name and a rule for it.",
                )
            )


def _map_unruled(
    name, rules, mesh, used, replicate_unmapped, names, path, logical=False
) -> list[str]:
    """The mesh axes of a name that no rule mapped: its own axis, or none, or an error."""
    if any(alias == name for alias, _ in rules):  # its rules' axes are taken: replicated
        return []
    if name in mesh.shape and not logical:
        if name in used:
            raise ConfigurationError(
                message(
                    f"The annotation of '{path}' names the mesh axis '{name}' twice (an array "
                    "dimension cannot be split twice over one axis; flax rejects it too).",
                    received(path=path, annotation=names),
                    f"name '{name}' for one dimension only, e.g. ('{name}', None).",
                )
            )
        return [name]
    if replicate_unmapped or any(alias == REST for alias, _ in rules):
        return []
    if logical and name in mesh.shape:
        raise ConfigurationError(
            message(
                f"The annotation of '{path}' (nn.LogicallyPartitioned) names '{name}', a "
                "logical name that no logical_axis_rule maps; a logical name is not read as "
                "the mesh axis of the same name (nn.logical_to_mesh_sharding replicates it).",
                received(
                    path=path,
                    annotation=names,
                    logical_axis_rules=tuple(rules),
                    mesh_axes=tuple(mesh.shape),
                ),
                f"add the rule ('{name}', '{name}') to logical_axis_rules to split over that "
                f"axis, or ('{name}', None) to replicate.",
            )
        )
    raise ConfigurationError(
        message(
            f"The annotation of '{path}' names '{name}', which is neither a mesh axis nor "
            "mapped by the strategy's logical_axis_rules.",
            received(
                path=path,
                annotation=names,
                logical_axis_rules=tuple(rules),
                mesh_axes=tuple(mesh.shape),
            ),
            f"add a rule such as ('{name}', '{next(iter(mesh.shape))}') or ('{name}', None) "
            "to logical_axis_rules.",
        )
    )


@contextlib.contextmanager
def flax_context(rules: LogicalRules) -> Iterator[None]:
    """Flax's own context for model code: logical rules set, eager sharding off.

    Variables are created unplaced (the strategy places them by its layout),
    and `nn.with_logical_constraint`-style calls see the strategy's rules.
    """
    flax_rules = tuple(rule for rule in rules if rule[0] != REST)  # flax replicates the rest
    with nnx.use_eager_sharding(False), flax_spmd.logical_axis_rules(flax_rules):
        yield


@contextlib.contextmanager
def rules_without(axes: Sequence[str]) -> Iterator[None]:
    """Flax's logical axis rules in effect, with the mesh `axes` dropped from their targets.

    Inside `strategy.run` the batch axes are manual (each replica holds its own
    slice), and a sharding constraint may name only the other axes: an
    `nn.with_logical_constraint(y, ("batch", "mlp"))` there constrains over
    `mlp`'s axis alone, as the global step constrains over both.
    """
    rules = tuple(flax_spmd.get_logical_axis_rules() or ())
    kept = tuple((alias, _drop_axes(target, axes)) for alias, target in rules)
    if kept == rules:
        yield
        return
    with flax_spmd.logical_axis_rules(kept):
        yield


def _drop_axes(target: Any, axes: Sequence[str]) -> Any:
    """A rule's target (None, a mesh axis, or a tuple of them) without `axes`."""
    if target is None or isinstance(target, str):
        return None if target in axes else target
    rest = tuple(a for a in target if a not in axes)
    return rest or None


def _unmapped(names: tuple, rules: LogicalRules, mesh: Mesh, logical: bool) -> list[str]:
    mapped = {alias for alias, _ in rules}
    return [
        name
        for entry in names
        for name in _axes(entry)
        if name not in mapped and (logical or name not in mesh.shape)
    ]


def check_mapped(noted: Sequence[tuple[str, Annotation]], rules: LogicalRules, mesh: Mesh) -> None:
    """Checks that every name of every annotation is mapped by `rules` or is a mesh axis
    (a logical-only annotation's names: mapped by `rules`).

    Args:
      noted: (path, annotation) pairs.

    Raises:
      ConfigurationError: names no rule maps, each listed once with one path that has it.
    """
    if any(alias == REST for alias, _ in rules):
        return
    first: dict[str, str] = {}
    for path, note in noted:
        for name in _unmapped(note.names, rules, mesh, note.logical):
            first.setdefault(name, path)
    if not first:
        return
    listed = ", ".join(f"'{name}' (at '{path}')" for name, path in first.items())
    suggestion = ", ".join(f"('{name}', None)" for name in first)
    raise ConfigurationError(
        message(
            f"Every logical name of the state's annotations is a mesh axis or mapped by the "
            f"strategy's logical_axis_rules; these are not: {listed}.",
            received(
                unmapped=tuple(first),
                logical_axis_rules=tuple(rules),
                mesh_axes=tuple(mesh.shape),
            ),
            f"add a rule for each to logical_axis_rules (e.g. {suggestion}, or one naming a "
            "mesh axis), or end the rules with (spmd.logical.REST, None) to replicate every "
            "name they do not map.",
        )
    )
