"""Islands of devices: the mesh DiLoCo cuts from an inner strategy, and the bytes that cross it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh

from spmd._src.errors import ConfigurationError, message, received
from spmd._src.explain import Collective, Explanation
from spmd._src.mesh import make_mesh, order_devices, resolve_devices
from spmd._src.roofline import flows, ring_bytes
from spmd._src.strategy.base import Strategy
from spmd._src.strategy.diloco_state import DiLoCoState

__all__ = [
    "ISLAND",
    "DiLoCoState",
    "IslandsExplanation",
    "crossing",
    "island_strategies",
]

ISLAND = "island"  # the outermost mesh axis: one index per island


def island_strategies(
    inner: Any,
    islands: int,
    *,
    devices: Sequence[Any] | None = None,
    rules: Sequence[Any] = (),
    batch_axes: Sequence[str] | None = None,
    logical_axis_rules: Sequence[Any] = (),
) -> tuple[Strategy, Strategy]:
    """The two strategies over the islands' mesh: (layout, synchronous).

    `layout` gives a state leaf its spec inside one island (its batch axes are the
    inner ones, so a partitioner never shards over islands); `synchronous` has the
    same mesh with `island` first among the batch axes: the global batch split over
    islands first, and the plain synchronous strategy DiLoCo is measured against.

    Args:
      inner: None (data parallel in each island), a mapping of one island's mesh
        axes ({"data": -1, "model": 2}), or a `Strategy` over every device, whose
        outermost batch axes are cut into islands.
      islands: the island count.
      devices: the devices, for a mapping or None; every device by default.
      rules, batch_axes, logical_axis_rules: one island's layout, for a mapping.
    """
    if isinstance(inner, Strategy):
        if devices is not None or rules or batch_axes is not None or logical_axis_rules:
            raise ConfigurationError(
                message(
                    "With inner=Strategy, the layout (devices, rules, batch axes) is the "
                    "strategy's own.",
                    received(inner=inner, devices=devices, rules=rules, batch_axes=batch_axes),
                    "put the devices and rules into the inner strategy, or pass inner as a "
                    'mesh mapping such as {"data": -1, "model": 2} with rules=... .',
                )
            )
        mesh = _carve(inner, islands)
        fields = {
            "rules": inner.rules,
            "placement": inner.placement,
            "strict": inner.strict,
            "logical_axis_rules": inner.logical_axis_rules,
            "_replicate_unmapped": inner._replicate_unmapped,
        }
        inner_batch = tuple(inner.batch_axes)
    else:
        axes = {"replica": -1} if inner is None else inner
        if not isinstance(axes, Mapping) or ISLAND in axes:
            raise ConfigurationError(
                message(
                    "inner is None, a spmd.Strategy, or a mapping of one island's mesh axes "
                    f"to sizes (without '{ISLAND}', which DiLoCo adds).",
                    received(inner=inner),
                    'pass e.g. inner={"data": -1, "model": 2} or inner=spmd.MirroredStrategy().',
                )
            )
        chosen = order_devices(resolve_devices(devices) if devices is not None else _all())
        if len(chosen) % islands:
            raise ConfigurationError(
                message(
                    f"The devices must split evenly into {islands} islands.",
                    received(devices=len(chosen), islands=islands),
                    f"pick an island count that divides {len(chosen)}.",
                )
            )
        mesh = make_mesh({ISLAND: islands, **axes}, chosen)
        names = tuple(axes)
        inner_batch = names[:1] if batch_axes is None else tuple(batch_axes)
        fields = {"rules": rules, "logical_axis_rules": logical_axis_rules}
        fields["_replicate_unmapped"] = inner is None
    layout = Strategy(mesh, batch_axes=inner_batch, name="DiLoCo", **fields)
    synchronous = Strategy(
        mesh, batch_axes=(ISLAND, *inner_batch), name="DiLoCo.synchronous", **fields
    )
    return layout, synchronous


def _all() -> list[Any]:
    return list(jax.devices())


def _carve(inner: Strategy, islands: int) -> Mesh:
    """The inner strategy's mesh with `islands` cut from its outermost (batch) axes."""
    if ISLAND in inner.mesh.shape:
        raise ConfigurationError(
            message(
                f"The inner strategy's mesh must not have an axis named '{ISLAND}': DiLoCo adds it.",
                received(mesh_axes=inner.mesh.axis_names),
                "rename that axis of the inner strategy's mesh.",
            )
        )
    shape, left = [], islands
    for name, size in inner.mesh.shape.items():
        if left > 1 and name not in inner.batch_axes:
            left = -1
            break
        cut = np.gcd(size, left) if left > 1 else 1
        if left > 1 and cut not in (size, left):
            left = -1
            break
        shape.append(size // cut)
        left //= cut
    if left != 1:
        raise ConfigurationError(
            message(
                f"DiLoCo cuts its {islands} islands from the inner strategy's outermost batch "
                "axes, whose sizes must divide (or be divided by) the island count in turn.",
                received(islands=islands, mesh=dict(inner.mesh.shape), batch_axes=inner.batch_axes),
                "pick an island count that divides the outer batch axes (e.g. the process "
                "count for MultiWorkerMirroredStrategy), or pass inner as a mapping of one "
                "island's axes.",
            )
        )
    devices = inner.mesh.devices.reshape((islands, *shape))
    types = (AxisType.Auto, *inner.mesh.axis_types)
    return Mesh(devices, (ISLAND, *inner.mesh.axis_names), axis_types=types)


# -- what crosses between islands ----------------------------------------------


def crossing(hlo_text: str, islands: int, devices: Sequence[Any]) -> dict[str, Collective]:
    """The collectives of a compiled program that cross between islands, per device and step.

    Islands are the outermost equal parts of the program's mesh (`devices`, in
    mesh order). XLA compiles one program per TPU slice: a collective in it
    joins devices by their place in the slice (islands outermost), and a
    data-center-network transfer (a megascale send) joins slices. A
    collective whose groups span k islands, m devices (or slices) in each,
    counts the bytes each device sends across when the collective runs
    inside each island first and across islands second, as XLA's multi-slice
    collectives do: a ring over the k islands of its part (1/m of an
    all-reduce's or all-gather's bytes). A loop's collective counts once per
    iteration.

    Returns:
      kind -> `Collective` (count; bytes: sent across islands per device).
    """
    n = len(devices)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    found: dict[str, list[float]] = {}
    for flow in flows(hlo_text, n // slices, slices):
        span = n if flow.link == "ICI" else slices  # ids in the program, or slice indices
        spread = _spread(flow.groups, islands, span)
        if spread is None:
            continue
        k, m = spread
        part = flow.bytes / m if flow.kind in ("all-reduce", "all-gather") else flow.bytes
        counts = found.setdefault(flow.kind, [0, 0.0])
        counts[0] += flow.times
        counts[1] += flow.times * ring_bytes(flow.kind, part, k)
    return {kind: Collective(kind, int(c), round(b)) for kind, (c, b) in found.items()}


def _spread(groups: Sequence[Sequence[int]], islands: int, span: int) -> tuple[int, int] | None:
    """(islands, members in each) of the first group that spans islands; None if none does."""
    for group in groups:
        members = Counter(member * islands // span for member in group)
        if len(members) > 1:
            return len(members), max(members.values())
    return None


@dataclass(frozen=True)
class IslandsExplanation:
    """What DiLoCo's programs cost, and the bytes that cross between islands per step.

    Attributes:
      inner: the inner step's program (every island's step at once).
      sync: the synchronisation programs, one per fragment.
      synchronous: the same step trained synchronously on the same mesh.
      sync_every: H, inner steps between two synchronisations of a fragment.
      inner_crossing, sync_crossing, synchronous_crossing: kind -> `Collective` of
        the collectives whose device groups span islands, per program (summed
        over the fragments' programs for `sync_crossing`).
    """

    inner: Explanation
    sync: tuple[Explanation, ...]
    synchronous: Explanation
    sync_every: int
    inner_crossing: Mapping[str, Collective]
    sync_crossing: Mapping[str, Collective]
    synchronous_crossing: Mapping[str, Collective]

    @property
    def bytes_across_islands_per_step(self) -> float:
        """Bytes per device that cross between islands, averaged over H steps."""
        inner = sum(c.bytes for c in self.inner_crossing.values())
        return inner + sum(c.bytes for c in self.sync_crossing.values()) / self.sync_every

    @property
    def synchronous_bytes_across_islands_per_step(self) -> int:
        """The same for synchronous training on the same mesh: every step's all-reduce."""
        return sum(c.bytes for c in self.synchronous_crossing.values())

    @property
    def ratio(self) -> float:
        """DiLoCo's bytes across islands per step over synchronous training's (1/H)."""
        sync = self.synchronous_bytes_across_islands_per_step
        return self.bytes_across_islands_per_step / sync if sync else float("nan")

    def __str__(self) -> str:
        def kinds(found: Mapping[str, Collective]) -> str:
            return ", ".join(f"{c.kind} x{c.count} {c.bytes:,} B" for c in found.values()) or "none"

        rows = {
            "inner step:": self.inner_crossing,
            f"sync (every {self.sync_every}):": self.sync_crossing,
            "synchronous step:": self.synchronous_crossing,
        }
        width = max(len(label) for label in rows) + 2  # the values in one column
        return "\n".join(
            [
                "DiLoCo, bytes across islands per device:",
                *(f"  {label.ljust(width)}{kinds(found)}" for label, found in rows.items()),
                f"  per step: {self.bytes_across_islands_per_step:,.1f} B vs synchronous "
                f"{self.synchronous_bytes_across_islands_per_step:,} B (ratio {self.ratio:.4f})",
            ]
        )


def fragment_tree(params_def: Any, values: Sequence[Any], fragment: tuple[int, ...]) -> Any:
    """One fragment's values in the parameters' own tree, as the outer optimizer sees them.

    The fragment's leaves (`values`, in the order of `fragment`) stand where they
    are in the tree; the other fragments' leaves are `optax.MaskedNode()`, as
    `optax.masked` leaves a masked-out parameter, so that an outer optimizer
    choosing leaves by path (`optax.multi_transform`, `optax.masked`) sees the
    tree it was written for. With one fragment this is the parameters' tree.
    """
    chosen = dict(zip(fragment, values, strict=True))
    return params_def.unflatten(
        [chosen.get(i, optax.MaskedNode()) for i in range(params_def.num_leaves)]
    )
