"""Checks of the Trainer's strategy, optimizer, `verbose` and keyword arguments: Keras'
spellings named in spmd's."""

from __future__ import annotations

from typing import Any

import optax

from spmd._src.errors import ArgumentTypeError, ConfigurationError, message, received
from spmd._src.strategy import strategies
from spmd._src.strategy.base import Strategy
from spmd._src.strategy.diloco import DiLoCo

__all__ = ["check_keras_arguments", "check_optimizer", "check_strategy", "check_verbose"]

# Keras' optimizer names with optax's equivalent at Keras' default learning rate.
_KERAS_OPTIMIZERS = {
    name: f"optax.{name}({0.01 if name == 'sgd' else 1e-3})"
    for name in (
        "adadelta",
        "adafactor",
        "adagrad",
        "adam",
        "adamax",
        "adamw",
        "lamb",
        "lion",
        "nadam",
        "rmsprop",
        "sgd",
    )
}


def check_strategy(strategy: Any) -> Strategy | DiLoCo:
    """`strategy` if it is a `Strategy` (what any named strategy returns) or a `DiLoCo`.

    Raises:
      ConfigurationError: anything else; a name ("mirrored") or a constructor
        (`spmd.MirroredStrategy`) is told the call to pass.
    """
    if isinstance(strategy, Strategy | DiLoCo):
        return strategy
    fix = f"pass a strategy, e.g. strategy={_strategy_call(strategy)}, or leave it None "
    fix += "for the current one (spmd.get_strategy())."
    raise ConfigurationError(
        message(
            "A Trainer runs on a spmd.Strategy (what a named strategy, spmd.MirroredStrategy(), "
            "spmd.TPUStrategy(), ..., returns) or a spmd.DiLoCo.",
            received(strategy=strategy),
            fix,
        )
    )


def _strategy_call(strategy: Any) -> str:
    """The call that builds the strategy `strategy` names ("mirrored", spmd.MirroredStrategy)."""
    if callable(strategy) and getattr(strategy, "__module__", "").startswith("spmd."):
        return f"spmd.{strategy.__name__}()"
    named = strategies.constructor_name(strategy) if isinstance(strategy, str) else None
    return f"spmd.{named or 'MirroredStrategy'}()"


def check_optimizer(optimizer: Any) -> optax.GradientTransformation:
    """`optimizer` if it is an optax GradientTransformation (or has its init and update).

    Raises:
      ConfigurationError: anything else, e.g. Keras' "adam" (the message names optax's
        equivalent).
    """
    if all(callable(getattr(optimizer, f, None)) for f in ("init", "update")):
        return optimizer
    name = optimizer.lower() if isinstance(optimizer, str) else None
    keras = _KERAS_OPTIMIZERS.get(name) if name else None
    raise ConfigurationError(
        message(
            "A Trainer's optimizer is an optax GradientTransformation (init and update).",
            received(optimizer=optimizer),
            f"pass {keras}, optax's {name!r} at Keras' default learning rate."
            if keras
            else "pass one, e.g. optax.adam(1e-3) or optax.sgd(0.01).",
        )
    )


def check_verbose(verbose: Any) -> None:
    """Raises unless `verbose` is one Keras reads: 0, 1, 2 or "auto".

    Raises:
      ConfigurationError: any other value.
    """
    if (
        verbose == "auto"
        if isinstance(verbose, str)
        else isinstance(verbose, int) and 0 <= verbose <= 2
    ):
        return
    raise ConfigurationError(
        message(
            'verbose is 0 (silent), 1 (a progress bar), 2 (a line per epoch) or "auto" '
            "(1 on a terminal, else 2).",
            received(verbose=verbose),
            'pass one of 0, 1, 2 or "auto".',
        )
    )


_PREFETCH = (
    "drop it: spmd reads the data in a background thread of its own, placing "
    "InputOptions(prefetch=2) batches ahead (strategy.distribute_dataset(ds, options))."
)
# Keras' arguments of fit / evaluate / predict / the callbacks that spmd spells otherwise
# or does not take, with what to do instead.
_KERAS_ARGUMENTS = {
    "x": "pass the data as the first argument: trainer.{what}((x, y), batch_size=64).",
    "y": "pass (x, y) as one tuple, the first argument: trainer.{what}((x, y), batch_size=64).",
    "sample_weight": "put the weights in the data: fit((x, y, sample_weight), "
    "batch_size=64), or batches of (x, y, sample_weight).",
    "validation_split": "split the arrays yourself, as Keras does (the last fraction, "
    "before shuffling): n = int(len(x) * (1 - split)); fit((x[:n], y[:n]), "
    "validation_data=(x[n:], y[n:])).",
    "validation_steps": "give validation_data the batches to evaluate (e.g. ds.take(n) for "
    "a tf.data dataset): it is read to its end.",
    "validation_freq": "evaluate every epoch (validation_data=), or call trainer.evaluate "
    "from a callback's on_epoch_end on the epochs you want.",
    "steps": "give the data the batches to read (e.g. ds.take(n) for a tf.data dataset): "
    "it is read to its end.",
    "max_queue_size": _PREFETCH,
    "workers": _PREFETCH,
    "use_multiprocessing": _PREFETCH,
    "save_weights_only": "drop it: a checkpoint holds the whole train state (parameters, "
    "optimizer state, step), restored with trainer.load_state.",
    "initial_value_threshold": "drop it, or stop on a threshold with EarlyStopping(baseline=...).",
    "options": "drop it: checkpoints are Orbax's, with CheckpointManager's options.",
    "double_checkpoint": "drop it: BackupAndRestore always keeps the last two backups and "
    "resumes from the older where the newer is damaged.",
    **{
        name: "drop it: spmd's TensorBoard writes the logs' scalars only (for a profile, "
        "jax.profiler.trace(log_dir) around the fit)."
        for name in (
            "histogram_freq",
            "write_graph",
            "write_images",
            "write_steps_per_second",
            "profile_batch",
            "embeddings_freq",
            "embeddings_metadata",
        )
    },
}


def check_keras_arguments(what: str, extra: dict[str, Any], takes: tuple[str, ...]) -> None:
    """Raises for keyword arguments `what` does not take: a Keras one named as such, with
    what spmd does instead; any other with the arguments it does take.

    Raises:
      ArgumentTypeError: (a ConfigurationError and a TypeError) any argument in `extra`.
    """
    if not extra:
        return
    name = next(iter(extra))
    if name in _KERAS_ARGUMENTS:
        expected = f"{what} takes Keras' arguments but {name!r}, which spmd does not take."
        fix = _KERAS_ARGUMENTS[name].replace("{what}", what)
    else:
        expected = f"{what} takes the arguments {', '.join(takes)}."
        fix = f"drop {name}= or spell it as one of those."
    value = extra[name]
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        value = f"an array of shape {tuple(value.shape)}"
    raise ArgumentTypeError(message(expected, received(**{name: value}), fix))
