"""spmd.topology: Cloud TPU names parsed, abstract slices built, strategies on them compile only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.topologies import CHIPS, parse

pytestmark = pytest.mark.cpu_mesh


@pytest.mark.parametrize(
    ("name", "chip", "shape"),
    [
        ("v5p-8", "v5p", (2, 2, 1)),
        ("v5p-256", "v5p", (4, 4, 8)),  # v5p names count TensorCores: 128 chips
        ("v5p-1024", "v5p", (8, 8, 8)),
        ("v4-32", "v4", (2, 2, 4)),
        ("v5litepod-16", "v5e", (4, 4)),
        ("v5e-256", "v5e", (16, 16)),
        ("v5e-8", "v5e", (2, 4)),
        ("v6e-64", "v6e", (8, 8)),
        ("v6e-1", "v6e", (1, 1)),
        ("v5e:16x16", "v5e", (16, 16)),
        ("V5P:4x4x8", "v5p", (4, 4, 8)),
        ("v5litepod:2x2", "v5e", (2, 2)),
    ],
)
def test_cloud_tpu_names_map_to_torus_shapes(name, chip, shape):
    got_chip, got_shape = parse(name)
    assert (got_chip.name, got_shape) == (chip, shape)


@pytest.mark.parametrize(
    "name", ["v5p-255", "v5p", "v7x-8", "v5e:2x2x2", "v5p:4x4", "tpu", "", 256, "v5p-12"]
)
def test_bad_names_list_the_accepted_forms(name):
    with pytest.raises(spmd.ConfigurationError, match="v5litepod-16") as info:
        parse(name)
    assert "Received" in str(info.value) and "To fix" in str(info.value)


def test_chip_table_cites_its_source():
    for chip in CHIPS.values():
        assert chip.source.startswith("https://cloud.google.com/tpu/docs/")
        assert chip.peak_flops > 1e14 and chip.hbm_bytes > 8e9 and chip.hbm_bandwidth > 5e11


libtpu = pytest.importorskip("libtpu", reason="the TPU compiler (the tpu-compile extra)")


def _create(key):
    return {"w": jax.random.normal(key, (256, 512)), "b": jnp.zeros((512,))}


def _train(state, x):
    def loss(p):
        return ((x @ p["w"] + p["b"]) ** 2).mean()

    grads = jax.grad(loss)(state)
    return jax.tree.map(lambda a, g: a - 0.1 * g, state, grads), {"loss": loss(state)}


def test_topology_gives_abstract_devices_of_the_slice():
    topo = spmd.topology("v5p-16")
    assert (topo.chip.name, topo.shape, topo.chips, len(topo)) == ("v5p", (2, 2, 2), 8, 8)
    assert {d.platform for d in topo} == {"tpu"}
    assert all(d not in jax.devices() for d in topo)
    two = spmd.topology("v5e-4", slices=2)
    assert len(two) == 8 and two.slices == 2
    assert sorted({d.slice_index for d in two}) == [0, 1]


def test_strategies_on_a_topology_lay_out_slices_outermost():
    two = spmd.topology("v5e-4", slices=2)
    tpu = spmd.TPUStrategy(topology=two)
    assert dict(tpu.mesh.shape) == {"host": 2, "replica": 4}
    for row, devices in enumerate(tpu.mesh.devices):
        assert {d.slice_index for d in devices} == {row}
    mesh = spmd.make_mesh({"data": -1, "model": 2}, devices=two)
    assert {d.slice_index for d in mesh.devices[:2].flat} == {0}  # DCN is the outer axis
    mwms = spmd.MultiWorkerMirroredStrategy(topology=spmd.topology("v5e-16"))
    assert dict(mwms.mesh.shape) == {"host": 4, "replica": 4}
    ps = spmd.ParameterServerStrategy(
        spmd.partitioners.FixedShardsPartitioner(8), devices=spmd.topology("v5p-16")
    )
    state = ps.abstract_state(_create, jax.random.key(0))
    assert state["w"].sharding.shard_shape((256, 512)) == (32, 512)


def test_a_topology_strategy_compiles_with_the_tpu_compiler():
    strategy = spmd.TPUStrategy(topology=spmd.topology("v5e:2x2"))
    step = strategy.step(_train)
    state = strategy.abstract_state(_create, jax.random.key(0))
    lowered, _ = step.lower(state, jax.ShapeDtypeStruct((32, 256), jnp.float32))
    compiled = lowered.compile()
    assert "TPU" in compiled.as_text() or "T(8,128)" in compiled.as_text()  # TPU tiled layouts
    assert compiled.memory_analysis().argument_size_in_bytes >= 256 * 512 * 4


def test_a_topology_strategy_refuses_to_run():
    strategy = spmd.TPUStrategy(topology=spmd.topology("v5e:2x2"))
    step = strategy.step(_train)
    with pytest.raises(spmd.ConfigurationError, match="abstract TPU topology"):
        strategy.init(_create, jax.random.key(0))
    with pytest.raises(spmd.ConfigurationError, match="abstract TPU topology"):
        strategy.put({"w": np.zeros((4, 4), np.float32)})
    state = strategy.abstract_state(_create, jax.random.key(0))
    with pytest.raises(spmd.ConfigurationError, match="Calling a step"):
        step(state, np.zeros((32, 256), np.float32))
    with pytest.raises(spmd.ConfigurationError, match="not both"):
        spmd.TPUStrategy(jax.devices(), topology=spmd.topology("v5e:2x2"))


def test_a_shape_the_compiler_refuses_is_a_clear_error():
    with pytest.raises(spmd.ConfigurationError, match="knows this topology"):
        spmd.topology("v5e:3x5")
    with pytest.raises(spmd.ConfigurationError, match="slices"):
        spmd.topology("v5e:2x2", slices=0)
