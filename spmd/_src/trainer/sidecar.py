"""SidecarEvaluator: the `evaluator` task, evaluating each checkpoint a training job writes."""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from etils import epath
from flax import nnx

from spmd._src.checkpoint.integrity import Damaged
from spmd._src.checkpoint.manager import CheckpointManager
from spmd._src.errors import CheckpointError, ConfigurationError, message, received
from spmd._src.placement import from_host
from spmd._src.strategy.base import Strategy
from spmd._src.trainer.callbacks import Callback, CallbackList
from spmd._src.trainer.losses import Metric
from spmd._src.trainer.sidecar_layout import Layout
from spmd._src.trainer.sidecar_watch import (
    REMOVED_BEFORE,
    Ending,
    Run,
    Skips,
    Wait,
    agreed,
    agreed_mark,
    file_on,
    going,
    under_a_file,
)
from spmd._src.trainer.tensorboard import TensorBoard
from spmd._src.trainer.trainer import Trainer
from spmd._src.validate import non_negative_number, positive_int, positive_number

__all__ = ["SidecarEvaluator"]

_log = logging.getLogger("spmd.evaluator")

_MAX_POLL_S = 600.0  # the longest pause between two looks at the directory
_STEP_FILES = ("_CHECKPOINT_METADATA", "state/_METADATA")  # what only a step's folder holds


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
      callbacks: a list of `spmd.callbacks.Callback`s (or one, as Keras
        takes it); each evaluation calls their test hooks as
        `Trainer.evaluate` does (`on_test_begin`, `on_test_batch_begin/end`
        per batch, `on_test_end(logs)`), with `trainer.iterations` set to the
        checkpoint's step, the train step it was saved at (Keras restores
        `optimizer.iterations`). `spmd.callbacks.TensorBoard(log_dir)` here
        writes what `log_dir` does. The arguments so far are Keras', in its
        order; the others are keyword-only.
      log_dir: write each step's metrics as TensorBoard scalars
        `evaluation_<metric>_vs_iterations` at the step, under
        `log_dir/validation` (as Keras' TensorBoard callback does), each on
        disk when its evaluation ends; created at construction, which fails if
        it cannot be written.
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
      params_key: where the model's parameters are in the saved state, a
        '/'-joined path: "params" for `Trainer.fit`'s checkpoints and for a
        custom loop that saves `{"params": ..., "opt": ...}` (examples/06);
        e.g. "model/params" for one nested deeper.
      rest_key: where the model's other state is (BatchNorm statistics, RNG
        counts; `Trainer.fit` saves it as "rest"), or None where the loop
        saves none. Read only for a model that has such state.

    Raises:
      ConfigurationError: a bare model without `loss`, a Trainer with
        `loss`, `metrics` or `strategy` (it has its own), an argument out
        of range, a `checkpoint_dir` that is a file or one step's folder,
        `callbacks` that are not Callbacks, or a `log_dir` that is not a
        path or cannot be written.

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
        callbacks: Sequence[Callback] | Callback | None = None,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        loss: str | Callable | None = None,
        metrics: Sequence[str | Metric] = (),
        strategy: Strategy | None = None,
        batch_size: int | None = None,
        poll_interval: float = 1.0,
        timeout: float | None = None,
        final_grace: float = 60.0,
        params_key: str = "params",
        rest_key: str | None = "rest",
    ) -> None:
        self.trainer = as_trainer(model_or_trainer, loss, metrics, strategy)
        self.data = check_data(data)
        self.batch_size = optional_count(batch_size, "batch_size", "examples per batch")
        self.checkpoint_dir = check_directory(checkpoint_dir)
        self.steps = optional_count(steps, "steps", "batches per evaluation")
        self.max_evaluations = optional_count(max_evaluations, "max_evaluations", "evaluations")
        self.poll_interval = check_poll(poll_interval)
        self.timeout = None if timeout is None else positive_number(timeout, "timeout")
        self.final_grace = check_grace(final_grace)
        self.layout = Layout.checked(params_key, rest_key)
        self.callbacks = check_callbacks(callbacks)
        if (log_dir := check_log_dir(log_dir)) is not None:
            self.callbacks.append(TensorBoard(log_dir))
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
            message names the paths that differ), or holds nothing at
            `params_key` / `rest_key` (the message lists its top-level keys),
            or the directory or a step's files cannot be read (permissions:
            the message names the path and the errno). Damaged and removed
            steps are skipped.
          BatchError: `data` has no batch.
          ConfigurationError: `data` never ends (repeat()) and `steps` is None.
        """
        trainer = self.trainer
        trainer.build()
        dataset = trainer._dataset(
            self.data, self.batch_size, shuffle=False, pad=True, what="SidecarEvaluator data"
        )
        check_ends(dataset, self.steps)
        hooks = CallbackList(self.callbacks, trainer, {"steps": self.steps, "verbose": 0})
        try:
            self._loop(dataset, hooks)
        finally:
            for callback in self.callbacks:  # log_dir's, and any given as Keras users do
                if isinstance(callback, TensorBoard):
                    callback.on_train_end()  # closes its event files: the last events land
        return self.history

    def _loop(self, dataset: Any, hooks: CallbackList) -> None:
        reader, skips = CheckpointManager(self.checkpoint_dir, read_only=True), Skips()
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
        self, reader: CheckpointManager, dataset: Any, hooks: CallbackList, skips: Skips
    ) -> str | None:
        """Evaluates the run in the directory to its end (None), or until another run replaces
        it: then why the directory holds a new run."""
        done, last_new = -1, time.monotonic()
        ending, wait = Ending(self.final_grace), Wait(self.checkpoint_dir, self.timeout)
        run = Run(reader.directory)
        while True:
            mark = agreed_mark(reader)  # before the listing: see below
            steps = agreed(reader.all_steps(), "all_steps")
            why = agreed(run.changed(steps, done), "new run")
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
            if agreed(ending.ended(mark, steps, done), "ended"):  # each process times the grace
                _log.info("the training run ended at step %d: done", mark.step)
                return None
            waited = time.monotonic() - last_new
            if self.timeout is not None and agreed(waited >= self.timeout, "timeout"):
                if done < 0 and not steps and not _appeared(self.checkpoint_dir):
                    _log.warning(
                        "%s never appeared in %.0f s (timeout): done, having evaluated "
                        "nothing. Check the path: it is the training job's checkpoint_dir.",
                        self.checkpoint_dir,
                        waited,
                    )
                    return None
                _log.info("no new checkpoint in %.0f s (timeout): done", waited)
                return None
            pause = self.poll_interval
            if self.timeout is not None:
                pause = min(pause, self.timeout - waited)
            wait.log()
            time.sleep(pause)

    def _evaluate(self, reader: CheckpointManager, dataset: Any, hooks, step: int) -> dict | None:
        """The metrics of checkpoint `step`, or None if it is damaged or gone (logged)."""
        trainer, layout = self.trainer, self.layout
        if not agreed(step in reader.all_steps(), "listed"):
            _log.warning("skipping checkpoint step %d: %s", step, REMOVED_BEFORE)
            return None
        try:
            layout.check(list(reader.saved_arrays(step)), trainer.state, step)
            target = layout.target(trainer.state)  # the model alone: no optimizer state
            model = layout.read(reader.restore(step, target=target, partial=True), trainer.state)
        except CheckpointError as error:
            if agreed(going(reader.directory / str(step), step), "removed"):
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
        trainer.state = {**trainer.state, **model, "step": _placed(step, trainer.state["step"])}
        trainer.iterations = step
        _load_into_model(trainer)
        batches = dataset if self.steps is None else _first(dataset, self.steps)
        metrics = trainer._evaluate_dataset(batches, "SidecarEvaluator", hooks)
        shown = "  ".join(f"{k} {v:.6g}" for k, v in metrics.items())
        _log.info("checkpoint step %d: %s", step, shown)
        return metrics


def _placed(step: int, like: jax.Array) -> jax.Array:
    """`step` as a scalar laid out as `like` (the train state's step counter)."""
    value = np.asarray(step, like.dtype)
    return from_host(value, like.sharding)


def _load_into_model(trainer: Trainer) -> None:
    """Puts the restored weights into the model the evaluator was given, in place, as Keras'
    evaluator loads each checkpoint into its model (`Trainer.model` updates the module)."""
    trainer.model  # noqa: B018 - reading the property writes the state into the module


class _first:
    """The first `count` batches of `dataset`, each time it is iterated."""

    def __init__(self, dataset: Any, count: int) -> None:
        self.dataset, self.count = dataset, count

    def __iter__(self):
        return itertools.islice(iter(self.dataset), self.count)


def _appeared(directory: str) -> bool:
    """Whether `directory` exists (an error asking counts as yes: no false alarm)."""
    try:
        return epath.Path(directory).exists()
    except Exception:  # noqa: BLE001 (a store's own errors: say nothing rather than guess)
        return True


def _why(error: BaseException, most: int = 400) -> str:
    """An error's first line (what was expected) and its second (what was received), the
    second cut at `most` characters (Orbax's errors quote whole tensorstore specs)."""
    lines = str(error).splitlines()[:2] or [type(error).__name__]
    if len(lines) > 1 and len(lines[1]) > most:
        lines[1] = lines[1][:most] + " ..."
    return " ".join(lines)


# -- the checks of the arguments: each a clear error at construction


def check_directory(directory: Any) -> str:
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
    if "://" not in text and (file := file_on(text)) not in (None, text):
        raise under_a_file(text, file)
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


def check_ends(dataset: Any, steps: int | None) -> None:
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


def check_data(data: Any) -> Any:
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


def as_trainer(value: Any, loss: Any, metrics: Sequence[Any], strategy: Strategy | None) -> Trainer:
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


def optional_count(value: Any, name: str, what: str) -> int | None:
    if value is None:
        return None
    return positive_int(value, name, fix=f"pass a number of {what} >= 1, or None for no limit.")


def check_grace(value: Any) -> float:
    fix = "pass the seconds a resumed run may take to open the directory, e.g. final_grace=60."
    return non_negative_number(value, "final_grace", fix=fix)


def check_poll(value: Any) -> float:
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


def check_callbacks(callbacks: Any) -> list[Callback]:
    """`callbacks` as a list: None is none, one Callback is a list of it (Keras flattens)."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        return [callbacks]
    if isinstance(callbacks, list | tuple) and all(isinstance(c, Callback) for c in callbacks):
        return list(callbacks)
    hint = ""
    if isinstance(callbacks, str | os.PathLike):
        hint = f" (a path: log_dir is keyword-only, after Keras' callbacks: log_dir={callbacks!r})"
    raise ConfigurationError(
        message(
            "callbacks is a list of spmd.callbacks.Callback (the sixth argument, as in Keras' "
            "SidecarEvaluator(model, data, checkpoint_dir, steps, max_evaluations, callbacks)).",
            received(callbacks=callbacks) + hint,
            "pass e.g. callbacks=[spmd.callbacks.TensorBoard(log_dir)], subclass "
            "spmd.callbacks.Callback for your own, and pass log_dir=... by name.",
        )
    )


def check_log_dir(log_dir: Any) -> str | None:
    """`log_dir` as a string, made (on process 0) and found writable, or None."""
    if log_dir is None:
        return None
    if not (isinstance(log_dir, str | os.PathLike) and os.fspath(log_dir)):
        raise ConfigurationError(
            message(
                "log_dir is the folder TensorBoard reads: a path.",
                received(log_dir=log_dir),
                'pass e.g. log_dir="/logs/run", or leave it None.',
            )
        )
    text = os.fspath(log_dir)
    problem = agreed(_not_writable(text) if jax.process_index() == 0 else None, "log_dir")
    if problem is not None:
        raise ConfigurationError(
            message(
                "log_dir must be a folder the evaluator can write (process 0 writes the "
                "TensorBoard event files there).",
                received(log_dir=text, error=problem),
                "give this process write access to it, or pass another log_dir.",
            )
        )
    return text


def _not_writable(folder: str) -> str | None:
    """Why `folder` (made if missing) cannot hold a new file, or None. An object store's
    folder (gs://) is not tried: it is written at the first evaluation."""
    if "://" in folder:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        return f"{type(error).__name__}: {error}"
    return None
