"""Optimizer-state offload: which state leaves live in host memory, and a step that streams them.

With `placement="offload_optimizer"` the optimizer's leaves live in
`pinned_host` between steps and the rest of the state on the devices. Inside
the step each offloaded leaf is moved to the device where the step first needs
it and back to the host as soon as its new value exists, one dataflow group at
a time (`streamed`), so that the device never holds the whole optimizer state
at once and the compiler can overlap one group's transfers with another's
update.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from spmd._src.errors import ConfigurationError, message, received
from spmd._src.rules import is_key, matches, path_str

__all__ = ["OPTIMIZER_PATH", "check_offload", "offloaded", "streamed"]

# The default rule: a leaf under an `opt_state` entry (spmd.Trainer's state, flax's
# TrainState, nnx.Optimizer) or inside an optax state (any pytree holding `tx.init(...)`).
OPTIMIZER_PATH = r"(.*/)?opt_state(/.*)?"
_OPTIMIZER = re.compile(OPTIMIZER_PATH)


def check_offload(offload: Any, placement: str) -> tuple[str, ...]:
    """`offload` as a tuple of regexes, each compiled once to check it.

    Raises:
      ConfigurationError: `offload` is not a string or a sequence of strings, is
        an empty sequence, a regex does not compile, or it is given with another
        placement.
    """
    if offload is None:
        return ()
    patterns = (offload,) if isinstance(offload, str) else offload
    fix = 'pass e.g. placement="offload_optimizer", offload=r"opt/.*" (or a list of regexes).'
    if not isinstance(patterns, Sequence) or not all(isinstance(p, str) for p in patterns):
        raise ConfigurationError(
            message(
                "offload is a regex, or a list of regexes, over '/'-joined state paths.",
                received(offload=offload),
                fix,
            )
        )
    if not patterns:
        raise ConfigurationError(
            message(
                "offload names at least one regex: a list of none would offload nothing, "
                "and None (the default) offloads the optimizer state.",
                received(offload=offload),
                "pass offload=None for the default (the optimizer state), or at least one "
                'regex, e.g. offload=r"opt/.*".',
            )
        )
    if placement != "offload_optimizer":
        raise ConfigurationError(
            message(
                "offload names the leaves placement='offload_optimizer' keeps in host memory; "
                "other placements keep the whole state in one memory.",
                received(offload=offload, placement=placement),
                fix,
            )
        )
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ConfigurationError(
                message(
                    "Each offload regex compiles (it is matched as a rule's regex is).",
                    received(offload=pattern, error=str(error)),
                    fix,
                )
            ) from None
    return tuple(patterns)


def offloaded(tree: Any, patterns: Sequence[str]) -> list[bool]:
    """Per flat leaf of `tree` (a pure state), whether it lives in host memory.

    A leaf whose '/'-joined path one of `patterns` matches (whole, or a
    '/'-suffix of it, as a rule's regex) is offloaded;
    with no patterns, a leaf under an `opt_state` entry or inside an optax
    state. Scalars (a step count) and PRNG keys stay in device memory: a
    scalar saves nothing in host memory and would tie every group of the
    update together, and jax keeps no key array in `pinned_host`.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    if patterns:
        compiled = [re.compile(p) for p in patterns]
        named = [any(matches(r, path_str(p)) for r in compiled) for p, _ in flat]
    else:
        inside = _inside_optax(tree)
        named = [
            inside[i] or bool(_OPTIMIZER.fullmatch(path_str(p))) for i, (p, _) in enumerate(flat)
        ]
    return [
        n and np.ndim(leaf) > 0 and not is_key(leaf)
        for n, (_, leaf) in zip(named, flat, strict=True)
    ]


def _is_optax_state(node: Any) -> bool:
    return isinstance(node, tuple) and type(node).__module__.split(".")[0] == "optax"


def _inside_optax(tree: Any) -> list[bool]:
    """Per flat leaf, whether it sits inside an optax state (its leaves are contiguous)."""
    flags: list[bool] = []
    for node in jax.tree.leaves(tree, is_leaf=_is_optax_state):
        inside = _is_optax_state(node)
        flags += [inside] * (len(jax.tree.leaves(node)) if inside else 1)
    return flags


def streamed(fn: Callable[..., Any], host: Sequence[bool]) -> Callable[..., Any]:
    """`fn(leaves, *rest)`, its offloaded leaves streamed through the device by dataflow group.

    `fn` takes the state's flat leaves (those flagged in `host` arrive in
    `pinned_host`), moves them to the device itself (one `jax.device_put` per
    leaf) and moves their new values back. Traced once, its equations are
    split: those that depend on no offloaded leaf run first (the forward and
    backward pass); those that do are grouped by the leaves they join (Adam's
    two moments of one parameter and that parameter's update make one group).
    Each group's transfers and update then wait, through an
    `optimization_barrier`, for the previous group's results, so the compiler
    cannot move every transfer to the start of the step: at most a group or
    two of optimizer state is in device memory at once.

    A step whose equations carry effects (callbacks, prints) runs as written.
    """

    def run(leaves: list, *rest: Any) -> Any:
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(leaves, *rest)
        args = jax.tree.leaves((leaves, rest))
        roots = {closed.jaxpr.invars[i] for i, h in enumerate(host) if h}
        if closed.jaxpr.effects or not roots:
            outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
        else:
            outs = _evaluate(closed, args, roots)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def _evaluate(closed: Any, args: list, roots: set) -> list:
    """Evaluates `closed`: first what no offloaded leaf feeds, then each group in turn."""
    jaxpr = closed.jaxpr
    env: dict = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    groups = _groups(jaxpr.eqns, roots)
    for eqn, group in zip(jaxpr.eqns, groups, strict=True):
        if group is None:
            _bind(eqn, env)
    outputs = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    previous: list = []
    for group in dict.fromkeys(g for g in groups if g is not None):
        eqns = [e for e, g in zip(jaxpr.eqns, groups, strict=True) if g == group]
        made = {v for e in eqns for v in e.outvars}
        needed = list(
            dict.fromkeys(
                v for e in eqns for v in e.invars if isinstance(v, jcore.Var) and v not in made
            )
        )
        values, _ = jax.lax.optimization_barrier(([env[v] for v in needed], previous))
        env.update(zip(needed, values, strict=True))
        for eqn in eqns:
            _bind(eqn, env)
        previous = [env[v] for e in eqns for v in e.outvars if v in outputs]
    return [v.val if isinstance(v, jcore.Literal) else env[v] for v in jaxpr.outvars]


def _groups(eqns: Sequence[Any], roots: set) -> list[Any]:
    """Per equation, its group (None for one no offloaded leaf feeds): union-find over
    the equations an offloaded leaf reaches, joined where two leaves meet."""
    parent: dict[int, int] = {}

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    of_var: dict[Any, int] = {}
    found: list[int | None] = []
    for k, eqn in enumerate(eqns):
        ids = {find(of_var[v]) for v in eqn.invars if isinstance(v, jcore.Var) and v in of_var}
        if any(isinstance(v, jcore.Var) and v in roots for v in eqn.invars):
            parent[k] = k
            ids.add(k)
        if not ids:
            found.append(None)
            continue
        first = min(ids)
        for other in ids:
            parent[other] = first
        for v in eqn.outvars:
            of_var[v] = first
        found.append(first)
    return [None if g is None else find(g) for g in found]


def _bind(eqn: Any, env: dict) -> None:
    """Binds one equation to the values in `env`, as `jax.core.eval_jaxpr` does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    values = [v.val if isinstance(v, jcore.Literal) else env[v] for v in eqn.invars]
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*values, **params)
    if eqn.primitive.multiple_results:
        env.update(zip(eqn.outvars, out, strict=True))
    else:
        env[eqn.outvars[0]] = out
