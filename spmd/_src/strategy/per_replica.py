"""The per-replica view: `strategy.run` (shard_map) and reduce / gather / local_results."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import inspect
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd._src.clusters.hang_watch import SHARED as _SHARED
from spmd._src.clusters.hang_watch import STEPS as _STEPS
from spmd._src.data.host_batches import fingerprint
from spmd._src.errors import BatchError, ConfigurationError, ContextError, message, received
from spmd._src.logical import rules_without
from spmd._src.placement import batch_sharding, conform
from spmd._src.rules import path_str
from spmd._src.strategy.replica import (
    PerReplica,
    ReduceOp,
    ReplicaContext,
    in_replica_context,
    replica_context,
    running_strategy,
)
from spmd._src.strategy.step_checks import (
    COMPARE_BATCH_EVERY,
    RUN,
    LastAgreed,
    agree_on_values,
    host_value,
    static_key,
)
from spmd._src.strategy.step_records import spans_processes
from spmd._src.validate import is_integer

if TYPE_CHECKING:
    from spmd._src.strategy.base import Strategy

__all__ = ["gather", "local_results", "reduce", "run"]

RUN_CACHE_SIZE = 64  # programs `strategy.run` keeps compiled, over every fn and strategy

_REPLICATED, _SPLIT, _STACKED = "replicated", "split", "stacked"
_REDUCERS = {
    ReduceOp.SUM: jnp.sum,
    ReduceOp.MEAN: jnp.mean,
    ReduceOp.MAX: jnp.max,
    ReduceOp.MIN: jnp.min,
}

# What names a call of `run` the same way in every process running the same program:
# fn's code -> the signature its calls agreed on last (bounded, least recently used first).
_RUN_AGREED: collections.OrderedDict = collections.OrderedDict()
# function identity -> program, and traced program -> program; bounded, LRU.
_BY_FUNCTION: collections.OrderedDict = collections.OrderedDict()
_BY_JAXPR: collections.OrderedDict = collections.OrderedDict()
# Primitives whose callable parameters are derivative rules, run only when differentiated.
_CUSTOM_DERIVATIVES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_UNBOUND_AXIS = re.compile(r"unbound axis name: ([^\s.,]+)")
_SIGNATURE_BYTES = 512  # each process's shapes and dtypes, as one all-gather carries them


def _is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def run(
    strategy: Strategy,
    fn: Callable,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    axis_name: str | None = None,
    *,
    current: Any = None,
):
    """`Strategy.run`: `fn` once per replica; fn's structure with `PerReplica` leaves.

    `current` is the strategy `spmd.get_strategy()` gives inside `fn`
    (`strategy` by default; a `DiLoCo` runs its island layout as itself).
    Traced inside a shard_map manual over other axes of the strategy's mesh
    (a DiLoCo island's step), `fn` runs over the batch axes of that island.
    """
    _check_run_call(strategy, fn, args, kwargs)
    _check_axis_name(strategy, axis_name)
    top, treedef = jax.tree.flatten((tuple(args), dict(kwargs or {})), is_leaf=_is_per_replica)
    n_args = len(jax.tree.leaves(tuple(args), is_leaf=_is_per_replica))
    flat, kinds, subdefs = [], [], []
    for i, x in enumerate(top):
        if _is_per_replica(x):
            _check_count(strategy, x, "run")
            leaves, subdef = jax.tree.flatten(x.values)
            flat += leaves
            kinds += [_STACKED] * len(leaves)
            subdefs.append(subdef)
            continue
        if _is_static(x):  # passed to fn as it is, as tf.distribute passes Python values
            subdefs.append(_Static.of(x, i, n_args))
            continue
        flat.append(x)
        kinds.append(_SPLIT if i < n_args and np.ndim(x) > 0 else _REPLICATED)
        subdefs.append(None)
    if not any(isinstance(x, jax.core.Tracer) for x in flat):  # runs now, not traced in a step
        _STEPS[0] += 1  # progress, as a Step call is (spmd/_src/clusters/hang_watch.py)
        _SHARED[0] += strategy._spans_processes
        if jax.process_count() > 1 and spans_processes(strategy.mesh):
            _agree_on_run(
                strategy, fn, args, kwargs or {}, (treedef, tuple(subdefs), tuple(kinds)), flat
            )
    if _SPLIT in kinds:
        # fn's positional arguments, PerReplica leaves left out, named by fn's own names.
        split = [
            jax.tree.map(lambda x: None if _is_per_replica(x) else x, a, is_leaf=_is_per_replica)
            for a in args
        ]
        try:
            strategy.check_batch(tuple(split), names=_argument_names(fn, len(split)))
        except BatchError as error:
            if "same leading (batch) size" not in str(error):
                raise
            raise BatchError(
                f"{error} A value every replica holds a copy of (what flax.jax_utils.replicate "
                "made for jax.pmap) goes in as spmd.PerReplica(stacked), one copy per replica."
            ) from None
    batch = batch_sharding(strategy.mesh, strategy.batch_axes)
    flat = [
        conform(x, strategy.replicated if k == _REPLICATED else batch)
        for x, k in zip(flat, kinds, strict=True)
    ]
    structure = (strategy, treedef, tuple(subdefs), tuple(kinds), axis_name, current or strategy)
    if axis_name is None or (axis_name,) == tuple(strategy.batch_axes):
        return _program(fn, structure, flat)(*flat)
    if _island_mesh(strategy) is not None:
        _no_island_axis_name(tuple(strategy.batch_axes), axis_name)
    # Under the strategy's scope (or jax.set_mesh) its mesh is the context mesh;
    # the program runs on the replica mesh, the same devices renamed.
    # Inside a trace set_mesh is refused, and `_jitted` renames the abstract mesh instead.
    renamed: Any = contextlib.nullcontext()
    if not jax.sharding.get_abstract_mesh().empty:
        with contextlib.suppress(ValueError):
            renamed = jax.set_mesh(_replica_mesh(strategy, axis_name))
    with renamed:
        out = _program(fn, structure, flat)(*flat)
    # The program ran on the mesh with the batch axes named `axis_name`: the same
    # devices in the same order, so placing its results back on the strategy's
    # mesh moves nothing.
    back = batch_sharding(strategy.mesh, strategy.batch_axes)
    return jax.tree.map(
        lambda r: PerReplica(jax.tree.map(lambda v: conform(v, back), r.values)),
        out,
        is_leaf=_is_per_replica,
    )


def _is_static(x: Any) -> bool:
    """Whether `run` passes a leaf of its arguments to fn as a Python value (a
    compile-time constant): anything but an array or a number; a bool too, so that
    fn can branch on it (`training=True`), as tf.distribute passes it."""
    if isinstance(x, bool):
        return True
    if isinstance(x, jax.Array | np.ndarray | np.generic | int | float | complex):
        return False
    return not (hasattr(x, "__array__") or hasattr(x, "__jax_array__"))


class _Static:
    """A Python value `run` passes to fn as it is; keyed by type and value, as a step's
    static keyword arguments are (`step_checks.static_key`)."""

    __slots__ = ("key", "value")

    def __init__(self, value: Any, key: Any):
        self.value, self.key = value, key

    @classmethod
    def of(cls, value: Any, index: int, n_args: int) -> _Static:
        """The static value of `run`'s argument leaf number `index` (of `n_args`
        positional leaves, then the keyword arguments' leaves).

        Raises:
          ConfigurationError: the value is not hashable.
        """
        try:
            return cls(value, static_key({"value": value}))
        except ConfigurationError:
            where = "args" if index < n_args else "kwargs"
            raise ConfigurationError(
                message(
                    f"strategy.run passes a value of its {where} that is not an array or a "
                    "number (a bool, a string, a function, a config) to fn as it is, a "
                    "compile-time constant; such a value must be hashable.",
                    received(value=_short(value), type=type(value).__name__),
                    "pass a hashable value (a tuple, not a list; a frozen dataclass), an "
                    "array, or close over it: strategy.run(functools.partial(fn, value=v), "
                    "args=...).",
                )
            ) from None

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and other.key == self.key

    def __repr__(self) -> str:
        return f"_Static({self.value!r})"


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _agree_on_run(
    strategy: Strategy, fn: Callable, args: Sequence, kwargs: dict, form: tuple, flat: list
) -> None:
    """With several processes, a `run` whose argument signature (structure, each array's
    shape and dtype, the static values) differs from the previous call's of the same
    code agrees on it with every process first, as a step does: a `BatchError` on
    every process rather than replicas computing on mixed data. Calls with the
    signature of the previous call cost a comparison. The numpy arguments split
    over the replicas (each process's is the global batch) are compared by
    fingerprint too, at each new signature and every `COMPARE_BATCH_EVERY` calls.

    Raises:
      BatchError: the processes' signatures or split numpy values differ
        (`step_checks.agree_on_batch`, `step_checks.agree_on_values`).
    """
    kinds = form[2]
    host = [k == _SPLIT and not isinstance(x, jax.Array) for x, k in zip(flat, kinds, strict=True)]
    key = (
        strategy,
        form,
        tuple((np.shape(x), np.result_type(x)) for x in flat),
        tuple(
            host_value(x) if k == _REPLICATED else None for x, k in zip(flat, kinds, strict=True)
        ),
        tuple(host),
    )
    site = _call_site(fn)
    agreed = _RUN_AGREED.pop(site, None) or LastAgreed()
    _RUN_AGREED[site] = agreed
    while len(_RUN_AGREED) > RUN_CACHE_SIZE:
        _RUN_AGREED.pop(next(iter(_RUN_AGREED)))
    split = [x for x, h in zip(flat, host, strict=True) if h]
    if not agreed.differs(key):
        if split and agreed.due(COMPARE_BATCH_EVERY):
            agree_on_values({"split arguments": fingerprint(split)}, caller=RUN)
        return
    paths, _ = jax.tree_util.tree_flatten_with_path((tuple(args), kwargs), is_leaf=_is_per_replica)
    static = {
        path_str(path[1:]) if path[0].idx else f"args/{path_str(path[1:])}": x
        for path, x in paths
        if not _is_per_replica(x) and _is_static(x)
    }
    without = jax.tree.map(
        lambda x: None if not _is_per_replica(x) and _is_static(x) else x,
        (tuple(args), kwargs),
        is_leaf=_is_per_replica,
    )
    agreed.agree(
        fn,
        without[0],
        key,
        without[1],
        static,
        names=_argument_names(fn, len(args)),
        caller=RUN,
        values={"split arguments": fingerprint(split)} if split else {},
    )


def _call_site(fn: Callable) -> Any:
    """What stands for `fn` the same way in every process: its code (a new lambda each
    call has the same), through partials, bound methods and wrappers; else its type."""
    for _ in range(8):
        inner = getattr(fn, "func", None) or getattr(fn, "__func__", None)
        inner = inner or getattr(fn, "__wrapped__", None)
        if inner is None or not callable(inner):
            break
        fn = inner
    return getattr(fn, "__code__", None) or type(fn)


def _check_axis_name(strategy: Strategy, axis_name: Any) -> None:
    """An axis name for the replicas is a string that names no other axis of the mesh."""
    if axis_name is None:
        return
    others = [a for a in strategy.mesh.axis_names if a not in strategy.batch_axes]
    if not isinstance(axis_name, str) or axis_name in others:
        raise ConfigurationError(
            message(
                "run's axis_name is a string naming the replicas (the batch axes "
                f"{tuple(strategy.batch_axes)}), as jax.pmap's axis_name did; it may not "
                f"name another axis of the mesh ({others}).",
                received(axis_name=axis_name),
                'pass the name the function\'s collectives use, e.g. axis_name="batch" '
                'for lax.pmean(x, "batch").',
            )
        )


def _argument_names(fn: Callable, count: int) -> list[str] | None:
    """The names of fn's first `count` positional parameters, or None where unknown."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    names: list[str] = []
    for p in parameters:
        if p.kind is p.VAR_POSITIONAL:
            names += [f"{p.name}[{i}]" for i in range(count - len(names))]
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return names[:count] if len(names) >= count else None


def _replica_mesh(strategy: Strategy, axis_name: str) -> Mesh:
    """The strategy's mesh with its batch axes as one axis called `axis_name`.

    The batch axes come first, in the order they split the batch, then the
    other axes in mesh order: a leading-axis split over `axis_name` places every
    row on the same device as a split over the batch axes does.
    """
    mesh, batch = strategy.mesh, list(strategy.batch_axes)
    names = list(mesh.axis_names)
    rest = [a for a in names if a not in batch]
    devices = np.transpose(mesh.devices, [names.index(a) for a in batch + rest])
    devices = devices.reshape((-1, *devices.shape[len(batch) :]))
    types = tuple(mesh.axis_types[names.index(a)] for a in rest)
    return Mesh(devices, (axis_name, *rest), axis_types=(mesh.axis_types[0], *types))


def _check_run_call(strategy: Strategy, fn: Any, args: Any, kwargs: Any) -> None:
    """Checks `run`'s arguments and that it is called in the cross-replica context.

    Raises:
      ConfigurationError: `fn` is not callable, `args` not a tuple or list, or
        `kwargs` not a dict.
      ContextError: called inside a replica function, or traced inside the step
        (or scope) of a strategy on another mesh.
    """
    if in_replica_context():
        raise ContextError(
            message(
                "strategy.run is called in the cross-replica context (TF: 'Method requires "
                "being in cross-replica context'), not inside a replica function.",
                received(called_from="a replica function of strategy.run"),
                "call fn directly inside the replica function, or return its inputs and "
                "call strategy.run again after the first run returns.",
            )
        )
    current = jax.sharding.get_abstract_mesh()
    inside = _island_mesh(strategy) is not None
    if not current.empty and current != strategy.mesh.abstract_mesh and not inside:
        raise ContextError(
            message(
                f"strategy.run runs on its strategy's mesh, {dict(strategy.mesh.shape)}: inside "
                "a step or scope, only that step's (scope's) strategy can run.",
                received(current_mesh=dict(current.shape), run_strategy=strategy),
                "call run of the strategy the step was built by (or whose scope is open).",
            )
        )
    if not callable(fn):
        raise ConfigurationError(
            message(
                "strategy.run takes a function to run once per replica.",
                received(fn=fn, type=type(fn).__name__),
                "pass a function: strategy.run(replica_fn, args=(x,)).",
            )
        )
    if not isinstance(args, tuple | list):
        raise ConfigurationError(
            message(
                "args is a tuple (or list) of fn's positional arguments.",
                received(args_type=type(args).__name__),
                "wrap the arguments in a tuple: args=(x,), with the comma for one argument.",
            )
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigurationError(
            message(
                "kwargs is a dict of fn's keyword arguments.",
                received(kwargs_type=type(kwargs).__name__),
                'pass kwargs={"name": value}, or None.',
            )
        )


def _island_mesh(strategy: Strategy) -> Any:
    """The context mesh where it is the strategy's mesh with other axes than the batch
    axes manual (inside a DiLoCo island's step, the `island` axis), else None."""
    current = jax.sharding.get_abstract_mesh()
    mesh = strategy.mesh
    if current.empty or not current.manual_axes:
        return None
    same = current.axis_names == mesh.axis_names and current.axis_sizes == tuple(
        mesh.shape.values()
    )
    if not same or set(current.manual_axes) & set(strategy.batch_axes):
        return None
    return current


def _check_count(strategy: Strategy, value: PerReplica, where: str) -> None:
    """A PerReplica holds one value per replica: each leaf's leading size is the replica count."""
    n = strategy.num_replicas_in_sync if strategy is not None else None
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(value.values)}
    if len(sizes) > 1 or (n is not None and sizes and sizes != {n}):
        raise ConfigurationError(
            message(
                "A PerReplica holds one value per replica: every leaf of its values is "
                "stacked over the replicas on a leading axis"
                + (f" of size {n} (num_replicas_in_sync)." if n is not None else "."),
                received(where=where, leading_sizes=sorted(sizes, key=str)),
                "build it from values[i] for replica i of this strategy, e.g. "
                "spmd.PerReplica(jnp.stack([v0, ..., v7])), or pass a plain batch to be "
                "split over the replicas instead.",
            )
        )


def _program(fn: Callable, structure: tuple, flat: list) -> Callable:
    """The program that runs `fn` on these arguments, as `jax.jit` would find it.

    The same function object is traced once per argument signature (values it
    reads through globals or closures are constants of its program, as with
    jax.jit). A new function object (a fresh lambda, a bound method accessed
    again, a new partial) is traced anew, and its traced program is shared
    with an earlier function's when the two jaxprs, their constants (those of
    nested jaxprs included: a `jax.jit` fn calls closing over an array), their
    output structures and the Python functions their equations call back into
    (callbacks) are the same: a new lambda each call
    compiles once and always sees current values, and never gets another
    function's output structure or callback.

    A shared program only runs, on concrete arrays. A call that reads a traced
    value (an argument, or a value `fn` closes over, of an enclosing `jax.grad`,
    `jax.vmap` or step) runs `fn`'s own program, traced anew: transforming it
    (differentiating it, with `fn`'s own custom derivative rules) is then JAX's.
    """
    if any(isinstance(x, jax.core.Tracer) for x in flat):  # inside a step: its trace caches
        return _jitted(fn, structure)
    signature = tuple(_aval_key(x) for x in flat)
    by_fn = (_Identity(fn), structure, signature)
    program = _BY_FUNCTION.get(by_fn)
    if program is None:
        jitted = _jitted(fn, structure)
        traced = jitted.trace(*flat)
        if _reads_traced_values(traced, flat):
            return jitted
        by_jaxpr = (
            structure,
            signature,
            traced.out_tree,
            str(traced.jaxpr),
            _consts_key(traced.jaxpr.consts),
            _functions_key(traced.jaxpr.jaxpr),
        )  # the consts of nested jaxprs (a jax.jit fn calls) are in _functions_key
        program = _BY_JAXPR.get(by_jaxpr)
        if program is None:
            program = _BY_JAXPR[by_jaxpr] = jax.jit(_replay(traced))
        _BY_FUNCTION[by_fn] = program
        for cache in (_BY_FUNCTION, _BY_JAXPR):
            while len(cache) > RUN_CACHE_SIZE:  # the least recently used go first
                cache.pop(next(iter(cache)))
    else:
        _BY_FUNCTION.move_to_end(by_fn)
    return program


def _reads_traced_values(traced: Any, flat: list) -> bool:
    """Whether a traced program reads values of an enclosing trace besides `flat`.

    `fn` closing over a tracer (`jax.grad`'s, a step's) gets it as an extra
    leading input of its jaxpr (or, in older JAX, a constant): its program is
    transformed with that trace, which a replay of another function's jaxpr
    could not be (and would do with that function's derivative rules).
    """
    if len(traced.jaxpr.in_avals) != len(flat):
        return True
    consts = [*traced.jaxpr.consts, *_nested_consts(traced.jaxpr.jaxpr)]
    return any(isinstance(c, jax.core.Tracer) for c in consts)


def _replay(traced: Any) -> Callable:
    """A function that runs a traced program again: its jaxpr, not the Python function."""
    return lambda *flat: traced(*flat)


def _aval_key(x: Any) -> tuple:
    aval = jax.typeof(x)
    return (aval.shape, aval.dtype, getattr(aval, "weak_type", False), type(x))


def _consts_key(consts: list) -> tuple:
    """A traced program's constants as a key: numpy values by value, arrays by identity.

    A jax.Array is immutable, so the same object is the same value; the key holds
    it, so that its id is never reused.
    """
    return tuple(
        _Identity(c)
        if isinstance(c, jax.Array) or not isinstance(c, np.ndarray | np.generic)
        else (np.shape(c), np.asarray(c).dtype, np.asarray(c).tobytes())
        for c in consts
    )


def _functions_key(jaxpr: Any) -> tuple:
    """The Python functions a jaxpr's equations call when it runs, by identity, and the
    constants of its nested jaxprs.

    A nested closed jaxpr (of a `jax.jit` that `fn` calls, closing over an array)
    prints its constants as variables: two programs that print alike may compute
    with different arrays, so each nested jaxpr's constants are part of the key
    (as the top-level ones are, `_consts_key`).

    A printed jaxpr names a callback without telling two functions apart, so two
    programs that print alike may call different Python code; their functions
    are part of the key, sub-jaxprs included. A custom derivative's rules are
    not: a shared program only runs, on concrete arrays (a `run` that reads a
    traced value, its arguments or its closure's, runs its own program: see
    `_program`), so it never calls them, and each trace wraps them in a new
    function (a new lambda calling jax.nn.relu would compile every time).
    Each equation's name stack (`jax.named_scope`) is part of it too: the printed
    jaxpr leaves it out, and a profile names its ops by it.
    """
    found: list = []

    def walk(value: Any) -> None:
        if isinstance(value, jax_core.ClosedJaxpr | jax_core.Jaxpr):
            if isinstance(value, jax_core.ClosedJaxpr):
                found.append(_consts_key(value.consts))
            # Both have .eqns; a ClosedJaxpr's .jaxpr is itself in some jax versions.
            for eqn in value.eqns:
                found.append(str(eqn.source_info.name_stack))
                rules = eqn.primitive.name in _CUSTOM_DERIVATIVES
                for param in eqn.params.values():
                    if not rules or isinstance(param, jax_core.ClosedJaxpr | jax_core.Jaxpr):
                        walk(param)
        elif isinstance(value, tuple | list):
            for item in value:
                walk(item)
        elif not isinstance(value, type) and (callable(value) or hasattr(value, "call_wrapped")):
            found.append(_Identity(value))

    walk(jaxpr)
    return tuple(found)


def _nested_consts(jaxpr: Any) -> list:
    """The constants of every closed jaxpr nested in `jaxpr`'s equations, at any depth."""
    found: list = []

    def walk(value: Any) -> None:
        if isinstance(value, jax_core.ClosedJaxpr):
            found.extend(value.consts)
        if isinstance(value, jax_core.ClosedJaxpr | jax_core.Jaxpr):
            for eqn in value.eqns:
                walk(tuple(eqn.params.values()))
        elif isinstance(value, tuple | list):
            for item in value:
                walk(item)

    walk(jaxpr)
    return found


class _Identity:
    """Wraps a value so that it compares by identity (and keeps it alive)."""

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value


def _jitted(fn: Callable, structure: tuple) -> Callable:
    """One jitted shard_map of `fn` for (strategy, argument structure)."""
    strategy, treedef, subdefs, kinds, axis_name, current = structure
    mesh, axes = strategy.mesh, tuple(strategy.batch_axes)
    island = _island_mesh(strategy)
    if island is not None:  # axis_name is None or the island's one batch axis (`run`)
        mesh = island
    elif axis_name is not None and (axis_name,) != axes:
        mesh, axes = _replica_mesh(strategy, axis_name), (axis_name,)
    context = ReplicaContext(strategy.num_replicas_in_sync, axes)
    batch = PartitionSpec(axes)
    specs = tuple(PartitionSpec() if k == _REPLICATED else batch for k in kinds)

    def per_replica(*flat):
        flat = iter(x[0] if k == _STACKED else x for x, k in zip(flat, kinds, strict=True))
        top = [
            next(flat)
            if subdef is None
            else subdef.value
            if isinstance(subdef, _Static)
            else jax.tree.unflatten(subdef, [next(flat) for _ in range(subdef.num_leaves)])
            for subdef in subdefs
        ]
        args, kwargs = jax.tree.unflatten(treedef, top)
        with (
            replica_context(context),
            running_strategy(current),
            rules_without((*strategy.batch_axes, *axes)),
        ):
            out = _call_replica_fn(fn, args, kwargs, axes, axis_name)
        _check_outputs(out)
        return jax.tree.map(lambda y: jnp.asarray(y)[None], out)

    mapped = jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=specs,
        out_specs=batch,
        axis_names=set(axes),
        # Each replica's gradients stay its own, as in tf.distribute: with
        # varying-axis checks on, the gradient of a replicated argument would
        # come back already summed over the replicas.
        check_vma=False,
    )

    def program(*flat):
        # Inside a step the context mesh is the strategy's; the replica mesh is
        # the same devices with the batch axes renamed, so it stands in for it.
        context_mesh = jax.sharding.get_abstract_mesh()
        if context_mesh.empty or context_mesh == mesh.abstract_mesh:
            return jax.tree.map(PerReplica, mapped(*flat))
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return jax.tree.map(PerReplica, mapped(*flat))

    return jax.jit(program)


def _no_island_axis_name(axes: tuple[str, ...], axis_name: str) -> None:
    """Inside a DiLoCo island the replicas keep the island's batch axis names: a collective
    over a renamed axis could not come back onto the island's mesh."""
    raise ConfigurationError(
        message(
            "Inside a DiLoCo step, run names the island's replicas by the island's batch "
            "axes; an axis_name of your own is supported outside DiLoCo only.",
            received(axis_name=axis_name, island_batch_axes=axes),
            f"write fn's collectives over {axes[0]!r} (lax.psum(x, {axes[0]!r})) or with "
            "spmd.get_replica_context().all_reduce, and pass axis_name=None.",
        )
    )


def _check_outputs(out: Any) -> None:
    """Raises where a leaf of fn's output is not an array or a number (a string, an object):
    each leaf comes back stacked over the replicas, which only arrays can be.

    Raises:
      ConfigurationError: naming the leaf's path in the output and its type.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(out):
        if isinstance(leaf, jax.Array) or hasattr(leaf, "__jax_array__"):
            continue
        if isinstance(leaf, np.ndarray | np.generic):
            if leaf.dtype.kind not in "OUSmM":  # not objects, text, dates
                continue
        elif isinstance(leaf, bool | int | float | complex):
            continue
        raise ConfigurationError(
            message(
                "strategy.run's fn returns arrays and numbers (any pytree of them): each "
                "output leaf comes back as the PerReplica of its replicas' values.",
                received(
                    output_leaf=f"out{jax.tree_util.keystr(path)}",
                    leaf_type=type(leaf).__name__
                    + (f" of dtype {leaf.dtype}" if isinstance(leaf, np.ndarray) else ""),
                ),
                "return only arrays (or numbers) from fn; keep Python values such as names "
                "and tags outside it: out = strategy.run(fn, args=(x,)); tag = 'tag'.",
            )
        )


def _call_replica_fn(fn: Callable, args: Any, kwargs: dict, axes: tuple, axis_name: Any):
    """Calls `fn` for one replica; a collective over an axis `run` does not bind is a
    ConfigurationError that names the axis_name to pass (was JAX's NameError)."""
    try:
        return fn(*args, **kwargs)
    except NameError as error:
        found = _UNBOUND_AXIS.search(str(error))
        if found is None:
            raise
        raise ConfigurationError(
            message(
                "strategy.run names the replicas for fn's collectives by the batch axes, or by "
                "the one axis_name passed (as jax.pmap's axis_name); fn names no other axis.",
                received(unbound_axis=found.group(1), axis_name=axis_name, bound_axes=axes),
                f"pass axis_name={found.group(1)!r} to strategy.run, as "
                f"jax.pmap(fn, axis_name={found.group(1)!r}) did (one name per run: use it "
                "for every collective of fn).",
            )
        ) from error


def reduce(op: ReduceOp, value: Any, axis: int | None, strategy: Strategy | None = None) -> Any:
    """`Strategy.reduce` over a structure whose leaves are `PerReplica` or plain values."""
    if axis is not None:
        _check_axis_type(axis, "reduce")
    if jax.process_count() > 1:
        leaves = jax.tree.leaves(value, is_leaf=_is_per_replica)
        _agree_on_host_values([x for x in leaves if not _is_per_replica(x) and _is_host_value(x)])
    return jax.tree.map(
        lambda x: _reduce_one(op, x, axis, strategy), value, is_leaf=_is_per_replica
    )


def _agree_on_host_values(values: list) -> None:
    """Every process reduces host values of the same shapes and dtypes, checked by one
    all-gather of a fixed size: values of different shapes would make the all-gather
    of the values mismatch (a wrong result, or gloo aborting the process).

    Raises:
      BatchError: on every process, when the processes' shapes or dtypes differ.
    """
    if not values:
        return
    from jax.experimental import multihost_utils

    shown = ", ".join(f"{np.result_type(x).name}{list(np.shape(x))}" for x in values)
    text = shown.encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    record = np.zeros(_SIGNATURE_BYTES, np.uint8)
    record[:8] = np.frombuffer(digest, np.uint8)
    body = text[: _SIGNATURE_BYTES - 8]
    record[8 : 8 + len(body)] = np.frombuffer(body, np.uint8)
    records = np.asarray(multihost_utils.process_allgather(record))
    if (records == records[0]).all():
        return
    per_process = {
        p: bytes(r[8:]).rstrip(b"\0").decode(errors="replace") for p, r in enumerate(records)
    }
    raise BatchError(
        message(
            "With several processes, strategy.reduce of a plain value (numpy, a number, a "
            "local array) reduces each process's own value over the processes, element by "
            "element: every process passes values of the same shapes and dtypes.",
            received(per_process=per_process),
            "give the value the same shape and dtype on every process (e.g. a count as a "
            "scalar, a sum and a count rather than a list of losses), or reduce the "
            "PerReplica that strategy.run returned.",
        )
    )


def _reduce_one(op: ReduceOp, value: Any, axis: int | None, strategy: Strategy | None) -> Any:
    fn = _REDUCERS[op]
    if isinstance(value, PerReplica):
        _check_count(strategy, value, "reduce")
        return jax.tree.map(lambda x: fn(x, axis=_replica_axes(x, axis)), value.values)
    if jax.process_count() > 1 and _is_host_value(value):
        # tf.distribute's MultiWorkerMirroredStrategy: a plain value is this
        # worker's, and is reduced over the workers (`reduce` checked the shapes).
        from jax.experimental import multihost_utils

        value = fn(jnp.asarray(multihost_utils.process_allgather(np.asarray(value))), axis=0)
    if axis is None:
        return value
    return fn(value, axis=_in_range(axis, np.ndim(value), "reduce", np.shape(value)))


def _replica_axes(x: jax.Array, axis: int | None) -> tuple[int, ...]:
    """The axes of a stacked per-replica leaf that `reduce(axis=...)` reduces over."""
    if axis is None:
        return (0,)
    return (0, _in_range(axis, x.ndim - 1, "reduce", x.shape[1:]) + 1)


def _check_axis_type(axis: Any, where: str) -> None:
    if not is_integer(axis):
        raise ConfigurationError(
            message(
                f"{where}'s axis is an int (negative counts from the end)"
                + (", or None." if where == "reduce" else "."),
                received(axis=axis, type=type(axis).__name__),
                "pass e.g. axis=0 or axis=-1.",
            )
        )


def _in_range(axis: int, ndim: int, where: str, shape: tuple) -> int:
    """`axis` as a non-negative axis of a value of rank `ndim`, checked to be one."""
    if not -ndim <= axis < ndim:
        raise ConfigurationError(
            message(
                f"{where}'s axis must be an axis of each replica's value.",
                received(axis=int(axis), per_replica_shape=tuple(shape)),
                f"pass an axis in [{-ndim}, {ndim})."
                if ndim
                else "each replica's value is a scalar: reduce with axis=None, or gather "
                "with axis=0.",
            )
        )
    return int(axis) % ndim


def _is_host_value(x: Any) -> bool:
    """A value of this process alone: numpy, a Python number, or a local jax.Array."""
    if isinstance(x, jax.Array):
        return x.is_fully_addressable and len(x.sharding.device_set) < jax.device_count()
    return True


def local_results(value: Any) -> tuple[Any, ...]:
    """`Strategy.local_results`: one structure per local replica, in replica order.

    Inside a step (traced) with one process every replica is local: each
    replica's value is its row of the stacked values.

    Raises:
      ContextError: traced inside a step of a multi-process job, where which
        replicas are local is not part of the one global program.
    """
    per_replica = [x for x in jax.tree.leaves(value, is_leaf=_is_per_replica) if _is_per_replica(x)]
    if not per_replica:
        return (value,)
    if any(isinstance(x, jax.core.Tracer) for p in per_replica for x in jax.tree.leaves(p.values)):
        return _traced_results(value)
    rows = {}
    for p in per_replica:
        leaves, treedef = jax.tree.flatten(p.values)
        per_leaf = [_local_rows(x) for x in leaves]
        count = len(per_leaf[0]) if per_leaf else 0
        rows[id(p)] = [jax.tree.unflatten(treedef, [r[i] for r in per_leaf]) for i in range(count)]
    count = min(len(r) for r in rows.values())
    return tuple(
        jax.tree.map(
            lambda x, i=i: rows[id(x)][i] if _is_per_replica(x) else x,
            value,
            is_leaf=_is_per_replica,
        )
        for i in range(count)
    )


def _traced_results(value: Any) -> tuple[Any, ...]:
    if jax.process_count() > 1:
        raise ContextError(
            message(
                "local_results inside a step is defined with one process only: the step "
                "is one global program, with no notion of this process's replicas.",
                received(process_count=jax.process_count(), traced=True),
                "use strategy.gather or strategy.reduce inside the step, or call "
                "local_results on the step's output, outside it.",
            )
        )
    leaves = [x for x in jax.tree.leaves(value, is_leaf=_is_per_replica) if _is_per_replica(x)]
    count = min(jax.tree.leaves(p.values)[0].shape[0] for p in leaves if jax.tree.leaves(p.values))
    return tuple(
        jax.tree.map(
            lambda x, i=i: jax.tree.map(lambda y: y[i], x.values) if _is_per_replica(x) else x,
            value,
            is_leaf=_is_per_replica,
        )
        for i in range(count)
    )


def gather(value: Any, axis: int = 0, strategy: Strategy | None = None) -> Any:
    """`Strategy.gather`: every replica's value concatenated along `axis`.

    With several processes the result is replicated, a copy on every device, so
    that every process can read it (`np.asarray`), as a `reduce`'s result can.
    """
    _check_axis_type(axis, "gather")

    def concat(x):
        if x.ndim == 1:  # scalars per replica: stacked along the only axis there is
            if axis != 0:
                _in_range(axis, 0, "gather", ())
            return x
        at = _in_range(axis, x.ndim - 1, "gather", x.shape[1:])
        moved = jnp.moveaxis(x, 0, at)
        return moved.reshape(moved.shape[:at] + (-1,) + moved.shape[at + 2 :])

    def fetchable(x):
        if isinstance(x, jax.core.Tracer) or x.is_fully_addressable:
            return concat(x)
        replicated = NamedSharding(x.sharding.mesh, PartitionSpec())
        return jax.jit(concat, out_shardings=replicated)(x)

    def one(x):
        if not _is_per_replica(x):
            return x
        _check_count(strategy, x, "gather")
        return jax.tree.map(fetchable, x.values)

    return jax.tree.map(one, value, is_leaf=_is_per_replica)


def _local_rows(x: jax.Array) -> list[jax.Array]:
    """The distinct rows of a stacked per-replica array that live on this process.

    Each row is sliced on its own device, under a one-device mesh so that an
    open `scope()`'s mesh context does not reject the single-device operation.
    """
    rows = {}
    for shard in x.addressable_shards:
        start = shard.index[0].start or 0
        with jax.set_mesh(Mesh(np.asarray([shard.device], dtype=object), ("row",))):
            for offset in range(shard.data.shape[0]):
                if start + offset not in rows:
                    rows[start + offset] = shard.data[offset]
    return [rows[i] for i in sorted(rows)]
