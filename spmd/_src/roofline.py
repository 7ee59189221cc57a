"""A compiled step's traffic over ICI and DCN, and its step time on a stated roofline.

The roofline (per device, one step):

    compute = FLOPs / (peak FLOP/s x efficiency)   memory = HBM bytes accessed / HBM bandwidth
    ici     = ICI wire bytes / ICI bandwidth  dcn    = DCN wire bytes / DCN bandwidth
    host    = host bytes each way / host link bandwidth (PCIe; full duplex)
    step    = max(compute, memory) + ici + dcn + host

The efficiency is the share of peak a TPU's matrix units reach over a step,
calibrated on MaxText's published runs (`spmd._src.calibration`); figures
measured on this machine (CPU, GPU) are a matrix product's already, at 1.
Compute and HBM traffic overlap; collectives and host transfers are counted
as not overlapping them, so the estimate leans long where XLA hides one behind
compute. The host bytes are the state a placement keeps in `pinned_host`
(`placement="host"`: all of it; `"offload_optimizer"`: the optimizer's),
moved to the device and back each step.
FLOPs are the larger of XLA's estimate and the step's matrix-product FLOPs
(`spmd._src.flops`, which counts a scanned layer once per iteration; XLA's estimate
counts a loop body once). Wire bytes are what a ring algorithm sends per
device: an all-reduce of N bytes over g devices sends 2(g-1)/g N, an
all-gather to N bytes (g-1)/g N, a reduce-scatter to N bytes (g-1) N, an
all-to-all of N bytes (g-1)/g N, a collective-permute N. A collective in a
loop counts once per iteration: the trip count XLA proved (the while's
`known_trip_count`), else the one read from the loop's condition and the
comparison it calls (a fusion on CPU and GPU). On several slices XLA compiles
one slice's program, and the part of a collective that crosses slices becomes
a data-center-network transfer (a "megascale" send): those are the DCN bytes,
over the slices as the group.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from spmd._src.calibration import MATMUL_EFFICIENCY
from spmd._src.topologies import CHIPS, Chip

__all__ = [
    "Flow",
    "Roofline",
    "Traffic",
    "estimate",
    "flows",
    "replica_groups",
    "ring_bytes",
    "traffic",
]

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s(?P<op>"
    + "|".join(_KINDS)
    + r"|send)(?P<start>-start)?\("
)
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(
    r"\b(?P<how>calls|body|condition|to_apply|branch_computations|called_computations)="
    r"(?P<names>\{[^}]*\}|%[\w.\-]+)"
)
_SHAPE = re.compile(r"\b(?P<dtype>pred|[a-z]+\d+[a-z0-9]*)\[(?P<dims>[\d,]*)\]")
_BITS = {"pred": 8}
_GROUPS = re.compile(
    r"(replica_groups|source_target_pairs)=(\{[{}\d,\s]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)"
)
_IOTA = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:, device_ids=\(\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?\))? \{(?P<grouped>[^}]*)\}"
)
_TARGET_GROUPS = re.compile(r"_xla_megascale_target=\{(?P<groups>(?:\{[\d,]*\},?)+)\}")
_TARGET_SLICES = re.compile(r'_xla_megascale_target="\{(?P<slices>[\d,]+)\}x')
_SLICE_ID = 100_000  # a megascale target names device d of slice s (from 0) (s + 1) * 100000 + d
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(?P<kind>\w+)"')
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="(?P<key>[^"]+)"')
_CHANNEL = re.compile(r"\bchannel_id=(?P<id>\d+)")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')


@dataclass(frozen=True)
class Traffic:
    """One kind of collective over one link, per device and step.

    Attributes:
      kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all" or
        "collective-permute".
      link: "ICI" (inside a slice, or inside a host for CPU and GPU devices)
        or "DCN" (between slices).
      count: how many run per step (a loop's once per iteration).
      bytes: the bytes they produce on each device, summed.
      wire_bytes: the bytes each device sends for them (ring algorithms).
    """

    kind: str
    link: str
    count: int
    bytes: int
    wire_bytes: float


@dataclass(frozen=True)
class Flow:
    """One collective of a compiled program, per device (an async pair or a DCN transfer once).

    Attributes:
      kind, link: as `Traffic`.
      times: how many times it runs per step (its loops' trip counts).
      bytes: the bytes it produces on each device, one run.
      wire_bytes: the bytes each device sends for it, one run.
      groups: the devices it joins: over ICI, groups of the program's device
        ids (its replica groups or permute pairs); over DCN, groups of slice
        indices (its megascale target).
    """

    kind: str
    link: str
    times: int
    bytes: int
    wire_bytes: float
    groups: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Roofline:
    """An estimated step time, per device, and the figures it comes from.

    Attributes:
      chip: whose figures (a `spmd.Topology`'s `chip`; for CPU devices, measured).
      devices_per_chip: devices sharing one chip's figures (a v4 topology with
        `megacore=False` shows its two TensorCores as two devices; simulated
        CPU devices share the host).
      flops, hbm_bytes, ici_bytes, dcn_bytes: the step's work per device.
      compute_s, memory_s, ici_s, dcn_s: each over its bandwidth.
      dcn_known: False where the chip has no published DCN figure (then
        `dcn_s` is 0 and the estimate leaves DCN out).
      host_bytes: bytes each device moves between host and device memory
        each way per step (the state kept in `pinned_host`).
      host_s: `host_bytes` over the chip's host link (its share of it).
      host_known: False where the chip has no host link figure and
        `host_bytes` is not 0 (then `host_s` is 0: left out).
      efficiency: the share of the chip's peak FLOP/s `compute_s` assumes.
    """

    chip: Chip
    devices_per_chip: int
    flops: float
    hbm_bytes: float
    ici_bytes: float
    dcn_bytes: float
    compute_s: float
    memory_s: float
    ici_s: float
    dcn_s: float
    dcn_known: bool = True
    host_bytes: float = 0.0
    host_s: float = 0.0
    host_known: bool = True
    efficiency: float = 1.0

    @property
    def step_s(self) -> float:
        """max(compute, memory) + ici + dcn + host, in seconds."""
        return max(self.compute_s, self.memory_s) + self.ici_s + self.dcn_s + self.host_s

    @property
    def bound(self) -> str:
        """The largest term: "compute", "memory", "ICI", "DCN" or "host"."""
        terms = {"compute": self.compute_s, "memory": self.memory_s}
        terms |= {"ICI": self.ici_s, "DCN": self.dcn_s, "host": self.host_s}
        return max(terms, key=terms.get)


def _bytes(text: str) -> int:
    total = 0
    for match in _SHAPE.finditer(re.sub(r"\{[^{}]*\}", "", text)):
        dtype = match["dtype"]
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype) or 8)
        total += math.prod(int(d) for d in match["dims"].split(",") if d) * bits // 8
    return total


def _result(type_text: str, start: bool) -> str:
    """The result's type of a collective (an async start's tuple: its last element)."""
    text = type_text
    while re.search(r"\{[^{}]*\}", text):
        text = re.sub(r"\{[^{}]*\}", "", text)
    text = re.sub(r"/\*[^*]*\*/", "", text).strip()
    if start and text.startswith("("):
        depth, parts, current = 0, [], ""
        for ch in text[1:-1]:
            depth += ch == "("
            depth -= ch == ")"
            if ch == "," and depth == 0:
                parts.append(current)
                current = ""
            else:
                current += ch
        parts.append(current)
        return parts[-1]
    return text


def _first(type_text: str) -> str:
    """A send's payload: the first element of its (payload, context, token) tuple."""
    match = _SHAPE.search(type_text)
    return match.group(0) if match else ""


def replica_groups(line: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of one collective's HLO line: replica groups or permute pairs.

    Reads the three forms XLA writes: explicit (`{{0,1},{2,3}}`), iota
    (`[2,2]<=[4]`, `[2,2]<=[2,2]T(1,0)`) and mesh axes
    (`mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'b'}`). A collective that
    names none joins all `num_devices` devices of the program.
    """
    if found := _MESH_GROUPS.search(line):
        return _mesh_groups(found)
    found = _GROUPS.search(line)
    if found is None:
        return (tuple(range(num_devices)),)
    value = found.group(2)
    if iota := _IOTA.fullmatch(value):
        shape = [int(x) for x in iota.group(1).split(",")]
        ids = _iota(iota.group(2), iota.group(3))
        return tuple(tuple(g) for g in ids.reshape(shape[0], -1).tolist())
    groups = [
        tuple(int(x) for x in g.split(",") if x.strip())
        for g in re.findall(r"\{([\d,\s]*)\}", value)
    ]
    return tuple(g for g in groups if g) or (tuple(range(num_devices)),)


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """Device ids 0..n-1 laid out in `dims`, transposed by `perm`, flattened."""
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return (ids.transpose([int(p) for p in perm.split(",")]) if perm else ids).reshape(-1)


def _mesh_groups(found: re.Match) -> tuple[tuple[int, ...], ...]:
    """Groups named by mesh axes: the devices that differ only along the named axes."""
    axes = re.findall(r"'(\w+)'=(\d+)", found["axes"])
    sizes = [int(s) for _, s in axes]
    order = _iota(found["dims"], found["perm"]) if found["dims"] else np.arange(math.prod(sizes))
    named = set(re.findall(r"'(\w+)'", found["grouped"]))
    grouped = [i for i, (name, _) in enumerate(axes) if name in named]
    rest = [i for i in range(len(axes)) if i not in grouped]
    size = math.prod(sizes[i] for i in grouped)
    ids = order.reshape(sizes).transpose(rest + grouped).reshape(-1, size)
    return tuple(tuple(g) for g in ids.tolist())


def _slice_groups(line: str, slices: int) -> tuple[tuple[int, ...], ...]:
    """The slices a DCN transfer joins, from its megascale target; all of them where it names none."""
    if found := _TARGET_GROUPS.search(line):
        groups = {
            tuple(sorted({int(x) // _SLICE_ID - 1 for x in g.split(",") if x}))
            for g in re.findall(r"\{([\d,]*)\}", found["groups"])
        }
        return tuple(sorted(groups))
    if found := _TARGET_SLICES.search(line):
        return (tuple(int(x) - 1 for x in found["slices"].split(",")),)
    return (tuple(range(slices)),)


def ring_bytes(kind: str, nbytes: float, group: int) -> float:
    """The bytes each device sends for a collective of `nbytes` over `group` devices (rings)."""
    if group <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (group - 1) / group * nbytes
    if kind == "reduce-scatter":
        return (group - 1) * nbytes
    if kind == "collective-permute":
        return float(nbytes)
    return (group - 1) / group * nbytes  # all-gather, all-to-all


def _computations(hlo: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    entry = None
    for line in hlo.splitlines():
        if current is None:
            match = _HEADER.match(line)
            if match:
                current = found.setdefault(match["name"], [])
                if line.startswith("ENTRY"):
                    entry = match["name"]
        elif line.startswith("}"):
            current = None
        else:
            current.append(line)
    if entry is not None:
        found["__entry__"] = [entry]
    return found


def _trip_count(loop: str, comps: dict[str, list[str]]) -> int:
    """A counted loop's trip count: the one XLA proved (`known_trip_count` in the while's
    backend config), else the constant its condition compares the counter to. XLA:CPU
    and XLA:GPU wrap the comparison in a fusion the condition calls: it is read too."""
    if known := _KNOWN_TRIPS.search(loop):
        return int(known["n"])
    condition = re.search(r"condition=%([\w.\-]+)", loop)
    lines, seen = list(comps.get(condition[1], [])) if condition else [], set()
    for line in lines:  # grows with the computations the condition calls
        for match in _CALLS.finditer(line):
            for child in re.findall(r"%([\w.\-]+)", match["names"]):
                if child not in seen:
                    seen.add(child)
                    lines += comps.get(child, [])
    text = "\n".join(lines)
    if "direction=LT" not in text:
        return 1
    constants = [int(c) for c in re.findall(r"\bconstant\((\d+)\)", text)]
    return max(constants) if len(constants) == 1 else 1


def _multipliers(comps: dict[str, list[str]]) -> dict[str, int]:
    """How many times each computation runs per step: loop bodies by their trip counts."""
    entry = comps.get("__entry__", [None])[0]
    if entry is None:
        return {}
    runs = {entry: 1}
    queue = [entry]
    while queue:
        name = queue.pop()
        for line in comps.get(name, ()):
            trips = 1
            if " while(" in line:
                trips = _trip_count(line, comps)
            for match in _CALLS.finditer(line):
                if match["how"] == "to_apply":
                    continue
                times = runs[name] * (trips if match["how"] == "body" else 1)
                for child in re.findall(r"%([\w.\-]+)", match["names"]):
                    if runs.get(child, 0) < times:
                        runs[child] = times
                        queue.append(child)
    return runs


def flows(hlo: str, num_partitions: int, slices: int = 1) -> tuple[Flow, ...]:
    """The collectives of an optimized HLO module, each once, with how often a step runs it.

    A collective split over several computations (an async start and done,
    or the start, body and done of TPU's async collective fusion) counts once,
    by its kind and channel (XLA numbers channels per kind: a reduce-scatter
    and an all-gather may share one); a DCN transfer once, by its rendezvous.
    """
    comps = _computations(hlo)
    runs = _multipliers(comps)
    seen: dict[tuple[str, ...], Flow] = {}
    for comp, lines in comps.items():
        if comp == "__entry__":
            continue
        times = runs.get(comp, 1)
        for line in lines:
            match = _INSTR.match(line)
            if not match or (match["op"] == "send" and not _MEGASCALE.search(line)):
                continue
            key, flow = _flow(line, match, comp, times, num_partitions, slices)
            previous = seen.get(key)
            if previous is None or previous.times < times:
                seen[key] = flow
    return tuple(seen.values())


def _flow(
    line: str, match: re.Match, comp: str, times: int, num_partitions: int, slices: int
) -> tuple[tuple[str, ...], Flow]:
    """One collective instruction (or megascale send) as (its key, its `Flow`)."""
    if match["op"] == "send":
        kind = _MEGASCALE.search(line)["kind"].lower().replace("_", "-")
        kind = kind if kind in _KINDS else "collective-permute"
        groups = _slice_groups(line, slices)
        nbytes = _bytes(_first(match["type"]))
        key = ("DCN", (_RENDEZVOUS.search(line) or match)[0])
        return key, Flow(
            kind, "DCN", times, nbytes, ring_bytes(kind, nbytes, len(groups[0])), groups
        )
    kind = match["op"]
    channel = _CHANNEL.search(line)
    groups = replica_groups(line, num_partitions)
    nbytes = _bytes(_result(match["type"], bool(match["start"])))
    key = ("ICI", kind, channel["id"] if channel else f"{comp}/{match['name']}")
    return key, Flow(kind, "ICI", times, nbytes, ring_bytes(kind, nbytes, len(groups[0])), groups)


def traffic(hlo: str, num_partitions: int, slices: int = 1) -> tuple[Traffic, ...]:
    """The collectives of an optimized HLO module, by kind and link, per device and step."""
    totals: dict[tuple[str, str], list[float]] = {}
    for f in flows(hlo, num_partitions, slices):
        row = totals.setdefault((f.kind, f.link), [0, 0, 0.0])
        row[0] += f.times
        row[1] += f.times * f.bytes
        row[2] += f.times * f.wire_bytes
    return tuple(
        Traffic(kind, link, int(c), int(b), float(w))
        for (kind, link), (c, b, w) in sorted(totals.items())
    )


def estimate(
    chip: Chip,
    flops: float,
    hbm_bytes: float,
    flows: tuple[Traffic, ...],
    devices_per_chip: int = 1,
    host_bytes: float = 0.0,
    efficiency: float | None = None,
) -> Roofline:
    """The roofline's step time for one device's work on `chip` (see the module's docstring).

    `host_bytes` is what the device moves between host and device memory each
    way per step; the devices of one chip share its host link. `efficiency`
    is the share of peak FLOP/s compute runs at: by default `MATMUL_EFFICIENCY`
    for a TPU's published figures, 1 for figures measured here.
    """
    share = max(1, devices_per_chip)
    if efficiency is None:
        efficiency = MATMUL_EFFICIENCY if CHIPS.get(chip.name) == chip else 1.0
    ici = sum(t.wire_bytes for t in flows if t.link == "ICI")
    dcn = sum(t.wire_bytes for t in flows if t.link == "DCN")
    dcn_known = chip.dcn_bandwidth is not None
    host_known = chip.host_bandwidth is not None
    return Roofline(
        chip=chip,
        devices_per_chip=share,
        flops=flops,
        hbm_bytes=hbm_bytes,
        ici_bytes=ici,
        dcn_bytes=dcn,
        compute_s=flops / (chip.peak_flops * efficiency / share),
        memory_s=hbm_bytes / (chip.hbm_bandwidth / share),
        ici_s=ici / chip.ici_bandwidth,
        dcn_s=dcn / chip.dcn_bandwidth if dcn_known else 0.0,
        dcn_known=dcn_known or dcn == 0,
        host_bytes=host_bytes,
        host_s=host_bytes / (chip.host_bandwidth / share) if host_known else 0.0,
        host_known=host_known or host_bytes == 0,
        efficiency=efficiency,
    )


def by_link(flows: tuple[Traffic, ...]) -> Mapping[str, float]:
    """Wire bytes per device and step, by link."""
    out: dict[str, float] = {}
    for t in flows:
        out[t.link] = out.get(t.link, 0.0) + t.wire_bytes
    return out
