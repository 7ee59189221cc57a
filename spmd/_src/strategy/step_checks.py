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
from spmd._src.data.host_batches import fingerprint
from spmd._src.errors import BatchError, ConfigurationError, message, received
from spmd._src.rules import path_str
from spmd._src.strategy import nnx_state
from spmd._src.strategy.diloco_state import DiLoCoState
from spmd._src.strategy.state_placement import buffers
from spmd._src.validate import positive_number

if TYPE_CHECKING:
    from spmd._src.strategy.base import Strategy

__all__ = [
    "AGREE_TIMEOUT_S",
    "COMPARE_BATCH_EVERY",
    "ENV_AGREE_TIMEOUT",
    "LastAgreed",
    "RUN",
    "STEP",
    "agree_on_batch",
    "agree_on_values",
    "agree_timeout",
    "check_arguments",
    "check_leaf_types",
    "data_names",
    "deleted_closure",
    "describe_call",
    "host_prints",
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
# Each scheduled comparison of a host batch's values takes the next number, likewise.
_VALUE_CHECKS = itertools.count()
# A step compares the values of a host batch across processes at each new batch
# signature and every this many calls in between (Strategy.step's compare_batch_every).
COMPARE_BATCH_EVERY = 100


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
        _compare_values(records, self._caller)

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


class _BatchValues(Agreement):
    """Every process passes a step (or `strategy.run`) the same values as the global
    batch: the fingerprints of its host arguments (`host_prints`), compared on the
    step's schedule between signature changes."""

    def __init__(self, client: Any, prefix: str, caller: str = STEP):
        super().__init__(client, agree_timeout(), prefix)
        self._caller = caller

    def compare(self, records: list[dict], index: int) -> None:
        _compare_values(records, self._caller)

    def missing_message(self, process: int, index: int) -> str:
        return message(
            f"Every process calls {self._caller} the same number of times: the processes "
            f"compare their global batches every so many calls, within {self._timeout:g} s "
            "of each other.",
            received(missing_process=process),
            f"call {self._caller} the same number of times on every process, with the same "
            "compare_batch_every.",
        )


def _compare_values(records: list[dict], caller: str) -> None:
    """Raises a BatchError naming the arguments whose values differ between processes."""
    values = {p: r.get("values") for p, r in enumerate(records)}
    if all(v == values[0] for v in values.values()):
        return
    names = sorted({name for v in values.values() for name in (v or {})})
    differ = [n for n in names if len({(v or {}).get(n) for v in values.values()}) > 1]
    raise BatchError(_different_values(differ, values, caller))


def _different_values(differ: list[str], values: dict[int, Any], caller: str) -> str:
    the = "the step" if caller == STEP else caller
    return message(
        f"Every process passes {caller} the same global batch: a process's numpy arrays are "
        "the whole global batch, of which it keeps the rows its devices hold, so processes "
        f"that pass different values would train on a mix of them. (A process that passes "
        "jax.Arrays where another passes numpy differs too: each compares only numpy.)",
        received(differs=differ, fingerprint_per_process=values),
        f"feed {the} from strategy.distribute_dataset(...) (one global batch, each process "
        "reading its share) or strategy.distribute_datasets_from_function(...), or make "
        "every process build the same global batch (the same seed, files and order, not "
        "ones that depend on jax.process_index()).",
    )


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

    __slots__ = ("_key", "_shown", "_since")

    def __init__(self) -> None:
        self._key: Any = None  # the signature, as the caller compares it
        self._shown: str | None = None  # how it reads, for the next agreement's errors
        self._since = 0  # calls since the processes last compared the batch's values

    def differs(self, key: Any) -> bool:
        """Whether a call with signature `key` must agree first."""
        return self._key is None or self._key != key

    def due(self, every: int) -> bool:
        """Whether this call, one more with the agreed signature, compares the batch's
        values: every `every`-th call since the last comparison (never for 0)."""
        if not every:
            return False
        self._since += 1
        if self._since < every:
            return False
        self._since = 0
        return True

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
        values: dict[str, str] | None = None,
    ) -> None:
        """Agrees on `data` and the keyword arguments (signature `key`), and on the host
        values' fingerprints `values`, with every process (`agree_on_batch`)."""
        self._key = None
        self._shown = agree_on_batch(
            fn, data, self._shown, kwargs, static, names=names, caller=caller, values=values
        )
        self._key, self._since = key, 0


def agree_on_batch(
    fn: Any,
    data: tuple,
    previous: str | None = None,
    kwargs: dict | None = None,
    static: dict | None = None,
    *,
    names: list[str] | None = None,
    caller: str = STEP,
    values: dict[str, str] | None = None,
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
      values: the fingerprints of the host arguments (`host_prints`), compared
        too; None to compare none.

    Returns:
      The signature agreed on, as shown in errors; None with one process.

    Raises:
      BatchError: the processes' signatures (or `values`) differ, or one did not
        reach the step within `agree_timeout()` seconds, or went on past it with
        its previous one.
    """
    client = coordination_client()
    if client is None:
        return None
    batch = describe_call(fn, data, kwargs, static, names)
    record = {"batch": batch} if values is None else {"batch": batch, "values": values}
    # One prefix, an index per agreement: process 0 deletes each one's keys at the next.
    _BatchSignatures(client, "spmd/step", batch, previous, hang_watch.STEPS[0], caller).agree(
        next(_AGREEMENTS), record
    )
    return batch


def agree_on_values(values: dict[str, str], caller: str = STEP) -> None:
    """Checks with every other process that this call's host batch has the same values
    (`values`, from `host_prints`): the scheduled comparison between signature changes.

    Raises:
      BatchError: the values differ (naming the arguments), or a process did not
        come within `agree_timeout()` seconds.
    """
    client = coordination_client()
    if client is not None:
        # As agree_on_batch: one prefix, process 0 deleting each comparison's keys at the next.
        _BatchValues(client, "spmd/values", caller).agree(next(_VALUE_CHECKS), {"values": values})


def host_prints(data: tuple, names: list[str]) -> dict[str, str]:
    """A fingerprint of each argument's host values (numpy arrays, Python numbers), by
    name: what every process claims is the same global batch.

    `fingerprint` (CRC-32 of shapes, dtypes and bytes, a large leaf by about
    256 KiB of evenly spaced rows); a jax.Array is not fetched, so an argument of
    jax.Arrays only has none.
    """
    prints = {}
    for name, entry in zip(names, data, strict=False):
        host = [x for x in jax.tree.leaves(entry) if not isinstance(x, jax.Array)]
        if host:
            prints[name] = fingerprint(host)
    return prints


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
      ConfigurationError: a DiLoCo state, NNX objects outside the state, a state leaf that is
        not an array, donated to an earlier call or placed by another strategy,
        one array at two paths of a donated state, or a keyword argument that
        is neither static nor an array.
      BatchError: a batch of strings or objects, ragged, empty or not divisible.
    """
    _check_not_diloco(strategy, pure)
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


def _check_not_diloco(strategy: Strategy, state: Any) -> None:
    """A DiLoCo state (`spmd.DiLoCo.init`'s) is stepped by its DiLoCo's step: a plain step
    would train its stacked islands as one model, never synchronising them."""
    if not isinstance(state, DiLoCoState):
        return
    raise ConfigurationError(
        message(
            "A DiLoCo state (the global params, the outer optimizer's state and one copy of "
            "your state per island, stacked on a leading island axis) is trained by the "
            "step of the spmd.DiLoCo that made it, which steps each island apart and "
            "synchronises them; a synchronous step would train the stack as one model.",
            received(
                state="DiLoCoState",
                islands=_island_count(state),
                step_strategy=strategy,
            ),
            "build the step with that DiLoCo: step = diloco.step(train_step) (the same "
            "spmd.DiLoCo whose init made the state); to use the trained parameters with a "
            "synchronous strategy, take them out: strategy.put(state.params).",
        )
    )


def _island_count(state: Any) -> int | str:
    leaves = jax.tree.leaves(state.islands)
    return np.shape(leaves[0])[0] if leaves and np.ndim(leaves[0]) else "?"


def deleted_closure(fn: Any) -> list[str]:
    """The names of the deleted jax.Arrays (donated to a step, which reused their memory)
    that `fn` reads from its closure or its module's globals, through partials and
    wrappers."""
    names: list[str] = []
    for _ in range(8):
        code = getattr(fn, "__code__", None)
        if code is not None:
            cells = zip(code.co_freevars, fn.__closure__ or (), strict=False)
            values = [(name, _cell(cell)) for name, cell in cells]
            values += [(n, fn.__globals__[n]) for n in code.co_names if n in fn.__globals__]
            names += [name for name, value in values if _holds_deleted(value)]
        inner = getattr(fn, "func", None) or getattr(fn, "__wrapped__", None)
        if inner is None or not callable(inner):
            break
        fn = inner
    return names


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _holds_deleted(value: Any) -> bool:
    if isinstance(value, jax.Array):
        return not isinstance(value, jax.core.Tracer) and value.is_deleted()
    if not isinstance(value, dict | list | tuple):
        return False  # a module, a function, an object: not searched
    leaves = jax.tree.leaves(value)
    return any(isinstance(x, jax.Array) and _holds_deleted(x) for x in leaves)


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


def check_leaf_types(strategy: Strategy, pure: Any) -> None:
    """Every leaf of a state is an array or a number of a numeric dtype (tracers pass):
    `strategy.put` and `strategy.init` check what they place, as a step does.

    Raises:
      ConfigurationError: a leaf is a string, an object or an array of strings,
        naming its path.
    """
    leaves = jax.tree.leaves(pure)
    bad = next((i for i, x in enumerate(leaves) if _leaf_problem(strategy, x) == "type"), None)
    if bad is not None:
        _raise_state_error(strategy, pure, bad)


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
    """A donated state holds each array once, and no two of its arrays share a device
    buffer (arrays put apart from one array on one device): XLA cannot donate a
    buffer twice, and with several devices crashes rather than raise."""
    seen: dict[int, int] = {}  # an array's id, or one of its buffers -> its first leaf
    for i, x in enumerate(state_leaves):
        if not isinstance(x, jax.Array | np.ndarray) or isinstance(x, jax.core.Tracer):
            continue
        first = next((seen[k] for k in (id(x), *buffers(x)) if k in seen), i)
        if first == i:
            seen.update(dict.fromkeys((id(x), *buffers(x)), i))
            continue
        paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(pure)[0]]
        raise ConfigurationError(
            message(
                "A donated state holds each array once: its buffers are reused for the "
                "result, and one buffer cannot be donated twice (tied weights).",
                received(first=paths[first] or "<the state>", second=paths[i] or "<the state>"),
                "keep one copy in the state and tie in the model (use the same entry for "
                "both, e.g. the embedding's transpose as the output layer); for two values "
                "that start equal (a parameter EMA), state = strategy.put(state) gives each "
                "path its own copy; or build the step with @strategy.step(donate=False).",
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
