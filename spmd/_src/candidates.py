"""The layouts `spmd.auto_strategy` tries: data parallel, FSDP, HSDP, TP, FSDP x TP, optimizer
offload; pipeline stages and context parallelism where the step calls `spmd.pipeline` or
`spmd.attention`.

Each candidate is a `Strategy` on the target's devices whose rules lay out
every leaf of the state. A leaf with a flax annotation keeps it wherever it
shards over the candidate's axes (every candidate's mesh has the axes the
model's annotations and rules name, of size 1 where the candidate does not
use them); the other leaves take the candidate's own layout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec

from spmd._src.activations import activation_rules
from spmd._src.attention import AttentionCall
from spmd._src.logical import REST, LogicalRules, annotations, to_spec
from spmd._src.mesh import make_mesh
from spmd._src.pipeline import PipelineCall
from spmd._src.rules import Rule, path_str
from spmd._src.strategy import nnx_state
from spmd._src.strategy.base import Strategy
from spmd._src.strategy.offload import offloaded

__all__ = [
    "MIN_SHARDED_ELEMENTS",
    "ModelLayout",
    "candidates",
    "idle_axes",
    "model_layout",
    "tensor_axis",
]

MIN_SHARDED_ELEMENTS = 1 << 14  # smaller leaves stay replicated: splitting them costs more
TENSOR_AXIS = "model"
FSDP_AXIS = "fsdp"
DATA_AXIS = "data"


def _divisors(n: int) -> list[int]:
    return [k for k in range(2, n + 1) if n % k == 0]


def _names(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one entry of a `PartitionSpec` (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _fsdp_spec(shape: Sequence[int], axis: str, size: int, taken: PartitionSpec | None = None):
    """The leaf's spec with its largest free dimension that `size` divides split over `axis`."""
    entries = list(taken or ()) + [None] * (len(shape) - len(taken or ()))
    if math.prod(shape) < MIN_SHARDED_ELEMENTS:
        return PartitionSpec(*entries)
    free = [i for i, e in enumerate(entries) if e is None and shape[i] % size == 0]
    if free:
        dim = max(free, key=lambda i: shape[i])
        entries[dim] = axis
    return PartitionSpec(*entries)


def _tp_spec(shape: Sequence[int], axis: str, size: int) -> PartitionSpec:
    """A matrix's last dimension over `axis` (column-parallel), where `size` divides it."""
    if len(shape) < 2 or math.prod(shape) < MIN_SHARDED_ELEMENTS or shape[-1] % size:
        return PartitionSpec()
    return PartitionSpec(*([None] * (len(shape) - 1)), axis)


def _sharding(noted: PartitionSpec, sizes: Mapping[str, int]) -> PartitionSpec | None:
    """An annotation's spec over the axes that split in this candidate; None if none does."""
    entries = []
    for entry in noted:
        axes = tuple(a for a in _names(entry) if sizes.get(a, 1) > 1)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries) if any(e is not None for e in entries) else None


def _leaf_spec(
    shape: Sequence[int], noted: PartitionSpec | None, sizes: Mapping[str, int], tensor: str
) -> PartitionSpec:
    """One leaf's spec in a candidate: its annotation where it splits, else the candidate's
    own (column-parallel over the tensor axis); then FSDP over a free dimension."""
    spec = None if noted is None else _sharding(noted, sizes)
    if spec is None:
        tp = sizes.get(tensor, 1)
        spec = _tp_spec(shape, tensor, tp) if tp > 1 else PartitionSpec()
    fsdp = sizes.get(FSDP_AXIS, 1)
    if fsdp > 1 and FSDP_AXIS not in {a for e in spec for a in _names(e)}:
        spec = _fsdp_spec(shape, FSDP_AXIS, fsdp, spec)
    return spec


def _rules(leaves, sizes: Mapping[str, int], tensor: str, annotated: Mapping[str, PartitionSpec]):
    rules = []
    for path, leaf in leaves:
        shape = tuple(getattr(leaf, "shape", ()))
        spec = _leaf_spec(shape, annotated.get(path), sizes, tensor)
        if any(e is not None for e in spec):
            rules.append(("^" + re.escape(path) + "$", spec))
    return rules


class ModelLayout(NamedTuple):
    """What a model asks of every candidate, read from its abstract state.

    Attributes:
      leaves: ('/'-joined path, `ShapeDtypeStruct`) of every leaf of the state.
      annotated: path -> the `PartitionSpec` over mesh axes that a leaf's flax
        annotation gives (its names mapped through the logical axis rules).
      axes: the mesh axes the annotations and rules name.
      optimizer: the paths of the leaves placement="offload_optimizer" keeps
        in host memory (the optimizer state, found as `Strategy.offload`'s
        default finds it); empty where the state holds none.
    """

    leaves: list[tuple[str, Any]]
    annotated: dict[str, PartitionSpec]
    axes: tuple[str, ...]
    optimizer: tuple[str, ...] = ()


def _rule_axes(rules: Sequence[Rule], logical_axis_rules: LogicalRules) -> list[str]:
    """The mesh axes state rules' specs and logical axis rules' targets name."""
    named = [
        a for _, spec in rules if isinstance(spec, PartitionSpec) for e in spec for a in _names(e)
    ]
    named += [a for _, target in logical_axis_rules for a in _names(target)]
    return list(dict.fromkeys(named))


def _noted_axes(names: tuple, logical_axis_rules: LogicalRules) -> list[str]:
    """The mesh axes an annotation's names stand for: a rule's targets, else the name itself."""
    aliases = {alias for alias, _ in logical_axis_rules}
    axes = []
    for name in (n for entry in names for n in _names(entry)):
        if name not in aliases and REST not in aliases:
            axes.append(name)
    return axes


def model_layout(
    create_fn: Callable[..., Any],
    args: tuple,
    devices: Sequence[Any],
    rules: Sequence[Rule] = (),
    logical_axis_rules: LogicalRules = (),
) -> ModelLayout:
    """Reads the state `create_fn` makes (abstractly, on one device): its leaves, the
    layouts its flax annotations give, and the mesh axes the model names.

    A name no logical axis rule maps is taken for a mesh axis (as the NNX GSPMD
    guide's `("model", None)`); every candidate's mesh then has it.
    """
    axes = _rule_axes(rules, logical_axis_rules)

    def one_device(named):
        sizes = {DATA_AXIS: 1} | {a: 1 for a in named}
        return make_mesh(sizes, devices[:1])

    probe = Strategy(
        one_device(axes),
        rules=rules,
        logical_axis_rules=logical_axis_rules,
        _replicate_unmapped=True,
    )
    state = nnx_state.pure(probe.abstract_state(create_fn, *args))
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    leaves = [(path_str(p), leaf) for p, leaf in flat]
    notes = annotations(state)
    for note in notes:
        if note is not None:
            axes += [a for a in _noted_axes(note.names, logical_axis_rules) if a not in axes]
    mesh = one_device(axes)
    annotated = {
        path: to_spec(
            note.names,
            logical_axis_rules,
            mesh,
            replicate_unmapped=True,
            path=path,
            logical=note.logical,
        )
        for (path, leaf), note in zip(leaves, notes, strict=True)
        if note is not None and len(note.names) <= len(getattr(leaf, "shape", ()))
    }
    optimizer = tuple(
        path for (path, _), host in zip(leaves, offloaded(state, ()), strict=True) if host
    )
    return ModelLayout(leaves, annotated, tuple(a for a in axes if a != DATA_AXIS), optimizer)


def idle_axes(strategy: Strategy, state: Any, busy: Sequence[str] = ()) -> list[str]:
    """The mesh axes of more than one device that split no work: outside the batch axes
    (so every device along one gets the same rows) and `busy` (the axes the step's
    `spmd.pipeline` and `spmd.attention` calls split their work over), and splitting no
    leaf of `state` (an abstract state: `strategy.abstract_state`).

    A tensor-parallel candidate of a model whose matrices are all under
    `MIN_SHARDED_ELEMENTS` (or not divisible by the axis) is such a layout: its
    devices would each compute the whole step of their rows.
    """
    used = set(strategy.batch_axes) | set(busy)
    for leaf in jax.tree.leaves(nnx_state.pure(state)):
        spec = getattr(getattr(leaf, "sharding", None), "spec", None) or ()
        used.update(a for entry in spec for a in _names(entry))
    return [a for a, size in strategy.mesh.shape.items() if size > 1 and a not in used]


def tensor_axis(model_axes: Sequence[str]) -> str:
    """The tensor-parallel axis's name: the one axis the model names besides data and fsdp
    (so that its annotations split over it), else "model"."""
    others = [a for a in model_axes if a not in (DATA_AXIS, FSDP_AXIS)]
    return others[0] if len(others) == 1 else TENSOR_AXIS


def candidates(
    state_leaves: Sequence[tuple[str, Any]],
    devices: Sequence[Any],
    slices: int = 1,
    host_memory: bool = False,
    *,
    annotated: Mapping[str, PartitionSpec] | None = None,
    model_axes: Sequence[str] = (),
    rules: Sequence[Rule] = (),
    logical_axis_rules: LogicalRules = (),
    pipelines: Sequence[PipelineCall] = (),
    attentions: Sequence[AttentionCall] = (),
) -> list[tuple[str, Callable[[], Strategy]]]:
    """The layouts `auto_strategy` tries for these state leaves on these devices.

    Data parallel; FSDP over every k dividing the devices (the rest data
    parallel: HSDP when the data axis crosses slices); tensor parallel over
    2, 4, 8 (each matrix's last dimension split: column-parallel, no
    Megatron pairing inferred); FSDP x TP with FSDP over every device the
    TP axis leaves inside a slice; and, where the devices have host memory,
    the widest FSDP with the optimizer state in host memory
    (placement="offload_optimizer"), for a model that almost fits.

    Where the step calls `spmd.pipeline`, its stage axis of every size k that
    runs every call (k divides the layers / repeats; k dividing a slice's
    devices, or k = the slices), outermost in the mesh (across the slices:
    the pipeline's permutes are the one traffic that goes over DCN), with
    data parallelism or FSDP over the rest ("stage 2 x FSDP 4"). Where it
    calls `spmd.attention`, its context axis of every size c dividing a
    slice's devices and every call's lengths, innermost, with data
    parallelism or FSDP over the rest ("context 4 x data 2"); the candidate's
    `activation_length` is split over it.

    Args:
      state_leaves: ('/'-joined path, leaf) of every leaf of the state.
      devices: the target's devices.
      slices: how many slices they are.
      host_memory: whether to try the optimizer state in host memory (an
        accelerator with `pinned_host` memory, and a state holding one).
      annotated: path -> the `PartitionSpec` (over mesh axes) a leaf's flax
        annotation gives. Where it splits over a candidate's axes the leaf
        keeps it (FSDP adds its axis on a free dimension); elsewhere the leaf
        takes the candidate's layout.
      model_axes: the mesh axes the model names (its annotations, sharding
        constraints, rules): every candidate's mesh has them, of size 1 where
        the candidate does not split over them. Tensor parallelism splits the
        one of them that is not data or fsdp (`tensor_axis`), nor a pipeline's
        or an attention's axis.
      rules, logical_axis_rules: given to every candidate, the rules ahead of
        the candidate's own (its logical rules end with `activation_rules`: the
        layout of the activations `spmd.logical.constrain` names).
      pipelines: the step's `spmd.pipeline` calls (`spmd._src.pipeline.calls_in`
        of the step traced on one device); none: no stage candidates.
      attentions: the step's `spmd.attention` calls (`spmd._src.attention.calls_in`);
        none: no context candidates.

    Returns:
      (name, a function building the `Strategy`) pairs.
    """
    n = len(devices)
    per_slice = n // slices
    calls = {c.axis for c in (*pipelines, *attentions)}
    tensor = tensor_axis([a for a in model_axes if a not in calls])  # not the stage or context
    notes = dict(annotated or {})
    out: list[tuple[str, Callable[[], Strategy]]] = []

    def strategy(name, axes, batch_axes, placement="device", context=None):
        sizes = axes | {a: 1 for a in model_axes if a not in axes}
        own = _rules(state_leaves, sizes, tensor, notes)

        def build():
            mesh = make_mesh(sizes, devices)
            return Strategy(
                mesh,
                rules=[*rules, *own],
                batch_axes=batch_axes,
                placement=placement,
                logical_axis_rules=[*logical_axis_rules, *activations],
            )

        activations = activation_rules(sizes, batch_axes, tensor, context)
        out.append((name, build))

    strategy("data parallel", {DATA_AXIS: n}, (DATA_AXIS,))
    for k in _divisors(per_slice) + ([n] if slices > 1 else []):
        hsdp = f" (HSDP: data {n // k} over DCN)" if slices > 1 and k == per_slice else ""
        strategy(f"FSDP over {k}{hsdp}", {DATA_AXIS: n // k, FSDP_AXIS: k}, (DATA_AXIS, FSDP_AXIS))
    for m in (2, 4, 8):
        if per_slice % m:
            continue
        strategy(f"TP over {m}", {DATA_AXIS: n // m, tensor: m}, (DATA_AXIS,))
        k = per_slice // m
        if k > 1:
            axes = {DATA_AXIS: slices, FSDP_AXIS: k, tensor: m}
            strategy(f"FSDP {k} x TP {m}", axes, (DATA_AXIS, FSDP_AXIS))
    if host_memory:
        axes = {DATA_AXIS: n // per_slice, FSDP_AXIS: per_slice}
        name = f"FSDP over {per_slice}, optimizer state in host memory"
        strategy(name, axes, (DATA_AXIS, FSDP_AXIS), placement="offload_optimizer")
    for axis, k in _stage_sizes(pipelines, n, per_slice, slices):
        in_slice = n // k // (slices // math.gcd(k, slices))  # the stages fill the slices first
        for label, inner in _with_data(n // k, in_slice):
            strategy(f"{axis} {k}{label}", {axis: k} | inner, tuple(inner))
    for axis, c in _context_sizes(attentions, per_slice):
        for label, inner in _with_data(n // c, per_slice // c):
            strategy(f"{axis} {c}{label}", inner | {axis: c}, tuple(inner), context=axis)
    return out


def _with_data(rest: int, in_slice: int) -> list[tuple[str, dict[str, int]]]:
    """(name suffix, axes) of the devices a stage or context axis leaves: data parallel
    over them, and FSDP over those inside a slice (data over the slices)."""
    if rest == 1:
        return [("", {DATA_AXIS: 1})]
    out = [(f" x data {rest}", {DATA_AXIS: rest})]
    if in_slice > 1:
        out.append((f" x FSDP {in_slice}", {DATA_AXIS: rest // in_slice, FSDP_AXIS: in_slice}))
    return out


def _stage_sizes(calls: Sequence[PipelineCall], n: int, per_slice: int, slices: int):
    """(axis, k) for each stage axis and size that runs all its pipeline calls."""
    sizes = _divisors(per_slice) + ([slices] if slices > 1 else [])
    for axis in dict.fromkeys(c.axis for c in calls):
        mine = [c for c in calls if c.axis == axis]
        for k in sorted(set(sizes)):
            if n % k == 0 and all(c.splits_over(k) for c in mine):
                yield axis, k


def _context_sizes(calls: Sequence[AttentionCall], per_slice: int):
    """(axis, c) for each context axis and size, inside a slice, that splits all its calls."""
    for axis in dict.fromkeys(c.axis for c in calls):
        mine = [c for c in calls if c.axis == axis]
        for c in _divisors(per_slice):
            if all(call.splits_over(c) for call in mine):
                yield axis, c
