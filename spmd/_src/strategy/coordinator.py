"""ClusterCoordinator: tf.distribute's schedule / join / fetch loop, in a multi-controller world."""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from spmd._src.data.dataset import DistributedDataset
from spmd._src.errors import ConfigurationError, ContextError, OutOfRangeError, message, received
from spmd._src.rules import path_str
from spmd._src.strategy.replica import in_replica_context

__all__ = ["ClusterCoordinator", "RemoteValue"]

# Errors of scheduled functions that nothing has raised yet (join, done, schedule, fetch,
# get), with the call that raised them: raised at the program's end if still there.
_UNSEEN: list[tuple[BaseException, str]] = []
_AT_EXIT: list[bool] = []  # whether _surface_at_exit is registered
UNJOINED = (
    "A scheduled function's error is raised by join(), done(), the next schedule() or its "
    "RemoteValue's fetch(); the program ended without any of them raising this one, so it "
    "is raised at the end (tf.distribute's coordinator raises it at exit too), and the "
    "program exits with code 1."
)


class RemoteValue:
    """The result of a scheduled function: returned at once, filled when the devices finish.

    tf.distribute's `RemoteValue`: `fetch()` waits and gives the value as numpy
    arrays, `get()` waits and gives the arrays as they are (jax.Arrays).
    An error the function raised is raised by `fetch()` and `get()`.
    """

    def __init__(
        self, value: Any = None, error: BaseException | None = None, origin: str = "a value"
    ):
        self._value = value
        self._error = error
        self._origin = origin  # which scheduled call made it, for errors

    def _raise(self) -> None:
        if self._error is not None:
            _seen(self._error)
            raise self._error
        donated = _donated(self._value)
        if donated:
            raise ConfigurationError(
                message(
                    "A RemoteValue holds what its function returned; arrays of it that a "
                    "later step took as its state were donated to that step (a step donates "
                    "its state by default, reusing its memory), so they are gone.",
                    received(remote_value=self._origin, donated=donated),
                    "fetch it before scheduling the step that takes that state "
                    "(value = coordinator.schedule(...); value.fetch()), return the metrics "
                    "rather than the state from the scheduled function, or build the step "
                    "with @strategy.step(donate=False).",
                )
            )

    def done(self) -> bool:
        """Whether the value is ready (or the function failed); never waits."""
        if self._error is not None:
            return True
        return all(_ready(x) for x in jax.tree.leaves(self._value))

    def get(self) -> Any:
        """Waits for the value and returns it (jax.Arrays stay on the devices).

        Raises:
          The error the function raised (`spmd.OutOfRangeError` for an exhausted
            iterator).
          ConfigurationError: arrays of the value were donated to a later step
            since (a returned state that the next scheduled step took).
        """
        self._raise()
        return jax.block_until_ready(self._value)

    def fetch(self) -> Any:
        """Waits for the value and returns it with every array as numpy (a float for a scalar
        is `float(rv.fetch())`).

        An array sharded over several processes (a DiLoCo step's metrics, one row
        per island) is gathered from every process: a collective, which every
        process must call, in the same order, as every process runs the loop.
        """
        return jax.tree.map(_to_numpy, self.get())


def _keep(error: BaseException, origin: str) -> None:
    """Remembers a scheduled function's error until some call raises it."""
    if not _AT_EXIT:
        atexit.register(_surface_at_exit)
        _AT_EXIT.append(True)
    _UNSEEN.append((error, origin))


def _seen(error: BaseException) -> None:
    """A kept error was raised to the program: the end need not raise it."""
    _UNSEEN[:] = [(e, o) for e, o in _UNSEEN if e is not error]


def _surface_at_exit() -> None:
    """At the program's end: an error no call raised is printed, and the process exits 1.

    It goes through `sys.excepthook`, as an uncaught error does: with several
    processes that is the hook that tells the peers and names this process.
    """
    if not _UNSEEN:
        return
    error, origin = _UNSEEN[0]
    with contextlib.suppress(Exception):
        more = len(_UNSEEN) - 1
        print(
            "spmd: "
            + message(
                UNJOINED,
                received(function=origin, error=type(error).__name__, other_unraised=more),
                "call coordinator.join() after the last schedule() (and catch its error "
                "where the program handles it).",
            ),
            file=sys.stderr,
        )
        sys.excepthook(type(error), error, error.__traceback__)
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(1)


def _donated(value: Any) -> list[str]:
    """The paths of `value`'s arrays that were donated (deleted) since it was returned."""
    flat = jax.tree_util.tree_flatten_with_path(value)[0]
    return [
        path_str(path) or "<the value>"
        for path, x in flat
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()
    ]


def _live(value: Any) -> list[Any]:
    """`value`'s leaves that can be waited on: not arrays donated to a later step, which
    has itself waited for them."""
    return [x for x in jax.tree.leaves(value) if not (isinstance(x, jax.Array) and x.is_deleted())]


def _ready(x: Any) -> bool:
    is_ready = getattr(x, "is_ready", None)
    return True if is_ready is None else bool(is_ready())


def _to_numpy(x: Any) -> Any:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x.addressable_shards[0].data)
    return np.asarray(x) if isinstance(x, jax.Array) else x


class ClusterCoordinator:
    """tf.distribute's `ClusterCoordinator` for ported programs: `schedule`, `join`, `fetch`.

    In spmd every process runs the same program (multi-controller), so every
    process runs the coordinator's loop: there is no coordinator task sending
    functions to workers, and no `ps` task. `schedule(fn, args)` calls `fn` at
    once, in this process, in program order; what `fn` computes with jax is
    dispatched asynchronously, so `schedule` returns before the devices finish,
    and a `RemoteValue` holds the result: `fetch()` blocks until it is ready.
    `join()` waits for everything scheduled. Steps therefore run in order and
    synchronously across processes (a scheduled step is one program over every
    device) - no stale updates and no lost steps. For training that tolerates
    slow links the way asynchronous parameter servers did, schedule the steps
    of a `spmd.DiLoCo` strategy: islands that communicate every H steps.

    Differences from TensorFlow, by design:
      - `fn` runs in the calling thread and in order; it is a Python function
        (typically calling a `@strategy.step`), not a `tf.function` sent away.
      - `schedule` returns when `fn`'s Python has run (the next batch, the
        first call's compile, the dispatch); only the device work is left to
        run asynchronously. Each function runs once, in the order scheduled.
      - An error in `fn` is kept and raised by `join()`, `done()`, the next
        `schedule()` (which then does not call its own `fn`) and its
        `RemoteValue`'s `fetch()`, as TF does. One that none of them raised
        before the program ends (a last `schedule` with no `join`) is raised
        at exit: printed with its traceback, and the process exits with code
        1 (through `sys.excepthook`, so with several processes the peers are
        told), never a silent exit 0. A failed process ends the job
        (restart it with `spmd launch --max-restarts` and a
        `CheckpointManager`) rather than having its steps rescheduled.
      - A `RemoteValue` passed to `schedule` reaches `fn` as it is, not
        resolved (TF does not support it either): pass `value.get()`.
      - Every process must call `schedule` the same number of times with the
        same functions (every process runs the loop), or the others wait.

    Args:
      strategy: a `spmd.Strategy` (any named strategy) or a `spmd.DiLoCo`.

    Example:
      >>> coordinator = spmd.ClusterCoordinator(strategy)
      >>> iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
      >>> for _ in range(steps_per_epoch):
      ...     coordinator.schedule(step_fn, args=(iterator,))
      >>> coordinator.join()
      >>> loss = coordinator.schedule(step_fn, args=(iterator,)).fetch()
    """

    def __init__(self, strategy: Any):
        if not (hasattr(strategy, "step") and hasattr(strategy, "distribute_dataset")):
            raise ConfigurationError(
                message(
                    "A ClusterCoordinator coordinates a spmd strategy.",
                    received(strategy=strategy),
                    "pass e.g. spmd.ParameterServerStrategy(...), spmd.MirroredStrategy() "
                    "or spmd.DiLoCo(...).",
                )
            )
        self.strategy = strategy
        self._pending: list[RemoteValue] = []
        self._errors: list[BaseException] = []
        self._scheduled = 0  # schedule calls so far, which name a RemoteValue in errors

    def schedule(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping | None = None
    ) -> RemoteValue:
        """Runs `fn(*args, **kwargs)` now (its device work asynchronously); returns a `RemoteValue`.

        Raises:
          An error an earlier scheduled function raised (then forgotten, as TF does);
            `fn` is then not called.
          ConfigurationError: `fn` is not callable, or `args` is not a sequence.
          ContextError: called inside `strategy.run`.
        """
        self._raise_kept()
        if in_replica_context():
            raise ContextError(
                message(
                    "schedule is called from the program's main loop, not inside strategy.run.",
                    received(fn=fn),
                    "call coordinator.schedule(step_fn, args=...) from the training loop.",
                )
            )
        if not callable(fn) or isinstance(args, str | bytes) or not isinstance(args, Sequence):
            raise ConfigurationError(
                message(
                    "schedule takes a function and a sequence of arguments.",
                    received(fn=fn, args=args),
                    "pass e.g. coordinator.schedule(step_fn, args=(iterator,)).",
                )
            )
        self._scheduled += 1
        origin = f"{getattr(fn, '__name__', type(fn).__name__)} (schedule call {self._scheduled})"
        try:
            value = RemoteValue(fn(*args, **(kwargs or {})), origin=origin)
        except StopIteration as stop:
            error = OutOfRangeError(
                message(
                    "A scheduled function read past the end of its iterator: the dataset has "
                    "no more batches (tf.distribute raises tf.errors.OutOfRangeError here).",
                    received(function=origin),
                    "catch spmd.OutOfRangeError (also a StopIteration) around schedule and "
                    "join to end the epoch, as a TF loop catches tf.errors.OutOfRangeError, "
                    "or schedule as many calls as the dataset has batches.",
                )
            )
            error.__cause__ = stop
            value = RemoteValue(error=error, origin=origin)
            self._errors.append(error)
            _keep(error, origin)
        except Exception as error:  # kept, raised by join / the next schedule / fetch
            value = RemoteValue(error=error, origin=origin)
            self._errors.append(error)
            _keep(error, origin)
        self._pending.append(value)
        return value

    def join(self) -> None:
        """Waits until every scheduled function has finished.

        A returned array that a later scheduled step took as its state (donated)
        has been waited for by that step; join does not wait on it, and its
        `RemoteValue`'s `fetch` says it is gone.

        Raises:
          The first error a scheduled function raised since the last `join`;
            `spmd.OutOfRangeError` (a `StopIteration` too) where it read past the
            end of its iterator, as tf.distribute raises `OutOfRangeError`.
        """
        pending, self._pending = self._pending, []
        for value in pending:
            if value._error is None:
                jax.block_until_ready(_live(value._value))
        self._raise_kept()

    def done(self) -> bool:
        """Whether every scheduled function has finished; never waits.

        Raises:
          The first error a scheduled function raised, as `join` does.
        """
        self._raise_kept()
        self._pending = [v for v in self._pending if not v.done()]
        return not self._pending

    def fetch(self, values: Any) -> Any:
        """Waits for `RemoteValue`s (in any structure) and returns their values as numpy."""
        return jax.tree.map(
            lambda v: v.fetch() if isinstance(v, RemoteValue) else _to_numpy(v),
            values,
            is_leaf=lambda v: isinstance(v, RemoteValue),
        )

    def create_per_worker_dataset(self, dataset_fn: Any) -> Iterable[Any]:
        """The dataset every worker (here: every process) iterates, as global batches.

        Args:
          dataset_fn: a dataset, or a function returning one; a function of one
            argument is given the `spmd.InputContext` (and the result taken as
            this process's share, as `distribute_datasets_from_function`). A
            result that is already distributed (`strategy.distribute_dataset`,
            `distribute_datasets_from_function`) is used as it is.

        Returns:
          An iterable; `iter()` of it is what scheduled functions call `next` on.
        """
        if not callable(dataset_fn):
            return self._distributed(dataset_fn)
        try:
            takes_context = len(inspect.signature(dataset_fn).parameters) == 1
        except (TypeError, ValueError):
            takes_context = False
        if takes_context:
            return self.strategy.distribute_datasets_from_function(dataset_fn)
        return self._distributed(dataset_fn())

    def _distributed(self, dataset: Any) -> Iterable[Any]:
        if isinstance(dataset, DistributedDataset):
            return dataset
        return self.strategy.distribute_dataset(dataset)

    def _raise_kept(self) -> None:
        if self._errors:
            error = self._errors[0]
            for kept in self._errors:  # forgotten, as TF does: none is raised at exit
                _seen(kept)
            self._errors = []
            raise error
