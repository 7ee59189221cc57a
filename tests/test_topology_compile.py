"""spmd.topology: Cloud TPU names parsed, abstract slices built, strategies on them compile only."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from commands import run_program

import spmd
from spmd._src.explain import _human
from spmd._src.topologies import CHIPS, parse

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
        ("v5litepod-1", "v5e", (1, 1)),
        # MaxText's accelerator_to_spec_map: slices of whole 4x4x4 cubes, the most cube-like
        ("v5p-384", "v5p", (4, 4, 12)),
        ("v5p-768", "v5p", (4, 8, 12)),
        ("v5p-1536", "v5p", (8, 8, 12)),
        ("v5p-8448", "v5p", (8, 12, 44)),
        ("v5p-12288", "v5p", (16, 16, 24)),  # Cloud TPU's largest v5p slice
        ("v4-384", "v4", (4, 4, 12)),
        ("v4-4096", "v4", (8, 16, 16)),
        ("v5p:4x4x12", "v5p", (4, 4, 12)),
    ],
)
def test_cloud_tpu_names_map_to_torus_shapes(name, chip, shape):
    got_chip, got_shape = parse(name)
    assert (got_chip.name, got_shape) == (chip, shape)


@pytest.mark.parametrize(
    "name", ["v5p-255", "v5p", "v7x-8", "v5e:2x2x2", "v5p:4x4", "tpu", "", 256]
)
def test_bad_names_list_the_accepted_forms(name):
    with pytest.raises(spmd.ConfigurationError, match="v5litepod-16") as info:
        parse(name)
    assert "Received" in str(info.value) and "To fix" in str(info.value)


@pytest.mark.parametrize(
    ("name", "fix"),
    [
        ("v5e-512", 'spmd.topology("v5e-256", slices=2)'),
        ("v6e-1024", 'spmd.topology("v6e-256", slices=4)'),
        ("v5p-16384", 'spmd.topology("v5p-8192", slices=2)'),
        ("v5e:64x64", 'spmd.topology("v5e-256", slices=16)'),
        ("v5p:32x32x32", 'spmd.topology("v5p-8192", slices=8)'),
    ],
)
def test_more_chips_than_one_ici_domain_is_an_error_suggesting_slices(name, fix):
    with pytest.raises(spmd.ConfigurationError, match="one ICI domain") as info:
        parse(name)
    assert fix in str(info.value) and f"name='{name}'" in str(info.value)


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("v5p-12", "no v5p slice of 6 chips"),
        ("v5e-2", "no v5e slice of 2 chips"),
        ("v5e:3x5", "no v5e slice of shape 3x5"),
        ("v5p:4x4x6", "each side a multiple of 4"),
        ("v5p-8576", "no v5p slice of 4288 chips"),  # 67 cubes: a side of 268 chips
    ],
)
def test_slices_cloud_tpu_does_not_offer_are_an_error_listing_the_sizes(name, said):
    with pytest.raises(spmd.ConfigurationError, match=said) as info:
        parse(name)
    assert "To fix: pick a" in str(info.value)


def test_chip_table_cites_its_source():
    for chip in CHIPS.values():
        assert chip.source.startswith("https://cloud.google.com/tpu/docs/")
        assert chip.peak_flops > 1e14 and chip.hbm_bytes > 8e9 and chip.hbm_bandwidth > 5e11


def test_without_the_tpu_compiler_the_error_says_what_to_install(monkeypatch):
    import sys

    from spmd._src import topologies

    monkeypatch.setitem(sys.modules, "libtpu", None)  # `import libtpu` raises ImportError
    monkeypatch.setattr(topologies, "_CACHE", {})
    with pytest.raises(spmd.ConfigurationError, match="tpu-compile"):
        spmd.topology("v5e-4")


@pytest.mark.parametrize("topology", [42, (4, 4), [1, 2], [], 2.5])
@pytest.mark.parametrize("make", ["TPUStrategy", "MultiWorkerMirroredStrategy"])
def test_a_topology_of_another_type_names_it_and_the_fix(make, topology):
    with pytest.raises(spmd.ConfigurationError) as caught:
        getattr(spmd, make)(topology=topology)
    text = str(caught.value)
    assert f"type='{type(topology).__name__}'" in text, text
    assert 'To fix: pass topology=spmd.topology("v5p-8")' in text, text


@pytest.mark.parametrize(
    "name, slices, said",
    [
        ("v5e-16", 10**6, "pass slices <= 8192 for 16-chip slices (v5e-16)"),
        ("v5p-8", 2**16, "pass slices <= 32768 for 4-chip slices (v5p-8)"),
        ("v5e:1000x1000", 1, 'at most 131072 chips over all slices, e.g. spmd.topology("v5e-256"'),
    ],
)
def test_more_chips_than_a_topology_holds_give_the_largest_count_before_allocating(
    name, slices, said
):
    """Checked before libtpu describes anything: 10**6 slices allocated until the kernel
    ended the process."""
    with pytest.raises(spmd.ConfigurationError, match="at most 131072 chips") as caught:
        spmd.topology(name, slices=slices)
    assert said in str(caught.value), caught.value


libtpu = pytest.importorskip("libtpu", reason="the TPU compiler (the tpu-compile extra)")


def _create(key):
    return {"w": jax.random.normal(key, (256, 512)), "b": jnp.zeros((512,))}


def _train(state, x):
    def loss(p):
        return ((x @ p["w"] + p["b"]) ** 2).mean()

    grads = jax.grad(loss)(state)
    return jax.tree.map(lambda a, g: a - 0.1 * g, state, grads), {"loss": loss(state)}


@pytest.mark.slow  # 6 s of CPU: a fresh interpreter loads libtpu
def test_topology_on_a_host_without_chips_prints_nothing_of_libtpus():
    """libtpu's start on a host that is no TPU VM wrote five lines (unexpected worker
    hostname, host bounds, a source location trace) on every program's first topology."""
    import os
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    code = "import spmd; print(len(spmd.topology('v5e-4')), len(spmd.topology('v5p-8', 2)))"
    done = run_program([sys.executable, "-c", code], env, 300)
    assert done.returncode == 0 and done.stdout.split() == ["4", "8"], done.stderr[-3000:]
    assert done.stderr == "", done.stderr


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


def _slice(device):
    return getattr(device, "slice_index", 0)  # one slice's devices have none


def _compact(group):
    """Whether a mesh axis's chips fill a box of the torus (a line of neighbours, a 2x2 tray)."""
    chips = {tuple(d.coords) for d in group}
    box = np.ptp(np.array(sorted(chips)), axis=0) + 1
    return int(np.prod(box)) == len(chips)


@pytest.mark.parametrize(
    ("name", "slices", "axes"),
    [
        ("v5p-256", 1, {"data": -1, "model": 2}),  # 4x4x8: an axis of 2 splits a physical one
        ("v5p-256", 1, {"data": -1, "fsdp": 2}),
        ("v5e:16x16", 2, {"data": -1, "model": 4}),
        ("v5e-256", 2, {"data": 2, "fsdp": 32, "model": 8}),
        ("v6e-64", 1, {"data": -1, "model": 8, "expert": 2}),
        ("v4-32", 2, {"data": -1, "model": 4}),
        ("v4-32/per core", 2, {"data": -1, "model": 4}),  # two devices a chip: spmd's own map
    ],
)
def test_any_axis_sizes_lay_out_with_inner_axes_on_neighbouring_chips(name, slices, axes):
    name, _, per_core = name.partition("/")
    topo = spmd.topology(name, slices=slices, megacore=not per_core)
    mesh = spmd.make_mesh(axes, devices=topo)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in topo)
    inner = mesh.devices.reshape(-1, mesh.devices.shape[-1])
    for group in inner:  # the busiest axis: neighbouring chips of one slice
        assert len({_slice(d) for d in group}) == 1 and _compact(group)
    for index, part in enumerate(mesh.devices):  # the slices are the outermost axis
        assert {_slice(d) for d in part.flat} == {index * slices // len(mesh.devices)}


@pytest.mark.parametrize("name", ["v5p-128", "v5e-256", "v6e-64"])
def test_parameter_server_strategy_lays_out_on_realistic_slices(name):
    topo = spmd.topology(name)
    ps = spmd.ParameterServerStrategy(spmd.partitioners.FixedShardsPartitioner(8), devices=topo)
    assert set(ps.mesh.shape.values()) == {2} and ps.mesh.devices.size == len(topo)
    state = ps.abstract_state(_create, jax.random.key(0))
    assert state["w"].sharding.shard_shape((256, 512)) == (32, 512)


def test_strategies_take_a_topology_by_its_name():
    tpu = spmd.TPUStrategy(topology="v5p-8")
    assert set(tpu.mesh.devices.flat) == set(spmd.topology("v5p-8"))
    mwms = spmd.MultiWorkerMirroredStrategy(topology="v5e-16")
    assert dict(mwms.mesh.shape) == {"host": 4, "replica": 4}
    with pytest.raises(spmd.ConfigurationError, match=r"spmd.topology\('v5e-8'\)"):
        spmd.make_mesh({"data": -1}, devices="v5e-8")


def test_devices_that_are_no_whole_slice_keep_their_order():
    topo = spmd.topology("v5e:4x4")
    mesh = spmd.make_mesh({"data": 3}, devices=topo[:3])
    assert list(mesh.devices.flat) == sorted(topo[:3], key=lambda d: d.id)


def test_devices_of_two_tpu_generations_are_a_clear_error():
    mixed = list(spmd.topology("v5e-4")) + list(spmd.topology("v5p-8"))
    with pytest.raises(spmd.ConfigurationError, match="one TPU generation") as info:
        spmd.TPUStrategy(topology=mixed)
    assert "tpu: TPU v5 lite" in str(info.value) and "tpu: TPU v5'" in str(info.value)


def test_slices_of_different_sizes_are_a_clear_error():
    two = spmd.topology("v5e-4", slices=2)
    with pytest.raises(spmd.ConfigurationError, match="slices of equal size") as info:
        spmd.make_mesh({"data": 2, "model": 3}, devices=list(two)[:6])
    assert "devices_per_slice=[2, 4]" in str(info.value) and "To fix" in str(info.value)


def test_a_topology_strategy_compiles_with_the_tpu_compiler():
    strategy = spmd.TPUStrategy(topology=spmd.topology("v5e:2x2"))
    step = strategy.step(_train)
    state = strategy.abstract_state(_create, jax.random.key(0))
    lowered, _ = step.lower(state, jax.ShapeDtypeStruct((32, 256), jnp.float32))
    compiled = lowered.compile()
    assert "TPU" in compiled.as_text() or "T(8,128)" in compiled.as_text()  # TPU tiled layouts
    assert compiled.memory_analysis().argument_size_in_bytes >= 256 * 512 * 4


def _diloco():
    two = spmd.topology("v5e-4", slices=2)
    return spmd.DiLoCo(spmd.TPUStrategy(topology=two), islands=2, sync_every=4)


def _diloco_create(key):
    return {"params": _create(key)}


def _saved(tmp_path):
    manager = spmd.CheckpointManager(tmp_path, async_save=False)
    manager.save(1, {"w": np.zeros((256, 512), np.float32), "b": np.zeros(512, np.float32)})
    return manager


X = np.zeros((32, 256), np.float32)
WAYS_TO_RUN = {
    "init": lambda s, tmp: s.init(_create, jax.random.key(0)),
    "put": lambda s, tmp: s.put({"w": np.zeros((4, 4), np.float32)}),
    "Calling a step": lambda s, tmp: s.step(_train)(
        s.abstract_state(_create, jax.random.key(0)), X
    ),
    "strategy.run": lambda s, tmp: s.run(lambda x: x * 2, args=(X,)),
    "distribute_dataset": lambda s, tmp: s.distribute_dataset([X]),
    "distribute_datasets_from_function": lambda s, tmp: s.distribute_datasets_from_function(
        lambda ctx: [X]
    ),
    "distribute_batch": lambda s, tmp: s.distribute_batch(X),
    "CheckpointManager.restore": lambda s, tmp: _saved(tmp).restore(
        1, target=s.abstract_state(_create, jax.random.key(0))
    ),
}
DILOCO_WAYS_TO_RUN = {
    "init": lambda d, tmp: d.init(_diloco_create, jax.random.key(0)),
    "Calling a step": lambda d, tmp: d.step(_train)(
        d.abstract_state(_diloco_create, jax.random.key(0)), X
    ),
    "global_state": lambda d, tmp: d.global_state(
        d.abstract_state(_diloco_create, jax.random.key(0))
    ),
    "restore": lambda d, tmp: d.restore(_saved(tmp), _diloco_create, jax.random.key(0)),
    "distribute_dataset": lambda d, tmp: d.distribute_dataset([X]),
    "distribute_datasets_from_function": lambda d, tmp: d.distribute_datasets_from_function(
        lambda ctx: [X]
    ),
}


@pytest.mark.parametrize("what", list(WAYS_TO_RUN))
def test_every_way_to_run_a_topology_strategy_says_it_compiles_only(what, tmp_path):
    strategy = spmd.TPUStrategy(topology=spmd.topology("v5e:2x2"))
    with pytest.raises(spmd.ConfigurationError, match="abstract TPU topology") as info:
        WAYS_TO_RUN[what](strategy, tmp_path)
    assert str(info.value).startswith(what) and "To fix" in str(info.value)


def test_the_cannot_run_advice_works_as_written():
    strategy = spmd.TPUStrategy(topology=spmd.topology("v5e:2x2"))
    step = strategy.step(_train)
    state = strategy.abstract_state(_create, jax.random.key(0))
    batch = (jax.ShapeDtypeStruct(X.shape, X.dtype),)
    with pytest.raises(spmd.ConfigurationError) as info:
        step(state, X)
    advice = re.findall(
        r"(?:strategy|step)\.\w+\((?:step, )?state, \*batch\)(?:\[0\]\.compile\(\))?",
        str(info.value),
    )
    assert len(advice) == 2, str(info.value)
    for call in advice:  # each call it names runs, as written
        eval(call, {"strategy": strategy, "step": step, "state": state, "batch": batch})


@pytest.mark.parametrize("what", list(DILOCO_WAYS_TO_RUN))
def test_every_way_to_run_diloco_on_a_topology_says_it_compiles_only(what, tmp_path):
    with pytest.raises(spmd.ConfigurationError, match="abstract TPU topology") as info:
        DILOCO_WAYS_TO_RUN[what](_diloco(), tmp_path)
    assert str(info.value).startswith(what)


@pytest.mark.parametrize(
    "make", [lambda: spmd.TPUStrategy(topology=spmd.topology("v5e:2x2")), _diloco]
)
def test_building_a_flax_model_in_a_topology_scope_says_to_build_it_abstractly(make):
    from flax import nnx

    strategy = make()
    refused = pytest.raises(spmd.ConfigurationError, match="nnx.eval_shape")
    with refused as info, strategy.scope():
        nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    assert "abstract_state" in str(info.value) and "ran a computation eagerly" in str(info.value)
    with strategy.scope():  # what the advice says works
        model = nnx.eval_shape(lambda: nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    assert isinstance(model.kernel.get_value(), jax.ShapeDtypeStruct)


def test_a_topology_strategy_compiles_what_it_cannot_run():
    """The refusals are for running: inside a step `strategy.run` compiles, and
    a strategy takes devices or a topology, not both."""
    strategy = spmd.TPUStrategy(topology=spmd.topology("v5e:2x2"))

    def train(state, x):
        return state, {"sum": strategy.reduce("SUM", strategy.run(jnp.sum, args=(x,)))}

    state = strategy.abstract_state(_create, jax.random.key(0))
    e = strategy.explain(train, state, jax.ShapeDtypeStruct((32, 256), jnp.float32))
    assert e.chip == "v5e"
    with pytest.raises(spmd.ConfigurationError, match="not both"):
        spmd.TPUStrategy(jax.devices(), topology=spmd.topology("v5e:2x2"))


def _twenty_gib(key):
    return {"w": jnp.zeros((8, 20 * (1 << 30) // 4 // 8), jnp.float32)}  # replicated


def _scale(state, x):
    return {"w": state["w"] * 0.9 + x.mean()}, {"m": x.mean()}


def test_v4_is_planned_per_chip_as_jax_runs_it():
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    topo = spmd.topology("v4-8")  # 4 chips: one device each, as on a v4 TPU VM
    assert (len(topo), topo.chips) == (4, 4)
    strategy = spmd.TPUStrategy(topology=topo)
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    e = strategy.explain(_scale, strategy.abstract_state(_twenty_gib, jax.random.key(0)), x)
    assert e.fits and 30 << 30 < e.hbm_capacity < 32 << 30  # the compiler's: 30.75 GiB
    assert e.roofline.devices_per_chip == 1
    # The oracle: plain jax.jit on the devices MaxText's AOT compile asks libtpu for.
    devices = topologies.get_topology_desc(
        topology_name="v4:2x2x1", platform="tpu", chip_config_name="megacore"
    ).devices
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    whole, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("d"))
    state = {"w": jax.ShapeDtypeStruct((8, 20 * (1 << 30) // 32), jnp.float32, sharding=whole)}
    compiled = (
        jax.jit(_scale, donate_argnums=0, out_shardings=({"w": whole}, {"m": whole}))
        .lower(state, jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=rows))
        .compile()
    )
    assert compiled.memory_analysis().argument_size_in_bytes == e.argument_bytes


def test_v4_per_tensorcore_is_asked_for_and_halves_the_hbm():
    topo = spmd.topology("v4-8", megacore=False)
    assert (len(topo), topo.chips) == (8, 4)
    strategy = spmd.TPUStrategy(topology=topo)
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    e = strategy.explain(_scale, strategy.abstract_state(_twenty_gib, jax.random.key(0)), x)
    assert e.fits is False and 15 << 30 < e.hbm_capacity < 16 << 30  # 15.25 GiB a core
    assert e.roofline is None  # refused for want of HBM: no program to estimate


@pytest.mark.parametrize("name", ["v5p-8", "v5e-8", "v6e-4"])
def test_megacore_false_is_an_error_where_a_chip_has_no_per_core_mode(name):
    with pytest.raises(spmd.ConfigurationError, match="megacore") as info:
        spmd.topology(name, megacore=False)
    assert "v4 only" in str(info.value) and f"topology='{name}'" in str(info.value)


def test_v5p_is_one_device_per_chip():
    topo = spmd.topology("v5p-8")
    assert (len(topo), topo.chips) == (4, 4)


def test_a_bad_slice_count_is_a_clear_error():
    with pytest.raises(spmd.ConfigurationError, match="slices"):
        spmd.topology("v5e:2x2", slices=0)


@pytest.mark.parametrize("name", ["v5litepod-1", "v6e-1"])
def test_one_chip_slices_are_described(name):
    # libtpu's default of 2x2x1 chips per host divides no one-chip slice
    topo = spmd.topology(name)
    assert len(topo) == 1 and topo.chips == 1


def _scanned(layers):
    def create(key):
        return {"w": jax.random.normal(key, (layers, 512, 512))}

    def train(state, x):
        def loss(p):
            def body(h, w):
                return jnp.tanh(h @ w), None

            h, _ = jax.lax.scan(body, x, p["w"])
            return (h**2).mean()

        grads = jax.grad(loss)(state)
        return jax.tree.map(lambda a, g: a - 0.1 * g, state, grads), {"loss": loss(state)}

    return create, train


def _fsdp(topo, slices=1):
    mesh = spmd.make_mesh({"data": slices, "fsdp": -1}, devices=topo)
    return spmd.Strategy(
        mesh, rules=[(".*w", jax.sharding.PartitionSpec(None, "fsdp"))], batch_axes=("data", "fsdp")
    )


def test_explain_on_a_topology_reports_hbm_traffic_and_a_roofline():
    create, train = _scanned(4)
    strategy = _fsdp(spmd.topology("v5p-8"))
    state = strategy.abstract_state(create, jax.random.key(0))
    e = strategy.explain(train, state, jax.ShapeDtypeStruct((64, 512), jnp.float32))
    assert e.chip == "v5p" and 95 << 30 < e.hbm_capacity < 96 << 30  # the compiler's figure
    assert e.fits and e.hbm_headroom == e.hbm_capacity - e.peak_bytes - e.code_bytes
    assert e.code_bytes > 0 and e.argument_bytes >= 4 * 512 * 128 * 4  # the compiler's figures
    links = {t.link for t in e.traffic}
    assert links == {"ICI"}  # one slice: nothing crosses the data-center network
    gathers = [t for t in e.traffic if t.kind == "all-gather"]
    assert gathers and gathers[0].wire_bytes > 0
    r = e.roofline
    assert r.chip.name == "v5p" and r.dcn_s == 0
    assert r.compute_s == pytest.approx(r.flops / (459e12 * r.efficiency)) and r.efficiency < 1
    assert e.step_seconds == pytest.approx(max(r.compute_s, r.memory_s) + r.ici_s)
    text = str(e)
    assert "fits" in text and "over ICI" in text and "estimated step" in text
    rows = {
        "arguments": e.argument_bytes,
        "outputs": e.output_bytes,
        "aliased (outputs in donated arguments)": e.alias_bytes,
        "temporaries": e.temp_bytes,
        "code": e.code_bytes,
    }
    for row, value in rows.items():  # the compiler's memory analysis, part by part
        assert re.search(rf"^  {re.escape(row)} +{re.escape(_human(value))}$", text, re.M), row


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_loop_collective_counts_once_per_iteration():
    counts = {}
    for layers in (2, 8):
        create, train = _scanned(layers)
        strategy = _fsdp(spmd.topology("v5p-8"))
        state = strategy.abstract_state(create, jax.random.key(0))
        e = strategy.explain(train, state, jax.ShapeDtypeStruct((64, 512), jnp.float32))
        counts[layers] = sum(t.count for t in e.traffic)
    assert counts[8] > counts[2]


def test_two_slices_send_over_dcn():
    create, train = _scanned(2)
    strategy = _fsdp(spmd.topology("v5e-4", slices=2), slices=2)
    state = strategy.abstract_state(create, jax.random.key(0))
    e = strategy.explain(train, state, jax.ShapeDtypeStruct((64, 512), jnp.float32))
    dcn = [t for t in e.traffic if t.link == "DCN"]
    assert dcn and dcn[0].kind == "all-reduce" and dcn[0].wire_bytes > 0
    assert e.roofline.dcn_s == pytest.approx(e.roofline.dcn_bytes / (2 * 100e9 / 64))


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_every_collective_of_a_two_slice_data_parallel_step_is_counted():
    # XLA gives this program's reduce-scatters and all-gathers the same channel ids.
    def create(key):
        return {"w1": jnp.zeros((1024, 4096)), "w2": jnp.zeros((4096, 1024))}

    def train(state, x):
        def loss(p):
            return ((jax.nn.relu(x @ p["w1"]) @ p["w2"] - x) ** 2).mean()

        grads = jax.grad(loss)(state)
        return jax.tree.map(lambda a, g: a - 1e-3 * g, state, grads), {}

    strategy = spmd.TPUStrategy(topology=spmd.topology("v5e-16", slices=2))
    state = strategy.abstract_state(create, jax.random.key(0))
    e = strategy.explain(train, state, jax.ShapeDtypeStruct((256, 1024), jnp.float32))
    ici = {t.kind: t for t in e.traffic if t.link == "ICI"}
    for kind in ("all-gather", "reduce-scatter"):
        assert ici[kind].count == e.collectives[kind].count > 0, kind
    gathered = e.collectives["all-gather"].bytes  # the weights, whole, on each chip
    assert ici["all-gather"].wire_bytes == pytest.approx(15 / 16 * gathered)


def test_a_state_over_hbm_does_not_fit_and_says_by_how_much():
    def create(key):
        return {"w": jnp.zeros((5, 1 << 30), jnp.float32)}  # 20 GiB, replicated

    strategy = spmd.TPUStrategy(topology=spmd.topology("v5e:2x2"))
    state = strategy.abstract_state(create, jax.random.key(0))
    e = strategy.explain(lambda s, x: (s, {"n": x.sum()}), state, jnp.zeros((8, 4)))
    assert e.fits is False and e.hbm_required > 20 << 30 and e.hbm_headroom < -(4 << 30)
    assert "DOES NOT FIT: the compiler refused it, over by" in str(e)


def test_explain_on_cpu_devices_has_no_chip_fields():
    strategy = spmd.MirroredStrategy()
    create, train = _scanned(2)
    state = strategy.abstract_state(create, jax.random.key(0))
    e = strategy.explain(train, state, jax.ShapeDtypeStruct((64, 512), jnp.float32))
    assert (e.chip, e.hbm_capacity, e.fits, e.roofline, e.traffic) == (None, None, None, None, ())
    assert "HBM" not in str(e) and "arguments" not in str(e)


def test_the_compilers_out_of_hbm_messages_are_read():
    from spmd._src.topologies import hbm_refusal

    assert (
        hbm_refusal(
            RuntimeError(
                "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                "temporaries (32.00G) exceeds available HBM (15.75G)."
            )
        )
        == 32 << 30
    )
    assert hbm_refusal(
        RuntimeError(
            "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.50G of 15.75G hbm."
        )
    ) == int(20.5 * (1 << 30))
    assert hbm_refusal(RuntimeError("INVALID_ARGUMENT: something else")) is None


@pytest.mark.parametrize(
    "name, said", [("v5p-0", "a positive even number"), ("v5e-0", "chips, at least 1")]
)
def test_a_slice_of_no_chips_says_what_n_counts(name, said):
    with pytest.raises(spmd.ConfigurationError, match=said):
        spmd.topology(name)
