"""argparse types of the `spmd` command's options: numbers with a lower bound."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["non_negative_int", "positive_float", "positive_int"]


def _number(text: str, kind: type, low: float, what: str) -> Any:
    """Parses `text` as `kind` >= `low`, or raises the usage error argparse shows."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or value < low or value != value:  # value != value: NaN
        raise argparse.ArgumentTypeError(f"must be {what}; received {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _number(text, int, 1, "an integer >= 1")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _number(text, int, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    return _number(text, float, 1e-9, "a number of seconds > 0")
