"""Callbacks of `Trainer.fit`, under Keras's hook names: the base, History, progress,
EarlyStopping, checkpoints (TensorBoard is in spmd/_src/trainer/tensorboard.py)."""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from spmd._src.checkpoint.manager import CheckpointManager
from spmd._src.errors import ConfigurationError, ContextError, message, received
from spmd._src.trainer.arguments import check_keras_arguments
from spmd._src.trainer.model import averages
from spmd._src.validate import positive_int

if TYPE_CHECKING:
    from spmd._src.trainer.trainer import Trainer

_log = logging.getLogger("spmd.trainer")

__all__ = [
    "BackupAndRestore",
    "BatchLogs",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "EpochLogger",
    "History",
    "ModelCheckpoint",
    "ProgressBar",
    "as_callbacks",
    "check_freq",
]


class Callback:
    """Base class of callbacks: override the hooks you need; `self.trainer` is set by fit.

    Hooks, as in Keras: `on_train_begin/end`, `on_epoch_begin/end`,
    `on_train_batch_begin/end`, `on_test_begin/end`, `on_test_batch_begin/end`,
    `on_predict_begin/end`, `on_predict_batch_begin/end`. `logs` is always a
    dict, as in Keras: of floats (epoch and test hooks; `on_train_batch_end`'s
    is a `BatchLogs`, the epoch's running metrics read when first looked at),
    `{"outputs": ...}` (`on_predict_batch_end`), or empty (the begin hooks).
    Every process runs every callback; write files from the chief only
    (`spmd.cluster().is_chief`), or through `spmd.CheckpointManager`, which
    coordinates the processes itself.
    """

    trainer: Trainer | None = None
    params: dict[str, Any] = {}

    def set_trainer(self, trainer: Trainer) -> None:
        """Called by fit before any hook."""
        self.trainer = trainer

    def set_params(self, params: dict[str, Any]) -> None:
        """Called by fit with `epochs`, `steps` (per epoch, or None) and `verbose`."""
        self.params = params

    def on_train_begin(self, logs: dict | None = None) -> None:
        """At the start of fit."""

    def on_train_end(self, logs: dict | None = None) -> None:
        """At the end of fit, with the last epoch's logs."""

    def on_train_abort(self) -> None:
        """When fit stops on an exception (on_train_end does not run): release what
        on_train_begin took (open files, a checkpoint directory's lock), so that
        a retry in the same process can take them again."""

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Before epoch `epoch` (0-based)."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """After epoch `epoch`, with its training and validation metrics."""

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Before a training call (of `steps_per_execution` batches)."""

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """After a training call; `batch` counts batches of the epoch, 0-based, the last one run.

        `logs` (a `BatchLogs`) holds the epoch's running metrics, `logs["loss"]`, ...:
        read from the devices when first looked at (waiting for the steps run so far),
        so a callback that does not look costs no read.
        """

    def on_test_begin(self, logs: dict | None = None) -> None:
        """At the start of evaluate (also fit's validation)."""

    def on_test_end(self, logs: dict | None = None) -> None:
        """At the end of evaluate, with its metrics."""

    def on_test_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Before evaluation batch `batch` (0-based, counted from this evaluation's first)."""

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """After evaluation batch `batch`, with the metrics over the batches so far
        (a read of the devices, made only when some callback overrides this hook)."""

    def on_predict_begin(self, logs: dict | None = None) -> None:
        """At the start of predict."""

    def on_predict_end(self, logs: dict | None = None) -> None:
        """At the end of predict."""

    def on_predict_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Before predict batch `batch` (0-based)."""

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """After predict batch `batch`, with `{"outputs": ...}`: its rows' outputs (numpy)."""


_HOOKS = [name for name in vars(Callback) if name.startswith("on_")]
_BATCH_HOOKS = [name for name in _HOOKS if "_batch_" in name]


def as_callbacks(callbacks: Any) -> list[Callback]:
    """`callbacks` as a list: one `Callback` alone is a list of it (Keras reads it so), None none.

    Raises:
      ConfigurationError: neither a `Callback` nor an iterable (a list) of them
        (`CallbackList` checks each element).
    """
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        return [callbacks]
    if isinstance(callbacks, Iterable) and not isinstance(callbacks, str | bytes | dict):
        return list(callbacks)
    raise ConfigurationError(
        message(
            "callbacks is a list of spmd.callbacks.Callback (one Callback alone is read as a "
            "list of it, as Keras does).",
            received(callbacks=callbacks),
            "pass e.g. callbacks=[spmd.callbacks.EarlyStopping(patience=2)].",
        )
    )


_STALE_LOGS = (
    "on_train_batch_end's logs are read from the devices when first looked at, and the "
    "step after their batch reuses the memory they were read from."
)


class BatchLogs(MutableMapping):
    """`on_train_batch_end`'s logs: the epoch's running metrics (`trainer.running_metrics()`
    after the batch: `logs["loss"]`, ...), read from the devices when first looked at.

    Keras hands every batch hook a dict of the metrics, read from the devices at
    every batch; this one reads them only when a callback looks (`logs["loss"]`,
    `logs.get`, `in`, `len`, `dict(logs)`, ...), waiting then for the steps run so
    far, so callbacks that never look (the progress bar, checkpoints) cost no read.
    A dict but for its type: `copy()` gives a plain one; items may be set.
    Look within the hook (or keep `dict(logs)`): once the next step ran, the values
    are gone, and looking then is a `ContextError`.
    """

    def __init__(self, sums: dict) -> None:
        self._sums = sums  # the metric sums after the batch, as device arrays
        self._values: dict | None = None

    def _read(self) -> dict:
        if self._values is None:
            leaves = jax.tree.leaves(self._sums)
            if any(isinstance(a, jax.Array) and a.is_deleted() for a in leaves):
                raise ContextError(
                    message(
                        _STALE_LOGS,
                        received(logs="read after the next training step ran"),
                        "read them within on_train_batch_end, or keep a copy there: "
                        "self.seen = dict(logs).",
                    )
                )
            self._values = averages(jax.device_get(self._sums))
        return self._values

    def __getitem__(self, key: str) -> Any:
        return self._read()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._read()[key] = value

    def __delitem__(self, key: str) -> None:
        del self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def copy(self) -> dict:
        """The logs as a plain dict."""
        return dict(self._read())

    def __repr__(self) -> str:
        shown = "not read yet" if self._values is None else repr(self._values)
        return f"BatchLogs({shown})"


class CallbackList:
    """Calls a hook on every callback, in order.

    A batch hook's dispatch is built ahead: only the callbacks that override it
    (in their class or on the instance) are called, and a hook none overrides
    is a no-op, so a batch hook costs nothing when no callback reads batches.
    The other hooks look each callback's hook up when called (as Keras does) and
    then build the batch hooks' dispatch again, so a hook a callback sets on
    itself (in `on_train_begin`, `on_epoch_begin`, ...) is called from then on.
    """

    def __init__(self, callbacks: Sequence[Callback], trainer: Trainer, params: dict[str, Any]):
        for callback in callbacks:
            if not isinstance(callback, Callback):
                raise ConfigurationError(
                    message(
                        "callbacks must be spmd.callbacks.Callback instances.",
                        received(callback=callback),
                        "subclass spmd.callbacks.Callback and override its on_* hooks.",
                    )
                )
            callback.set_trainer(trainer)
            callback.set_params(params)
        self.callbacks = list(callbacks)
        for name in _HOOKS:
            if name not in _BATCH_HOOKS:
                setattr(self, name, functools.partial(self._call, name))
        self._build()

    def _build(self) -> None:
        """Builds each batch hook's dispatch from the callbacks' hooks as they are now."""
        for name in _BATCH_HOOKS:
            setattr(self, name, _dispatch([m for c in self.callbacks if (m := _hook(c, name))]))

    def _call(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Calls hook `name` on every callback that has it now, then rebuilds the batch hooks."""
        for callback in self.callbacks:
            method = _hook(callback, name)
            if method is not None:
                method(*args, **kwargs)
        self._build()

    def overrides(self, name: str) -> bool:
        """Whether some callback overrides hook `name` (e.g. "on_train_batch_end")."""
        return any(_hook(c, name) is not None for c in self.callbacks)


def _hook(callback: Callback, name: str) -> Callable | None:
    """`callback`'s bound hook `name`, or None where it is `Callback`'s no-op."""
    method = getattr(callback, name)
    return None if getattr(method, "__func__", None) is getattr(Callback, name) else method


def _nothing(*args: Any, **kwargs: Any) -> None:
    """The dispatch of a hook no callback overrides."""


def _dispatch(methods: list[Callable]) -> Callable:
    """One call of every method in `methods`, in order."""
    if not methods:
        return _nothing
    if len(methods) == 1:
        return methods[0]

    def call(*args: Any, **kwargs: Any) -> None:
        for method in methods:
            method(*args, **kwargs)

    return call


class History(Callback):
    """Records every epoch's logs; `fit` returns it.

    Attributes:
      history: metric name -> one value per epoch, e.g. `history["val_loss"]`.
      epoch: the epochs run, 0-based.
    """

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)


class ProgressBar(Callback):
    """A progress bar per epoch on the chief (rich), with the running metrics.

    Metrics are read from the devices at most every `refresh` seconds, so the
    bar does not slow the steps down.

    Args:
      refresh: seconds between reads of the running metrics.
    """

    def __init__(self, refresh: float = 0.5) -> None:
        self.refresh = refresh
        self._progress = None
        self._task = None
        self._last = 0.0

    def _active(self) -> bool:
        return jax.process_index() == 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if not self._active():
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn(f"epoch {epoch + 1}/{self.params.get('epochs', '?')}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[metrics]}"),
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=self.params.get("steps"), metrics="")
        self._last = time.monotonic()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._progress is None:
            return
        fields = {}
        if time.monotonic() - self._last > self.refresh:
            fields["metrics"] = _format(self.trainer.running_metrics())
            self._last = time.monotonic()
        self._progress.update(self._task, completed=batch + 1, **fields)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._progress is None:
            return
        self._progress.update(self._task, metrics=_format(logs or {}))
        self._progress.stop()
        self._progress = None


class EpochLogger(Callback):
    """One line per epoch on the chief: for logs and terminals without a bar."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if jax.process_index() == 0:
            print(
                f"epoch {epoch + 1}/{self.params.get('epochs', '?')}: {_format(logs or {})}",
                file=sys.stdout,
                flush=True,
            )


def _format(logs: dict) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in logs.items())


class EarlyStopping(Callback):
    """Stops fit when a monitored metric has stopped improving.

    Args:
      monitor: the log key to watch, e.g. "val_loss" or "val_accuracy".
      min_delta: a change smaller than this is no improvement.
      patience: epochs without improvement before stopping.
      mode: "min", "max", or "auto" (max for accuracy-like keys, else min).
      baseline: a value the metric must beat, else training stops after `patience`.
      restore_best_weights: put back the state of the best epoch when stopping.
      start_from_epoch: epochs to wait before watching.
      verbose: accepted for Keras compatibility.

    Raises:
      ConfigurationError: an unknown mode, or (at the first epoch end) a
        monitored key missing from the logs.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
        *,
        verbose: int = 0,
        **keras: Any,
    ) -> None:
        check_keras_arguments("EarlyStopping", keras, _takes(EarlyStopping))
        if mode not in ("auto", "min", "max"):
            raise ConfigurationError(
                message(
                    'EarlyStopping mode is "auto", "min" or "max".',
                    received(mode=mode),
                    'pass mode="min" for losses, "max" for accuracies.',
                )
            )
        if mode == "auto":
            mode = "max" if "acc" in monitor else "min"
        self.monitor, self.patience, self.baseline = monitor, patience, baseline
        self.min_delta = abs(min_delta) * (1 if mode == "max" else -1)
        self.mode = mode
        self.restore_best_weights, self.start_from_epoch = restore_best_weights, start_from_epoch
        self.stopped_epoch = 0
        self.best_epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.wait = 0
        self.best = (
            self.baseline
            if self.baseline is not None
            else (-math.inf if self.mode == "max" else math.inf)
        )
        self.best_state = None
        self._through = -1  # the last epoch whose logs were weighed

    def _better(self, value: float) -> bool:
        if self.mode == "max":
            return value - self.min_delta > self.best
        return value - self.min_delta < self.best

    def _backup_state(self, ended: tuple[int, dict] | None = None) -> dict:
        """What BackupAndRestore saves of this callback: the wait and the best so far (JSON),
        with the epoch that just `ended` (epoch, logs) weighed first, whatever the order of
        the callbacks' on_epoch_end."""
        if ended is not None:
            self._weigh(*ended)
        best = self.best if math.isfinite(self.best) else None
        kept = self.best_state is not None
        return {"wait": self.wait, "best": best, "best_epoch": self.best_epoch, "kept": kept}

    def _resume(self, saved: dict) -> None:
        """Takes the wait and the best of the fit a backup resumes, as if it had not stopped."""
        self.wait, self.best_epoch = int(saved["wait"]), int(saved["best_epoch"])
        if saved["best"] is not None:
            self.best = float(saved["best"])
        if saved["kept"]:  # the weights are not in the backup: say so, never restore others
            _log.warning(
                "EarlyStopping(restore_best_weights=True) resumed from a backup: the best "
                "weights (epoch %d) were held in memory, not backed up, so a stop restores "
                "the best weights seen since the resume, if any.",
                self.best_epoch,
            )

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._weigh(epoch, logs)

    def _weigh(self, epoch: int, logs: dict | None) -> None:
        """Weighs an epoch's logs once: the best, the wait, and the stop after patience."""
        if epoch <= self._through:
            return
        self._through = epoch
        logs = logs or {}
        if self.monitor not in logs:
            raise ConfigurationError(
                message(
                    f"EarlyStopping watches '{self.monitor}', which the logs do not have.",
                    received(monitor=self.monitor, logs=sorted(logs)),
                    "watch one of the log keys (pass validation_data for val_* keys).",
                )
            )
        if epoch < self.start_from_epoch:
            return
        value = float(logs[self.monitor])
        if self._better(value):
            self.best, self.best_epoch, self.wait = value, epoch, 0
            if self.restore_best_weights:
                self.best_state = jax.tree.map(np.asarray, self.trainer.host_state())
            return
        self.wait += 1
        if self.wait >= max(self.patience, 1):
            self.stopped_epoch = epoch
            self.trainer.stop_training = True
            if self.restore_best_weights and self.best_state is not None:
                self.trainer.load_state(self.best_state)


def _better(mode: str, value: float, best: float) -> bool:
    return value > best if mode == "max" else value < best


class ModelCheckpoint(Callback):
    """Saves the train state with `spmd.CheckpointManager` (Orbax) every epoch or N batches.

    Every process calls the manager; Orbax decides who writes what. Each
    checkpoint is named by the global step and carries `{"epoch", "logs"}`
    as metadata. Restore one with `spmd.CheckpointManager(directory).restore(
    target=trainer.state)` or `trainer.load_state(...)`. When fit ends (not
    when it stops on an error), the latest checkpoint is marked as the run's
    final step (`CheckpointManager.mark_final`), where a `spmd.SidecarEvaluator`
    reading the directory stops.

    Args:
      filepath: the directory the checkpoints go in (shared by every process),
        one subdirectory per step (Keras' name; not a file name pattern).
      monitor: the log key `save_best_only` compares.
      save_best_only: save an epoch only if `monitor` improved.
      mode: "min", "max" or "auto" (max for accuracy-like keys).
      save_freq: "epoch", or a number of batches.
      max_to_keep: how many checkpoints to keep.
      async_save: write in background threads.
      verbose: accepted for Keras compatibility.

    Raises:
      ConfigurationError: a Keras file name (`"ckpt.weights.h5"`, `"{epoch:02d}"`).
      ArgumentTypeError: a Keras argument spmd does not take (`save_weights_only`).
    """

    def __init__(
        self,
        filepath: str | os.PathLike,
        monitor: str = "val_loss",
        save_best_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        max_to_keep: int | None = 3,
        async_save: bool = True,
        *,
        verbose: int = 0,
        **keras: Any,
    ) -> None:
        check_keras_arguments("ModelCheckpoint", keras, _takes(ModelCheckpoint))
        check_freq(save_freq, "ModelCheckpoint")
        _check_filepath(filepath)
        self.filepath = self.directory = filepath
        self.monitor, self.save_best_only = monitor, save_best_only
        self.mode = ("max" if "acc" in monitor else "min") if mode == "auto" else mode
        self.save_freq, self.max_to_keep, self.async_save = save_freq, max_to_keep, async_save
        self.manager = None
        self.best = -math.inf if self.mode == "max" else math.inf

    def on_train_begin(self, logs: dict | None = None) -> None:

        self._saves = self.trainer.iterations // self.save_freq if self.save_freq != "epoch" else 0
        self._first_save = True
        self.manager = self._open()

    def _open(self) -> CheckpointManager:
        return CheckpointManager(
            self.directory,
            max_to_keep=self.max_to_keep,
            async_save=self.async_save,
            preemption="off",
        )

    def _set_aside_newer(self, step: int) -> None:
        """Sets aside (as STEP.superseded) the steps after `step` that the stopped attempt of
        a fit BackupAndRestore resumed saved: the resumed fit saves those steps anew.

        A fit resumed from an older backup (BackupAndRestore each epoch, this callback
        each batch) would otherwise find them newer than its first save (a
        CheckpointError on every relaunch). Only where a BackupAndRestore of this fit
        restored a backup: any other run's steps stay an error."""
        resumed = [
            c.restored_step
            for c in getattr(self.trainer, "_fit_callbacks", ())
            if isinstance(c, BackupAndRestore) and c.restored_step is not None
        ]
        if not resumed:
            return
        newer = sorted(
            s for s in {*self.manager.all_steps(), *self.manager.damaged_steps()} if s > step
        )
        if not newer:
            return
        _log.warning(
            "ModelCheckpoint: fit resumed from the backup of step %d, and %s holds steps %s "
            "that the stopped attempt saved after it; they are set aside as STEP.superseded "
            "and saved anew as the resumed fit reaches them.",
            resumed[0],
            self.directory,
            newer,
        )
        self.manager.close()
        _on_process_zero(self.directory, lambda: _supersede(self.directory, newer))
        self.manager = self._open()

    def _save(self, logs: dict | None) -> None:
        if self._first_save:
            self._first_save = False
            self._set_aside_newer(self.trainer.iterations)
        meta = {"epoch": self.trainer.epoch, "logs": {k: float(v) for k, v in (logs or {}).items()}}
        self.manager.save(self.trainer.iterations, self.trainer.state, metadata=meta, force=True)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # A hook may come once per steps_per_execution batches: save when the count
        # crossed a multiple of save_freq, not only when it lands on one.
        if not isinstance(self.save_freq, int):
            return
        done = self.trainer.iterations // self.save_freq
        if done > self._saves:
            self._saves = done
            self._save(None)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.save_freq != "epoch":
            return
        if self.save_best_only:
            if self.monitor not in (logs or {}):
                raise ConfigurationError(
                    message(
                        f"ModelCheckpoint(save_best_only=True) watches '{self.monitor}', which the logs do not have.",
                        received(monitor=self.monitor, logs=sorted(logs or {})),
                        "watch one of the log keys (pass validation_data for val_* keys).",
                    )
                )
            if not _better(self.mode, float(logs[self.monitor]), self.best):
                return
            self.best = float(logs[self.monitor])
        self._save(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.manager is not None:
            self.manager.wait()  # the saves in flight commit before the latest is looked up
            if self.manager.latest_step() is not None:
                self.manager.mark_final()  # a SidecarEvaluator stops after this step
            self.on_train_abort()

    def on_train_abort(self) -> None:
        if self.manager is not None:  # fit stopped on an exception: wait for saves, release
            self.manager.close()
            self.manager = None


def _takes(callback: type) -> tuple[str, ...]:
    """The arguments a callback's constructor takes (for an error naming them)."""
    names = inspect.signature(callback.__init__).parameters
    return tuple(n for n in names if n not in ("self", "keras"))


def _check_filepath(filepath: Any) -> None:
    """Raises for a Keras checkpoint file name: spmd's checkpoints are directories.

    Raises:
      ConfigurationError: a name with a format field or a Keras file suffix.
    """
    name = os.fspath(filepath) if isinstance(filepath, str | os.PathLike) else None
    if name is not None and "{" not in name and not name.endswith(_KERAS_SUFFIXES):
        return
    raise ConfigurationError(
        message(
            "ModelCheckpoint's filepath is a directory: Orbax writes each checkpoint in a "
            "subdirectory named by its global step (no Keras file name or {epoch} pattern; "
            "the epoch and logs are each checkpoint's metadata).",
            received(filepath=filepath),
            'pass a directory, e.g. ModelCheckpoint(filepath="ckpt/"); restore with '
            "spmd.CheckpointManager(filepath).restore(target=trainer.state).",
        )
    )


_KERAS_SUFFIXES = (".h5", ".keras", ".weights.h5", ".hdf5", ".ckpt")


class BackupAndRestore(Callback):
    """Resumes an interrupted fit where it stopped: same epoch, same batch, same weights.

    At the start of fit it restores the latest backup (state, optimizer, RNGs,
    running metrics and the data position); it backs up at every epoch end (or
    every `save_freq` batches); a preemption notice (SIGTERM) makes every
    process back up at the same step and exit with code 42, which
    `spmd launch --max-restarts` relaunches. A fit that completes deletes the
    backup, as Keras does. The last two backups are kept: a damaged newest one
    (unreadable, or failing its checksums) is skipped with a warning and fit
    resumes from the one before.

    Args:
      backup_dir: where the backup lives (shared by every process).
      save_freq: "epoch", or a number of batches.
      delete_checkpoint: delete the backup when fit completes.
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        **keras: Any,
    ) -> None:
        check_keras_arguments("BackupAndRestore", keras, _takes(BackupAndRestore))
        check_freq(save_freq, "BackupAndRestore")
        self.backup_dir, self.save_freq, self.delete_checkpoint = (
            backup_dir,
            save_freq,
            delete_checkpoint,
        )
        self.manager = None
        self.restored_step: int | None = None
        self._saves = 0  # multiples of save_freq crossed so far
        self._resumed: dict | None = None  # the other callbacks' saved state, until applied

    def on_train_begin(self, logs: dict | None = None) -> None:

        interval = (
            self.save_freq if isinstance(self.save_freq, int) else 2**62
        )  # epochs force their saves
        # Two backups: if the newest is damaged, fit resumes from the one before (logged).
        self.manager = CheckpointManager(
            self.backup_dir, max_to_keep=2, save_interval_steps=interval
        )
        trainer = self.trainer
        state, step = self.manager.restore_newest(trainer.state, data=trainer.dataset)
        self.restored_step = step
        if step is not None:
            meta = self.manager.metadata(step)
            trainer.state = state
            trainer.epoch = int(meta["epoch"])
            trainer.iterations = step
            trainer._pass_ended = bool(meta.get("pass_ended", False))
            self._resumed = meta.get("callbacks")
        self._saves = trainer.iterations // interval

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        # After every callback's on_train_begin (which resets its own state), whatever
        # the callbacks' order: the resumed fit's callbacks go on as the stopped fit's.
        saved, self._resumed = self._resumed or {}, None
        for key, callback in _resumable(self.trainer).items():
            if key in saved:
                callback._resume(saved[key])

    def _save(
        self,
        epoch: int,
        force: bool,
        pass_ended: bool = False,
        ended: tuple[int, dict] | None = None,
    ) -> None:
        """Backs up at `epoch`; `pass_ended`: the epoch's data is read to its end, so the
        saved position is the next pass's start and the resumed epoch reads no batch;
        `ended`: the epoch that just ended and its logs, which the callbacks' saved state
        (EarlyStopping's best and wait) takes in."""
        trainer = self.trainer
        self.manager.save(
            trainer.iterations,
            trainer.state,
            data=trainer.dataset,
            metadata={
                "epoch": epoch,
                "pass_ended": pass_ended,
                "callbacks": {k: c._backup_state(ended) for k, c in _resumable(trainer).items()},
            },
            force=force,
        )

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # A hook may come once per steps_per_execution batches: save when the count
        # crossed a multiple of save_freq, not only when it lands on one.
        crossed = False
        if isinstance(self.save_freq, int):
            done = self.trainer.iterations // self.save_freq
            crossed, self._saves = done > self._saves, max(done, self._saves)
        trainer = self.trainer
        self._save(trainer.epoch, force=crossed, pass_ended=trainer._pass_ended)  # or preempted

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch + 1, force=True, ended=(epoch, dict(logs or {})))

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.manager is None:
            return
        self.manager.wait()
        if not self.delete_checkpoint and self.manager.latest_step() is not None:
            self.manager.mark_final()  # the backups stay: a SidecarEvaluator stops here
        self.manager.close()
        self.manager = None
        if self.delete_checkpoint:
            _remove_everywhere(self.backup_dir)

    def on_train_abort(self) -> None:
        if self.manager is not None:  # the backups stay: the retry resumes from them
            self.manager.close()
            self.manager = None


def _resumable(trainer: Any) -> dict[str, Callback]:
    """Fit's callbacks whose state a backup carries (EarlyStopping's wait and best), by
    class name and rank among them: "EarlyStopping:0", ..."""
    found: dict[str, Callback] = {}
    for callback in getattr(trainer, "_fit_callbacks", ()):
        if hasattr(callback, "_backup_state"):
            name = type(callback).__name__
            rank = sum(key.startswith(name + ":") for key in found)
            found[f"{name}:{rank}"] = callback
    return found


def _remove_everywhere(directory: str) -> None:
    """The chief deletes a shared folder once every process is done with it."""
    import shutil

    _on_process_zero(directory, lambda: shutil.rmtree(directory, ignore_errors=True))


def _on_process_zero(directory: str | os.PathLike, change: Callable[[], None]) -> None:
    """Process 0 changes a shared folder while every process waits, before and after."""
    from jax.experimental import multihost_utils

    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"spmd-remove:{directory}")
    if jax.process_index() == 0:
        change()
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"spmd-removed:{directory}")


def _supersede(directory: str | os.PathLike, steps: list[int]) -> None:
    """Renames each step folder to STEP.superseded (STEP.superseded.N if that is taken)."""
    from etils import epath

    root = epath.Path(directory)
    for step in steps:
        aside, n = root / f"{step}.superseded", 1
        while aside.exists():
            aside, n = root / f"{step}.superseded.{n}", n + 1
        if (root / str(step)).exists():
            (root / str(step)).rename(aside)


def check_freq(save_freq: Any, owner: str) -> None:
    if isinstance(save_freq, str) and save_freq == "epoch":
        return
    fix = 'pass save_freq="epoch", or a number of batches, e.g. save_freq=100.'
    positive_int(save_freq, f"{owner}.save_freq", fix=fix)
