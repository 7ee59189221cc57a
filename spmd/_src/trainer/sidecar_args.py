"""The checks of SidecarEvaluator's arguments: each a clear error at construction."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import optax
from etils import epath
from flax import nnx

from spmd._src.errors import ConfigurationError, message, received
from spmd._src.strategy.base import Strategy
from spmd._src.trainer.callbacks import Callback
from spmd._src.trainer.sidecar_watch import agreed, file_on, under_a_file
from spmd._src.trainer.trainer import Trainer
from spmd._src.validate import non_negative_number, positive_int, positive_number

__all__ = [
    "as_trainer",
    "check_callbacks",
    "check_data",
    "check_directory",
    "check_ends",
    "check_grace",
    "check_log_dir",
    "check_poll",
    "optional_count",
]

_MAX_POLL_S = 600.0  # the longest pause between two looks at the directory
_STEP_FILES = ("_CHECKPOINT_METADATA", "state/_METADATA")  # what only a step's folder holds


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
