"""The distributed dataset and its iterator: global batches on the devices, with a position."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import jax

from spmd._src.data import in_flight
from spmd._src.data.input_context import AutoShardPolicy, InputContext, InputOptions, Remainder
from spmd._src.data.prefetch import INLINE_S, HostCheck, Prefetcher
from spmd._src.data.sources import HostBatch, with_mask
from spmd._src.errors import ConfigurationError, message, received
from spmd._src.placement import put_rows

if TYPE_CHECKING:
    from spmd._src.strategy.base import Strategy

__all__ = ["FUNCTION", "DistributedDataset", "DistributedIterator", "Plan", "SourcePositions"]

logger = logging.getLogger("spmd.data")

STATE_VERSION = 1
FUNCTION = "FUNCTION"  # the policy named in the state of a dataset function's iterator
# Under these, a position counts per-pipeline batches: it only means the same
# data with the same number of pipelines.
_PER_PIPELINE = ("FILE", "OFF", FUNCTION)


class SourcePositions(Protocol):
    """A source's own position at each of spmd's (a grain iterator's state), saved with it."""

    def state(self, epoch: int, batch: int) -> dict | None:
        """This pipeline's source position before batch `batch` of `epoch`, keyed by pipeline id."""

    def seek(self, state: dict) -> None:
        """Makes the next `batches(epoch, batch)` of `state` start at its saved source position."""


@dataclass(frozen=True)
class Plan:
    """What a distributed dataset reads, resolved for this process.

    Attributes:
      batches: `batches(epoch, start)` yields this process's rows of batches
        `start, start + 1, ...` of `epoch`.
      policy: the auto-shard policy in force, or "FUNCTION".
      remainder: what happens to a smaller last batch.
      ctx: this process's input pipeline.
      num_batches: batches per epoch, when known ahead.
      num_examples: real examples per epoch, when known ahead.
      global_batch_size: when known ahead.
      seed: the shuffle seed, if the dataset shuffles.
      num_dropped: real examples the remainder drops per epoch, when known ahead.
      positions: the source's own positions, saved in the state as `per_pipeline`.
      source: a description of the pipeline that a position depends on (its
        transformations and seeds), saved in the state and compared on restore.
      infinite: the dataset never ends (`repeat()`): an epoch needs a step count.
    """

    batches: Callable[[int, int], Iterator[HostBatch]]
    policy: str
    remainder: Remainder
    ctx: InputContext
    num_batches: int | None = None
    num_examples: int | None = None
    global_batch_size: int | None = None
    seed: int | None = None
    num_dropped: int | None = None
    positions: SourcePositions | None = None
    source: str | None = None
    infinite: bool = False


@dataclass
class _Cursor:
    """An iterator's position, held by the iterator and by its dataset.

    The dataset keeps the latest iterator's cursor (not the iterator), so its
    `get_state()` reports that position whether or not the iterator has been
    garbage collected.
    """

    epoch: int
    batch: int
    global_batch_size: int | None
    exhausted: bool = False  # the epoch ended at the end of the data
    closed: bool = False  # close() was called: the data goes on where the next iter() starts

    def state(self, plan: Plan) -> dict:
        if self.exhausted:
            return _state(plan, self.epoch + 1, 0, self.global_batch_size)
        return _state(plan, self.epoch, self.batch, self.global_batch_size)


class DistributedDataset:
    """A dataset whose every element is a global batch of `jax.Array`s over the replicas.

    Iterate it once per epoch (each `iter()` is a new epoch), or hold the
    iterator for a step-based loop. Made by `strategy.distribute_dataset` and
    `strategy.distribute_datasets_from_function`.

    Example:
      >>> dist = strategy.distribute_dataset(strategy.make_numpy_dataset((x, y), 64, shuffle=True))
      >>> for epoch in range(3):
      ...     for xb, yb in dist:
      ...         state, metrics = train_step(state, xb, yb)
    """

    def __init__(self, strategy: Strategy, plan: Plan, options: InputOptions):
        self._strategy = strategy
        self._plan = plan
        self._options = options
        self._next = (0, 0)  # (epoch, batch) where the next iter() starts
        self._latest: _Cursor | None = None  # the latest iterator's position
        self._global_batch_size = plan.global_batch_size  # or a restored state's

    def __iter__(self) -> DistributedIterator:
        epoch, batch = self._next
        self._next = (epoch + 1, 0)
        iterator = DistributedIterator(
            self._strategy, self._plan, self._options, self, epoch, batch, self._global_batch_size
        )
        self._latest = iterator._cursor
        return iterator

    @property
    def num_batches(self) -> int | None:
        """Global batches per epoch, or None when not known before reading."""
        return self._plan.num_batches

    @property
    def infinite(self) -> bool:
        """Whether the dataset is known never to end (e.g. a tf.data `repeat()`)."""
        return self._plan.infinite

    @property
    def num_examples(self) -> int | None:
        """Real examples per epoch (padding not counted), or None when not known ahead."""
        return self._plan.num_examples

    @property
    def num_dropped(self) -> int | None:
        """Examples a "drop" remainder leaves out per epoch (0 for "pad"), or None when not known."""
        return self._plan.num_dropped

    @property
    def auto_shard_policy(self) -> AutoShardPolicy | None:
        """The policy in force (AUTO resolved), or None for a dataset function."""
        policy = self._plan.policy
        return None if policy == FUNCTION else AutoShardPolicy[policy]

    def get_state(self) -> dict:
        """The latest iterator's position until it is closed, then where the next one starts.

        It does not depend on garbage collection: an iterator dropped mid-epoch
        without `close()` still reports where it stopped; one closed (as the
        Trainer closes each epoch's) hands over to the next `iter()`.
        """
        if self._latest is not None and not self._latest.closed:
            return self._latest.state(self._plan)
        return _state(self._plan, *self._next, self._global_batch_size)

    def set_state(self, state: dict) -> None:
        """Makes the next `iter()` start at `state` (from `get_state()`, e.g. a checkpoint).

        The state's global batch size is checked against the first batch read.
        """
        self._next = _check_state(state, self._plan, self._global_batch_size)
        self._global_batch_size = self._global_batch_size or _saved_size(state)
        self._latest = None

    def _note_epoch(self, epoch: int, cursor: _Cursor) -> None:
        self._next = (epoch + 1, 0)
        self._latest = cursor

    def __repr__(self) -> str:
        return (
            f"DistributedDataset(policy={self._plan.policy}, remainder={self._plan.remainder!r}, "
            f"num_batches={self.num_batches}, strategy={self._strategy!r})"
        )


class DistributedIterator:
    """Yields global batches placed on the devices, prefetched by a background thread.

    It has a position: `get_state()` returns a JSON-serialisable dict, the
    same on every process, and `set_state(state)` makes the next batch the
    first one not yet seen at that position. `close()` (or `with`, or
    dropping the iterator) stops the prefetch thread.
    """

    def __init__(
        self,
        strategy: Strategy,
        plan: Plan,
        options: InputOptions,
        dataset: DistributedDataset,
        epoch: int,
        batch: int,
        global_batch_size: int | None = None,
    ):
        self._strategy, self._plan, self._options = strategy, plan, options
        self._dataset = dataset
        self._cursor = _Cursor(epoch, batch, global_batch_size or plan.global_batch_size)
        self._source: Prefetcher | Iterator[Any] | None = None
        self._finished = False  # the epoch ended (or failed)

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        if self._source is None:
            self._cursor.closed = False
            self._source = self._start()
        try:
            element, batch_size = next(self._source)
        except StopIteration:
            self._finish(exhausted=True)
            raise
        except BaseException:
            self._finish(exhausted=False)
            raise
        cursor = self._cursor
        cursor.batch += 1
        if cursor.global_batch_size is None:
            cursor.global_batch_size = batch_size
        in_flight.note(self, element, batch_size)
        return element

    def get_state(self) -> dict:
        """The position: epoch and batch of the next element, with what they depend on.

        Returns:
          A JSON-serialisable dict: `epoch`, `batch` (elements of that epoch
          already handed out), `seed`, `global_batch_size`,
          `auto_shard_policy`, `num_input_pipelines` and `version`.
        """
        return self._cursor.state(self._plan)

    def set_state(self, state: dict) -> None:
        """Moves to `state`: the next element is the first one not seen at that position.

        Raises:
          ConfigurationError: the state is malformed or belongs to other data
            (another seed, global batch size, or number of input pipelines).
        """
        cursor = self._cursor
        epoch, batch = _check_state(state, self._plan, cursor.global_batch_size)
        self._stop_source()
        cursor.global_batch_size = cursor.global_batch_size or _saved_size(state)
        cursor.epoch, cursor.batch, cursor.exhausted, cursor.closed = epoch, batch, False, False
        self._finished = False
        self._dataset._note_epoch(epoch, cursor)

    def close(self) -> None:
        """Stops the prefetch thread; a later `next()` starts it again where the iterator is."""
        self._cursor.closed = True
        self._stop_source()
        in_flight.clear(self)

    def _stop_source(self) -> None:
        source, self._source = self._source, None
        if source is not None:
            source.close()

    def __enter__(self) -> DistributedIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> Prefetcher | Iterator[Any]:
        stop = threading.Event()
        check = HostCheck.create(self._options.host_timeout) if self._options.check_hosts else None
        contents = check is not None and self._options.check_contents
        items = _device_batches(
            self._strategy,
            self._plan,
            self._cursor.epoch,
            self._cursor.batch,
            check,
            stop,
            contents,
            self._cursor.global_batch_size,
        )
        if self._options.prefetch:
            # Several processes agree on each batch over the network: that wait
            # belongs in the background thread from the start.
            inline_s = None if check is not None else INLINE_S
            return Prefetcher(items, self._options.prefetch, stop, inline_s)
        return items

    def _finish(self, exhausted: bool) -> None:
        self._stop_source()
        self._finished, self._cursor.exhausted = True, exhausted
        in_flight.clear(self)


def _device_batches(
    strategy: Strategy,
    plan: Plan,
    epoch: int,
    start: int,
    check: HostCheck | None,
    stop: threading.Event,
    contents: bool = False,
    global_batch_size: int | None = None,
) -> Iterator[Any]:
    """(placed batch, its global batch size) for each host batch, after every process
    agrees it has one. The size is the data's, padding for the replicas not counted:
    what a position counts in.

    Raises:
      ConfigurationError: a batch of another size than `global_batch_size`
        (the size a restored position was saved with).
    """
    host = plan.batches(epoch, start)
    place = _placer(strategy)
    for step in itertools.count():
        try:
            batch = next(host, None)
        except Exception as error:
            if check is not None:  # tell the others, then raise this process's own error
                with contextlib.suppress(Exception):
                    check.post(step, {"error": f"{type(error).__name__}: {error}".splitlines()[0]})
            raise
        if check is not None:
            check.agree(step, _record(batch, contents), stop)
        if batch is None:
            return
        if global_batch_size is not None and batch.batch_size != global_batch_size:
            raise ConfigurationError(_size_message(global_batch_size, batch.batch_size))
        if step == 0 and batch.global_size != batch.batch_size:
            _note_padding(strategy, batch)
        yield place(batch), batch.batch_size


def _note_padding(strategy: Strategy, batch: HostBatch) -> None:
    """Logs (chief) that each global batch is padded for the replicas, and what it costs."""
    if jax.process_index() == 0:
        padded = batch.global_size - batch.batch_size
        logger.info(
            "Each global batch of %d rows is padded to %d over %d replicas: %d masked rows "
            "(%.0f%% of each step's rows) keep the global batch, and so the training, the same.",
            batch.batch_size,
            batch.global_size,
            strategy.num_replicas_in_sync,
            padded,
            100 * padded / batch.global_size,
        )


def _size_message(saved: int, now: int) -> str:
    return message(
        "A saved position only means the same batches with the same global_batch_size: "
        "batch b of another size starts at another record.",
        received(global_batch_size=f"{saved} saved, {now} now"),
        "restore with the global batch size the state was saved with, or start the epoch "
        "over from {'epoch': e, 'batch': 0}.",
    )


def _saved_size(state: dict) -> int | None:
    size = state.get("global_batch_size")
    return size if isinstance(size, int) and size > 0 else None


def _placer(strategy: Strategy) -> Callable[[HostBatch], Any]:
    """Makes this process's rows of a batch into global arrays over the replicas (+ mask),
    by `placement.put_rows` (one batched transfer a batch with one process)."""
    mesh, axes = strategy.mesh, tuple(strategy.batch_axes)

    def place(batch: HostBatch) -> Any:
        leaves, mask = batch.leaves, batch.mask
        if mask is not None:
            leaves = [*leaves, mask]
        placed = put_rows(mesh, axes, leaves, batch.global_size)
        if mask is None:
            return batch.treedef.unflatten(placed)
        return with_mask(batch.treedef.unflatten(placed[:-1]), placed[-1])

    return place


def _record(batch: HostBatch | None, contents: bool) -> dict:
    """What this process posts for a batch: its shapes, and under DATA its content's fingerprint."""
    if batch is None:
        return {"end": True}
    record = {"shape": _describe(batch)}
    if contents and batch.content is not None:
        record["content"] = batch.content()
    return record


def _describe(batch: HostBatch) -> str:
    """The structure, shapes and dtypes of a host batch, to compare across processes.

    Each leaf's shape is its global one (the global batch's rows, then its own
    axes): processes may hold unequal parts of a batch (a `BlockContext`).
    """
    size = batch.global_size
    shapes = ", ".join(f"{x.dtype}{[size, *x.shape[1:]] if x.ndim else []}" for x in batch.leaves)
    masked = " + mask" if batch.mask is not None else ""
    padded = f" ({batch.batch_size} padded)" if batch.batch_size != batch.global_size else ""
    return f"{batch.treedef}: {shapes}{masked} of global {batch.global_size}{padded}"


def _state(plan: Plan, epoch: int, batch: int, global_batch_size: int | None) -> dict:
    state = {
        "version": STATE_VERSION,
        "epoch": epoch,
        "batch": batch,
        "seed": plan.seed,
        "global_batch_size": global_batch_size,
        "auto_shard_policy": plan.policy,
        "num_input_pipelines": plan.ctx.num_input_pipelines,
    }
    if plan.source is not None:
        state["source"] = plan.source
    if plan.positions is not None:
        state["per_pipeline"] = plan.positions.state(epoch, batch)
    return state


def _check_state(state: dict, plan: Plan, global_batch_size: int | None = None) -> tuple[int, int]:
    """(epoch, batch) of `state`, after checking that it belongs to this data."""
    if not isinstance(state, dict) or not all(
        isinstance(state.get(k), int) and state[k] >= 0 for k in ("epoch", "batch")
    ):
        raise ConfigurationError(
            message(
                "An iterator state is the dict get_state() returned, with int epoch and batch.",
                received(state=state),
                "pass what iterator.get_state() returned (saved as JSON).",
            )
        )
    ours = _state(plan, 0, 0, global_batch_size or plan.global_batch_size)
    keys = ["seed", "source", "global_batch_size"]
    if state.get("auto_shard_policy") in _PER_PIPELINE or plan.policy in _PER_PIPELINE:
        keys.append("num_input_pipelines")
    differ = {
        k: (state.get(k), ours[k])
        for k in keys
        if state.get(k) is not None and ours[k] is not None and state.get(k) != ours[k]
    }
    if differ:
        raise ConfigurationError(
            message(
                "A saved position only means the same batches for the same data: the same "
                "seed, pipeline and global batch size (and, when each process reads its own part, the "
                "same number of input pipelines).",
                received(
                    **{k: f"{saved!r} saved, {now!r} now" for k, (saved, now) in differ.items()}
                ),
                "restore with the dataset and process count the state was saved with, or "
                "start the epoch over from {'epoch': e, 'batch': 0}; for a job whose process "
                "count changes (spmd launch --min-processes), read with "
                "InputOptions(auto_shard_policy='DATA'), whose position maps to any count.",
            )
        )
    if plan.positions is not None:
        plan.positions.seek(state)
    return state["epoch"], state["batch"]
