"""Preflight: what a step will cost per device, read from the compiled program without running it."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from spmd._src.flops import matmul_flops
from spmd._src.pipeline import PipelineSchedule, schedules_in

if TYPE_CHECKING:
    from spmd._src.strategy.base import Step

__all__ = [
    "Collective",
    "CompilerOutput",
    "Explanation",
    "compile_lowered",
    "explain",
    "explain_compiled",
    "explain_traced",
    "parse_collectives",
    "traced_program",
]

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(
    r"=\s*(?P<type>\(.*?\)|[\w\[\],{}:()]+)\s+(?P<op>"
    + "|".join(COLLECTIVES)
    + r")(?P<start>-start)?\("
)
_SHAPE = re.compile(r"\b(?P<dtype>pred|[a-z]+\d+[a-z0-9]*)\[(?P<dims>[\d,]*)\]")
_DTYPE_BITS = {"pred": 8, "f8e4m3fn": 8, "f8e5m2": 8}


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a compiled step.

    Attributes:
      kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all" or
        "collective-permute".
      count: how many such operations the step runs.
      bytes: the bytes they produce on each device, summed.
    """

    kind: str
    count: int
    bytes: int


def _shape_bytes(text: str) -> int:
    total = 0
    for match in _SHAPE.finditer(text):
        dtype = match["dtype"]
        bits = _DTYPE_BITS.get(dtype) or int(re.sub(r"\D", "", dtype) or 8)
        dims = [int(d) for d in match["dims"].split(",") if d]
        total += math.prod(dims) * bits // 8
    return total


def parse_collectives(hlo_text: str) -> dict[str, Collective]:
    """Counts the collectives of an optimized HLO module and the bytes each produces.

    Async pairs (`all-gather-start` / `-done`) count once, by their result.
    """
    found: dict[str, list[int]] = {}
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if not match:
            continue
        result = re.sub(r"\{[^{}]*\}", "", match["type"])  # layouts: TPU's hold "(8,128)"
        if match["start"] and result.startswith("("):
            result = result[1:-1].split("),")[-1] if ")," in result else result.rsplit(", ", 1)[-1]
        counts = found.setdefault(match["op"], [0, 0])
        counts[0] += 1
        counts[1] += _shape_bytes(result)
    return {kind: Collective(kind, c, b) for kind, (c, b) in found.items()}


def _per_device_bytes(tree: Any, kind: str | None = None) -> int:
    """The most bytes any one device holds of `tree`'s leaves (of one memory kind)."""
    per_device: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            continue
        if kind is not None and getattr(sharding, "memory_kind", None) != kind:
            continue
        nbytes = math.prod(sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for device in sharding.device_set:
            per_device[device] = per_device.get(device, 0) + nbytes
    return max(per_device.values(), default=0)


@dataclass(frozen=True)
class Explanation:
    """What one call of a step costs on each device, from XLA's compiled program.

    Attributes:
      strategy: the strategy's repr.
      state_bytes: bytes of state one device holds in device memory.
      state_host_bytes: bytes of state kept in host memory (CentralStorageStrategy,
        or the optimizer's with placement="offload_optimizer"): what the step
        moves to the device and back, each way.
      input_bytes: bytes of one batch one device receives.
      argument_bytes, output_bytes, alias_bytes, temp_bytes: XLA's memory
        analysis of the compiled program (alias = outputs reusing donated inputs),
        in device memory. The TPU and GPU compilers count arguments and outputs
        in `pinned_host` apart; on CPU devices, whose "device" memory is the
        same RAM, XLA counts them in, and they are taken out here. None where
        the compiler refused the program (unknown, not 0).
      peak_bytes: argument + output - alias + temp, an upper bound of the
        program's device memory (it counts arguments and temporaries as if all
        were live at once); None where the compiler refused the program.
      flops: XLA's cost estimate of floating point operations per device. It
        counts a loop's body once and, on GPUs, leaves out the library calls
        matrix products become (cuBLAS): a lower bound, not a figure for MFU.
        None where the compiler refused the program.
      matmul_flops: the FLOPs of the step's matrix products and convolutions,
        counted from its traced program, over all devices:
        a scan's body times its length; recomputation counts; a backend's
        fused kernels (a cuDNN attention) do not. The numerator of MFU.
      collectives: kind -> `Collective`: the collective ops in the compiled
        program (count, bytes), a loop's once (`traffic` counts them per step).
      hlo: the optimized HLO text, for a closer look.
      chip: on TPU devices (real or an `spmd.topology`), the chip's name
        ("v5p"); None elsewhere, and so are the fields below.
      hbm_capacity: on TPU, the HBM one device has for a program, as the TPU
        compiler counts it (v5e: 15.75 GiB of its 16 GB).
      hbm_required: on TPU, when the compiler refuses the program for want
        of HBM, the bytes it says the program needs (the other memory
        fields and `flops` are then None: there is no compiled program to read).
      code_bytes: on TPU, the compiled program's code, which HBM holds too
        (None where the compiler refused the program).
      traffic: on TPU, the collectives by kind and link (ICI inside a slice,
        DCN between slices) with the bytes each device sends
        (`spmd.Traffic`), loops counted per iteration.
      roofline: on TPU, the estimated step time and its terms
        (`spmd.Roofline`; the model is in docs/planning.md).
      pipelines: the schedules of the step's `spmd.pipeline` calls, each
        with its bubble (the fraction of idle stage-steps).
    """

    strategy: str
    state_bytes: int
    state_host_bytes: int
    input_bytes: int
    argument_bytes: int | None
    output_bytes: int | None
    alias_bytes: int | None
    temp_bytes: int | None
    flops: float | None
    collectives: Mapping[str, Collective] = field(default_factory=dict)
    hlo: str = field(default="", repr=False)
    matmul_flops: float = 0.0
    chip: str | None = None
    hbm_capacity: int | None = None
    hbm_required: int | None = None
    code_bytes: int | None = 0
    traffic: tuple = ()
    roofline: Any = None
    pipelines: tuple[PipelineSchedule, ...] = ()

    @property
    def peak_bytes(self) -> int | None:
        """An upper bound of the device memory the step needs, per device; None where the
        compiler refused the program."""
        parts = (self.argument_bytes, self.output_bytes, self.alias_bytes, self.temp_bytes)
        if any(p is None for p in parts):
            return None
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def peak_and_code_bytes(self) -> int | None:
        """Peak plus code: an upper bound of the HBM the program holds; None where refused."""
        if self.peak_bytes is None:
            return None
        return self.peak_bytes + (self.code_bytes or 0)

    @property
    def fits(self) -> bool | None:
        """On TPU, the compiler's verdict: it compiled the program (True) or refused it for
        want of HBM (False); None where there is no HBM to judge against (CPU, GPU).

        A compiled program fits even where `peak_and_code_bytes`, an upper bound,
        exceeds `hbm_capacity`: the compiler knows which buffers are live at once.
        """
        if self.hbm_capacity is None:
            return None
        return self.hbm_required is None

    @property
    def hbm_headroom(self) -> int | None:
        """On TPU, HBM left over: for a refused program, capacity less what the compiler
        says it needs (negative: over by that much); for a compiled one, at least this much
        (capacity less the upper bound, 0 where the bound exceeds it); None where unknown."""
        if self.hbm_capacity is None:
            return None
        if self.hbm_required is not None:
            return self.hbm_capacity - self.hbm_required
        return max(0, self.hbm_capacity - self.peak_and_code_bytes)

    @property
    def step_seconds(self) -> float | None:
        """On TPU, the roofline's estimated step time; None elsewhere."""
        return None if self.roofline is None else self.roofline.step_s

    def __str__(self) -> str:
        rows = [
            ("state (device memory)", _human(self.state_bytes)),
            ("state (host memory)", _human(self.state_host_bytes)),
            ("one batch", _human(self.input_bytes)),
            *(_memory_rows(self) if self.chip is not None else ()),
            ("temporaries", _known(self.temp_bytes)),
            ("peak (upper bound)", _known(self.peak_bytes)),
            ("FLOPs (XLA's estimate)", "-" if self.flops is None else f"{self.flops:,.0f}"),
            ("matmul FLOPs (all devices)", f"{self.matmul_flops:,.0f}"),
        ]
        rows += [
            (f"{c.kind} x{c.count} in the program", f"{_human(c.bytes)} produced")
            for c in sorted(self.collectives.values(), key=lambda c: c.kind)
        ]
        if not self.collectives:
            rows.append(("collectives in the program", "none" if self.hlo else "-"))
        rows += [("pipeline", str(p)) for p in self.pipelines]
        if self.chip is not None:
            rows += _chip_rows(self)
        width = max(len(name) for name, _ in rows)
        lines = [f"{self.strategy}, per device:"]
        lines += [f"  {name:<{width}}  {value}" for name, value in rows]
        return "\n".join(lines)


def _known(n: float | None) -> str:
    """A byte count, or "-" where the compiler gave none."""
    return "-" if n is None else _human(n)


def _memory_rows(e: Explanation) -> list[tuple[str, str]]:
    """The TPU compiler's memory analysis, each part on its own row (peak adds them up)."""
    return [
        ("arguments", _known(e.argument_bytes)),
        ("outputs", _known(e.output_bytes)),
        ("aliased (outputs in donated arguments)", _known(e.alias_bytes)),
        ("code", _known(e.code_bytes)),
    ]


def _chip_rows(e: Explanation) -> list[tuple[str, str]]:
    """The rows a TPU adds: HBM against capacity, traffic by link, the roofline."""
    rows = [(f"HBM of one {e.chip} device", _human(e.hbm_capacity or 0))]
    if e.hbm_required is not None:
        over = _human(e.hbm_required - e.hbm_capacity)
        verdict = f"DOES NOT FIT: the compiler refused it, over by {over}"
        rows.append(("the compiler needs", f"{_human(e.hbm_required)} ({verdict})"))
    else:
        bound = e.peak_and_code_bytes
        above = bound - e.hbm_capacity
        note = f", though the bound is {_human(above)} over HBM" if above > 0 else ""
        rows.append(
            (
                "peak + code (upper bound)",
                f"{_human(bound)} (fits: the compiler accepted the program{note})",
            )
        )
    if e.traffic:
        rows.append(("collectives executed per step", "(a loop's once per iteration)"))
    rows += [
        (f"{t.kind} x{t.count} over {t.link}", f"{_human(t.wire_bytes)} sent") for t in e.traffic
    ]
    r = e.roofline
    if r is not None:
        dcn = "" if r.dcn_known else " (no published DCN figure: left out)"
        rows += [
            ("compute / HBM time", f"{r.compute_s * 1e3:,.3f} ms / {r.memory_s * 1e3:,.3f} ms"),
            ("ICI / DCN time", f"{r.ici_s * 1e3:,.3f} ms / {r.dcn_s * 1e3:,.3f} ms{dcn}"),
        ]
        if r.host_bytes:
            rows.append(
                (
                    "host link time",
                    f"{r.host_s * 1e3:,.3f} ms ({_human(r.host_bytes)} each way)",
                )
            )
        rows.append(("estimated step", f"{r.step_s * 1e3:,.3f} ms ({r.bound}-bound)"))
    return rows


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def explain(step: Step, state: Any, *data: Any, **kwargs: Any) -> Explanation:
    """Compiles `step` for these arguments without running it and reports its cost.

    Args:
      step: a `Step` from `strategy.step`.
      state: the state, placed or abstract (`strategy.abstract_state(...)`).
      *data: batches, as arrays or `jax.ShapeDtypeStruct`s of the global batch.
      **kwargs: the step's keyword arguments.

    Returns:
      An `Explanation`; `print()` it for a table.
    """
    return explain_traced(*traced_program(step, state, *data, **kwargs))


def traced_program(step: Step, state: Any, *data: Any, **kwargs: Any) -> tuple:
    """`explain_traced`'s arguments for a step: (name, traced, state, batches, devices).

    The state and batches are `ShapeDtypeStruct`s with the strategy's shardings.
    """
    traced, pure = step.trace(state, *data, **kwargs)
    strategy = step.strategy
    state_sharding = strategy.state_sharding(pure)
    sized = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), _dtype(x), sharding=s), pure, state_sharding
    )
    batches = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            np.shape(x), _dtype(x), sharding=strategy.batch_sharding(np.ndim(x), step.batch_axis)
        ),
        data,
    )
    return repr(strategy), traced, sized, batches, list(strategy.mesh.devices.flat)


def explain_traced(
    name: str,
    traced: jax.stages.Traced,
    state: Any,
    batches: Any,
    devices: list | None = None,
) -> Explanation:
    """Compiles a traced program and reports its cost per device.

    Args:
      name: what the report calls the program (a strategy's repr).
      traced: the `jax.stages.Traced` program.
      state, batches: its state and batch, as `ShapeDtypeStruct`s with shardings.
      devices: the devices it runs on; on TPU devices the report adds the chip's
        HBM, the traffic by link and the roofline.
    """
    output = compile_lowered(traced.lower())
    return explain_compiled(name, traced, output, state, batches, devices)


@dataclass(frozen=True)
class CompilerOutput:
    """What the compiler says of one program: the figures an `Explanation` is read from.

    Plain data (it round-trips through JSON, for the plan's disk cache).

    Attributes:
      argument_bytes, output_bytes, alias_bytes, temp_bytes, code_bytes: the
        memory analysis, arguments and outputs in device memory only; None
        where the compiler refused the program.
      flops, bytes_accessed: the cost analysis; None where refused.
      hlo: the optimized HLO text ("" where refused).
      required: the bytes the TPU compiler says a refused program needs; None
        where it compiled.
    """

    argument_bytes: int | None
    output_bytes: int | None
    alias_bytes: int | None
    temp_bytes: int | None
    code_bytes: int | None
    flops: float | None
    bytes_accessed: float | None
    hlo: str = ""
    required: int | None = None


def compile_lowered(lowered: jax.stages.Lowered) -> CompilerOutput:
    """Compiles a lowered program; the TPU compiler's refusal for want of HBM is a verdict.

    Raises:
      Exception: what the compiler raises for any other reason, as raised.
    """
    try:
        compiled = lowered.compile()
    except Exception as e:  # the TPU compiler refuses a program over HBM
        from spmd._src.topologies import hbm_refusal

        required = hbm_refusal(e)
        if required is None:
            raise
        return CompilerOutput(None, None, None, None, None, None, None, "", required)
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    arguments, outputs = _device_resident(compiled, memory)
    return CompilerOutput(
        argument_bytes=arguments,
        output_bytes=outputs,
        alias_bytes=int(getattr(memory, "alias_size_in_bytes", 0)),
        temp_bytes=int(getattr(memory, "temp_size_in_bytes", 0)),
        code_bytes=int(getattr(memory, "generated_code_size_in_bytes", 0)),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        hlo=compiled.as_text(),
    )


def explain_compiled(
    name: str,
    traced: jax.stages.Traced,
    output: CompilerOutput,
    state: Any,
    batches: Any,
    devices: list | None = None,
) -> Explanation:
    """The `Explanation` of a program from what its compiler said (`compile_lowered`).

    Args: as `explain_traced`, with `output` the compiler's figures.
    """
    traced_flops = matmul_flops(traced.jaxpr)
    host_bytes = _per_device_bytes(state, "pinned_host")
    tpu = _tpu_fields(devices or [], output, traced_flops, host_bytes)
    if output.required is not None:
        tpu |= {"hbm_required": output.required, "roofline": None, "traffic": ()}
    return Explanation(
        strategy=name,
        state_bytes=_per_device_bytes(state, "device"),
        state_host_bytes=host_bytes,
        input_bytes=_per_device_bytes(batches),
        argument_bytes=output.argument_bytes,
        output_bytes=output.output_bytes,
        alias_bytes=output.alias_bytes,
        temp_bytes=output.temp_bytes,
        flops=output.flops,
        collectives=parse_collectives(output.hlo),
        hlo=output.hlo,
        matmul_flops=traced_flops,
        pipelines=schedules_in(traced.jaxpr),
        **tpu,
    )


def _device_resident(compiled: Any, memory: Any) -> tuple[int, int]:
    """The program's argument and output bytes in device memory.

    The TPU and GPU compilers report those in `pinned_host` apart
    (`host_argument_size_in_bytes`); XLA:CPU, where both kinds are the same
    RAM, counts them in, so they are taken out by the program's shardings.
    """
    arguments = int(getattr(memory, "argument_size_in_bytes", 0))
    outputs = int(getattr(memory, "output_size_in_bytes", 0))
    if getattr(memory, "host_argument_size_in_bytes", 0) or (
        getattr(memory, "host_output_size_in_bytes", 0)
    ):
        return arguments, outputs
    avals = jax.tree.leaves(compiled.in_avals)
    ins = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        for a, s in zip(avals, jax.tree.leaves(compiled.input_shardings), strict=True)
    ]
    host_in = _per_device_bytes(ins, "pinned_host")
    host_out = _per_device_bytes(jax.tree.leaves(compiled.out_info), "pinned_host")
    return max(0, arguments - host_in), max(0, outputs - host_out)


def _tpu_fields(devices: list, output: CompilerOutput, traced_flops: float, host_bytes: int):
    """On TPU devices: the chip, its HBM, the traffic by link and the roofline."""
    from spmd._src.roofline import estimate, traffic
    from spmd._src.topologies import chip_of, compiler_hbm, devices_per_chip

    if not devices:
        return {}
    chip = chip_of(devices[0])
    if chip is None:
        return {}
    capacity = compiler_hbm(devices[0])
    fields = {"chip": chip.name, "hbm_capacity": capacity, "code_bytes": output.code_bytes}
    if output.required is not None:  # refused: no program to read traffic or costs from
        return fields
    hlo = output.hlo
    found = re.search(r"num_partitions=(\d+)", hlo)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    flows = traffic(hlo, int(found[1]) if found else len(devices) // slices, slices)
    flops = max(output.flops, traced_flops / len(devices))
    share = devices_per_chip(devices[0])
    return fields | {
        "traffic": flows,
        "roofline": estimate(chip, flops, output.bytes_accessed, flows, share, host_bytes),
    }


def _dtype(x: Any) -> Any:
    """An array's dtype; for a Python scalar in the state, the one jit gives it."""
    dtype = getattr(x, "dtype", None)
    return jnp.result_type(x) if dtype is None else dtype
