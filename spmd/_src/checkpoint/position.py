"""The data position a checkpoint holds: what `save` takes, what `restore` fills."""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping
from typing import Any

from spmd._src.errors import CheckpointError, message, received

__all__ = ["as_json", "position_of", "restore_position"]


def as_json(value: Any, name: str) -> Any:
    """`value` if it serializes as JSON, else a CheckpointError naming the argument."""
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            message(
                f"{name} is saved as JSON: dicts, lists, strings, numbers, booleans, None.",
                received(**{name: value}, error=str(e)),
                "convert numpy or jax values with int()/float()/.tolist() first.",
            )
        ) from e
    return value


def position_of(data: Any) -> dict | None:
    """The data position to save: `data.get_state()`, a dict, or None."""
    if data is None:
        return None
    if hasattr(data, "get_state"):
        return as_json(data.get_state(), "data.get_state()")
    if isinstance(data, Mapping):
        return as_json(dict(data), "data")
    raise CheckpointError(
        message(
            "data is the input position: an iterator with get_state() -> dict, or a dict.",
            received(data_type=type(data).__name__),
            "pass the iterator itself (e.g. the one from spmd._src.data), or {'position': n}.",
        )
    )


def restore_position(data: Any, position: dict | None, step: int) -> None:
    """Restores `position` into an iterator (`set_state`) or a dict (in place)."""
    if position is None:
        raise CheckpointError(
            message(
                "restore(data=...) needs a checkpoint saved with a data position.",
                received(step=step, saved_position=None),
                "pass data=... to save(), or leave data out of restore().",
            )
        )
    if hasattr(data, "set_state"):
        data.set_state(position)
    elif isinstance(data, MutableMapping):
        data.clear()
        data.update(position)
    else:
        raise CheckpointError(
            message(
                "data is restored into an iterator with set_state(dict), or a dict.",
                received(data_type=type(data).__name__),
                "pass the iterator you saved with, or a dict to fill.",
            )
        )
