"""The padding dataset's batch a loop is on: what `compute_average_loss` checks its call by."""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np

from spmd._src.data.sources import PaddedBatch

__all__ = ["Padded", "clear", "note", "padded"]

# (the iterator that handed the batch out, the batch), in the thread that took it
_LATEST: ContextVar[tuple[weakref.ref, Padded] | None] = ContextVar("spmd_padded", default=None)


@dataclass(frozen=True)
class Padded:
    """A padding dataset's batch: its rows, padding included, and the data's global batch size."""

    rows: int
    batch_size: int


def note(iterator: Any, element: Any, batch_size: int) -> None:
    """Records the element `iterator` just handed out in this thread, padded or not."""
    if isinstance(element, PaddedBatch):
        rows = int(np.shape(element.mask)[0])
        _LATEST.set((weakref.ref(iterator), Padded(rows, batch_size)))
    elif _LATEST.get() is not None:
        _LATEST.set(None)


def clear(iterator: Any) -> None:
    """`iterator`'s epoch ended or it was closed: its batch is no longer the loop's."""
    latest = _LATEST.get()
    if latest is not None and latest[0]() is iterator:
        _LATEST.set(None)


def padded() -> Padded | None:
    """The padding dataset's batch this thread's loop is on, while its iterator lives."""
    latest = _LATEST.get()
    if latest is None or latest[0]() is None:
        return None
    return latest[1]
