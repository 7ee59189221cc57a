"""The final-step marker: a training run's note, in its checkpoint directory, that it has ended.

A file `spmd-final-step.json` beside the step folders holds `{"step": N}`:
the run wrote its last checkpoint at step N and will write no more. A
`SidecarEvaluator` ends once it has evaluated step N. The writer puts it
there when fit ends (`CheckpointManager.mark_final`) and removes it when it
saves a later step (a resumed run goes on), so a marker never names a step
older than the newest one.
"""

from __future__ import annotations

import json
import logging
import os
import uuid

from etils import epath

from spmd.errors import CheckpointError, message, received

__all__ = ["MARKER", "check", "clear", "read", "write"]

MARKER = "spmd-final-step.json"
_log = logging.getLogger(__name__)


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


def write(directory: epath.Path, step: int) -> None:
    """Writes the marker whole or not at all (a rename on local disks; one object on a store)."""
    text = json.dumps({"step": int(step)})
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


def read(directory: epath.Path) -> int | None:
    """The step the marker names, or None if there is none (or it cannot be read: logged)."""
    path = directory / MARKER
    try:
        if not path.exists():
            return None
        value = json.loads(path.read_text())["step"]
    except FileNotFoundError:  # removed between the two calls
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        _log.warning("ignoring the final-step marker %s: %s", path, e)
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        _log.warning("ignoring the final-step marker %s: step %r is not an integer", path, value)
        return None
    return value
