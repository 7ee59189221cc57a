"""JAX's TPU backend on a host with no TPU chip: never started, so libtpu says nothing.

With libtpu installed (`jax[tpu]`, spmd's `tpu-compile` extra), JAX tries its
TPU backend on every host when its backends start. On a host with no TPU chip,
libtpu's initialization prints five lines to stderr (`Failed to find host
bounds for accelerator type: ...`, `WARNING: Logging before InitGoogle() ...`,
`E0000 ... unexpected worker hostname ...` and a source location trace), then
fails, and JAX goes on with the CPU. JAX knows there is no chip (its
`hardware_utils.num_available_tpu_chips_and_device_id` reads the PCI devices;
`cloud_tpu_init` sets `jax_platforms="tpu,cpu"` only where it finds some) but
tries the backend anyway, and neither JAX nor libtpu has a setting that skips
it other than `jax_platforms` (JAX_PLATFORMS), which also makes every other
backend's failure an error.

`skip_without_chips()` wraps the TPU backend's factory in JAX's registry:
where JAX finds no chip, no TPU device node exists (/dev/accel*, /dev/vfio/*),
`jax_platforms` is not set and JAX_FORCE_TPU_INIT is not set, the factory
fails at once without loading libtpu, as a backend without its hardware does
(quietly: JAX logs it at INFO level and starts the others, CUDA's included).
Anything else goes to JAX's factory as before. Compiling for a TPU topology
(`spmd.topology`) loads libtpu through `jax.experimental.topologies`, which
this leaves alone; `quiet_libtpu_without_chips()` gives libtpu, on such a
host, the two variables whose absence it prints those lines about.
"""

from __future__ import annotations

import dataclasses
import glob
import os

__all__ = ["NO_CHIP", "quiet_libtpu_without_chips", "skip_without_chips"]

NO_CHIP = (
    "this host has no TPU chip (no Google TPU PCI device, no /dev/accel* nor /dev/vfio "
    "device), so spmd did not start libtpu; set JAX_PLATFORMS=tpu (or JAX_FORCE_TPU_INIT=1) "
    "to start it anyway"
)
_DEVICE_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*")  # where a TPU VM's chips are opened
_wrapped: list = []  # the factory installed, once per process
# What libtpu reads from a TPU VM's metadata when it loads, and complains about on any
# other host: the workers' hostnames ("E0000 ... unexpected worker hostname", a source
# location trace) and the host's chip bounds ("Failed to find host bounds ..."). Neither
# changes a topology it describes for compiling (checked: the same devices, coordinates
# and process indices for v4, v5e and v5p slices, one or several).
_COMPILE_ONLY_ENV = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}


def skip_without_chips() -> bool:
    """Makes JAX's TPU backend fail at once, without libtpu, on a host with no TPU chip.

    Call before JAX's backends start; later (or where JAX's registry is not
    where this JAX keeps it) it does nothing.

    Returns:
      Whether JAX's TPU backend factory is wrapped (now or before).
    """
    if _wrapped:
        return True
    try:
        from jax._src import xla_bridge  # private: guarded, JAX may move it
    except ImportError:
        return False
    factories = getattr(xla_bridge, "_backend_factories", None)
    registration = factories.get("tpu") if isinstance(factories, dict) else None
    started = getattr(xla_bridge, "backends_are_initialized", lambda: True)()
    if started or not dataclasses.is_dataclass(registration):
        return False
    if not hasattr(registration, "factory"):
        return False
    factory = registration.factory

    def tpu_if_present():  # what JAX calls for its TPU backend
        if _tpu_asked_for() or _tpu_present():
            return factory()
        raise RuntimeError(NO_CHIP)

    factories["tpu"] = dataclasses.replace(registration, factory=tpu_if_present)
    _wrapped.append(tpu_if_present)
    return True


def _tpu_asked_for() -> bool:
    """Whether the user chose the platforms (jax_platforms) or forced TPU initialization."""
    import jax

    return bool(jax.config.jax_platforms) or "JAX_FORCE_TPU_INIT" in os.environ


def _tpu_present() -> bool:
    """Whether this host shows a TPU chip, by JAX's own PCI check or a TPU device node."""
    try:
        from jax._src import hardware_utils  # private: guarded, JAX may move it

        if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
            return True
    except Exception:  # noqa: BLE001 - unknown: try the TPU, as JAX would
        return True
    return any(glob.glob(pattern) for pattern in _DEVICE_NODES)


def quiet_libtpu_without_chips() -> None:
    """On a host with no TPU chip, gives libtpu what it would otherwise print lines about.

    Call before libtpu loads to compile for a topology (`spmd.topology`). Its
    log levels (TPU_MIN_LOG_LEVEL, TPU_STDERR_LOG_LEVEL) do not reach these
    lines, which it writes before its logging starts; the variables it reads
    do. A variable already set is left as it is, and a host with chips is
    left alone.
    """
    if _tpu_present():
        return
    for name, value in _COMPILE_ONLY_ENV.items():
        os.environ.setdefault(name, value)
