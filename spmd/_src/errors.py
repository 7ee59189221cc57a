"""The exception classes of spmd and the long messages they carry."""

from __future__ import annotations

import os
import sys
import warnings
from enum import Enum
from typing import Any, TypeVar

E = TypeVar("E", bound=Enum)

# Frames a warning skips to reach the user's line: spmd's own, and the libraries a
# call of spmd's passes through (jax's tracing, flax's modules, optax's transforms).
_SPMD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THROUGH = ("jax", "jaxlib", "flax", "optax", "orbax")


class SpmdError(Exception):
    """Base class of every error spmd raises on purpose."""


class ConfigurationError(SpmdError, ValueError):
    """A strategy, mesh or rule was given arguments that cannot work."""


class ArgumentTypeError(ConfigurationError, TypeError):
    """An argument of the wrong type where tf.distribute raises a TypeError.

    Both a `ConfigurationError` (spmd's contract) and a `TypeError` (TensorFlow's),
    so code written against either catches it.
    """


class ClusterError(ConfigurationError):
    """The cluster description (arguments, TF_CONFIG, environment) is malformed."""


class BatchError(SpmdError, ValueError):
    """A batch does not fit the strategy: wrong shape, not divisible, ragged."""


class ScopeError(ConfigurationError, RuntimeError):
    """Another strategy's scope is open; a RuntimeError, as tf.distribute raises."""


class ContextError(ConfigurationError, RuntimeError):
    """A call made in the wrong context: `run` inside `run`, a step inside `run`, ...

    A RuntimeError, as tf.distribute raises for a call outside its required
    (replica or cross-replica) context.
    """


class InitializationError(SpmdError, RuntimeError):
    """`spmd.initialize()` was called too late or could not reach the cluster."""


class LaunchError(SpmdError, RuntimeError):
    """A process started by `spmd launch` failed."""


class CheckpointError(SpmdError, RuntimeError):
    """A checkpoint could not be saved or restored as asked."""


class OutOfRangeError(SpmdError, StopIteration):
    """An iterator a scheduled function read is exhausted (`ClusterCoordinator`).

    tf.distribute's coordinator raises `tf.errors.OutOfRangeError` there; a ported
    loop catches this one in its place. A `StopIteration` too, so a loop that
    caught the iterator's own `StopIteration` still does.
    """


def shown_as_public(error: type[BaseException]) -> None:
    """Names an exception class by its public path (`spmd.BatchError`) in tracebacks.

    A traceback prints `type.__module__`; the class is defined here, but a user
    catches it as `spmd.<name>`, which also pickles it (the name resolves there).
    """
    error.__module__ = "spmd"


for _error in (
    SpmdError,
    ConfigurationError,
    ArgumentTypeError,
    ClusterError,
    BatchError,
    ScopeError,
    ContextError,
    InitializationError,
    LaunchError,
    CheckpointError,
    OutOfRangeError,
):
    shown_as_public(_error)


def warn(text: str, category: type[Warning] = UserWarning) -> None:
    """Warns at the user's line that led here, however deep spmd's own calls go.

    The warning's place is the first frame outside spmd and the libraries its
    calls pass through (jax tracing a step, flax, optax): the line a user wrote.
    """
    skip = [_SPMD_DIR + os.sep]
    for name in _THROUGH:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            skip.append(os.path.dirname(module.__file__) + os.sep)
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(tuple(skip))
        or frame.f_code.co_filename.startswith("<frozen ")
    ):
        frame, level = frame.f_back, level + 1
    warnings.warn(text, category, stacklevel=level)


def received(**values: Any) -> str:
    """Formats the `Received: name=value` part of a message."""
    return "Received: " + ", ".join(_value(name, value) for name, value in values.items())


def _value(name: str, value: Any) -> str:
    """`name=value`; a text of several lines (a nested error's message) as an indented
    block with real newlines, not a repr full of `\\n`."""
    if isinstance(value, str) and "\n" in value.strip():
        return f"{name}=\n    " + value.strip().replace("\n", "\n    ")
    return f"{name}={value!r}"


def message(expected: str, got: str, fix: str) -> str:
    """Joins the three parts every spmd error message has.

    Args:
      expected: what spmd needed, as a sentence.
      got: what it was given, usually from `received(...)`.
      fix: how to fix it, as a sentence.

    Returns:
      The message, one part a line.
    """
    return f"{expected}\n{got}\nTo fix: {fix}"


def enum_member(cls: type[E], value: E | str, *, field: str, fix: str) -> E:
    """`value` as a member of the enum `cls`: a member, or its name in any case.

    Raises:
      ConfigurationError: `value` names no member (the message lists them).
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value.upper() in cls.__members__:
        return cls[value.upper()]
    raise ConfigurationError(
        message(
            f"{field} is one of {[m.name for m in cls]}.",
            received(**{field.replace(" ", "_").replace("-", "_"): value}),
            fix,
        )
    )
