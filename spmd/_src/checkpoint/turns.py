"""Several CheckpointManagers in one process: their own barrier names, one save in flight at a time.

Orbax names its multi-process barriers by what they do (e.g.
`async_commit_complete.<step>`, `CheckpointManager:save_start`), by the step
folder's name at most: two managers of one process that save the same step
(`BackupAndRestore` and `ModelCheckpoint`, each saving at the same step of a
fit) would meet in each other's barriers, which the coordination service
refuses ("Barrier ... is already ongoing") or which pair one manager's process 0
with another manager's process 1 (a hang). Orbax also counts its save operations
in one counter per process, which its background commits read. So:

- each manager's barriers carry a prefix of their own, the same on every process
  (`barrier_prefix`: from the directory, which every process names alike);
- an Orbax operation of one manager starts only once the other managers' saves
  in flight in this process are committed (`take_turn`): at most one save is in
  flight per process. The saves of one manager still overlap the steps.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any, Protocol

from etils import epath

__all__ = ["Settles", "barrier_prefix", "in_flight", "settled", "take_turn"]


class Settles(Protocol):
    """A store whose saves may be in flight: `settle` waits for them, keeping their failure."""

    def settle(self) -> None:
        """Waits until this store's saves in flight are done, keeping a failure for its owner."""


_IN_FLIGHT: weakref.WeakSet = weakref.WeakSet()  # stores of this process with saves in flight


def barrier_prefix(directory: epath.Path, role: str) -> str:
    """The prefix of Orbax's barrier names for a manager of `directory` ("write", "read" or
    "chief"), the same on every process: one writer holds a directory at a time."""
    digest = hashlib.sha256(str(directory).encode()).hexdigest()[:16]
    return f"spmd_{role}_{digest}"


def in_flight(store: Settles) -> None:
    """`store` started a save that may still be running after its call returned."""
    _IN_FLIGHT.add(store)


def settled(store: Settles) -> None:
    """`store` has no save in flight any more."""
    _IN_FLIGHT.discard(store)


def take_turn(store: Any) -> None:
    """Before `store` starts an Orbax operation: every other store's saves in this process
    are committed or failed (each failure is kept for the store it belongs to)."""
    for other in list(_IN_FLIGHT):
        if other is not store:
            other.settle()
