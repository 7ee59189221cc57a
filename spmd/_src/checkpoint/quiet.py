"""Orbax's noise around a failed save or restore, kept out while spmd reports the failure itself.

When a save fails (a full disk) Orbax logs it at ERROR from its background
threads, with tracebacks; when a read or write of a step fails, the other
arrays' tensorstore completions arrive after Orbax's asyncio loop closed and
each raises "Event loop is closed" into sys.unraisablehook. spmd's
CheckpointError says what failed, once: these would bury it.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
import weakref
from typing import Any

__all__ = ["drop_late_completions", "writer_closed", "writer_opened"]

# What Orbax logs (at ERROR, with its traceback) from the threads of a save that failed,
# which spmd reports itself as one CheckpointError from save, wait or close.
_SAVE_FAILED_LOGS = (
    "_SignalingThread.run() raised an exception",
    "Save Finalize thread",
    "Commit operations or the Commit callback",
)
_ORBAX = os.path.join("orbax", "checkpoint", "")
_WRITERS: weakref.WeakSet = weakref.WeakSet()  # the open writers, whose saves spmd reports


def _late_completion(unraisable: Any) -> bool:
    """Whether `unraisable` is a read or write of a failed restore or save that completed
    after its loop closed.

    Orbax reads (and writes) every array of a step at once on an asyncio loop;
    when one fails (a damaged file, a full disk), the loop closes while
    tensorstore still completes the others, and each completion's
    `loop.call_soon_threadsafe` raises "Event loop is closed" into
    sys.unraisablehook: one traceback per array, after the fault was handled
    (spmd's CheckpointError names it).
    """
    error = unraisable.exc_value
    if not isinstance(error, RuntimeError) or str(error) != "Event loop is closed":
        return False
    frames = traceback.extract_tb(unraisable.exc_traceback)
    asyncio_dir = os.path.join("asyncio", "base_events.py")
    return any(
        f.name == "call_soon_threadsafe" and f.filename.endswith(asyncio_dir) for f in frames
    )


def drop_late_completions() -> None:
    """Drops the tracebacks of a failed restore's or save's late completions, and only those.

    Installed before a restore reads and when a writer opens (once per
    process): the late completions can come before the failure reaches
    spmd's handler, on a loaded machine.
    """
    previous, default = sys.unraisablehook, sys.__unraisablehook__
    if getattr(previous, "spmd_drops_late_reads", False):
        return

    def hook(unraisable: Any) -> None:
        try:
            late = _late_completion(unraisable)
        except Exception:  # at the interpreter's exit this module's names may be gone
            late = False
        if not late:
            (previous or default)(unraisable)

    hook.spmd_drops_late_reads = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


class _SaveFailureLogs(logging.Filter):
    """Keeps Orbax's logs of a failed save out of the output while a writer is open: spmd's
    CheckpointError says what failed, once; Orbax's tracebacks would bury it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not _WRITERS or _ORBAX not in record.pathname:
            return True
        said = record.getMessage()
        return not any(s in said for s in _SAVE_FAILED_LOGS)


def _quiet_save_failures() -> None:
    """Installs `_SaveFailureLogs` on absl's logger, through which Orbax logs (once)."""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _SaveFailureLogs) for f in absl.filters):
        absl.addFilter(_SaveFailureLogs())


def writer_opened(writer: Any) -> None:
    """A writer opened: Orbax's logs of its failed saves are kept out until it closes."""
    _WRITERS.add(writer)
    _quiet_save_failures()
    drop_late_completions()


def writer_closed(writer: Any) -> None:
    """A writer closed: its saves are over (their failures reported)."""
    _WRITERS.discard(writer)
