"""`spmd.auto_strategy`: compile candidate layouts for a target, drop what does not fit, rank the rest.

Every candidate is a `Strategy` over the target's devices (this process's, or
an `spmd.topology` compiled for without a TPU). Each is compiled for the step
and its abstract state (nothing is allocated), judged by the compiler's memory
analysis against the device's HBM, and ranked by the roofline's estimated step
time (`spmd._src.roofline`; on CPU and GPU devices with figures measured on this
machine, see `measured_chip`).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import jax

from spmd._src import attention as attention_calls
from spmd._src import pipeline as pipeline_calls
from spmd._src import plan_cache
from spmd._src.activations import constrains_activations
from spmd._src.calibration import calibration_note
from spmd._src.candidates import MIN_SHARDED_ELEMENTS, candidates, idle_axes, model_layout
from spmd._src.errors import (
    ArgumentTypeError,
    ConfigurationError,
    SpmdError,
    message,
    received,
)
from spmd._src.explain import (
    CompilerOutput,
    Explanation,
    _human,
    _per_device_bytes,
    explain_compiled,
    traced_program,
)
from spmd._src.logical import LogicalRules
from spmd._src.mesh import make_mesh
from spmd._src.plan_compile import compile_programs
from spmd._src.roofline import Roofline, estimate
from spmd._src.rules import Rule
from spmd._src.strategy.base import Step, Strategy, check_sizes
from spmd._src.topologies import Chip, Topology, chip_of, compiler_hbm, topology
from spmd._src.validate import positive_int

__all__ = ["Candidate", "Plan", "auto_strategy", "candidates", "measured_chip"]

_MEASURED: dict[str, Chip] = {}
_ONE_DEVICE_NOTE = (
    "spmd.auto_strategy: this was raised tracing {what} on one device of the target (every "
    "mesh axis of size 1), before any layout was tried: a bug in create_fn, the step or the "
    "batch, not a layout that does not fit."
)


@dataclass(frozen=True)
class Candidate:
    """One layout `auto_strategy` tried.

    Attributes:
      name: what it is ("data parallel", "FSDP over 8", "FSDP 16 x TP 4", ...).
      strategy: the `Strategy` (None where it could not be built).
      explanation: the compiled program's `Explanation` (None where it did
        not compile).
      roofline: the estimated step time and its terms (None where dropped).
      dropped: why it was dropped ("does not fit: ...", "does not compile:
        ..."), or None for a ranked candidate.
    """

    name: str
    strategy: Strategy | None
    explanation: Explanation | None = field(default=None, repr=False)
    roofline: Roofline | None = None
    dropped: str | None = None

    @property
    def step_seconds(self) -> float | None:
        """The estimated step time; None where dropped."""
        return None if self.roofline is None else self.roofline.step_s

    @property
    def memory_bytes(self) -> int | None:
        """Per-device bytes the program needs: what the compiler asked for where it refused
        the program, else peak + code (an upper bound: the compiler accepted it)."""
        e = self.explanation
        if e is None:
            return None
        if e.hbm_required is not None:
            return e.hbm_required
        return e.peak_and_code_bytes

    def to_dict(self) -> dict[str, Any]:
        """The candidate as JSON-ready data; a figure the compiler did not give is None."""
        e, r = self.explanation, self.roofline
        compiled = e is not None and e.hbm_required is None
        return {
            "name": self.name,
            "mesh": None if self.strategy is None else dict(self.strategy.mesh.shape),
            "dropped": self.dropped,
            "fits": None if e is None else e.fits,
            "memory_upper_bound_bytes": e.peak_and_code_bytes if compiled else None,
            "compiler_needs_bytes": None if e is None else e.hbm_required,
            "hbm_capacity_bytes": None if e is None else e.hbm_capacity,
            "headroom_at_least_bytes": e.hbm_headroom if compiled else None,
            "state_bytes": None if e is None else e.state_bytes,
            "state_host_bytes": None if e is None else e.state_host_bytes,
            "flops": e.flops if compiled else None,
            "step_seconds": None if r is None else r.step_s,
            "bound": None if r is None else r.bound,
        }


@dataclass(frozen=True)
class Plan:
    """Every candidate, the ranked ones first (fastest estimate first), then the dropped.

    `print()` it for a table; `plan.best` is the first ranked candidate.
    `notes` are what the table's reader should know of the model (a
    tensor-parallel candidate of a model that lays out none of its
    activations, say).
    """

    target: str
    candidates: tuple[Candidate, ...]
    notes: tuple[str, ...] = ()

    @property
    def ranked(self) -> tuple[Candidate, ...]:
        """The candidates that fit, fastest estimated step first."""
        return tuple(c for c in self.candidates if c.dropped is None)

    @property
    def dropped(self) -> tuple[Candidate, ...]:
        """The candidates that do not fit or did not compile."""
        return tuple(c for c in self.candidates if c.dropped is not None)

    @property
    def best(self) -> Candidate | None:
        """The fastest candidate that fits, or None."""
        return self.ranked[0] if self.ranked else None

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (`json.dumps(plan.to_dict())`): the target and every
        candidate (`Candidate.to_dict`), ranked first; unknown figures are None (null)."""
        return {"target": self.target, "candidates": [c.to_dict() for c in self.candidates]}

    def __str__(self) -> str:
        header = (
            "#",
            "layout",
            "mesh",
            "memory/device (upper bound)",
            "host/device",
            "headroom (at least)",
            "step (est.)",
            "bound",
        )
        rows = []
        for i, c in enumerate(self.ranked, 1):
            e, r = c.explanation, c.roofline
            rows.append(
                (
                    str(i),
                    c.name,
                    _mesh(c.strategy),
                    "-" if c.memory_bytes is None else _human(c.memory_bytes),
                    _human(e.state_host_bytes) if e.state_host_bytes else "-",
                    "-" if e.hbm_headroom is None else _human(e.hbm_headroom),
                    _seconds(r.step_s),
                    r.bound,
                )
            )
        widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=False)]
        lines = [f"auto_strategy for {self.target}: {len(self.ranked)} ranked, "]
        lines[0] += f"{len(self.dropped)} dropped"
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) for row in rows]
        if any(c.roofline.host_bytes and not c.roofline.host_known for c in self.ranked):
            lines.append(
                "host/device: state kept in host memory; no host link figure for this chip, so "
                "moving it each step is not in the estimate"
            )
        elif any(c.roofline.host_bytes for c in self.ranked):
            lines.append(
                "host/device: state kept in host memory, moved in and back out each step over "
                "the host link (in the estimate)"
            )
        if any(c.roofline.efficiency < 1 for c in self.ranked):
            lines.append(calibration_note())
        lines += [f"note: {note}" for note in self.notes]
        if self.dropped:
            lines.append("dropped:")
            lines += [f"  {c.name} ({_mesh(c.strategy)}): {c.dropped}" for c in self.dropped]
        return "\n".join(lines)


def _seconds(t: float) -> str:
    return f"{t * 1e3:,.3f} ms" if t >= 1e-3 else f"{t * 1e6:,.2f} µs"


def _mesh(strategy: Strategy | None) -> str:
    if strategy is None:
        return "-"
    return " x ".join(f"{k}={v}" for k, v in strategy.mesh.shape.items())


# ------------------------------------------------------------------ the figures of a CPU or GPU


def measured_chip(device: Any) -> Chip:
    """A roofline `Chip` for a CPU or GPU device, measured once on this machine.

    Peak FLOP/s from a float32 matrix product, HBM (memory) bandwidth from an
    array copy, both on `device`; the link between devices is taken to be the
    memory bandwidth (simulated CPU devices and one host's GPUs copy through
    memory or NVLink). Simulated CPU devices share the host's cores, which
    the roofline accounts for (`Roofline.devices_per_chip`). Where the device
    has `pinned_host` memory, the host link's bandwidth is measured too, from
    the same array moved there and back.
    """
    key = f"{device.platform}:{device.device_kind}"
    if key not in _MEASURED:
        import jax.numpy as jnp

        n = 1024
        a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
        matmul = jax.jit(lambda x: x @ x)
        matmul(a).block_until_ready()
        start, reps = time.perf_counter(), 5
        for _ in range(reps):
            matmul(a).block_until_ready()
        flops = 2 * n**3 * reps / (time.perf_counter() - start)
        big = jax.device_put(jnp.ones((1 << 24,), jnp.float32), device)
        copy = jax.jit(lambda x: x + 1)
        copy(big).block_until_ready()
        start = time.perf_counter()
        for _ in range(reps):
            copy(big).block_until_ready()
        bandwidth = 2 * big.nbytes * reps / (time.perf_counter() - start)
        host = _host_link(big, device, reps)
        _MEASURED[key] = Chip(
            name=device.platform,
            device_kind=str(device.device_kind),
            peak_flops=flops,
            hbm_bytes=0,
            hbm_bandwidth=bandwidth,
            ici_bandwidth=bandwidth,
            dcn_bandwidth=None,
            cores_per_chip=1,
            dims=1,
            source="measured on this machine (a 1024x1024 float32 product; a 64 MiB copy; "
            "the same moved to pinned_host and back)",
            host_bandwidth=host,
        )
    return _MEASURED[key]


def _host_link(array: jax.Array, device: Any, reps: int) -> float | None:
    """Bytes/s each way between `device` and its `pinned_host` memory; None without one."""
    if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
        return None
    there = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    back = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    jax.device_put(jax.device_put(array, there), back).block_until_ready()
    start = time.perf_counter()
    for _ in range(reps):
        jax.device_put(jax.device_put(array, there), back).block_until_ready()
    return 2 * array.nbytes * reps / (time.perf_counter() - start)


# ------------------------------------------------------------------ the target and the options


def _target(devices_or_topology: Any, slices: Any) -> tuple[list[Any], str, int]:
    """The target's devices, its name in the table, and its slice count."""
    positive_int(slices, "slices", fix="pass slices=2 with a topology name for two slices.")
    if isinstance(devices_or_topology, str):
        devices_or_topology = topology(devices_or_topology, slices=slices)
    elif slices != 1:
        raise ConfigurationError(
            message(
                "slices= goes with a topology name: an spmd.topology(...) or a device list "
                "already holds its slices.",
                received(target=devices_or_topology, slices=slices),
                'pass the name ("v5e-256", slices=2) or spmd.topology("v5e-256", slices=2) '
                "without slices=.",
            )
        )
    if devices_or_topology is None:
        devices = jax.devices()
        return devices, f"this process's {len(devices)} {devices[0].platform} devices", 1
    if isinstance(devices_or_topology, Topology):
        t = devices_or_topology
        name = t.name + (f" x {t.slices} slices" if t.slices > 1 else "")
        return list(t.devices), f"{name} ({t.chips} {t.chip.name} chips)", t.slices
    devices = list(devices_or_topology) if isinstance(devices_or_topology, Iterable) else []
    if not devices or not all(hasattr(d, "platform") and hasattr(d, "id") for d in devices):
        raise ConfigurationError(
            message(
                "auto_strategy's target is a topology name, an spmd.topology(...), a list of "
                "jax.Devices, or None for this process's devices.",
                received(target=devices_or_topology),
                'pass e.g. "v5p-256", spmd.topology("v5e:16x16", slices=2) or jax.devices().',
            )
        )
    n_slices = len({getattr(d, "slice_index", 0) for d in devices})
    return devices, f"{len(devices)} {devices[0].platform} devices", n_slices


def _args(args: Any) -> tuple:
    if args is None:
        return (jax.random.key(0),)
    if not isinstance(args, tuple | list):
        raise ConfigurationError(
            message(
                "args is the tuple of create_fn's arguments.",
                received(args=args, type=type(args).__name__),
                "pass args=(jax.random.key(0),), or args=() for a create_fn of no arguments.",
            )
        )
    return tuple(args)


def _callables(create_fn: Any, step: Any) -> None:
    """`create_fn` and the step are functions (a `Step` is one)."""
    for name, value, example in (
        ("create_fn", create_fn, "create_fn=create, where create(key) returns the train state"),
        ("step", step, "step=train_step, where train_step(state, *batch) -> (state, metrics)"),
    ):
        if not callable(value):
            raise ArgumentTypeError(
                message(
                    f"auto_strategy's {name} is a function.",
                    received(**{name: value}, type=type(value).__name__),
                    f"pass the function itself, e.g. {example}.",
                )
            )


def _batch(batch: Any) -> tuple:
    """The step's data arguments as a tuple, every leaf's shape of sizes >= 0 (before any
    candidate is built: one error, not every candidate dropped for it)."""
    batch = tuple(batch) if isinstance(batch, tuple | list) else (batch,)
    check_sizes(batch)
    return batch


def _only(only: Any) -> tuple[str, ...]:
    """`only` as names to look for: a string is one name; None, every candidate."""
    if only is None:
        return ()
    names = (only,) if isinstance(only, str) else only
    if not isinstance(names, Iterable) or not all(isinstance(o, str) for o in names):
        raise ConfigurationError(
            message(
                "only is a string, or a list of strings, each kept candidate's name contains "
                "one of.",
                received(only=only),
                'pass e.g. only=["FSDP"] or only="TP over 4".',
            )
        )
    names = tuple(names)
    if not names:
        raise ConfigurationError(
            message(
                "only keeps the candidates whose names contain one of its strings; an empty "
                "list keeps none.",
                received(only=only),
                'pass only=None for every candidate, or the names to keep, e.g. only=["FSDP"].',
            )
        )
    return names


def _extra(extra: Any, devices: Sequence[Any]) -> list[tuple[str, Strategy]]:
    """`extra`'s layouts, each checked to be on the target's devices."""
    if extra is None:
        return []
    fix = (
        'pass extra={"name": strategy}, each strategy built on the target\'s devices, e.g. '
        "spmd.Strategy(spmd.make_mesh({...}, devices=topo), ...) with topo = "
        "spmd.topology(...) as given to auto_strategy."
    )
    if not isinstance(extra, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Strategy) for k, v in extra.items()
    ):
        raise ConfigurationError(
            message("extra maps names to Strategy values.", received(extra=extra), fix)
        )
    target = set(devices)
    for name, strategy in extra.items():
        own = list(strategy.mesh.devices.flat)
        if set(own) != target:
            raise ConfigurationError(
                message(
                    "auto_strategy compares layouts on the target's devices; "
                    f"extra[{name!r}] is on other devices.",
                    received(extra=name, its_devices=_devices(own), target=_devices(devices)),
                    fix,
                )
            )
    return list(extra.items())


def _devices(devices: Sequence[Any]) -> str:
    kinds = sorted({str(getattr(d, "device_kind", d.platform)) for d in devices})
    return f"{len(devices)} devices ({', '.join(kinds)})"


def _matching(built: list, only: tuple[str, ...]) -> list:
    kept = [entry for entry in built if any(o in entry[0] for o in only)] if only else built
    if not kept:
        raise ConfigurationError(
            message(
                "only keeps the candidates whose names contain one of its strings; none does.",
                received(only=list(only), candidates=[entry[0] for entry in built]),
                'pass parts of the names above, e.g. only=["FSDP"] or only=["TP over 4"].',
            )
        )
    return kept


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


def auto_strategy(
    create_fn: Callable[..., Any],
    step: Callable[..., Any] | Step,
    batch: Any,
    devices_or_topology: Any = None,
    *,
    args: Sequence[Any] | None = None,
    slices: int = 1,
    only: str | Sequence[str] | None = None,
    extra: Mapping[str, Strategy] | None = None,
    rules: Sequence[Rule] = (),
    logical_axis_rules: LogicalRules = (),
    jobs: int = 1,
    cache_dir: str | Path | None = None,
    progress: Callable[[Candidate, str], None] | None = None,
    remat: Sequence[str] | None = None,
) -> tuple[Strategy, Plan]:
    """Compiles candidate layouts for a target, drops those that do not fit, ranks the rest.

    Nothing is allocated or run: each candidate's state is abstract
    (`strategy.abstract_state`) and its step is compiled with
    `strategy.explain`. On TPU (a real slice or an `spmd.topology`) the
    compiler's verdict decides the fit: a candidate it refuses for want of
    HBM is dropped, one it compiles fits (its peak + code, which counts
    arguments and temporaries as if all were live at once, is an upper
    bound), and those are ranked by the roofline's step time from Cloud
    TPU's published figures. Without compiling, a candidate whose state
    alone exceeds a device's HBM is dropped, and so is the optimizer-offload
    candidate where the same mesh without it fits. On CPU and GPU
    devices every candidate that compiles is ranked, by the same roofline
    with this machine's measured figures (`measured_chip`).

    The step is first traced on one device of the target (every mesh axis of
    size 1): an error there is a bug in `create_fn`, the step or the batch,
    raised at once (with a note), not a layout that does not fit.

    A candidate of spmd's with a mesh axis that splits no work (outside the
    batch axes, and no leaf of the state split over it: tensor parallelism
    over a model whose matrices are all under `MIN_SHARDED_ELEMENTS`) is
    dropped before it is compiled ("splits no work: ..."): its devices along
    that axis would each compute the same rows. `extra=` layouts are kept
    as given.

    A flax model's annotations are kept: every candidate's mesh has the mesh
    axes they name (through `logical_axis_rules`), tensor parallelism splits
    the one that is not data or fsdp, and a leaf keeps its annotation wherever
    it splits (see `spmd._src.planning.candidates`). Every candidate lays out
    the activations the step names with `spmd.logical.constrain` by its own
    rules (`spmd._src.activations.activation_rules`); where the step lays out
    none, the plan notes that its tensor-parallel candidates may hold the
    residual stream whole on every device of a tensor group.

    Where the model exposes its rematerialisation choices (`remat=`, with
    `step` a function of the policy's name that returns the step), each
    layout is tried with each policy ("FSDP over 8, remat full").

    Args:
      create_fn: builds the train state from `args` (as for `strategy.init`).
      step: the train step `(state, *batch) -> (state, metrics)`, a function
        or a `Step` (its options, such as static arguments, are kept).
      batch: the step's data arguments after the state: a tuple of arrays or
        `jax.ShapeDtypeStruct`s of the global batch (one array alone is a
        tuple of one).
      devices_or_topology: a topology name ("v5p-256"), an `spmd.topology`,
        a list of devices, or None for this process's devices.
      args: the tuple of `create_fn`'s arguments; `(jax.random.key(0),)` by
        default.
      slices: with a topology name, how many slices.
      only: keep the candidates whose names contain this string, or one of
        these strings (e.g. `["FSDP"]`); all of them by default (None; an
        empty list is an error).
      extra: more candidates to compare, name -> `Strategy` on the target's
        devices (e.g. a tuned tensor-parallel layout).
      rules: state rules given to every candidate, ahead of its own.
      logical_axis_rules: maps the model's flax annotation names to mesh axes,
        in every candidate (as `spmd.Strategy(logical_axis_rules=)`).
      jobs: how many candidates compile at once (worker threads; the
        compiler runs outside Python's lock). Tracing stays on this thread.
      cache_dir: a directory where each program's compiler output is kept,
        keyed by the program's text, its devices and the compiler versions:
        a candidate compiled before for the same target is read, not
        compiled. None (the default): no cache.
      progress: called with each candidate as it is settled, and how
        ("compiled in 12.3 s", "from the cache", "not compiled").
      remat: the model's remat policies to try, e.g. `("none", "minimal",
        "full")`; `step` is then called as `step(remat=name)` for each and
        returns the train step. None (the default): `step` is the train step.

    Returns:
      (the best `Strategy`, the `Plan`: every candidate with its estimate or
      why it was dropped; `print()` it for a table).

    Raises:
      ConfigurationError: the target, `args`, `only`, `extra`, `slices` or
        `jobs` is not understood, `only` keeps no candidate, or no candidate fits (the
        message holds the table); `ArgumentTypeError` (a ConfigurationError)
        where `create_fn` or `step` is not a function.
      BatchError: a batch leaf's shape has a negative size.
      Exception: what `create_fn` or the step raises when traced on one
        device, as raised, with a note that says so.

    Example:
      >>> best, plan = spmd.auto_strategy(create, train_step, (tokens,), "v5p-256")
      >>> print(plan)
    """
    _callables(create_fn, step)
    devices, target, n_slices = _target(devices_or_topology, slices)
    args = _args(args)
    batch = _batch(batch)
    wanted = _only(only)
    extras = _extra(extra, devices)
    positive_int(jobs, "jobs", fix="pass jobs=1 to compile one candidate at a time.")
    cache_dir = _cache_dir(cache_dir)
    steps = _remat_steps(step, remat)
    rules, logical_axis_rules = tuple(rules), tuple(logical_axis_rules)
    model = _traced(lambda: model_layout(create_fn, args, devices, rules, logical_axis_rules))
    traced = [
        _check_on_one_device(create_fn, s, batch, args, devices, model, rules, logical_axis_rules)
        for _, s in steps
    ]
    pipelines = tuple(dict.fromkeys(c for t in traced for c in t.pipelines))
    attentions = tuple(dict.fromkeys(c for t in traced for c in t.attentions))
    # Every candidate's mesh has the calls' axes (of size 1 where it does not split them).
    busy = tuple(dict.fromkeys(c.axis for c in (*pipelines, *attentions)))
    built = candidates(
        model.leaves,
        devices,
        n_slices,
        host_memory=_offers_host_memory(devices[0]) and bool(model.optimizer),
        annotated=model.annotated,
        model_axes=tuple(dict.fromkeys((*model.axes, *busy))),
        rules=rules,
        logical_axis_rules=logical_axis_rules,
        pipelines=pipelines,
        attentions=attentions,
    )
    built = [(name, build, True) for name, build in built]
    built += [(name, (lambda s=s: s), False) for name, s in extras]
    built = [
        (name + (f", remat {policy}" if policy else ""), b, own, s)
        for name, b, own in built
        for policy, s in steps
    ]
    built = _matching(built, wanted)
    chip = chip_of(devices[0])
    capacity = _capacity(devices[0])
    judge = _Judge(
        create_fn, batch, args, chip, len(devices), capacity, cache_dir is not None, frozenset(busy)
    )
    results = _settle(built, judge, jobs, cache_dir, progress)
    ranked = sorted((c for c in results if c.dropped is None), key=lambda c: c.step_seconds)
    notes = () if all(t.constrained for t in traced) else _unconstrained_note(built)
    plan = Plan(target, tuple(ranked) + tuple(c for c in results if c.dropped is not None), notes)
    if plan.best is None:
        raise _nothing_fits(target, plan)
    return plan.best.strategy, plan


def _capacity(device: Any) -> int | None:
    """A TPU device's HBM as its compiler counts it; None elsewhere."""
    return compiler_hbm(device) if chip_of(device) is not None else None


def _cache_dir(cache_dir: Any) -> Path | None:
    if cache_dir is None:
        return None
    if not isinstance(cache_dir, str | Path):
        raise ConfigurationError(
            message(
                "cache_dir is a directory path, or None for no cache.",
                received(cache_dir=cache_dir),
                f'pass e.g. cache_dir="{plan_cache.DEFAULT_CACHE_DIR}".',
            )
        )
    return Path(cache_dir).expanduser()


@dataclass(frozen=True)
class _Program:
    """A candidate traced and lowered, waiting for the compiler."""

    name: str
    strategy: Strategy
    traced: Any
    lowered: Any
    state: Any
    batches: Any
    key: str


def _is_offload(strategy: Strategy | None) -> bool:
    return strategy is not None and strategy.placement == "offload_optimizer"


def _settle(built, judge, jobs, cache_dir, progress) -> list[Candidate]:
    """Every candidate settled: dropped before compiling, or compiled (spmd's offload
    candidate after the rest, so that it is not compiled where its mesh fits without it;
    `extra=` layouts are compiled as given)."""
    done: list[Candidate | None] = [None] * len(built)

    def settle(i: int, candidate: Candidate, how: str) -> None:
        done[i] = candidate
        if progress is not None:
            progress(candidate, how)

    waiting: dict[int, _Program] = {}
    for i, (name, build, own, step) in enumerate(built):
        prepared = judge.prepare(name, build, own, step)
        if isinstance(prepared, Candidate):
            settle(i, prepared, "not compiled")
        else:
            waiting[i] = prepared
    later = {i: p for i, p in waiting.items() if built[i][2] and _is_offload(p.strategy)}
    for wave in ({i: p for i, p in waiting.items() if i not in later}, later):
        if wave is later:
            for i, program in list(wave.items()):
                if (twin := _fitting_twin(program, built[i][3], built, done)) is not None:
                    settle(i, _cannot_help(program, twin), "not compiled")
                    del wave[i]
        order = list(wave)
        programs = [(wave[i].lowered, wave[i].key) for i in order]
        for j, output, seconds in compile_programs(programs, jobs, cache_dir):
            how = "from the cache" if seconds is None else f"compiled in {seconds:,.1f} s"
            settle(order[j], judge.judge(wave[order[j]], output), how)
    return done


def _fitting_twin(
    program: _Program, step: Any, built: list, done: list[Candidate | None]
) -> Candidate | None:
    """The candidate of the same mesh and train step (remat policy) with its state in
    device memory, where it fits."""
    shape = dict(program.strategy.mesh.shape)
    for c, (_, _, _, its_step) in zip(done, built, strict=True):
        if (
            its_step is step
            and c is not None
            and c.dropped is None
            and c.strategy is not None
            and not _is_offload(c.strategy)
            and dict(c.strategy.mesh.shape) == shape
        ):
            return c
    return None


def _cannot_help(program: _Program, twin: Candidate) -> Candidate:
    return Candidate(
        program.name,
        program.strategy,
        dropped=f"cannot help (not compiled): {twin.name} fits on the same mesh with the "
        "optimizer state in device memory, and moving it over the host link each step only "
        "adds to the step",
    )


def _offers_host_memory(device: Any) -> bool:
    """Whether to try the optimizer state in host memory: an accelerator (TPU, real or
    an `spmd.topology`; GPU) with `pinned_host` memory. On CPU devices it is the same RAM."""
    kinds = {m.kind for m in device.addressable_memories()}
    return device.platform != "cpu" and "pinned_host" in kinds


def _traced(fn: Callable[[], Any], what: str = "create_fn") -> Any:
    """`fn()`, with a note on what it raises: it ran on one device, before any layout."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    except Exception as e:
        e.add_note(_ONE_DEVICE_NOTE.format(what=what))
        raise


class _OnOneDevice(NamedTuple):
    """What the step traced on one device tells of the model."""

    constrained: bool  # whether it lays out any of its activations (a sharding constraint)
    pipelines: tuple[pipeline_calls.PipelineCall, ...]  # its spmd.pipeline calls
    attentions: tuple[attention_calls.AttentionCall, ...]  # its spmd.attention calls


def _check_on_one_device(
    create_fn, step, batch, args, devices, model, rules, logical_axis_rules
) -> _OnOneDevice:
    """Traces the step on one device (every axis of size 1): what fails there fails anywhere.

    Returns:
      Whether the step lays out any of its activations, and the `spmd.pipeline` and
      `spmd.attention` calls it makes (the stage and context axes to offer).
    """
    sizes = {"data": 1} | {a: 1 for a in model.axes}
    one = Strategy(
        make_mesh(sizes, devices[:1]), rules=rules, logical_axis_rules=logical_axis_rules
    )
    state = _traced(lambda: one.abstract_state(create_fn, *args))
    traced = _traced(lambda: _bound(one, step).trace(state, *batch), "the step")
    jaxpr = traced[0].jaxpr
    return _OnOneDevice(
        constrains_activations(jaxpr),
        pipeline_calls.calls_in(jaxpr),
        attention_calls.calls_in(jaxpr),
    )


REMAT_POLICIES = ("none", "minimal", "full")  # the usual names: MaxText's `remat_policy`


def _remat_steps(step: Any, remat: Any) -> list[tuple[str | None, Any]]:
    """(policy, train step) for each remat choice; `[(None, step)]` without choices."""
    if remat is None:
        return [(None, step)]
    names = (remat,) if isinstance(remat, str) else tuple(remat) if _iterable(remat) else ()
    names = names if all(isinstance(n, str) for n in names) else ()
    if not names or len(set(names)) != len(names):
        raise ConfigurationError(
            message(
                "remat is the model's remat policies to try: distinct names its step builder "
                f"takes, e.g. {REMAT_POLICIES}.",
                received(remat=remat),
                'pass remat=("none", "full") with step=build_step, where build_step(remat=name) '
                "returns the train step; or remat=None with the train step itself.",
            )
        )
    steps = []
    for name in names:
        try:
            built = _traced(lambda name=name: step(remat=name), f"step(remat={name!r})")
        except TypeError as e:
            if "remat" not in str(e):
                raise
            raise ArgumentTypeError(_builder_expected(name, f"TypeError: {e}")) from e
        if not callable(built):
            raise ArgumentTypeError(_builder_expected(name, type(built).__name__))
        steps.append((name, built))
    return steps


def _iterable(x: Any) -> bool:
    return isinstance(x, Iterable)


def _builder_expected(name: str, got: str) -> str:
    return message(
        "With remat=, step is a builder: step(remat=name) returns the train step.",
        received(remat=name, got=got),
        "pass the builder, e.g. def build_step(remat): return make_train_step("
        "policy=POLICIES[remat]); or remat=None with the train step itself.",
    )


def _unconstrained_note(built: list) -> tuple[str, ...]:
    """The note for a step that lays out no activation, where it matters: tensor parallelism."""
    if not any(" x TP " in name or name.startswith("TP over") for name, *_ in built):
        return ()
    return (
        "the step lays out none of its activations: under tensor parallelism (the TP "
        "layouts) the compiler may keep the residual stream whole on every device of a "
        "tensor group, and those layouts' memory is sized so. Name them as MaxText does: "
        'spmd.logical.constrain(h, ("activation_batch", "activation_length", '
        '"activation_embed")) (docs/planning.md)',
    )


def _bound(strategy: Strategy, step: Callable[..., Any] | Step) -> Step:
    """The step on `strategy`, a `Step`'s options kept."""
    if not isinstance(step, Step):
        return strategy.step(step)
    return strategy.step(
        step.fn,
        donate=step.donate,
        static_argnames=step.static_argnames,
        batch_axis=step.batch_axis,
    )


def _nothing_fits(target: str, plan: Plan) -> ConfigurationError:
    unfit = any(c.dropped.startswith("does not fit") for c in plan.dropped)
    fix = (
        "use a larger slice (or more slices), a smaller batch, remat (jax.checkpoint) in the "
        "model, or a smaller model."
        if unfit
        else "read each layout's reason above: a layout spmd cannot lay out on this target, or "
        "one the compiler refuses; pass a layout of your own as extra=, or another target."
    )
    return ConfigurationError(
        message(
            "At least one layout fits the target.",
            received(target=target, plan="\n" + str(plan)),
            fix,
        )
    )


def _idle(strategy: Strategy, state: Any, busy: frozenset[str]) -> str | None:
    """Why a candidate of spmd's splits no work over one of its axes; None where it does."""
    axes = idle_axes(strategy, state, busy)
    if not axes:
        return None
    sizes = strategy.mesh.shape
    named = " x ".join(f"{a}={sizes[a]}" for a in axes)
    devices = math.prod(sizes[a] for a in axes)
    return (
        f"splits no work: no leaf of the state is split over {named} (tensor parallelism "
        f"splits a matrix's last dimension where it holds at least {MIN_SHARDED_ELEMENTS:,} "
        f"elements and the axis divides it), so the {devices} devices along it would each "
        "compute the same rows"
    )


@dataclass(frozen=True)
class _Judge:
    """What every candidate is traced, lowered and judged with."""

    create_fn: Any
    batch: tuple
    args: tuple
    chip: Chip | None
    n_devices: int
    capacity: int | None
    cached: bool  # whether a cache key is wanted (the program's text: seconds for a large one)
    busy: frozenset[str] = frozenset()  # the axes the step's pipeline / attention calls split

    def prepare(self, name: str, build: Callable[[], Strategy], own: bool, step: Any):
        """The candidate (its layout and its train step: one per remat policy) traced and
        lowered (a `_Program`), or dropped before compiling."""
        try:
            strategy = build()
        except Exception as e:  # a layout this mesh cannot make
            return Candidate(name, None, dropped=f"cannot be built: {_first_line(e)}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                state = strategy.abstract_state(self.create_fn, *self.args)
                if own and (idle := _idle(strategy, state, self.busy)):
                    return Candidate(name, strategy, dropped=idle)
                if (over := self._state_over_hbm(state)) is not None:
                    return Candidate(name, strategy, dropped=over)
                _, traced, sized, batches, devices = traced_program(
                    _bound(strategy, step), state, *self.batch
                )
                lowered = traced.lower()
        except SpmdError as err:  # spmd's checks of this layout: the batch, the rules
            return Candidate(name, strategy, dropped=f"cannot be laid out: {_first_line(err)}")
        except Exception as err:  # it traced on one device: this layout
            return Candidate(name, strategy, dropped=f"does not compile: {_first_line(err)}")
        key = plan_cache.cache_key(lowered.as_text(), devices) if self.cached else ""
        return _Program(name, strategy, traced, lowered, sized, batches, key)

    def _state_over_hbm(self, state: Any) -> str | None:
        """Why the state alone rules a candidate out on a TPU; None where it does not."""
        if self.capacity is None:
            return None
        need = _per_device_bytes(state, "device")
        if need <= self.capacity:
            return None
        return (
            f"does not fit (not compiled): its state alone is {_human(need)} a device, over "
            f"the {_human(self.capacity)} of HBM by {_human(need - self.capacity)}"
        )

    def judge(self, program: _Program, output: CompilerOutput | BaseException) -> Candidate:
        """The compiled candidate ranked, or dropped with the compiler's reason."""
        name, strategy = program.name, program.strategy
        if isinstance(output, BaseException):
            return Candidate(name, strategy, dropped=f"does not compile: {_first_line(output)}")
        devices = list(strategy.mesh.devices.flat)
        e = explain_compiled(
            repr(strategy), program.traced, output, program.state, program.batches, devices
        )
        if e.fits is False:
            return Candidate(
                name,
                strategy,
                e,
                dropped=f"does not fit: the compiler needs {_human(e.hbm_required)} of "
                f"{_human(e.hbm_capacity)} HBM (over by {_human(-e.hbm_headroom)})",
            )
        roofline = e.roofline
        if roofline is None:  # CPU or GPU: this machine's measured figures
            return self._measured(name, strategy, e)
        return Candidate(name, strategy, e, roofline)

    def _measured(self, name: str, strategy: Strategy, e: Explanation) -> Candidate:
        """A CPU or GPU candidate: ranked by this machine's figures; on a GPU, dropped where
        its peak and code exceed the memory the device gives programs."""
        from spmd._src.roofline import traffic

        device = strategy.mesh.devices.flat[0]
        sharing = len(jax.local_devices()) if device.platform == "cpu" else 1
        flops = max(e.flops, e.matmul_flops / self.n_devices)
        flows = traffic(e.hlo, self.n_devices)
        chip = measured_chip(device)
        roofline = estimate(chip, flops, _accessed(e), flows, sharing, e.state_host_bytes)
        limit = _device_limit(device)
        need = e.peak_and_code_bytes
        if limit is not None and need > limit:
            return Candidate(
                name,
                strategy,
                e,
                dropped=f"does not fit: needs {_human(need)} of {_human(limit)} device memory "
                f"(over by {_human(need - limit)})",
            )
        return Candidate(name, strategy, e, roofline)


def _device_limit(device: Any) -> int | None:
    """A GPU's memory for programs (`memory_stats()["bytes_limit"]`); None elsewhere."""
    if device.platform == "cpu":
        return None
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend without memory statistics
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def _accessed(e: Explanation) -> float:
    """HBM bytes a step reads and writes at least: its arguments, outputs and temporaries."""
    return float(e.argument_bytes + e.output_bytes + e.temp_bytes)
