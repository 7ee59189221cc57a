"""Checks of the Trainer's strategy, optimizer and `verbose`: Keras' spellings named in spmd's."""

from __future__ import annotations

from typing import Any

import optax

from spmd._src.errors import ConfigurationError, message, received
from spmd._src.strategy import strategies
from spmd._src.strategy.base import Strategy
from spmd._src.strategy.diloco import DiLoCo

__all__ = ["check_optimizer", "check_strategy", "check_verbose"]

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
