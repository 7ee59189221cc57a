"""TensorBoard event files written on a background thread and flushed when asked."""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable
from typing import Any

__all__ = ["EventFiles"]

_FLUSH_S = 1.0  # the writer thread flushes a file at most this often between flush() calls

Scalars = dict[str, float] | Callable[[], dict[str, float]]


class EventFiles:
    """Scalars in TensorBoard event files, one file per run (`train`, `validation`).

    Scalars are written by one background thread, in the order they were
    added, so a hook never waits for a file (nor, given a function, for the
    device values it reads); the thread flushes a file at most every
    `_FLUSH_S` seconds. `flush()` returns once every scalar added before it
    is written and the files are flushed: TensorBoard reads them, and a
    process killed afterwards keeps them. (tensorboardX's `SummaryWriter`
    queues events for a thread that flushes every `flush_secs`, 120 s; its
    `flush()` does not wait for that queue, so the events just added stay in
    memory until the next timed flush or `close()`.)

    Args:
      log_dir: the folder of the runs (`log_dir/train`, ...); a path or a
        URL tensorboardX writes to (gs://, s3://).
    """

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self._files: dict[str, Any] = {}
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future] = []
        self._flushed: dict[str, float] = {}  # run -> when its file was last flushed

    def add(self, run: str, scalars: Scalars, step: int) -> None:
        """Queues `scalars` (tag -> value, or a function returning them, called on the
        writer thread) for run `run` at `step`."""
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, "spmd-tensorboard")
        self._pending = [f for f in self._pending if not f.done() or f.exception()]
        wall_time = time.time()
        self._pending.append(self._thread.submit(self._write, run, scalars, step, wall_time))

    def flush(self) -> None:
        """Returns once every scalar added so far is written and the files flushed.

        Raises:
          The first error a write met (a full disk, an unwritable folder).
        """
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        for run, file in self._files.items():
            file.flush()
            self._flushed[run] = time.monotonic()

    def close(self) -> None:
        """Flushes, closes the files and stops the thread; a later `add` opens new files."""
        try:
            self.flush()
        finally:
            if self._thread is not None:
                self._thread.shutdown()
            for file in self._files.values():
                file.close()
            self._files, self._thread = {}, None

    def _write(self, run: str, scalars: Scalars, step: int, wall_time: float) -> None:
        from tensorboardX.proto import event_pb2
        from tensorboardX.summary import scalar

        file = self._file(run)
        values = scalars() if callable(scalars) else scalars
        for tag, value in values.items():
            event = event_pb2.Event(summary=scalar(tag, float(value)), step=int(step))
            event.wall_time = wall_time
            file.write_event(event)
        if time.monotonic() - self._flushed.get(run, 0.0) >= _FLUSH_S:
            file.flush()
            self._flushed[run] = time.monotonic()

    def _file(self, run: str) -> Any:
        if run not in self._files:
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.record_writer import directory_check

            folder = f"{self.log_dir}/{run}"
            directory_check(folder)
            self._files[run] = EventsWriter(os.path.join(folder, "events"))
        return self._files[run]
