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
this leaves alone.
"""

from __future__ import annotations

import dataclasses
import glob
import os

__all__ = ["NO_CHIP", "skip_without_chips"]

NO_CHIP = (
    "this host has no TPU chip (no Google TPU PCI device, no /dev/accel* nor /dev/vfio "
    "device), so spmd did not start libtpu; set JAX_PLATFORMS=tpu (or JAX_FORCE_TPU_INIT=1) "
    "to start it anyway"
)
_DEVICE_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*")  # where a TPU VM's chips are opened
_wrapped: list = []  # the factory installed, once per process


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
