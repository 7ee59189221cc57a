"""The checks of SidecarEvaluator's arguments: each a clear error at construction."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import optax
from etils import epath
from flax import nnx

from spmd.errors import ConfigurationError, message, received
from spmd.strategy.base import Strategy
from spmd.trainer.trainer import Trainer
from spmd.validate import non_negative_number, positive_int, positive_number

__all__ = [
    "as_trainer",
    "check_data",
    "check_directory",
    "check_ends",
    "check_grace",
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
