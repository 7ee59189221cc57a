"""Checks of the numbers spmd takes as arguments: counts, indices, seconds.

Every "a positive integer" of the package is checked here, so each is checked the
same way and each error says the same three things (`spmd._src.errors.message`): what
was expected, what was received, and how to fix it. A bool is never taken for a
count (`True` is an `int` to Python, but `steps=True` is a mistake), a float is
never taken for an integer, and NaN is never a number of seconds. Python and
numpy integers are both accepted and returned as a Python `int`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from spmd._src.errors import ConfigurationError, SpmdError, message, received

__all__ = [
    "boolean",
    "integer",
    "is_integer",
    "non_negative_int",
    "non_negative_number",
    "positive_int",
    "positive_number",
]


def is_integer(value: Any) -> bool:
    """Whether `value` is an integer (Python or numpy) and not a bool."""
    return (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and (type(value).__name__ != "bool_")
    )


def _what(value: Any) -> str:
    """Why a value is not an integer, when its repr alone would not say."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return " (a bool is not a number here)"
    if isinstance(value, float) and value.is_integer():
        return " (a float; pass the int)"
    return ""


def integer(
    value: Any,
    name: str,
    *,
    low: int,
    high: int | None = None,
    fix: str | None = None,
    error: type[SpmdError] = ConfigurationError,
) -> int:
    """`value` as an `int` in `low .. high - 1` (`high` None: no upper bound).

    Args:
      value: what the user passed.
      name: the argument's name as the user wrote it (`steps_per_execution`,
        `TF_CONFIG['task']['index']`).
      low: the smallest value allowed.
      high: one past the largest value allowed, or None.
      fix: how to fix it, as a sentence; by default "pass e.g. {name}={low}.".
      error: the exception class to raise (a ClusterError for cluster settings).

    Raises:
      `error`: `value` is not an integer, is a bool, or is out of bounds.
    """
    if is_integer(value) and value >= low and (high is None or value < high):
        return int(value)
    if high is None:
        bounds = {1: "a positive integer (>= 1)", 0: "a non-negative integer (>= 0)"}.get(
            low, f"an integer >= {low}"
        )
    else:
        bounds = f"an integer in {low} .. {high - 1}"
    raise error(
        message(
            f"{name} must be {bounds}.",
            received(**{name: value}) + _what(value),
            fix or f"pass e.g. {name}={low}.",
        )
    )


def positive_int(
    value: Any, name: str, *, fix: str | None = None, error: type[SpmdError] = ConfigurationError
) -> int:
    """`value` as an `int` >= 1 (a count: steps, shards, processes, devices).

    Raises:
      `error`: `value` is not an integer >= 1 (a bool is not one).
    """
    return integer(value, name, low=1, fix=fix, error=error)


def non_negative_int(
    value: Any, name: str, *, fix: str | None = None, error: type[SpmdError] = ConfigurationError
) -> int:
    """`value` as an `int` >= 0 (an index, a number of retries).

    Raises:
      `error`: `value` is not an integer >= 0 (a bool is not one).
    """
    return integer(value, name, low=0, fix=fix, error=error)


def positive_number(
    value: Any,
    name: str,
    *,
    unit: str = "seconds",
    fix: str | None = None,
    error: type[SpmdError] = ConfigurationError,
) -> float:
    """`value` as a finite `float` > 0 (a timeout, an interval).

    Raises:
      `error`: `value` is not a real number, is a bool, NaN, infinite, or <= 0.
    """
    return _number(value, name, unit, fix, error, zero=False)


def non_negative_number(
    value: Any,
    name: str,
    *,
    unit: str = "seconds",
    fix: str | None = None,
    error: type[SpmdError] = ConfigurationError,
) -> float:
    """`value` as a finite `float` >= 0 (a grace period that may be none).

    Raises:
      `error`: `value` is not a real number, is a bool, NaN, infinite, or < 0.
    """
    return _number(value, name, unit, fix, error, zero=True)


def _number(
    value: Any, name: str, unit: str, fix: str | None, error: type[SpmdError], zero: bool
) -> float:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if real and math.isfinite(value) and (value > 0 or (zero and value == 0)):
        return float(value)
    raise error(
        message(
            f"{name} must be a number of {unit} {'>=' if zero else '>'} 0 (finite).",
            received(**{name: value}) + _what(value),
            fix or f"pass e.g. {name}=30.",
        )
    )


def boolean(
    value: Any, name: str, *, fix: str, error: type[SpmdError] = ConfigurationError
) -> bool:
    """`value` if it is True or False (numpy's too); 1, "yes" or None are errors.

    Raises:
      `error`: `value` is not a bool.
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise error(message(f"{name} is True or False.", received(**{name: value}), fix))
