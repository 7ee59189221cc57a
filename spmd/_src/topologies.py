"""TPU slices this process does not have: their abstract devices, for compiling without a TPU.

`spmd.topology("v5p-256")` asks JAX's TPU compiler (the `libtpu` package, the
`tpu-compile` extra) for the devices of a slice as Cloud TPU names it. A
strategy built on them lays out a mesh, computes abstract states and compiles
steps for that slice (`strategy.explain`); it cannot run
them, and says so.

Each chip's published figures (peak bf16 FLOP/s, HBM capacity and bandwidth,
ICI and DCN bandwidth) are in `CHIPS`, with the Cloud TPU page each comes from.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from spmd._src.errors import ConfigurationError, message, received

__all__ = [
    "CHIPS",
    "HOST_LINK_SOURCE",
    "Chip",
    "Topology",
    "check_placeable",
    "check_runnable",
    "chip_of",
    "compile_only",
    "compiler_hbm",
    "devices_per_chip",
    "eager_refused",
    "hbm_refusal",
    "is_name",
    "topology",
]

_GB = 1e9
_GIB = 1 << 30

# Cloud TPU's system-architecture pages give no host (PCIe) bandwidth; the JAX team's
# book does: "PCIe bandwidth for TPU v4 is 16GB / second each way", "PCIe bandwidth is
# typically around 1.5e10 bytes / second per chip", "Trillium (TPU v6e) has 32GB/s".
HOST_LINK_SOURCE = "https://jax-ml.github.io/scaling-book/tpus/ (PCIe: per chip, each way)"
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "v5": "v5p", "trillium": "v6e"}
FORMS = (
    '"v5p-256" (v4/v5p: -N counts TensorCores, two per chip: 128 chips)',
    '"v5e-16", "v5litepod-16", "v6e-64" (-N counts chips)',
    '"v5p:4x4x8", "v5e:16x16", "v6e:8x8", "v4:2x2x1" (the chips\' torus shape)',
)
# The slices Cloud TPU offers, one ICI domain each. 2-D (v5e, v6e): these shapes, up to a
# 256-chip pod (cloud.google.com/tpu/docs/v5e, /v6e). 3-D (v4, v5p): 2x2x1, 2x2x2, 2x2x4 and
# 2x4x4, then whole 4x4x4 cubes, every side a multiple of 4 (cloud.google.com/tpu/docs/v4,
# /types-topologies), up to `Chip.max_slice_chips`. An -N name takes the most cube-like shape
# of its cubes (fewest chips on the longest side, then on the middle one) with no side over
# 256 chips: this gives every v4 and v5p entry of MaxText's table of accelerator names,
# src/maxtext/utils/accelerator_to_spec_map.py (108 of them), and none it leaves out.
_SHAPES_2D = ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))
_SMALL_3D = ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4))
_CUBE = 4
_LONGEST_SIDE = 256
_NAME = re.compile(r"(v\d+[a-z]*|trillium)\s*([-:])\s*(\d+(?:x\d+)*)")
_CACHE: dict[tuple[str, int, bool], Any] = {}
# The most chips a topology describes, over all its slices. libtpu and JAX hold every
# abstract device in memory (about 5 KB each: 0.7 GB and ~15 s at this bound, measured
# on v5e-256 x 512); the largest Cloud TPU jobs published hold ~50,000 chips. Past it a
# mistyped slice count would allocate until the kernel ends the process.
MAX_CHIPS = 1 << 17
_SIZE = r"([\d.]+)\s*([KMGT]?)i?B?"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_REQUIRED = (
    re.compile(r"required for HLO temporaries \(" + _SIZE + r"\) exceeds available HBM"),
    re.compile(r"Used " + _SIZE + r" of [\d.]+\s*[KMGT]?i?B? hbm"),
)
_AVAILABLE = (
    re.compile(r"exceeds available HBM \(" + _SIZE + r"\)"),
    re.compile(r"Used [\d.]+\s*[KMGT]?i?B? of " + _SIZE + r" hbm"),
)
_HBM: dict[str, int] = {}


@dataclass(frozen=True)
class Chip:
    """One TPU generation's published per-chip figures, the roofline's constants.

    Attributes:
      name: Cloud TPU's name of the generation ("v5p", "v5e", ...).
      device_kind: what `jax.Device.device_kind` says for it.
      peak_flops: peak bf16 FLOP/s of one chip.
      hbm_bytes: HBM capacity of one chip, in bytes.
      hbm_bandwidth: HBM bytes/s of one chip.
      ici_bandwidth: inter-chip interconnect bytes/s of one chip, one direction.
      dcn_bandwidth: data-center network bytes/s per chip (between slices),
        or None where Cloud TPU publishes no figure.
      cores_per_chip: TensorCores per chip. JAX on a TPU VM drives v4's and
        v5p's two as one device (megacore), as `topology` does by default.
      dims: 3 for a 3-D torus (v4, v5p: the -N name counts TensorCores, two per
        chip), 2 for a 2-D torus (v5e, v6e: the -N name counts chips).
      source: where the figures are published.
      max_slice_chips: the most chips one slice (one ICI domain) has; larger
        jobs are several slices joined over DCN.
      host_bandwidth: bytes/s between one chip's HBM and its host's memory
        (PCIe), each way, or None where no figure is known. Cloud TPU's pages
        publish none: the figures are those of the JAX team's "How to Scale
        Your Model" (`HOST_LINK_SOURCE`).
    """

    name: str
    device_kind: str
    peak_flops: float
    hbm_bytes: int
    hbm_bandwidth: float
    ici_bandwidth: float
    dcn_bandwidth: float | None
    cores_per_chip: int
    dims: int
    source: str
    max_slice_chips: int = 1
    host_bandwidth: float | None = None


# Figures from Cloud TPU's public system-architecture pages (see docs/planning.md).
CHIPS: dict[str, Chip] = {
    "v4": Chip(
        name="v4",
        device_kind="TPU v4",
        peak_flops=275e12,
        hbm_bytes=32 * _GIB,
        hbm_bandwidth=1200 * _GB,
        # Not published per chip: the pod's all-reduce bandwidth (1.1 PB/s) over its 4096 chips.
        ici_bandwidth=1.1e15 / 4096,
        dcn_bandwidth=None,
        cores_per_chip=2,
        dims=3,
        source="https://cloud.google.com/tpu/docs/v4 (ICI: the pod's all-reduce bandwidth "
        "over its 4096 chips)",
        max_slice_chips=4096,  # the v4 pod
        host_bandwidth=16 * _GB,  # HOST_LINK_SOURCE: "16GB / second each way"
    ),
    "v5e": Chip(
        name="v5e",
        device_kind="TPU v5 lite",
        peak_flops=197e12,
        hbm_bytes=16 * _GB,
        hbm_bandwidth=819 * _GB,
        ici_bandwidth=1600e9 / 8,  # 1600 Gbps
        dcn_bandwidth=2 * 100e9 / 8 / 8,  # 2 x 100 Gbps NICs per host of 8 chips
        cores_per_chip=1,
        dims=2,
        source="https://cloud.google.com/tpu/docs/v5e and https://cloud.google.com/tpu/docs/v6e "
        "(its v5e column: NICs per host, over 8 chips)",
        max_slice_chips=256,  # the v5e pod
        host_bandwidth=15 * _GB,  # HOST_LINK_SOURCE: "typically around 1.5e10 bytes / second"
    ),
    "v5p": Chip(
        name="v5p",
        device_kind="TPU v5",
        peak_flops=459e12,
        hbm_bytes=95 * _GIB,
        hbm_bandwidth=2765 * _GB,
        ici_bandwidth=4800e9 / 8,  # 4800 Gbps
        dcn_bandwidth=50e9 / 8,  # 50 Gbps per chip
        cores_per_chip=2,
        dims=3,
        source="https://cloud.google.com/tpu/docs/v5p",
        max_slice_chips=6144,  # "The maximum v5p shape is 16x16x24 (6144 chips)"
        host_bandwidth=15 * _GB,  # HOST_LINK_SOURCE: no v5p figure; its "typical" one
    ),
    "v6e": Chip(
        name="v6e",
        device_kind="TPU v6 lite",
        peak_flops=918e12,
        hbm_bytes=32 * _GB,
        hbm_bandwidth=1640 * _GB,
        ici_bandwidth=3584e9 / 8,  # 3584 Gbps
        dcn_bandwidth=4 * 200e9 / 8 / 8,  # 4 x 200 Gbps NICs per host of 8 chips
        cores_per_chip=1,
        dims=2,
        source="https://cloud.google.com/tpu/docs/v6e (DCN: NICs per host, over 8 chips)",
        max_slice_chips=256,  # the v6e pod
        host_bandwidth=32 * _GB,  # HOST_LINK_SOURCE: "Trillium (TPU v6e) has 32GB/s"
    ),
}


def chip_of(device: Any) -> Chip | None:
    """The `Chip` of a TPU device (real or abstract), None for any other device."""
    if getattr(device, "platform", None) != "tpu":
        return None
    kind = str(getattr(device, "device_kind", ""))
    for chip in CHIPS.values():
        if kind == chip.device_kind:
            return chip
    for chip in CHIPS.values():  # e.g. "TPU v5p" where a runtime spells it so
        if kind.lower().endswith(chip.name):
            return chip
    return None


@dataclass(frozen=True, eq=False)
class Topology(Sequence):
    """The abstract devices of a TPU slice (or of several), to compile for without a TPU.

    A sequence of devices: pass it wherever a strategy or `make_mesh` takes
    devices. Strategies built on it compile steps (`strategy.explain`,
    `step.lower`) and compute abstract states, but cannot place or run anything.

    Attributes:
      name: the name it was asked for, as given.
      chip: the generation's published figures (`Chip`).
      shape: the chips' torus shape in one slice, e.g. (4, 4, 8).
      slices: how many slices, joined over the data-center network (DCN).
      devices: the abstract `jax.Device`s, slice by slice.
    """

    name: str
    chip: Chip
    shape: tuple[int, ...]
    slices: int
    devices: tuple[Any, ...]

    def __len__(self) -> int:
        return len(self.devices)

    def __getitem__(self, index):  # type: ignore[override]
        return self.devices[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.devices)

    @property
    def chips(self) -> int:
        """Chips over every slice."""
        return math.prod(self.shape) * self.slices

    @property
    def jax_name(self) -> str:
        """The name `jax.experimental.topologies.get_topology_desc` takes, e.g. "v5p:4x4x8"."""
        return f"{self.chip.name}:{'x'.join(map(str, self.shape))}"

    def __repr__(self) -> str:
        slices = f", slices={self.slices}" if self.slices > 1 else ""
        return (
            f"Topology({self.name!r}: {self.jax_name}{slices}, {self.chips} chips, "
            f"{len(self.devices)} devices)"
        )


def _bad_name(name: Any, why: str) -> ConfigurationError:
    return ConfigurationError(
        message(
            f"A TPU topology is named as Cloud TPU names it ({why}); accepted forms: "
            + "; ".join(FORMS)
            + f". Generations: {sorted(CHIPS)}.",
            received(name=name),
            'pass e.g. spmd.topology("v5p-256") or spmd.topology("v5e:16x16", slices=2).',
        )
    )


def _cubes(chips: int) -> tuple[int, ...] | None:
    """The shape of an -N slice of `chips` v4/v5p chips made of whole cubes, or None."""
    if chips % _CUBE**3:
        return None
    n = chips // _CUBE**3
    shapes = [
        (a, b, n // (a * b))
        for a in range(1, n + 1)
        for b in range(a, n + 1)
        if n % (a * b) == 0 and n // (a * b) >= b
    ]
    a, b, c = min(shapes, key=lambda t: (t[2], t[1]))
    return None if c * _CUBE > _LONGEST_SIDE else (a * _CUBE, b * _CUBE, c * _CUBE)


def _shape_of(chip: Chip, chips: int) -> tuple[int, ...] | None:
    """The shape of the -N slice of `chips` chips Cloud TPU offers, or None."""
    if chips < 1 or chips > chip.max_slice_chips:
        return None
    if chip.dims == 2:
        return next((s for s in _SHAPES_2D if math.prod(s) == chips), None)
    small = next((s for s in _SMALL_3D if math.prod(s) == chips), None)
    return small or _cubes(chips)


def _offered(chip: Chip, shape: tuple[int, ...]) -> bool:
    """Whether a torus shape is one Cloud TPU offers as one slice (either order of its sides)."""
    if math.prod(shape) > chip.max_slice_chips:
        return False
    if chip.dims == 2:
        return tuple(sorted(shape)) in _SHAPES_2D
    if tuple(sorted(shape, reverse=True)) in {tuple(sorted(s, reverse=True)) for s in _SMALL_3D}:
        return True
    return all(s % _CUBE == 0 and s <= _LONGEST_SIDE for s in shape)


def _accelerator_name(chip: Chip, chips: int) -> str:
    return f"{chip.name}-{chips * (2 if chip.dims == 3 else 1)}"


def _not_offered(name: Any, chip: Chip, chips: int, shape: str = "") -> ConfigurationError:
    """No such slice: the sizes there are, or the slices that make the count."""
    sizes = [c for c in range(1, chip.max_slice_chips + 1) if _shape_of(chip, c) is not None]
    listed = ", ".join(map(str, sizes[:12])) + (", ..." if len(sizes) > 12 else "")
    fix = f"pick a {chip.name} slice of {listed} chips (largest: {sizes[-1]})"
    if chips > chip.max_slice_chips:
        why = f"one {chip.name} slice has at most {chip.max_slice_chips} chips, one ICI domain"
        large = [c for c in reversed(sizes) if c * 8 >= chip.max_slice_chips]
        joined = next((c for c in large if chips % c == 0), None)
        if chips > MAX_CHIPS:
            fix = f"compile for at most {MAX_CHIPS} chips over all slices, e.g. "
            fix += f'spmd.topology("{_accelerator_name(chip, sizes[-1])}", '
            fix += f"slices={MAX_CHIPS // sizes[-1]})"
        elif joined:
            fix = (
                f"{chips} chips are {chips // joined} slices of {joined} joined over the "
                f'data-center network: spmd.topology("{_accelerator_name(chip, joined)}", '
                f"slices={chips // joined})"
            )
        else:
            fix += ", and pass slices= for several"
    elif shape and chip.dims == 3 and chips > math.prod(_SMALL_3D[-1]):
        why = f"past 32 chips a {chip.name} slice is whole 4x4x4 cubes: each side a multiple of 4"
    else:
        why = f"Cloud TPU offers no {chip.name} slice " + (
            f"of shape {shape}" if shape else f"of {chips} chips"
        )
    return ConfigurationError(
        message(
            f"A topology names a slice Cloud TPU offers ({why}).",
            received(name=name, chips=chips),
            fix + ".",
        )
    )


def is_name(text: Any) -> bool:
    """Whether `text` has the form of a Cloud TPU slice name ("v5p-256", "v5e:4x4")."""
    return isinstance(text, str) and _NAME.fullmatch(text.strip().lower()) is not None


def parse(name: Any) -> tuple[Chip, tuple[int, ...]]:
    """A Cloud TPU accelerator or topology name as (chip, torus shape of one slice).

    Raises:
      ConfigurationError: the name is none of the accepted forms (listed), or
        names a slice Cloud TPU does not offer (larger than one ICI domain:
        the message says how many slices make it).
    """
    if not isinstance(name, str):
        raise _bad_name(name, "a string")
    text = name.strip().lower()
    match = _NAME.fullmatch(text)
    if not match:
        raise _bad_name(name, "generation, then -N or :AxBxC")
    generation, sep, size = match.groups()
    chip = CHIPS.get(_ALIASES.get(generation, generation))
    if chip is None:
        raise _bad_name(name, f"unknown generation {generation!r}")
    if "x" in size or sep == ":":
        shape = tuple(int(s) for s in size.split("x"))
        if len(shape) != chip.dims or min(shape) < 1:
            raise _bad_name(name, f"{chip.name} slices have {chip.dims} dimensions")
        if not _offered(chip, shape):
            raise _not_offered(name, chip, math.prod(shape), "x".join(map(str, shape)))
        return chip, shape
    count = int(size)
    per_chip = 2 if chip.dims == 3 else 1  # v4/v5p names count TensorCores
    if count < 1 or count % per_chip:
        what = "TensorCores, a positive even number" if per_chip == 2 else "chips, at least 1"
        raise _bad_name(name, f"{chip.name}-N counts {what}")
    shape = _shape_of(chip, count // per_chip)
    if shape is None:
        raise _not_offered(name, chip, count // per_chip)
    return chip, shape


def topology(name: str, slices: int = 1, *, megacore: bool = True) -> Topology:
    """The abstract devices of a Cloud TPU slice, to compile for on any machine.

    Needs the TPU compiler (`pip install "spmd[tpu-compile]"`, which installs
    `libtpu` at the version jax pins); no TPU.

    Args:
      name: as Cloud TPU names it: "v5p-256" (v4 and v5p count TensorCores,
        two per chip: 128 chips), "v5e-16" / "v5litepod-16" / "v6e-64" (chips),
        or the torus shape "v5p:4x4x8", "v5e:16x16".
      slices: how many such slices, joined over the data-center network (a
        multi-slice job); a mesh on them puts the slices outermost.
      megacore: v4 and v5p chips hold two TensorCores, which JAX on a TPU VM
        and MaxText's AOT compile (`chip_config_name="megacore"`) drive as
        one device with the chip's HBM: one device per chip, as here by
        default. `megacore=False` (v4 only) gives one device per TensorCore,
        each with half the HBM.

    Returns:
      A `Topology`: a sequence of abstract devices with the chip's figures.

    Raises:
      ConfigurationError: the name is not one of the accepted forms, names no
        slice Cloud TPU offers (more chips than one ICI domain holds: use
        `slices`), slices is not a positive integer, the slices hold more
        than 131,072 chips in all (every abstract device is kept in memory),
        or the TPU compiler is not installed.

    Example:
      >>> strategy = spmd.TPUStrategy(topology=spmd.topology("v5p-256"))
    """
    from spmd._src.validate import positive_int

    positive_int(slices, "slices", fix="pass slices=1 for one slice, 2 for two, ...")
    chip, shape = parse(name)
    _check_total(name, math.prod(shape), slices)
    jax_name = f"{chip.name}:{'x'.join(map(str, shape))}"
    options = _host_bounds(shape) | _chip_config(name, chip, megacore)
    key = (jax_name, int(slices), megacore)
    if key not in _CACHE:
        _CACHE[key] = _describe(name, jax_name, int(slices), options)
    return Topology(name, chip, shape, int(slices), tuple(_CACHE[key].devices))


def _check_total(name: str, chips: int, slices: int) -> None:
    """Raises where `slices` slices of `chips` chips are more than `MAX_CHIPS` in all."""
    if chips * slices <= MAX_CHIPS:
        return
    raise ConfigurationError(
        message(
            f"A topology holds at most {MAX_CHIPS} chips over all its slices: libtpu and JAX "
            "keep every abstract device in memory (about 5 KB each), and the largest "
            "Cloud TPU jobs hold about 50,000 chips.",
            received(name=name, slices=slices, chips=chips * slices),
            f"pass slices <= {MAX_CHIPS // chips} for {chips}-chip slices ({name}).",
        )
    )


def _chip_config(name: str, chip: Chip, megacore: Any) -> dict[str, Any]:
    """libtpu's chip configuration: megacore (a chip's two TensorCores as one device), or not.

    MaxText's `accelerator_to_spec_map.py` names "megacore" for v4 and v5p;
    libtpu's own default is per TensorCore on v4 (it has no other on v5p).
    """
    if not isinstance(megacore, bool) or (not megacore and chip.name != "v4"):
        raise ConfigurationError(
            message(
                "megacore is True (a chip's two TensorCores as one device, as JAX runs v4 "
                "and v5p) or, for v4 only, False (one device per TensorCore); v5e and v6e "
                "have one TensorCore per chip, and libtpu runs v5p only as megacore.",
                received(topology=name, megacore=megacore),
                "leave megacore=True (the default).",
            )
        )
    return {"chip_config_name": "megacore"} if chip.cores_per_chip == 2 and megacore else {}


def _host_bounds(shape: tuple[int, ...]) -> dict[str, Any]:
    """libtpu's chips per host for a slice: its default (2x2x1) divides all but one chip."""
    return {"chips_per_host_bounds": (1, 1, 1)} if math.prod(shape) == 1 else {}


def _describe(name: str, jax_name: str, slices: int, options: dict[str, Any]) -> Any:
    try:
        import libtpu  # noqa: F401
    except ImportError as e:
        raise ConfigurationError(
            message(
                "Compiling for a TPU topology needs the TPU compiler, the `libtpu` package "
                "(no TPU is needed).",
                received(topology=name, missing="libtpu"),
                'pip install "spmd[tpu-compile]" (or "jax[tpu]" at the installed jax version).',
            )
        ) from e
    import os

    from spmd._src.clusters.tpu_backend import quiet_libtpu_without_chips

    # Compiling takes no TPU: let every process that compiles load libtpu at once
    # (it otherwise takes a machine-wide lock meant for processes that drive chips).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    quiet_libtpu_without_chips()  # no "unexpected worker hostname" lines on every call
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(
            topology_name=jax_name, platform="tpu", num_slices=slices, **options
        )
    except Exception as e:  # the TPU compiler refuses the shape
        raise ConfigurationError(
            message(
                "The TPU compiler (libtpu) describes this topology.",
                received(topology=name, as_jax_names_it=jax_name, slices=slices, error=str(e)),
                "use a shape Cloud TPU offers for that generation (its docs list them), e.g. "
                "v5p:4x4x8 or v5e:16x16"
                + (
                    "; another process holds libtpu's lock: set ALLOW_MULTIPLE_LIBTPU_LOAD=1."
                    if "lockfile" in str(e)
                    else "."
                ),
            )
        ) from e


def compile_only(devices: Sequence[Any]) -> bool:
    """Whether some of `devices` are not this process's to run on (an abstract topology's)."""
    import jax

    live: dict[str, set] = {}
    for device in devices:
        platform = getattr(device, "platform", None)
        if platform not in live:
            try:  # this process's devices of that platform, whichever backend is the default
                live[platform] = set(jax.devices(platform))
            except RuntimeError:  # no such backend here: a topology's abstract devices
                live[platform] = set()
        if device not in live[platform]:
            return True
    return False


def _is_compile_only(strategy: Any) -> bool:
    """`compile_only` of a strategy's devices, cached on it (a dict lookup after the first)."""
    cache = strategy.__dict__
    if "_compile_only" not in cache:
        cache["_compile_only"] = compile_only(list(strategy.mesh.devices.flat))
    return cache["_compile_only"]


def check_runnable(strategy: Any, what: str) -> None:
    """Raises if `strategy` is built on an abstract topology: it compiles, it cannot run."""
    if _is_compile_only(strategy):
        raise _cannot_run(what, strategy=repr(strategy))


def _ran_on_abstract(error: BaseException) -> bool:
    """Whether `error` is JAX's when asked to run on compile-only devices: an eager op's
    (its executable has no devices) or a transfer's (the compile-only client has none)."""
    text = str(error)
    return "compile-only" in text or (isinstance(error, AttributeError) and "local_devices" in text)


@contextlib.contextmanager
def eager_refused(strategy: Any) -> Iterator[None]:
    """Inside a topology strategy's scope, an eager computation is a clear error.

    Under `strategy.scope()` JAX runs eager code (building a flax model,
    `jnp.ones`) on the mesh's devices; an abstract topology's cannot run it.

    Raises:
      ConfigurationError: such code ran (from JAX's own error).
    """
    try:
        yield
    except Exception as e:
        if not _ran_on_abstract(e) or not _is_compile_only(strategy):
            raise
        raise ConfigurationError(
            message(
                "Code inside strategy.scope() ran a computation eagerly (building a flax "
                "model, jnp.ones(...), ...); this strategy is built on an abstract TPU "
                "topology, whose devices compile but cannot run.",
                received(strategy=repr(strategy), error=str(e).splitlines()[0]),
                "build the state abstractly: state = strategy.abstract_state(create_fn) "
                "(create_fn builds the model, e.g. nnx.Linear(4, 4, rngs=nnx.Rngs(0))), or "
                "model = nnx.eval_shape(lambda: nnx.Linear(4, 4, rngs=nnx.Rngs(0))) inside "
                "the scope.",
            )
        ) from e


def check_placeable(tree: Any, what: str) -> None:
    """Raises if some leaf of `tree` is laid out on an abstract topology's devices."""
    import jax

    devices = {
        device
        for leaf in jax.tree.leaves(tree)
        for device in getattr(getattr(leaf, "sharding", None), "device_set", ())
    }
    if devices and compile_only(sorted(devices, key=lambda d: d.id)):
        raise _cannot_run(what, target=f"a state laid out on {len(devices)} abstract TPU devices")


def _cannot_run(what: str, **got: Any) -> ConfigurationError:
    return ConfigurationError(
        message(
            f"{what} needs devices this process has; this strategy is built on an abstract "
            "TPU topology, which compiles but cannot run.",
            received(**got, what=what),
            "use state = strategy.abstract_state(create_fn, *args) for the state, and "
            "strategy.explain(step, state, *batch) or step.lower(state, *batch)[0].compile() "
            "(lower returns the Lowered program and the state's pure pytree) for the program; "
            "run on the TPU slice itself with a strategy built on its devices "
            "(spmd.TPUStrategy()).",
        )
    )


def _size(match: re.Match) -> int:
    return int(float(match[1]) * _UNITS[match[2]])


def hbm_refusal(error: BaseException) -> int | None:
    """The bytes the TPU compiler says a program needs, if `error` is its out-of-HBM refusal."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text:
        return None
    for pattern in _REQUIRED:
        if match := pattern.search(text):
            return _size(match)
    return None


def devices_per_chip(device: Any) -> int:
    """How many devices one TPU chip shows as: 2 for v4 per TensorCore, else 1 (megacore)."""
    chip = chip_of(device)
    cores = getattr(device, "num_cores", None)  # TensorCores one device drives
    if chip is None or not isinstance(cores, int) or cores < 1:
        return 1
    return max(1, chip.cores_per_chip // cores)


def compiler_hbm(device: Any) -> int:
    """The HBM one TPU device has for a program, as the TPU compiler counts it.

    Read once per device kind (and cores per device) from the compiler's own
    refusal of a program larger than any chip (v5e: 15.75 GiB, v5p: 95.74 GiB,
    a v4 chip 30.75 GiB, one of its TensorCores 15.25 GiB); the published
    figure (`Chip.hbm_bytes`) where the compiler does not say.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    kind = f"{device.device_kind}/{devices_per_chip(device)}"
    if kind not in _HBM:
        chip = chip_of(device)
        fallback = chip.hbm_bytes // devices_per_chip(device) if chip else 0
        mesh = Mesh(np.array([device]), ("one",))
        too_big = jax.jit(
            lambda: jnp.zeros((1 << 42,), jnp.int8),
            out_shardings=NamedSharding(mesh, PartitionSpec()),
        )
        try:
            too_big.lower().compile()
            _HBM[kind] = fallback
        except Exception as e:
            found = [m for p in _AVAILABLE if (m := p.search(str(e)))]
            _HBM[kind] = _size(found[0]) if found else fallback
    return _HBM[kind]
