"""What a SidecarEvaluator watches for in a training job's checkpoint directory.

The waits it logs, the steps it skips (and why), a new run replacing the one
it follows, and the end of the run (its final-step mark, held for a grace).
On a multi-process evaluator every decision is process 0's (`agreed`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax
from etils import epath

from spmd._src.checkpoint import final, guard, integrity
from spmd._src.checkpoint.manager import CheckpointManager
from spmd._src.checkpoint.store import forget_listings
from spmd._src.errors import ConfigurationError, message, received

__all__ = [
    "REMOVED_BEFORE",
    "Ending",
    "Run",
    "Skips",
    "Wait",
    "agreed",
    "agreed_mark",
    "file_on",
    "going",
    "under_a_file",
]

_log = logging.getLogger("spmd.evaluator")  # the evaluator's log, one name for its lines
WAIT_LOG_S = 300.0  # how often a long wait for a new checkpoint is logged again
REMOVED_BEFORE = "removed by the writer's max_to_keep before it could be read"


def agreed(value: Any, what: str) -> Any:
    """`value` as process 0 sees it, on every process of a multi-process evaluator."""
    if jax.process_count() == 1:
        return value
    return guard.agree(f"SidecarEvaluator {what}", value, 300.0)[0]


class Run:
    """Whether the directory still holds the run being followed.

    A new run: the directory was removed and is back, or is another folder
    (its inode changed: removed and re-created between two looks), or its
    newest step is below the last one evaluated and is not a checkpoint this
    evaluator read (Orbax's commit time of the step differs). A newest step
    below the last evaluated that is one it read, or whose commit record is
    gone, is the same run whose later steps are gone (set aside as damaged,
    or the whole run being deleted: the next looks tell).
    """

    def __init__(self, directory: epath.Path) -> None:
        self.directory = directory
        self.identity = _identity(directory)
        self.gone = False  # seen removed, not yet back
        self.commits: dict[int, int | None] = {}  # step -> commit time, of the steps read

    def evaluating(self, step: int) -> None:
        self.commits[step] = integrity.commit_time(self.directory / str(step))

    def changed(self, steps: list[int], done: int) -> str | None:
        """Why the directory now holds a new run, or None."""
        identity = _identity(self.directory)
        if identity is None:
            if self.identity is not None and not self.gone:
                _log.warning(
                    "the checkpoint directory %s was removed: waiting for it (a new run)",
                    self.directory,
                )
                self.gone = True
            return None
        if self.gone:
            return "the directory was removed and re-created"
        if self.identity is not None and identity != self.identity:
            return "the directory was replaced by another folder"
        self.identity = identity
        if steps and steps[-1] < done:  # a new run's, or the old run's being deleted
            newest = steps[-1]
            commit = integrity.commit_time(self.directory / str(newest))
            if commit is not None and commit != self.commits.get(newest):
                return f"its newest step {newest} is below step {done}, the last evaluated"
        return None


def _identity(directory: epath.Path) -> tuple | str | None:
    """What tells a folder from one re-created at its path (device and inode where the path is
    local; on an object store, only whether it exists), or None if there is none.

    Raises:
      ConfigurationError: the path goes through a file (one made since the evaluator
        was built): no folder can be there.
      CheckpointError: a folder on the path cannot be searched (permissions).
    """
    text = str(directory)
    if "://" in text:
        return "exists" if directory.exists() else None
    try:
        found = os.stat(text)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise under_a_file(text, file_on(text) or text) from None
    except PermissionError as e:
        raise guard.not_listable(directory, e) from None
    return (found.st_dev, found.st_ino)


def file_on(path: str) -> str | None:
    """The first part of local `path` that is a file (`path` itself included), or None."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        head = os.sep.join(parts[:i])
        if os.path.isfile(head):
            return head
    return None


def under_a_file(directory: str, file: str) -> ConfigurationError:
    """The error for a checkpoint_dir whose path goes through a file."""
    return ConfigurationError(
        message(
            "checkpoint_dir is a folder, or a path where one can be made: no part of it may "
            "be a file.",
            received(checkpoint_dir=directory, file=file),
            "pass the folder the training job's ModelCheckpoint (or CheckpointManager) writes.",
        )
    )


class Wait:
    """Says that the evaluator waits, as Keras does ("Waiting for new checkpoint at <dir>",
    INFO): when a wait begins, then every `WAIT_LOG_S` seconds while it lasts."""

    def __init__(self, directory: str, timeout: float | None) -> None:
        self.directory, self.timeout = directory, timeout
        self.since: float | None = None  # when this wait began
        self.logged = 0.0

    def found(self) -> None:
        self.since = None

    def log(self) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = self.logged = now
            _log.info("Waiting for new checkpoint at %s", self.directory)
        elif now - self.logged >= WAIT_LOG_S:
            self.logged = now
            bound = "no timeout" if self.timeout is None else f"timeout {self.timeout:.0f} s"
            _log.info(
                "still waiting for a new checkpoint at %s: %.0f s so far (%s)",
                self.directory,
                now - self.since,
                bound,
            )


class Ending:
    """When a final-step marker ends the evaluation: the marked step is the newest and has
    been evaluated (or skipped), and the same marker (step and writer) stayed there for
    `grace` seconds. A resumed run, or a second `fit`, takes the marker away when it opens
    the directory, before its first step: the grace covers the time it takes to start."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.seen: final.Mark | None = None  # the marker looked at, unchanged, since `since`
        self.since = 0.0

    def ended(self, mark: final.Mark | None, steps: list[int], done: int) -> bool:
        """Whether the run ended: its marked step evaluated, or gone from a listing made
        after the mark was read (which the run wrote before marking it: removed, or
        replaced by a file), every step listed evaluated; said at WARNING then."""
        gone = mark is not None and mark.step not in steps and done >= max(steps, default=-1)
        if mark is None or (done < mark.step and not gone) or (steps and steps[-1] > mark.step):
            self.seen = None
            return False
        now = time.monotonic()
        if mark != self.seen:
            self.seen, self.since = mark, now
            if gone:
                _log.warning(
                    "the training run marked step %d as its last, but the directory holds no "
                    "step %d (removed, or replaced by a file, after it was written): the "
                    "evaluation ends at step %d",
                    mark.step,
                    mark.step,
                    done,
                )
            if self.grace > 0:
                _log.info(
                    "the training run marked step %d as its last: ending in %.0f s unless it "
                    "goes on (final_grace)",
                    mark.step,
                    self.grace,
                )
        return now - self.since >= self.grace


def agreed_mark(reader: CheckpointManager) -> final.Mark | None:
    """The final-step marker, as process 0 sees it."""
    forget_listings(reader.directory)  # the writer is another process
    mark = agreed(final.read(reader.directory), "final_step")
    return None if mark is None else final.Mark(*mark)


class Skips:
    """One log line for each step the evaluator saw and will not evaluate.

    A step folder seen incomplete below the newest complete step is one Orbax
    is deleting (the writer's max_to_keep removes a folder file by file) or a
    damaged one: the next look tells, the folder gone or still there. Steps
    the writer saved and removed between two looks are never seen, so never
    logged.
    """

    def __init__(self) -> None:
        self.suspects: dict[int, str] = {}  # step -> why it was incomplete at the last look

    def look(self, reader: CheckpointManager, new: list[int], done: int) -> None:
        """Rules on the last look's suspects, and takes this look's (after `done`, before the
        newest of `new`: a later one may still be a save in flight on an object store)."""
        found = agreed({str(s): why for s, why in reader.damaged_steps().items()}, "damaged")
        found = {int(s): why for s, why in found.items()}
        for step in sorted(self.suspects):
            if step in found:
                _log.warning("skipping checkpoint step %d: damaged: %s", step, found[step])
            else:
                _log.warning("skipping checkpoint step %d: %s", step, REMOVED_BEFORE)
        newest = new[-1] if new else done
        self.suspects = {s: why for s, why in found.items() if done < s < newest}

    def end(self) -> None:
        """Logs the suspects no later look ruled on."""
        for step, why in sorted(self.suspects.items()):
            _log.warning(
                "skipping checkpoint step %d: not a complete checkpoint (damaged, or being "
                "removed by the writer's max_to_keep): %s",
                step,
                why,
            )
        self.suspects = {}


def going(step_dir: epath.Path, step: int) -> bool:
    """Whether a step found whole when listed is gone or no longer whole: being removed
    (a committed step changes no more, but for its deletion)."""
    return not step_dir.exists() or integrity.damage(step_dir, step) is not None
