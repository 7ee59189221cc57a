"""SidecarEvaluator: the `evaluator` task, evaluating each checkpoint a training job writes."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax
from etils import epath
from flax import nnx

from spmd.checkpoint import final, guard, integrity
from spmd.checkpoint.integrity import Damaged
from spmd.checkpoint.manager import CheckpointManager
from spmd.checkpoint.store import forget_listings
from spmd.errors import CheckpointError, ConfigurationError, message, received
from spmd.strategy.base import Strategy
from spmd.trainer.callbacks import Callback, CallbackList
from spmd.trainer.losses import Metric
from spmd.trainer.tensorboard import TensorBoard
from spmd.trainer.trainer import Trainer
from spmd.validate import non_negative_number, positive_int, positive_number

__all__ = ["SidecarEvaluator"]

_log = logging.getLogger(__name__)
_MAX_POLL_S = 600.0  # the longest pause between two looks at the directory
_WAIT_LOG_S = 300.0  # how often a long wait for a new checkpoint is logged again
_MODEL = ("params", "rest", "step")  # what an evaluation needs of a saved train state
_STEP_FILES = ("_CHECKPOINT_METADATA", "state/_METADATA")  # what only a step's folder holds
_REMOVED_BEFORE = "removed by the writer's max_to_keep before it could be read"


class SidecarEvaluator:
    """Evaluates the checkpoints a training job writes, while it writes them.

    The `evaluator` task of tf.distribute (Keras' `SidecarEvaluator`): a job of
    its own, beside the training job, that waits for each new checkpoint in
    `checkpoint_dir`, restores it into its own strategy (any device count: a
    one-device evaluator of an 8-device or multi-host run, the arrays are
    resharded), evaluates it exactly with `Trainer.evaluate`'s step (every
    example once, padding masked) and logs the metrics. It reads through a
    `CheckpointManager(read_only=True)`: it takes no lock, writes nothing
    into the directory, never sees a step being written, and works on a
    read-only mount.

    Every step is evaluated, oldest first. A directory removed and re-created
    by a new run (or whose steps go back below the last evaluated one to
    checkpoints it never read) is logged and followed from the new run's
    first step. Every step it saw and does not evaluate gets a log line:
    damaged (its checksums fail, its folder stays incomplete), or removed by
    the writer's `max_to_keep` before or while it was read (steps saved and
    removed between two looks are never seen). `start` ends after the step
    the training run marked as its last (`ModelCheckpoint` marks it when
    `fit` ends; a custom loop calls `CheckpointManager.mark_final()`), once
    that mark has stayed for `final_grace` seconds; after `max_evaluations`
    evaluations; or after `timeout` seconds without a new step. A run that
    goes on (a second `fit` call, a resumed run) takes the mark away when it
    opens the directory, before its first save: the grace is the time it has
    to start.

    Args:
      model_or_trainer: the training job's model (the same module class and
        config: its parameters and other model state are read from each
        checkpoint, never the optimizer state), as Keras takes a compiled
        model: a flax `nnx.Module` or an (init, apply) pair, with `loss` and
        `metrics`; or a `spmd.Trainer` of it, which brings its own loss,
        metrics and strategy. Each checkpoint is loaded into the model, in
        place, before it is evaluated (as Keras does): give the evaluator a
        model (or Trainer) of its own.
      data: the evaluation data, as `Trainer.evaluate` takes it (arrays with
        `batch_size`, or a re-iterable of batches): read anew for each step.
      checkpoint_dir: the training job's checkpoint directory (e.g. its
        `ModelCheckpoint` directory); it may not exist yet. While no new
        step comes, "Waiting for new checkpoint at <dir>" is logged (INFO)
        when the wait begins and every 5 minutes after.
      steps: evaluate the first `steps` batches of `data` (None: all of it);
        needed for a dataset that never ends (`repeat()`), as in Keras.
      max_evaluations: stop after this many evaluations (None: no limit).
        Keras stops after the checkpoint whose number (`ckpt-<k>`, one per
        save or epoch) reaches it; spmd names checkpoints by train step and
        evaluates each in turn, so this counts evaluations: with one
        checkpoint per epoch, `max_evaluations=n` stops after the n-th, as
        Keras does. Skipped (damaged or removed) steps do not count.
      log_dir: write each step's metrics as TensorBoard scalars
        `evaluation_<metric>_vs_iterations` at the step, under
        `log_dir/validation` (as Keras' TensorBoard callback does).
      callbacks: `spmd.callbacks.Callback`s; `on_test_begin` and
        `on_test_end(logs)` are called around each evaluation, with
        `trainer.iterations` set to the checkpoint's step, the train step it
        was saved at (Keras restores `optimizer.iterations`).
        `spmd.callbacks.TensorBoard(log_dir)` here writes what `log_dir` does.
      loss: with a bare model, the loss to evaluate, as `spmd.Trainer` takes
        it (a name such as "sparse_categorical_crossentropy", or a callable
        (outputs, labels) -> per-example loss): Keras' `model.compile(loss=)`.
      metrics: with a bare model, the metrics, as `spmd.Trainer` takes them
        (e.g. ("accuracy",)): Keras' `model.compile(metrics=)`.
      strategy: with a bare model, where to evaluate (the current strategy
        by default; any device count).
      batch_size: the global batch size, with array data.
      poll_interval: seconds between looks at the directory (at most 600).
      timeout: stop after this many seconds without a new step (None: wait
        for the run's final step). A training job that dies unmarked
        (killed, a node lost) leaves nothing else that ends the wait: give
        one of a few checkpoint intervals.
      final_grace: seconds the run's final-step mark must stay, unchanged,
        after the marked step was evaluated, before `start` ends: the time a
        job that calls `fit` again, or a run resumed beside the evaluator,
        has to open the directory (0: end at once, for a run that is never
        resumed).

    Raises:
      ConfigurationError: a bare model without `loss`, a Trainer with
        `loss`, `metrics` or `strategy` (it has its own), an argument out
        of range, or a `checkpoint_dir` that is a file or one step's folder.

    Example:
      >>> evaluator = spmd.SidecarEvaluator(
      ...     Net(nnx.Rngs(0)), (x_val, y_val), "/ckpt/run", loss="sparse_categorical_crossentropy",
      ...     metrics=("accuracy",), batch_size=256, log_dir="/logs/run",
      ...     timeout=3600)  # doctest: +SKIP
      >>> history = evaluator.start()  # {step: {"loss": ..., "accuracy": ...}}  # doctest: +SKIP
    """

    def __init__(
        self,
        model_or_trainer: Any,
        data: Any,
        checkpoint_dir: str,
        steps: int | None = None,
        max_evaluations: int | None = None,
        log_dir: str | None = None,
        callbacks: Sequence[Callback] = (),
        *,
        loss: str | Callable | None = None,
        metrics: Sequence[str | Metric] = (),
        strategy: Strategy | None = None,
        batch_size: int | None = None,
        poll_interval: float = 1.0,
        timeout: float | None = None,
        final_grace: float = 60.0,
    ) -> None:
        self.trainer = _as_trainer(model_or_trainer, loss, metrics, strategy)
        self.data, self.batch_size = _check_data(data), batch_size
        self.checkpoint_dir = _check_directory(checkpoint_dir)
        self.steps = _optional_count(steps, "steps", "batches per evaluation")
        self.max_evaluations = _optional_count(max_evaluations, "max_evaluations", "evaluations")
        self.poll_interval = _check_poll(poll_interval)
        self.timeout = None if timeout is None else positive_number(timeout, "timeout")
        self.final_grace = _check_grace(final_grace)
        self.callbacks = list(callbacks) + ([TensorBoard(log_dir)] if log_dir else [])
        self.history: dict[int, dict[str, float]] = {}
        self._evaluations = 0  # over every run the directory held

    @property
    def model(self) -> Any:
        """The model, holding the weights of the last checkpoint evaluated (Keras' `model`)."""
        return self.trainer.model

    def start(self) -> dict[int, dict[str, float]]:
        """Evaluates each new checkpoint until the run's final step (see the class).

        Returns:
          {step: {"loss": ..., metric: ...}} for every step evaluated, oldest first,
          of the run it ended with (a directory re-created by a new run starts it anew).

        Raises:
          CheckpointError: a checkpoint's model is not the evaluator's (the
            message names the paths that differ), or its files exist but
            cannot be read (permissions). Damaged and removed steps are skipped.
          BatchError: `data` has no batch.
          ConfigurationError: `data` never ends (repeat()) and `steps` is None.
        """
        trainer = self.trainer
        trainer.build()
        dataset = trainer._dataset(
            self.data, self.batch_size, shuffle=False, pad=True, what="SidecarEvaluator data"
        )
        _check_ends(dataset, self.steps)
        hooks = CallbackList(self.callbacks, trainer, {"steps": self.steps, "verbose": 0})
        try:
            self._loop(dataset, hooks)
        finally:
            for callback in self.callbacks:  # log_dir's, and any given as Keras users do
                if isinstance(callback, TensorBoard):
                    callback.on_train_end()  # closes its event files: the last events land
        return self.history

    def _loop(self, dataset: Any, hooks: CallbackList) -> None:
        reader, skips = CheckpointManager(self.checkpoint_dir, read_only=True), _Skips()
        try:
            while (why := self._follow(reader, dataset, hooks, skips)) is not None:
                skips.end()
                _log.warning(
                    "the checkpoint directory %s holds a new run (%s): evaluating its steps "
                    "from the start",
                    reader.directory,
                    why,
                )
                reader.close()  # its listings were of the old run's folders
                reader = CheckpointManager(self.checkpoint_dir, read_only=True)
                self.history = {}
        finally:
            skips.end()
            reader.close()

    def _follow(
        self, reader: CheckpointManager, dataset: Any, hooks: CallbackList, skips: _Skips
    ) -> str | None:
        """Evaluates the run in the directory to its end (None), or until another run replaces
        it: then why the directory holds a new run."""
        done, last_new = -1, time.monotonic()
        ending, wait = _Ending(self.final_grace), _Wait(self.checkpoint_dir, self.timeout)
        run = _Run(reader.directory)
        while True:
            mark = _agreed_mark(reader)  # before the listing: see below
            steps = _agreed(reader.all_steps(), "all_steps")
            why = _agreed(run.changed(steps, done), "new run")
            if why is not None:
                return why
            new = [s for s in steps if s > done]
            skips.look(reader, new, done)
            for step in new:
                run.evaluating(step)
                metrics = self._evaluate(reader, dataset, hooks, step)
                done = step
                if metrics is not None:
                    self.history[step] = metrics
                    self._evaluations += 1
                    if self.max_evaluations and self._evaluations >= self.max_evaluations:
                        _log.info("evaluated %d steps (max_evaluations): done", self._evaluations)
                        return None
            if new:
                last_new = time.monotonic()
                wait.found()
            # The run marks its final step after its last save committed, so a listing
            # made after reading the mark holds every step the run wrote.
            if ending.ended(mark, steps, done):
                _log.info("the training run ended at step %d: done", mark.step)
                return None
            waited = time.monotonic() - last_new
            if self.timeout is not None and _agreed(waited >= self.timeout, "timeout"):
                _log.info("no new checkpoint in %.0f s (timeout): done", waited)
                return None
            pause = self.poll_interval
            if self.timeout is not None:
                pause = min(pause, self.timeout - waited)
            wait.log()
            time.sleep(pause)

    def _evaluate(self, reader: CheckpointManager, dataset: Any, hooks, step: int) -> dict | None:
        """The metrics of checkpoint `step`, or None if it is damaged or gone (logged)."""
        trainer = self.trainer
        target = {part: trainer.state[part] for part in _MODEL}
        if not _agreed(step in reader.all_steps(), "listed"):
            _log.warning("skipping checkpoint step %d: %s", step, _REMOVED_BEFORE)
            return None
        try:
            model = reader.restore(step, target=target, partial=True)  # no optimizer state
        except CheckpointError as error:
            if _agreed(_going(reader.directory / str(step), step), "removed"):
                _log.warning(
                    "skipping checkpoint step %d: removed by the writer's max_to_keep while it "
                    "was being read",
                    step,
                )
                return None
            if isinstance(error, Damaged):
                _log.warning("skipping checkpoint step %d: damaged: %s", step, _why(error))
                return None
            raise
        trainer.state = {**trainer.state, **model}
        trainer.iterations = step
        _load_into_model(trainer)
        hooks.on_test_begin()
        batches = dataset if self.steps is None else _first(dataset, self.steps)
        metrics = trainer._evaluate_dataset(batches, "SidecarEvaluator")
        hooks.on_test_end(metrics)
        shown = "  ".join(f"{k} {v:.6g}" for k, v in metrics.items())
        _log.info("checkpoint step %d: %s", step, shown)
        return metrics


def _load_into_model(trainer: Trainer) -> None:
    """Puts the restored weights into the model the evaluator was given, in place, as Keras'
    evaluator loads each checkpoint into its model (`Trainer.model` updates the module)."""
    trainer.model  # noqa: B018 - reading the property writes the state into the module


class _Run:
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
    local; on an object store, only whether it exists), or None if there is none."""
    text = str(directory)
    if "://" in text:
        return "exists" if directory.exists() else None
    try:
        found = os.stat(text)
    except FileNotFoundError:
        return None
    return (found.st_dev, found.st_ino)


class _Wait:
    """Says that the evaluator waits, as Keras does ("Waiting for new checkpoint at <dir>",
    INFO): when a wait begins, then every `_WAIT_LOG_S` seconds while it lasts."""

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
        elif now - self.logged >= _WAIT_LOG_S:
            self.logged = now
            bound = "no timeout" if self.timeout is None else f"timeout {self.timeout:.0f} s"
            _log.info(
                "still waiting for a new checkpoint at %s: %.0f s so far (%s)",
                self.directory,
                now - self.since,
                bound,
            )


class _Ending:
    """When a final-step marker ends the evaluation: the marked step is the newest and has
    been evaluated (or skipped), and the same marker (step and writer) stayed there for
    `grace` seconds. A resumed run, or a second `fit`, takes the marker away when it opens
    the directory, before its first step: the grace covers the time it takes to start."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.seen: final.Mark | None = None  # the marker looked at, unchanged, since `since`
        self.since = 0.0

    def ended(self, mark: final.Mark | None, steps: list[int], done: int) -> bool:
        if mark is None or done < mark.step or (steps and steps[-1] > mark.step):
            self.seen = None
            return False
        now = time.monotonic()
        if mark != self.seen:
            self.seen, self.since = mark, now
            if self.grace > 0:
                _log.info(
                    "the training run marked step %d as its last: ending in %.0f s unless it "
                    "goes on (final_grace)",
                    mark.step,
                    self.grace,
                )
        return now - self.since >= self.grace


def _agreed_mark(reader: CheckpointManager) -> final.Mark | None:
    """The final-step marker, as process 0 sees it."""
    forget_listings(reader.directory)  # the writer is another process
    mark = _agreed(final.read(reader.directory), "final_step")
    return None if mark is None else final.Mark(*mark)


class _Skips:
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
        found = _agreed({str(s): why for s, why in reader.damaged_steps().items()}, "damaged")
        found = {int(s): why for s, why in found.items()}
        for step in sorted(self.suspects):
            if step in found:
                _log.warning("skipping checkpoint step %d: damaged: %s", step, found[step])
            else:
                _log.warning("skipping checkpoint step %d: %s", step, _REMOVED_BEFORE)
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


def _going(step_dir: epath.Path, step: int) -> bool:
    """Whether a step found whole when listed is gone or no longer whole: being removed
    (a committed step changes no more, but for its deletion)."""
    return not step_dir.exists() or integrity.damage(step_dir, step) is not None


class _first:
    """The first `count` batches of `dataset`, each time it is iterated."""

    def __init__(self, dataset: Any, count: int) -> None:
        self.dataset, self.count = dataset, count

    def __iter__(self):
        return itertools.islice(iter(self.dataset), self.count)


def _agreed(value: Any, what: str) -> Any:
    """`value` as process 0 sees it, on every process of a multi-process evaluator."""
    if jax.process_count() == 1:
        return value
    return guard.agree(f"SidecarEvaluator {what}", value, 300.0)[0]


def _why(error: BaseException) -> str:
    lines = str(error).splitlines()
    return lines[1] if len(lines) > 1 else lines[0] if lines else type(error).__name__


def _check_directory(directory: Any) -> str:
    """`directory` as a string, once it is no file and no step folder (it may not exist yet)."""
    if not (isinstance(directory, str | os.PathLike) and os.fspath(directory)):
        raise ConfigurationError(
            message(
                "checkpoint_dir is the training job's checkpoint folder: a path, or a URL such "
                "as gs://bucket/run.",
                received(checkpoint_dir=directory),
                'pass the directory its ModelCheckpoint writes, e.g. "/ckpt/run".',
            )
        )
    text = os.fspath(directory)
    path = epath.Path(text)
    if path.is_file():
        raise ConfigurationError(
            message(
                "checkpoint_dir is the folder that holds the step folders, not a file.",
                received(checkpoint_dir=text, is_a="file"),
                "pass the directory the training job's ModelCheckpoint (or CheckpointManager) "
                "writes, e.g. the folder of this file.",
            )
        )
    if any((path / name).exists() for name in _STEP_FILES):
        raise ConfigurationError(
            message(
                "checkpoint_dir is the folder that holds the step folders (one per saved step), "
                "not one step's folder.",
                received(checkpoint_dir=text, is_a="step folder"),
                f"pass its parent: checkpoint_dir={str(path.parent)!r}.",
            )
        )
    return text


def _check_ends(dataset: Any, steps: int | None) -> None:
    """Raises for a dataset that never ends without `steps`: no evaluation would end."""
    if getattr(dataset, "infinite", False) and steps is None:
        raise ConfigurationError(
            message(
                "SidecarEvaluator on a dataset that never ends (repeat() with no count) needs "
                "steps: the number of batches of each evaluation (as Keras asks).",
                received(steps=None, data="infinite"),
                "pass steps=N, or repeat the dataset a finite number of times.",
            )
        )


def _check_data(data: Any) -> Any:
    """`data`, unless it is a one-shot iterator: it is read anew for every checkpoint."""
    if hasattr(data, "__next__") and iter(data) is data:
        raise ConfigurationError(
            message(
                "SidecarEvaluator reads its data anew for every checkpoint, so it must start "
                "over on each iter(): a one-shot iterator would be empty from the second on.",
                received(data=type(data).__name__),
                "pass arrays (x, y) with batch_size, a list of batches, or an object whose "
                "__iter__ returns a new iterator.",
            )
        )
    return data


def _as_trainer(
    value: Any, loss: Any, metrics: Sequence[Any], strategy: Strategy | None
) -> Trainer:
    """The Trainer that evaluates: `value` itself, or one built around a bare model."""
    given = {k: v for k, v in (("loss", loss), ("metrics", metrics), ("strategy", strategy)) if v}
    if isinstance(value, Trainer):
        if given:
            raise ConfigurationError(
                message(
                    "A spmd.Trainer brings its own loss, metrics and strategy to SidecarEvaluator.",
                    received(model_or_trainer="Trainer", **given),
                    "pass them to the Trainer (spmd.Trainer(model, optimizer, loss, "
                    "metrics=..., strategy=...)), or pass the bare model with them.",
                )
            )
        return value
    if not _is_model(value):
        raise ConfigurationError(
            message(
                "model_or_trainer is the training job's model (a flax nnx.Module, or an "
                "(init, apply) pair) or a spmd.Trainer of it.",
                received(model_or_trainer=type(value).__name__),
                "pass the module the training job trains (a fresh instance of the same class "
                "and config), with loss=... and metrics=..., or a spmd.Trainer.",
            )
        )
    if loss is None:
        raise ConfigurationError(
            message(
                "SidecarEvaluator evaluates a model's loss (and metrics) on each checkpoint; "
                "a bare model needs them, as spmd.Trainer does (Keras' SidecarEvaluator takes "
                "them from model.compile).",
                received(model_or_trainer=type(value).__name__, loss=None),
                "pass loss= and metrics= as the Trainer takes them: spmd.SidecarEvaluator(model, "
                'data, checkpoint_dir, loss="sparse_categorical_crossentropy", '
                'metrics=("accuracy",)), or pass a spmd.Trainer of the model.',
            )
        )
    # Only the model is read from each checkpoint: an optimizer without state keeps none.
    return Trainer(value, optax.identity(), loss, metrics, strategy)


def _is_model(value: Any) -> bool:
    pair = isinstance(value, tuple) and len(value) == 2 and all(map(callable, value))
    return isinstance(value, nnx.Module) or pair


def _optional_count(value: Any, name: str, what: str) -> int | None:
    if value is None:
        return None
    return positive_int(value, name, fix=f"pass a number of {what} >= 1, or None for no limit.")


def _check_grace(value: Any) -> float:
    fix = "pass the seconds a resumed run may take to open the directory, e.g. final_grace=60."
    return non_negative_number(value, "final_grace", fix=fix)


def _check_poll(value: Any) -> float:
    seconds = positive_number(value, "poll_interval", fix="pass e.g. poll_interval=1.0.")
    if seconds > _MAX_POLL_S:
        raise ConfigurationError(
            message(
                f"poll_interval is at most {_MAX_POLL_S:.0f} seconds: a pause between two "
                "looks at the checkpoint directory, not a schedule.",
                received(poll_interval=value),
                "pass e.g. poll_interval=1.0; to stop when no step comes, pass timeout=...",
            )
        )
    return seconds
