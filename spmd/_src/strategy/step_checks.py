"""What a step checks before it compiles or runs: the state, the batch, the keyword arguments."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import itertools
import math
import os
import re
import threading
import weakref
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from spmd._src.clusters import hang_watch
from spmd._src.clusters.agreement import Agreement
from spmd._src.clusters.jax_state import coordination_client
from spmd._src.errors import BatchError, ConfigurationError, message, received
from spmd._src.rules import path_str
from spmd._src.strategy import nnx_state
from spmd._src.validate import positive_number

if TYPE_CHECKING:
    from spmd._src.strategy.base import Strategy

__all__ = [
    "AGREE_TIMEOUT_S",
    "ENV_AGREE_TIMEOUT",
    "LastAgreed",
    "RUN",
    "STEP",
    "agree_on_batch",
    "agree_timeout",
    "check_arguments",
    "data_names",
    "describe_call",
    "host_value",
    "register",
    "static_key",
]

# The last strategy built on each mesh, to say which one placed a state.
_BY_MESH: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_SCALARS = (bool, int, float, complex, np.generic)

NNX_OUTSIDE_STATE = (
    "A step updates the NNX objects (nnx.Module, nnx.Optimizer) of its state, its "
    "first argument, only; one passed anywhere else would silently not be updated."
)


# How long a process waits for the others to reach a step with a new batch signature
# where no hang watch bounds the wait, unless ENV_AGREE_TIMEOUT says otherwise (seconds).
AGREE_TIMEOUT_S = 300.0
ENV_AGREE_TIMEOUT = "SPMD_BATCH_AGREE_TIMEOUT"
# Each new batch signature of any step takes the next number, in the same order on
# every process (their steps run the same programs in the same order).
_AGREEMENTS = itertools.count()


STEP, RUN = "a step", "strategy.run"  # who agrees on a signature, as its errors name it

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class _BatchSignatures(Agreement):
    """Every process passes a step batches of one signature: shapes, dtypes, structure,
    and its keyword arguments (array shapes and dtypes, static values).

    A process agrees when its signature differs from the step's previous call.
    One that changed alone waits for peers that never come: they passed the
    call with the signature they all agreed on last, which the hang watch's
    records tell (`hang_watch.returned_from`), ending the wait at once.
    `caller` is what is called: a step, or `strategy.run`.
    """

    def __init__(
        self,
        client: Any,
        prefix: str,
        batch: str,
        previous: str | None,
        call: int,
        caller: str = STEP,
    ):
        super().__init__(client, agree_timeout(), prefix)
        self._batch, self._previous, self._call = batch, previous, call
        self._caller = caller
        self._main = threading.current_thread() is threading.main_thread()

    def compare(self, records: list[dict], index: int) -> None:
        if len({r["batch"] for r in records}) > 1:
            raise BatchError(_mixed({p: r["batch"] for p, r in enumerate(records)}, self._caller))

    def missing_message(self, process: int, index: int) -> str:
        return message(
            f"Every process calls {self._caller} with each new batch signature within "
            f"{self._timeout:g} s of the others.",
            received(missing_process=process),
            f"call {self._caller} the same number of times, with the same batch shapes, on "
            "every process; a process that changed its batch shape alone is the one to look at.",
        )

    def passed_message(self, process: int, index: int) -> str | None:
        if self._previous is None or not self._main:
            return None
        record = hang_watch.progress(self._client, process)
        if record is None or not hang_watch.returned_from(record, self._call):
            return None
        kept = f"{self._previous} (unchanged since its previous call of this {_noun(self._caller)})"
        return _mixed({self._process: self._batch, process: kept}, self._caller)


def _noun(caller: str) -> str:
    return "step" if caller == STEP else caller


def _mixed(per_process: dict[int, str], caller: str = STEP) -> str:
    return message(
        f"Every process passes {caller} the same global batch signature (shapes, dtypes, "
        "structure, and keyword arguments: array shapes and dtypes, static values): each "
        "process's arrays are the global batch, of which it keeps its own rows, and "
        f"{'the step' if caller == STEP else caller} runs on all processes together.",
        received(per_process=dict(sorted(per_process.items()))),
        "give every process the same global batch size and dtypes and the same keyword "
        f"arguments, or feed {'the step' if caller == STEP else caller} from "
        "strategy.distribute_dataset(...) / strategy.distribute_datasets_from_function(...), "
        "which split one global batch and check every batch across processes.",
    )


class LastAgreed:
    """The batch signature a step's processes agreed on last, for a step with several.

    A call whose signature differs from it agrees anew (`agree`), one signature
    seen before included: a process that went back to it alone would otherwise
    train on mixed data. A call with the same signature costs one comparison.
    """

    __slots__ = ("_key", "_shown")

    def __init__(self) -> None:
        self._key: Any = None  # the signature, as the caller compares it
        self._shown: str | None = None  # how it reads, for the next agreement's errors

    def differs(self, key: Any) -> bool:
        """Whether a call with signature `key` must agree first."""
        return self._key is None or self._key != key

    def agree(
        self,
        fn: Any,
        data: tuple,
        key: Any,
        kwargs: dict | None = None,
        static: dict | None = None,
        *,
        names: list[str] | None = None,
        caller: str = STEP,
    ) -> None:
        """Agrees on `data` and the keyword arguments (signature `key`) with every process
        (`agree_on_batch`)."""
        self._key = None
        self._shown = agree_on_batch(
            fn, data, self._shown, kwargs, static, names=names, caller=caller
        )
        self._key = key


def agree_on_batch(
    fn: Any,
    data: tuple,
    previous: str | None = None,
    kwargs: dict | None = None,
    static: dict | None = None,
    *,
    names: list[str] | None = None,
    caller: str = STEP,
) -> str | None:
    """Checks with every other process that they call a step with this batch signature.

    Called whenever a step's batch signature differs from its previous call's
    (its steady state costs nothing). The signature is each array's shape and
    dtype, the structure, and the keyword arguments: arrays by shape and dtype,
    static values by value, and traced host values (Python numbers, numpy
    arrays) by value too (`host_value`); a keyword jax.Array is not fetched to
    compare its value: every process passes the same (docs/multihost.md).

    Args:
      fn: the step function, whose argument names the signature shows.
      data: the call's batch arguments.
      previous: what this function returned for the step's previous call (the
        signature every process agreed on then); None for its first call.
      kwargs: the call's traced keyword arguments (arrays and numbers).
      static: the call's static keyword arguments (compile-time values).
      names: the names of `data`'s entries; by default `fn`'s parameters after
        the state (`data_names`).
      caller: what is called, as the errors name it (`STEP` or `RUN`).

    Returns:
      The signature agreed on, as shown in errors; None with one process.

    Raises:
      BatchError: the processes' signatures differ, or one did not reach the step
        within `agree_timeout()` seconds, or went on past it with its previous one.
    """
    client = coordination_client()
    if client is None:
        return None
    batch = describe_call(fn, data, kwargs, static, names)
    # One prefix, an index per agreement: process 0 deletes each one's keys at the next.
    _BatchSignatures(client, "spmd/step", batch, previous, hang_watch.STEPS[0], caller).agree(
        next(_AGREEMENTS), {"batch": batch}
    )
    return batch


def describe_call(
    fn: Any,
    data: tuple,
    kwargs: dict | None = None,
    static: dict | None = None,
    names: list[str] | None = None,
) -> str:
    """A call's signature as every process compares it and an error shows it:
    `images: float32[8, 3], lr: float32[], scale=2.0 (3 arrays, PyTreeDef(...))`."""
    kwargs, static = kwargs or {}, static or {}
    names = names or data_names(fn, len(data)) or [f"argument {i}" for i in range(len(data))]
    parts = [f"{name}: {_describe(entry)}" for name, entry in zip(names, data, strict=False)]
    parts += [_keyword_shown(name, kwargs[name]) for name in sorted(kwargs)]
    parts = [part for part in parts if part]
    parts += [f"{name}={_static_shown(static[name])}" for name in sorted(static)]
    leaves, treedef = jax.tree.flatten((data, kwargs) if kwargs else data)
    return f"{', '.join(parts)} ({len(leaves)} arrays, {treedef})"


def _keyword_shown(name: str, value: Any) -> str:
    """A traced keyword argument: its arrays' dtypes and shapes and, for host values
    (Python numbers, numpy arrays), their values (`host_value`); "" with no arrays."""
    leaves = jax.tree.leaves(value)
    if not leaves:
        return ""
    values = [host_value(x) for x in leaves]
    shown = f"{name}: {_describe(value)}"
    if all(v is None for v in values):
        return shown
    if len(values) == 1:
        return f"{shown} = {values[0]}"
    return f"{shown} = [{', '.join('(device array)' if v is None else v for v in values)}]"


def host_value(x: Any) -> str | None:
    """How a replicated host value reads when processes compare it: a Python number or
    a numpy array of up to 8 elements by value, a larger one by a fingerprint of its
    bytes; None for a jax.Array, whose value is not fetched to compare.

    A replicated keyword argument is one value for every device: a process passing
    another value would give its devices another number than the others' (a "replicated"
    state that silently differs per process).
    """
    if isinstance(x, bool | int | float | complex):
        return repr(x)
    if isinstance(x, np.ndarray | np.generic):
        array = np.asarray(x)
        if array.size <= 8:
            return f"{array.dtype.name}({array.tolist()!r})"
        digest = hashlib.blake2b(array.tobytes(), digest_size=8).hexdigest()
        return f"{array.dtype.name}#{digest}"
    return None


def _static_shown(value: Any) -> str:
    """A static value as processes compare it: its repr (1, 1.0 and True differ, as
    do 0.0 and -0.0), without memory addresses (a function's repr names one, different
    in each process)."""
    return _ADDRESS.sub("", repr(value))


def agree_timeout() -> float:
    """The seconds a process waits for the others at a step's new batch signature.

    `SPMD_BATCH_AGREE_TIMEOUT` where it is set. Otherwise no bound of its own
    (infinity) while this process's hang watch runs: a process that never comes
    to the step is a hung process, which the watch names with its stack within
    `hang_timeout` (exit code 75, restarted by `spmd launch`), where a timeout
    here would blame the batch (a BatchError, exit code 78, not restarted).
    Without a hang watch (no `spmd.initialize()` of several processes),
    `AGREE_TIMEOUT_S`.

    Raises:
      ConfigurationError: the variable is set to something else than a positive number.
    """
    value = os.environ.get(ENV_AGREE_TIMEOUT, "").strip()
    if not value:
        return math.inf if hang_watch.RUNNING.is_set() else AGREE_TIMEOUT_S
    try:
        seconds: object = float(value)
    except ValueError:
        seconds = value
    return positive_number(
        seconds,
        ENV_AGREE_TIMEOUT,
        fix=f"set {ENV_AGREE_TIMEOUT} to a number of seconds, e.g. 60, or unset it for "
        "the default (the hang watch's bound).",
    )


def _describe(entry: Any) -> str:
    """An argument's arrays as dtype[shape], a pytree's in its own structure."""
    shapes = [_leaf(x) for x in jax.tree.leaves(entry)]
    return (
        shapes[0]
        if len(shapes) == 1 and not isinstance(entry, dict | list | tuple)
        else ("{" + ", ".join(shapes) + "}")
    )


def _leaf(x: Any) -> str:
    """dtype[shape] of an array; the type's name for anything else."""
    try:
        return f"{np.result_type(x).name}{list(np.shape(x))}"
    except (TypeError, ValueError):
        return type(x).__name__


def register(strategy: Strategy) -> None:
    """Remembers `strategy` as the one that places states on its mesh."""
    with contextlib.suppress(TypeError):  # an unhashable mesh: then named by its shape only
        _BY_MESH[strategy.mesh] = strategy


def check_arguments(
    strategy: Strategy,
    pure: Any,
    state_leaves: list,
    data: tuple,
    kwargs: dict,
    axis: int,
    donate: bool = False,
    fn: Any = None,
) -> None:
    """Checks one call of a step before it runs; see the functions below.

    `fn`, the step's function, names the data arguments in a batch error.

    Raises:
      ConfigurationError: NNX objects outside the state, a state leaf that is
        not an array, donated to an earlier call or placed by another strategy,
        one array at two paths of a donated state, or a keyword argument that
        is neither static nor an array.
      BatchError: a batch of strings or objects, ragged, empty or not divisible.
    """
    _check_no_nnx("data", data)
    _check_no_nnx("keyword arguments", kwargs)
    bad = [i for i, x in enumerate(state_leaves) if _leaf_problem(strategy, x) is not None]
    if bad:
        _raise_state_error(strategy, pure, bad[0])
    if donate:
        _check_no_shared_arrays(pure, state_leaves)
    _check_kwargs(kwargs)
    _check_batch_dtypes(data)
    strategy.check_batch(data, axis, data_names(fn, len(data)))


def data_names(fn: Any, count: int) -> list[str] | None:
    """The names of a step's `count` data arguments (every positional one after the state).

    None where the signature cannot tell (a builtin, or fewer named parameters);
    a `*args` parameter names the rest `args[0]`, `args[1]`, ...
    """
    try:
        parameters = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    names = []
    for p in parameters:
        if p.kind is p.VAR_POSITIONAL:
            names += [f"{p.name}[{i}]" for i in range(count - len(names))]
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        if len(names) >= count:
            break
    return names[:count] if len(names) >= count else None


def _check_no_nnx(where: str, tree: Any) -> None:
    if nnx_state.has_graph(tree):
        leaves = jax.tree.leaves(tree, is_leaf=_is_nnx_object)
        kinds = sorted({type(x).__name__ for x in leaves if _is_nnx_object(x)})
        raise ConfigurationError(
            message(
                NNX_OUTSIDE_STATE,
                received(**{where.replace(" ", "_"): kinds}),
                "pass every NNX object in the state: step((model, optimizer), x, y) with "
                "def step(state, x, y): model, optimizer = state. Arguments after the "
                "state are batches (split over the replicas); pass other values by keyword.",
            )
        )


def _is_nnx_object(x: Any) -> bool:
    return nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable)


def _leaf_problem(strategy: Strategy, x: Any) -> str | None:
    """Why a state leaf cannot be used ("deleted", "type", "mesh"), or None."""
    if isinstance(x, jax.Array):
        if isinstance(x, jax.core.Tracer):
            return None
        if x.is_deleted():
            return "deleted"
        sharding = x.sharding
        if isinstance(sharding, NamedSharding) and sharding.mesh != strategy.mesh:
            return "mesh"
        return None
    if isinstance(x, (jax.ShapeDtypeStruct, *_SCALARS)):
        return None
    if isinstance(x, np.ndarray) and _numeric(x.dtype):
        return None
    return "type"


def _numeric(dtype: Any) -> bool:
    """Numbers or booleans, bfloat16 and the other ml_dtypes included; not str or object."""
    try:
        return dtype == np.bool_ or bool(jnp.issubdtype(dtype, jnp.number))
    except TypeError:
        return False


def _raise_state_error(strategy: Strategy, pure: Any, index: int) -> None:
    path, leaf = jax.tree_util.tree_flatten_with_path(pure)[0][index]
    where = path_str(path) or "<the state>"
    problem = _leaf_problem(strategy, leaf)
    if problem == "deleted":
        raise ConfigurationError(
            message(
                "The state's arrays were donated to an earlier call of a step (donate=True by "
                "default), which reused their memory for its result.",
                received(leaf=where, deleted=True),
                "pass the state that call returned: state, metrics = step(state, batch); or "
                "build the step with @strategy.step(donate=False) to keep the input state.",
            )
        )
    if problem == "mesh":
        mesh = leaf.sharding.mesh
        placed_by = _BY_MESH.get(mesh)
        raise ConfigurationError(
            message(
                f"The state must be placed by this step's strategy, {strategy!r}.",
                received(
                    leaf=where,
                    placed_by=placed_by if placed_by is not None else "another mesh",
                    mesh=dict(mesh.shape),
                ),
                "move it first: state = strategy.put(state) (or restore a checkpoint with "
                "this strategy's abstract_state as the target).",
            )
        )
    raise ConfigurationError(
        message(
            "Every leaf of a state is an array (jax.Array, numpy array or number) of a "
            "numeric dtype.",
            received(leaf=where, type=type(leaf).__name__, value=_short(leaf)),
            "keep non-array values (names, configs, callables) out of the state: pass "
            "them as static keyword arguments or close over them.",
        )
    )


def _check_no_shared_arrays(pure: Any, state_leaves: list) -> None:
    """A donated state holds each array object once: XLA cannot donate a buffer twice."""
    seen: dict[int, int] = {}
    for i, x in enumerate(state_leaves):
        if not isinstance(x, jax.Array | np.ndarray) or isinstance(x, jax.core.Tracer):
            continue
        first = seen.setdefault(id(x), i)
        if first == i:
            continue
        paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(pure)[0]]
        raise ConfigurationError(
            message(
                "A donated state holds each array once: its buffers are reused for the "
                "result, and one buffer cannot be donated twice (tied weights).",
                received(first=paths[first] or "<the state>", second=paths[i] or "<the state>"),
                "keep one copy in the state and tie in the model (use the same entry for "
                "both, e.g. the embedding's transpose as the output layer), or build the "
                "step with @strategy.step(donate=False).",
            )
        )


def _check_kwargs(kwargs: dict) -> None:
    """Non-static keyword arguments are traced: each leaf an array or a number."""
    for path, x in jax.tree_util.tree_flatten_with_path(kwargs)[0]:
        if isinstance(x, (jax.Array, *_SCALARS)) or (
            isinstance(x, np.ndarray) and _numeric(x.dtype)
        ):
            continue
        name = path_str(path)
        raise ConfigurationError(
            message(
                "A keyword argument not in static_argnames is traced: an array or a number.",
                received(**{name.replace("/", "_") or "kwarg": _short(x)}, type=type(x).__name__),
                f"add {name.split('/')[0]!r} to static_argnames "
                f"(@strategy.step(static_argnames=({name.split('/')[0]!r},))), so that its "
                "value is a compile-time constant.",
            )
        )


def _check_batch_dtypes(data: tuple) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(data)[0]:
        dtype = getattr(x, "dtype", None)
        if dtype is None:
            if isinstance(x, _SCALARS):
                continue
            dtype = np.asarray(x).dtype
        if not _numeric(dtype):
            raise BatchError(
                message(
                    "Every batch leaf is an array of numbers (or booleans).",
                    received(leaf=path_str(path), dtype=str(dtype), value=_short(x)),
                    "encode strings and objects as numbers before the step (token ids, "
                    "label indices), e.g. in the input pipeline.",
                )
            )


def static_key(static: dict) -> tuple:
    """The static keyword arguments as a cache key: each name, type and value.

    The type and, for floats, the repr are part of the key: 1, 1.0 and True,
    or 0.0 and -0.0, compare equal but may compute different numbers.

    Raises:
      ConfigurationError: a static value is not hashable.
    """
    key = []
    for name in sorted(static):
        value = static[name]
        try:
            hash(value)
        except TypeError:
            raise ConfigurationError(
                message(
                    "A static keyword argument is a compile-time constant and must be hashable.",
                    received(**{name: _short(value)}, type=type(value).__name__),
                    f"pass {name} as a tuple (not a list) or a frozen dataclass, or drop it "
                    "from static_argnames to pass it as an array.",
                )
            ) from None
        key.append((name, _typed(value)))
    return tuple(key)


def _typed(value: Any) -> Any:
    """`value` with its type at every level: (1,) and (1.0,) are different keys.

    Floats are keyed by repr too (0.0 and -0.0 compare equal). Tuples (named
    ones too), frozensets and dataclasses (a frozen config) are keyed field by
    field, so the same holds inside them; any other object by its own `==`, as
    `jax.jit` keys its static arguments.
    """
    if isinstance(value, tuple):
        return (type(value), tuple(map(_typed, value)))
    if isinstance(value, frozenset):
        return (type(value), frozenset(map(_typed, value)))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return (type(value), tuple((f.name, _typed(getattr(value, f.name))) for f in fields))
    if isinstance(value, float | complex | np.floating | np.complexfloating):
        return (type(value), value, repr(value))
    return (type(value), value)


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."
