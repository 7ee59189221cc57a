"""Named scopes that mark spmd's calls in a traced program, and finding them again.

`spmd.pipeline` and `spmd.attention` run under a `jax.named_scope` whose name
holds what the call was given (its layers, its sequence length, its mesh axis).
Every equation traced inside keeps that name in its name stack, so a traced
step tells which of these calls it makes: `strategy.explain` reports the
pipeline schedules, `auto_strategy` offers the `stage` and `context` axes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

__all__ = ["marked"]


def marked(jaxpr: Any, pattern: re.Pattern[str]) -> tuple[tuple[str, ...], ...]:
    """The distinct matches of `pattern` in the name stacks of a traced program's
    equations (its sub-programs' too), as their groups, in the order first met."""
    found: dict[tuple[str, ...], None] = {}
    for eqn in _eqns(getattr(jaxpr, "jaxpr", jaxpr)):
        for match in pattern.finditer(str(eqn.source_info.name_stack)):
            found[match.groups()] = None
    return tuple(found)


def _eqns(jaxpr: Any) -> Iterator[Any]:
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(item, "jaxpr", item)
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)
