"""Background prefetch to the devices, and the check that every process has the same batch."""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax

from spmd._src.clusters.agreement import Agreement
from spmd._src.clusters.agreement import Stopped as _Stopped
from spmd._src.clusters.jax_state import coordination_client
from spmd._src.errors import BatchError, message, received

__all__ = ["HostCheck", "Prefetcher"]

logger = logging.getLogger("spmd.data")

_POLL_S = 0.1  # how often a waiting thread looks at its stop event
_JOIN_S = 10.0  # how long close() waits for the producer thread to end
# Each started input pipeline gets the next number, in the same order on every
# process (they run the same program), so their records in the coordination
# service's key-value store meet under one name.
_SERIALS = itertools.count()

# An element produced in the consumer's next() in under this many seconds keeps the
# pipeline there: a handover to and from a producer thread costs ~0.1-0.3 ms of GIL
# waits on a dispatch-bound step. Two slower elements in a row start the thread.
INLINE_S = 250e-6
_SLOW_IN_A_ROW = 2


class HostCheck(Agreement):
    """Checks, batch by batch, that every process has a batch and that they match.

    Each process posts a one-line record per batch (`Agreement`): a missing
    batch, a different shape, or another process's failure becomes a
    `BatchError` on every process instead of a hang in the next collective.
    """

    def __init__(
        self,
        client: Any,
        timeout: float,
        *,
        process: int | None = None,
        count: int | None = None,
        serial: int | None = None,
    ):
        """The check of one pipeline run: this process's index among `count` (JAX's by
        default) and the run's `serial` (the next of this process's by default)."""
        serial = next(_SERIALS) if serial is None else serial
        super().__init__(client, timeout, f"spmd/input/{serial}", process=process, count=count)

    @classmethod
    def create(cls, timeout: float) -> HostCheck | None:
        """A check for this run, or None with one process (or no coordination service)."""
        if jax.process_count() == 1:
            return None
        client = _coordination_client()
        if client is None:
            logger.warning("No jax.distributed client: input batches are not checked across hosts.")
            return None
        return cls(client, timeout)

    def compare(self, records: list[dict], index: int) -> None:
        _compare(records, index)

    def missing_message(self, process: int, index: int) -> str:
        return message(
            f"Every process reaches each batch of an input pipeline within "
            f"host_timeout={self._timeout:g} s.",
            received(missing_process=process, batch_index=index),
            "create the same distributed datasets and iterators in the same "
            "order on every process; raise InputOptions(host_timeout=...) if "
            "a process is slow to produce its first batch.",
        )

    def failed_message(self, index: int, failed: dict[int, str]) -> str:
        return message(
            "Every process produces each batch of its input pipeline.",
            received(batch_index=index, failed=failed),
            "read the failing process's error above (each process reports its own).",
        )


def _compare(records: list[dict], step: int) -> None:
    """Raises unless every process's record for `step` says the same."""
    failed = {p: r["error"] for p, r in enumerate(records) if "error" in r}
    if failed:
        raise BatchError(
            message(
                "Every process produces each batch of its input pipeline.",
                received(batch_index=step, failed=failed),
                "read the failing process's error above (each process reports its own).",
            )
        )
    shapes = [{k: v for k, v in r.items() if k != "content"} for r in records]
    if len({json.dumps(r, sort_keys=True) for r in shapes}) == 1 and "content" in records[0]:
        contents = {p: r.get("content") for p, r in enumerate(records)}
        if len(set(contents.values())) > 1:
            raise BatchError(
                message(
                    "Under DATA sharding every process reads the same global batches and keeps "
                    "its own rows: the batches' contents must be the same on every process.",
                    received(batch_index=step, content_fingerprint_per_process=contents),
                    "give every process the same data in the same order (the same files, "
                    "seed and shuffle), or, if each process already reads its own share, "
                    "use InputOptions(auto_shard_policy='OFF') or "
                    "strategy.distribute_datasets_from_function.",
                )
            )
        return
    if len({json.dumps(r, sort_keys=True) for r in records}) > 1:
        said = {p: "end of data" if r.get("end") else r["shape"] for p, r in enumerate(records)}
        raise BatchError(
            message(
                "Every process has the same number of batches, of the same shapes: the steps "
                "run on all of them together.",
                received(batch_index=step, per_process=said),
                "give every input pipeline the same number of examples (equal files, or the "
                "same rows per pipeline from the dataset function); pad or drop the last "
                "batch the same way everywhere.",
            )
        )


def _coordination_client() -> Any:
    return coordination_client()


class _End:
    """Put in the queue after the last element."""


class _Failure:
    """Put in the queue when the producer raised."""

    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Runs an iterator up to `depth` elements ahead in a background thread, once it is slow.

    Each element is first produced in the consumer's own `next()`, timed: a
    cheap pipeline (its elements come in under `inline_s`) never starts a
    thread. Its transfers are asynchronous, so they already overlap the
    devices' work on the step just dispatched, and a second Python thread
    would only compete with the step's dispatch for the GIL (on a
    dispatch-bound step that costs more than the whole pipeline). Two
    elements in a row slower than `inline_s` start the thread, which runs
    `depth` elements ahead from then on (the first element, which also pays
    the pipeline's start, is not timed). With `inline_s=None` the thread
    starts at once.

    The thread holds no reference to the Prefetcher, so dropping the last
    reference (or `close()`) stops it; an exception in the producer is raised
    by the `next()` that reaches it.

    Args:
      items: produces the elements (in the consumer's thread, then in the
        background thread).
      depth: how many elements may wait in the queue.
      stop: set to stop the producer; `items` may watch it while it waits.
      inline_s: how long (seconds) an element may take in the consumer's
        thread before the background thread takes over, or None.
    """

    def __init__(
        self,
        items: Iterator[Any],
        depth: int,
        stop: threading.Event,
        inline_s: float | None = INLINE_S,
    ):
        self._items, self._depth, self._stop, self._inline_s = items, depth, stop, inline_s
        self._slow = 0  # elements in a row slower than inline_s
        self._first = True  # the first element also pays the pipeline's start: not timed
        self._queue: queue.Queue | None = None
        self._finalizer = weakref.finalize(self, _close_items, stop, items)
        if inline_s is None:
            self._start_thread()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if not self._finalizer.alive:
            raise StopIteration
        if self._queue is None:
            return self._next_inline()
        item = self._queue.get()
        if isinstance(item, _End):
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def _next_inline(self) -> Any:
        start = time.perf_counter()
        try:
            item = next(self._items)
        except BaseException:  # the end, or the pipeline's error: nothing more to produce
            self.close()
            raise
        if self._first or time.perf_counter() - start <= self._inline_s:
            self._first, self._slow = False, 0
        else:
            self._slow += 1
            if self._slow == _SLOW_IN_A_ROW:
                self._start_thread()
        return item

    def _start_thread(self) -> None:
        self._queue = queue.Queue(maxsize=self._depth)
        thread = threading.Thread(
            target=_produce,
            args=(self._items, self._queue, self._stop),
            name="spmd-prefetch",
            daemon=True,
        )
        self._finalizer.detach()
        thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._queue, thread)

    @property
    def threaded(self) -> bool:
        """Whether the background thread produces the elements (the pipeline was slow)."""
        return self._queue is not None

    def close(self) -> None:
        """Stops the producer (thread) and closes `items`."""
        self._finalizer()


def _close_items(stop: threading.Event, items: Iterator[Any]) -> None:
    stop.set()
    close: Callable[[], None] | None = getattr(items, "close", None)
    if close is not None:
        close()


def _produce(items: Iterator[Any], out: queue.Queue, stop: threading.Event) -> None:
    try:
        for item in items:
            if not _put(out, item, stop):
                return
            # Hand the GIL to the consumer now: it may wait for this item, and
            # would otherwise get the GIL only at the interpreter's switch
            # interval (5 ms), many steps long on a fast step.
            time.sleep(0)
        _put(out, _End(), stop)
    except _Stopped:
        pass
    except BaseException as error:  # noqa: BLE001 - handed to the consumer
        _put(out, _Failure(error), stop)
    finally:
        close: Callable[[], None] | None = getattr(items, "close", None)
        if close is not None:
            close()


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Puts `item` unless the consumer stops first; returns whether it was put."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _shutdown(stop: threading.Event, out: queue.Queue, thread: threading.Thread) -> None:
    stop.set()
    while True:  # free the producer if it waits on a full queue
        try:
            out.get_nowait()
        except queue.Empty:
            break
    if thread is not threading.current_thread():
        thread.join(_JOIN_S)
