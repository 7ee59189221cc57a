"""The final-step marker: a training run's note, in its checkpoint directory, that it has ended.

A file `spmd-final-step.json` beside the step folders holds `{"step": N,
"session": S}`: the writer S (one open `CheckpointManager`) wrote its last
checkpoint at step N and let go of the directory. A `SidecarEvaluator` ends
once it has evaluated step N and the same marker has stayed there for its
grace period. The rule that makes the marker true: it is there only while no
writer holds the directory.

- `mark_final` writes it when fit ends (`ModelCheckpoint`) or a custom loop
  says so.
- A writer that opens the directory (a resumed run, a second `fit` call)
  takes it away at once, before its first step: the run may go on.
- A writer that lets go having saved nothing (a manager opened to restore, a
  fit with no step left) puts it back, naming itself; one that saved steps
  and never marked leaves none (it stopped: crashed, killed, preempted).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import NamedTuple

from etils import epath

from spmd._src.errors import CheckpointError, message, received

__all__ = ["MARKER", "Hold", "Mark", "check", "clear", "new_session", "read", "write"]

MARKER = "spmd-final-step.json"
_log = logging.getLogger("spmd.checkpoint")


class Mark(NamedTuple):
    """What a final-step marker says."""

    step: int  # the run's last checkpoint
    session: str | None  # the writer that marked it (None: a marker of an older spmd)


def new_session() -> str:
    """A writer's name in the markers it writes: unique to one open manager."""
    return uuid.uuid4().hex


def check(step: int | None, steps: list[int], directory: epath.Path) -> int:
    """The step to mark: `step`, or the latest of `steps` if None; it must be the latest."""
    latest = steps[-1] if steps else None
    step = latest if step is None else step
    if step is not None and step == latest:
        return step
    raise CheckpointError(
        message(
            "mark_final marks the latest complete checkpoint as the run's last.",
            received(step=step, directory=str(directory), complete_steps=steps),
            "save the final state first (save(step, state, force=True)), then call "
            "mark_final() with no step.",
        )
    )


def write(directory: epath.Path, step: int, session: str) -> None:
    """Writes the marker whole or not at all (a rename on local disks; one object on a store)."""
    text = json.dumps({"step": int(step), "session": session})
    path = directory / MARKER
    if "://" in str(directory):  # an object store writes an object whole
        path.write_text(text)
        return
    partial = directory / f".{MARKER}.tmp-{uuid.uuid4().hex}"
    partial.write_text(text)
    os.replace(os.fspath(partial), os.fspath(path))


def clear(directory: epath.Path) -> None:
    """Removes the marker, if there is one (the run goes on past it)."""
    path = directory / MARKER
    if path.exists():
        path.unlink(missing_ok=True)


def read(directory: epath.Path) -> Mark | None:
    """What the marker says, or None if there is none (or it cannot be read: logged)."""
    path = directory / MARKER
    try:
        if not path.exists():
            return None
        found = json.loads(path.read_text())
        value, session = found["step"], found.get("session")
    except FileNotFoundError:  # removed between the two calls
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        _log.warning("ignoring the final-step marker %s: %s", path, e)
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        _log.warning("ignoring the final-step marker %s: step %r is not an integer", path, value)
        return None
    return Mark(value, session if isinstance(session, str) else None)


class Hold:
    """A writer's hold on the marker of the run it continues (process 0's).

    Taken when the writer opens the directory: the marker is removed, so no
    reader ends while this writer may still save. `release` (on close, or at
    exit for a writer never closed) puts it back, naming this writer, if the
    writer saved nothing and marked nothing, and the marked step is still there.
    """

    def __init__(self, directory: epath.Path, session: str) -> None:
        self.directory, self.session = directory, session
        self.mark = read(directory)
        self.saved = False  # set by the writer's first save
        if self.mark is not None:
            clear(directory)

    def release(self) -> None:
        """Puts the marker back where this writer changed nothing (see the class)."""
        mark, self.mark = self.mark, None
        if mark is None or self.saved or read(self.directory) is not None:
            return
        if (self.directory / str(mark.step)).exists():  # not set aside as damaged
            write(self.directory, mark.step, self.session)
