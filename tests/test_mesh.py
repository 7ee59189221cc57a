"""make_mesh: sizes, inference, errors, host order and TPU topology order."""

from dataclasses import dataclass

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import spmd
from spmd._src.mesh import _tpu_device_array, order_devices, prime_factors


@pytest.mark.cpu_mesh
def test_infers_minus_one_and_uses_auto_axes():
    mesh = spmd.make_mesh({"data": -1, "model": 2})
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)


@pytest.mark.cpu_mesh
def test_explicit_axis_types_are_an_option():
    mesh = spmd.make_mesh({"data": 8}, axis_types=AxisType.Explicit)
    assert mesh.axis_types == (AxisType.Explicit,)


@pytest.mark.cpu_mesh
def test_subset_of_devices():
    mesh = spmd.make_mesh({"data": 2}, devices=jax.devices()[:2])
    assert list(mesh.devices.flat) == jax.devices()[:2]


@pytest.mark.parametrize(
    "axes, fragment",
    [
        ({"data": 3}, "multiply to the number of devices (8)"),
        ({"data": -1, "model": 3}, "must divide the device count"),
        ({"data": -1, "model": -1}, "at most one -1"),
        ({"data": 0}, "positive integers"),
        ({}, "at least one named axis"),
        ({1: 8}, "named by strings"),
        ({"": 8}, "named by strings"),
    ],
)
@pytest.mark.cpu_mesh
def test_bad_sizes_say_what_and_how(axes, fragment):
    with pytest.raises(spmd.ConfigurationError) as info:
        spmd.make_mesh(axes)
    text = str(info.value)
    assert fragment in text and "Received:" in text and "To fix:" in text


@dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"
    coords: tuple = (0, 0, 0)
    core_on_chip: int = 0
    slice_index: int = 0


def test_hosts_outermost():
    devices = [FakeDevice(id=i, process_index=i % 2) for i in range(8)]
    ordered = order_devices(devices)
    assert [d.process_index for d in ordered] == [0, 0, 0, 0, 1, 1, 1, 1]
    rows = np.asarray(ordered, dtype=object).reshape(2, 4)
    assert {d.process_index for d in rows[0]} == {0}


def _tpu_v4(slices: int = 1) -> list[FakeDevice]:
    """A 2x2x1 v4 slice (4 chips, one core each) per slice, ids in non-topology order."""
    out = []
    for s in range(slices):
        for i, (x, y) in enumerate([(1, 1), (0, 0), (1, 0), (0, 1)]):
            out.append(
                FakeDevice(
                    id=s * 4 + i,
                    process_index=s,
                    platform="tpu",
                    device_kind="TPU v4",
                    coords=(x, y, 0),
                    slice_index=s,
                )
            )
    return out


def test_tpu_devices_follow_the_topology():
    array = _tpu_device_array((1, 4), _tpu_v4())
    coords = [d.coords for d in array.flat]
    # the ids come in scrambled order; the mesh walks the physical grid instead
    assert [d.coords for d in _tpu_v4()] != coords
    assert coords == sorted(d.coords for d in _tpu_v4())


def test_tpu_multislice_is_a_hybrid_mesh_with_slices_outermost():
    array = _tpu_device_array((2, 4), _tpu_v4(slices=2))
    assert [{d.slice_index for d in row} for row in array] == [{0}, {1}]


def test_tpu_strategy_needs_tpus():
    with pytest.raises(spmd.ConfigurationError, match="TPUStrategy needs TPU devices"):
        spmd.TPUStrategy()


@pytest.mark.parametrize("n, factors", [(1, []), (8, [2, 2, 2]), (12, [3, 2, 2]), (7, [7])])
def test_prime_factors(n, factors):
    assert prime_factors(n) == factors
