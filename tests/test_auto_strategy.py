"""spmd.auto_strategy and `spmd plan`: candidates compiled, the unfit dropped, the rest ranked."""

import json
import subprocess
import sys
import textwrap

import flax.linen as linen
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmd

pytestmark = pytest.mark.cpu_mesh


def _create(key, width=1024):
    k1, k2 = jax.random.split(key)
    params = {
        "w1": jax.random.normal(k1, (256, width)) * 0.02,
        "w2": jax.random.normal(k2, (width, 256)) * 0.02,
    }
    return {"params": params, "opt": optax.adam(1e-3).init(params)}


def _step(state, x):
    def loss(p):
        return ((jnp.tanh(x @ p["w1"]) @ p["w2"] - x) ** 2).mean()

    value, grads = jax.value_and_grad(loss)(state["params"])
    updates, opt = optax.adam(1e-3).update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": value}


X = jax.ShapeDtypeStruct((64, 256), jnp.float32)
BIG = jax.ShapeDtypeStruct((1024, 256), jnp.float32)  # a row for every chip of 2 v5e-256


@pytest.mark.slow
def test_on_cpu_devices_every_layout_is_ranked_and_the_best_runs():
    best, plan = spmd.auto_strategy(_create, _step, X, only=["data parallel", "FSDP over 8"])
    names = [c.name for c in plan.ranked]
    assert sorted(names) == ["FSDP over 8", "data parallel"] and not plan.dropped
    assert plan.best.strategy is best
    times = [c.step_seconds for c in plan.ranked]
    assert times == sorted(times) and all(t > 0 for t in times)
    fsdp = next(c for c in plan.ranked if c.name == "FSDP over 8")
    dp = next(c for c in plan.ranked if c.name == "data parallel")
    assert fsdp.explanation.state_bytes < dp.explanation.state_bytes  # the compiler's layout
    # The chosen strategy is a real one: it runs the step.
    state = best.init(_create, jax.random.key(0))
    state, metrics = best.step(_step)(state, jnp.ones((64, 256)))
    assert jnp.isfinite(metrics["loss"])
    text = str(plan)
    assert "data parallel" in text and "FSDP over 8" in text and "step (est.)" in text


libtpu = pytest.importorskip("libtpu", reason="the TPU compiler (the tpu-compile extra)")


@pytest.mark.slow
def test_on_a_topology_what_does_not_fit_is_dropped_with_the_reason():
    def create(key):  # 8 GiB of float32 weights and 16 GiB of Adam's moments: replicated, no fit
        return _create(key, width=1 << 22)

    best, plan = spmd.auto_strategy(
        create, _step, X, "v5e-16", only=["data parallel", "FSDP over 16"]
    )
    dp = next(c for c in plan.candidates if c.name == "data parallel")
    assert dp.dropped.startswith("does not fit (not compiled): its state alone is 24.00 GiB")
    ranked = {c.name: c for c in plan.ranked}
    assert set(ranked) == {"FSDP over 16"}
    offload = next(c for c in plan.candidates if "host memory" in c.name)
    assert offload.dropped.startswith("cannot help (not compiled): FSDP over 16 fits")
    assert all(c.explanation.fits for c in plan.ranked)
    assert dict(best.mesh.shape) == {"data": 1, "fsdp": 16}
    assert "dropped:" in str(plan) and "does not fit" in str(plan)


@pytest.mark.slow
def test_two_slices_offer_hsdp_and_host_offload():
    best, plan = spmd.auto_strategy(_create, _step, X, "v5e-4", slices=2)
    names = [c.name for c in plan.candidates]
    assert "FSDP over 4 (HSDP: data 2 over DCN)" in names
    across = next(c for c in plan.candidates if c.name == "FSDP over 8")
    assert across.dropped is None  # the FSDP axis itself crosses slices (data=1 is too small)
    assert {d.slice_index for d in across.strategy.mesh.devices[0, :4]} == {0}
    assert "FSDP over 4, optimizer state in host memory" in names
    hsdp = next(c for c in plan.candidates if c.name.startswith("FSDP over 4 (HSDP"))
    assert hsdp.dropped is None and hsdp.roofline.dcn_bytes > 0


def _deep(layers, width):
    """A deep MLP of `layers` square float32 matrices, trained with Adam."""

    def create(key):
        keys = jax.random.split(key, layers)
        params = {f"w{i}": jax.random.normal(k, (width, width)) * 0.01 for i, k in enumerate(keys)}
        return {"params": params, "opt": optax.adam(1e-3).init(params)}

    def step(state, x):
        def loss(p):
            h = x
            for i in range(layers):
                h = jnp.tanh(h @ p[f"w{i}"])
            return (h**2).mean()

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = optax.adam(1e-3).update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, value

    return create, step


@pytest.mark.slow  # 6 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_model_plain_fsdp_cannot_hold_is_kept_with_its_optimizer_in_host_memory():
    # 24 GiB of float32 weights and 48 GiB of Adam's moments on 4 v5e chips (15.75 GiB
    # each): FSDP holds 18 GiB of state per chip; with the moments in host memory, 6 GiB.
    create, step = _deep(layers=24, width=16384)
    x = jax.ShapeDtypeStruct((64, 16384), jnp.float32)
    best, plan = spmd.auto_strategy(create, step, x, "v5e:2x2", only="FSDP over 4")
    fsdp, offload = (
        next(c for c in plan.candidates if c.name == name)
        for name in ("FSDP over 4", "FSDP over 4, optimizer state in host memory")
    )
    assert fsdp.dropped.startswith("does not fit (not compiled): its state alone is 18.00 GiB")
    assert "over the 15.75 GiB of HBM" in fsdp.dropped
    assert offload.dropped is None and offload.explanation.fits
    assert best is offload.strategy and best.placement == "offload_optimizer"
    assert offload.explanation.state_host_bytes == 12 << 30  # the moments, a quarter per chip
    assert offload.roofline.host_s == pytest.approx((12 << 30) / 15e9)  # v5e's PCIe, each way
    table = str(plan)
    assert "host/device" in table and "12.00 GiB" in table and "(in the estimate)" in table
    assert "FSDP over 4 (data=1 x fsdp=4): does not fit" in table


def test_a_small_model_on_a_small_slice_is_ranked_in_seconds():
    def create(key):
        return {"w": jax.random.normal(key, (256, 256))}

    def train(state, x):
        grads = jax.grad(lambda p: ((x @ p["w"]) ** 2).mean())(state)
        return jax.tree.map(lambda a, g: a - 0.1 * g, state, grads), {}

    best, plan = spmd.auto_strategy(
        create, train, (X,), spmd.topology("v5e:2x2"), only=["data parallel", "FSDP over 2"]
    )
    assert sorted(c.name for c in plan.ranked) == ["FSDP over 2", "data parallel"]
    assert all(c.roofline.chip.name == "v5e" and c.step_seconds > 0 for c in plan.ranked)
    assert best is plan.best.strategy and best.mesh.devices.flat[0].platform == "tpu"


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_tensor_parallel_layouts_are_built_and_ranked_on_a_slice():
    # v5e:4x4: an axis of 2 takes half of a physical axis of 4
    best, plan = spmd.auto_strategy(
        _create, _step, X, "v5e:4x4", only=["TP over 2", "FSDP 8 x TP 2"]
    )
    assert sorted(c.name for c in plan.ranked) == ["FSDP 8 x TP 2", "TP over 2"]
    assert not plan.dropped and all(c.step_seconds > 0 for c in plan.ranked)
    tp, both = (next(c for c in plan.ranked if c.name == n) for n in ("TP over 2", "FSDP 8 x TP 2"))
    # the matrices split in 2 by TP, in 16 by FSDP x TP: the compiled programs' layouts
    assert tp.explanation.state_bytes == pytest.approx(8 * both.explanation.state_bytes, rel=0.01)


@pytest.mark.slow  # 11 s of CPU: 16 candidates compiled for 512 chips
def test_every_layout_builds_on_two_v5e_256_slices():
    best, plan = spmd.auto_strategy(_create, _step, BIG, "v5e:16x16", slices=2)
    (offload,) = plan.dropped  # HSDP fits on its mesh: settled without compiling
    assert offload.name == "FSDP over 256, optimizer state in host memory", str(plan)
    assert offload.dropped.startswith("cannot help (not compiled)")
    names = {c.name for c in plan.ranked}
    assert {"TP over 2", "TP over 4", "TP over 8"} <= names
    assert {"FSDP 128 x TP 2", "FSDP 64 x TP 4", "FSDP 32 x TP 8", "FSDP over 2"} <= names
    times = [c.step_seconds for c in plan.ranked]
    assert times == sorted(times) and best is plan.best.strategy
    tp = next(c for c in plan.ranked if c.name == "FSDP 64 x TP 4").strategy
    assert {d.slice_index for d in tp.mesh.devices[0].flat} == {0}  # data over DCN


@pytest.mark.slow  # 1 s of CPU each: compiles for 128 and 64 chips
@pytest.mark.parametrize("target", ["v5p-256", "v6e-64"])
def test_layouts_over_two_devices_build_on_large_slices(target):
    _, plan = spmd.auto_strategy(_create, _step, BIG, target, only=["TP over 2", "FSDP over 2"])
    assert sorted(c.name for c in plan.ranked) == ["FSDP over 2", "TP over 2"], str(plan)


def test_nothing_fits_is_an_error_holding_the_table():
    def create(key):
        return {"w": jnp.zeros((40, 1 << 30), jnp.float32)}  # 160 GiB: not on 4 v5e chips

    with pytest.raises(spmd.ConfigurationError, match="At least one layout fits") as info:
        spmd.auto_strategy(create, lambda s, x: (s, {}), X, "v5e:2x2", only=["FSDP over 4"])
    assert "does not fit" in str(info.value)


@pytest.mark.slow
def test_spmd_plan_prints_the_table_for_a_users_module(tmp_path):
    (tmp_path / "mymodel.py").write_text(
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp

            def create(key):
                return {"w": jax.random.normal(key, (512, 512))}

            def step(state, x):
                g = jax.grad(lambda p: ((x @ p["w"]) ** 2).mean())(state)
                return jax.tree.map(lambda a, b: a - 0.1 * b, state, g), {}

            def plan_inputs():
                return dict(create_fn=create, step=step,
                            batch=(jax.ShapeDtypeStruct((32, 512), jnp.float32),))
            """
        )
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd",
            "plan",
            "--target",
            "v5e-4",
            "--only",
            "FSDP",
            "mymodel:plan_inputs",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "auto_strategy for v5e-4" in run.stdout and "FSDP over 4" in run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "spmd", "plan", "mymodel"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 1 and "MODULE:FUNCTION" in bad.stderr


# ------------------------------------------------------------------ annotated flax models


class _DotReluDot(nnx.Module):
    """flax's GSPMD guide model (examples/09_flax_gspmd.py): kernels annotated in mesh axes."""

    def __init__(self, depth, rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
            use_bias=False,
            rngs=rngs,
        )
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), out_sharding=("model", None))

    def __call__(self, x):
        y = jax.nn.relu(self.dot1(x))
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        return jnp.dot(y, self.w2[...])


class _MultiDotReluDot(nnx.Module):
    def __init__(self, depth, num_layers, rngs):
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
        def create_sublayers(r):
            return _DotReluDot(depth, r)

        self.layers = create_sublayers(rngs.split(num_layers))

    def __call__(self, x):
        x, _ = jax.lax.scan(lambda x, layer: (layer(x), None), x, self.layers)
        return x


def _nnx_create():
    model = _MultiDotReluDot(256, 2, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def _nnx_step(state, x, y):
    model, optimizer = state
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


class _LogicalMLP(linen.Module):
    """A linen model annotated with logical names, as MaxText's and t5x's are."""

    @linen.compact
    def __call__(self, x):
        init = linen.initializers.lecun_normal()
        h = linen.Dense(1024, kernel_init=linen.with_logical_partitioning(init, ("embed", "mlp")))
        out = linen.Dense(256, kernel_init=linen.with_logical_partitioning(init, ("mlp", "embed")))
        return out(jax.nn.relu(h(x)))


def _linen_create(key):
    params = _LogicalMLP().init(key, jnp.ones((1, 256)))["params"]
    return {"params": params, "opt": optax.adam(1e-3).init(params)}


def _linen_step(state, x):
    def loss(p):
        return jnp.mean((_LogicalMLP().apply({"params": p}, x) - x) ** 2)

    value, grads = jax.value_and_grad(loss)(state["params"])
    updates, opt = optax.adam(1e-3).update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": value}


def _explained(strategy, create, step, batch, args=()):
    return strategy.explain(step, strategy.abstract_state(create, *args), *batch)


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
def test_an_nnx_model_annotated_in_mesh_axes_is_planned_with_its_annotations():
    topo = spmd.topology("v5e-8")
    xs = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    only = ["data parallel", "TP over 4", "FSDP 2 x TP 4"]
    _, plan = spmd.auto_strategy(_nnx_create, _nnx_step, (xs, xs), topo, args=(), only=only)
    assert sorted(c.name for c in plan.ranked) == sorted(only), str(plan)
    by_name = {c.name: c for c in plan.ranked}
    assert dict(by_name["data parallel"].strategy.mesh.shape) == {"data": 8, "model": 1}
    # TP over 4 is the guide's own layout: data 2 x model 4, the annotations over "model"
    guide = spmd.Strategy(spmd.make_mesh({"data": 2, "model": 4}, topo), batch_axes=("data",))
    want = _explained(guide, _nnx_create, _nnx_step, (xs, xs))
    got = by_name["TP over 4"].explanation
    assert (got.state_bytes, got.argument_bytes) == (want.state_bytes, want.argument_bytes)
    # FSDP x TP keeps the annotations over "model" and adds fsdp: a quarter of TP's state
    both = by_name["FSDP 2 x TP 4"].explanation
    assert both.state_bytes < got.state_bytes


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_linen_logical_model_is_planned_through_logical_axis_rules():
    topo = spmd.topology("v5e-8")
    logical = [("embed", None), ("mlp", "model")]
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    _, plan = spmd.auto_strategy(
        _linen_create,
        _linen_step,
        (x,),
        topo,
        only=["data parallel", "TP over 2"],
        logical_axis_rules=logical,
    )
    assert sorted(c.name for c in plan.ranked) == ["TP over 2", "data parallel"], str(plan)
    tp = next(c for c in plan.ranked if c.name == "TP over 2")
    # The model's rules first, then the candidate's layout of the activation names.
    n = len(logical)
    assert tp.strategy.logical_axis_rules[:n] == tuple(logical)
    assert dict(tp.strategy.logical_axis_rules[n:])["activation_embed"] == "model"
    hand = spmd.Strategy(spmd.make_mesh({"data": 4, "model": 2}, topo), logical_axis_rules=logical)
    want = _explained(hand, _linen_create, _linen_step, (x,), (jax.random.key(0),))
    assert tp.explanation.state_bytes == want.state_bytes


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
def test_rules_given_to_auto_strategy_lay_out_every_candidate():
    topo = spmd.topology("v5e-8")
    _, plan = spmd.auto_strategy(
        _create, _step, X, topo, only=["data parallel", "FSDP over 8"], rules=[(".*", None)]
    )
    states = {c.name: c.explanation.state_bytes for c in plan.ranked}
    assert states["data parallel"] == states["FSDP over 8"] > 0  # every leaf replicated


# ------------------------------------------------------------------ what auto_strategy is given


def test_extra_layouts_on_other_devices_are_an_error():
    with pytest.raises(spmd.ConfigurationError, match="on the target's devices") as info:
        spmd.auto_strategy(
            _create,
            _step,
            X,
            "v5e-8",
            extra={"mine": spmd.TPUStrategy(topology=spmd.topology("v5p-8"))},
        )
    assert "extra='mine'" in str(info.value) and "TPU v5 lite" in str(info.value)
    with pytest.raises(spmd.ConfigurationError, match="on the target's devices"):
        spmd.auto_strategy(_create, _step, X, "v5e-8", extra={"cpu": spmd.MirroredStrategy()})


@pytest.mark.parametrize("extra", [{"mine": "FSDP"}, ["a strategy"], {1: None}])
def test_extra_that_is_no_dict_of_strategies_is_an_error(extra):
    with pytest.raises(spmd.ConfigurationError, match="extra maps names to Strategy"):
        spmd.auto_strategy(_create, _step, X, "v5e-8", extra=extra)


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_extra_layouts_on_the_target_are_ranked_beside_the_candidates():
    topo = spmd.topology("v5e-8")
    mine = spmd.TPUStrategy(topology=topo)
    _, plan = spmd.auto_strategy(
        _create, _step, X, topo, only=["data parallel", "mine"], extra={"mine": mine}
    )
    assert sorted(c.name for c in plan.ranked) == ["data parallel", "mine"]


def _shape_bug(state, x):  # the batch is (64, 257): x @ w1 cannot contract
    return _step(state, x)


@pytest.mark.parametrize(
    ("step", "batch", "raised"),
    [
        (_shape_bug, (jax.ShapeDtypeStruct((64, 257), jnp.float32),), TypeError),
        (lambda s, x: (_ for _ in ()).throw(ValueError("my bug")), (X,), ValueError),
        (_step, {"x": X}, TypeError),  # a dict where the step takes an array
    ],
)
def test_a_bug_in_the_step_is_raised_at_once_not_nothing_fits(step, batch, raised):
    with pytest.raises(raised) as info:
        spmd.auto_strategy(_create, step, batch, "v5e-8")
    assert not isinstance(info.value, spmd.ConfigurationError)
    assert "before any layout was tried" in "".join(getattr(info.value, "__notes__", []))


def test_a_bug_in_create_fn_is_raised_at_once():
    def create(key):
        raise KeyError("embedding")

    with pytest.raises(KeyError) as info:
        spmd.auto_strategy(create, _step, X, "v5e-8")
    assert "create_fn" in "".join(info.value.__notes__)


def test_a_batch_some_layouts_cannot_split_drops_them_with_the_reason():
    twelve = jax.ShapeDtypeStruct((12, 256), jnp.float32)
    _, plan = spmd.auto_strategy(
        _create, _step, twelve, "v5e-8", only=["data parallel", "TP over 4"]
    )
    assert [c.name for c in plan.ranked] == ["TP over 4"]  # data 2 splits 12 rows
    (dp,) = plan.dropped
    assert dp.dropped.startswith("cannot be laid out: The global batch must split evenly")


def _small_create(key):  # matrices of 8,192 elements: under MIN_SHARDED_ELEMENTS
    k1, k2 = jax.random.split(key)
    params = {"w1": jax.random.normal(k1, (64, 128)), "w2": jax.random.normal(k2, (128, 64))}
    return {"params": params, "opt": optax.adam(1e-3).init(params)}


SMALL_X = jax.ShapeDtypeStruct((64, 64), jnp.float32)


def test_tensor_parallel_that_splits_no_leaf_is_dropped_not_ranked():
    # No matrix is large enough to split: "TP over 8" would be data=1 x model=8 with every
    # leaf replicated, each device computing the whole batch (and no all-reduce to pay).
    only = ["data parallel", "TP over 8", "FSDP 2 x TP 4"]
    best, plan = spmd.auto_strategy(_small_create, _step, SMALL_X, only=only)
    assert [c.name for c in plan.ranked] == ["data parallel"], str(plan)
    assert dict(best.mesh.shape) == {"data": 8}
    dropped = {c.name: c.dropped for c in plan.dropped}
    assert sorted(dropped) == ["FSDP 2 x TP 4", "TP over 8"]
    assert dropped["TP over 8"].startswith("splits no work: no leaf of the state is split over")
    assert "model=8" in dropped["TP over 8"] and "16,384 elements" in dropped["TP over 8"]
    assert "model=4" in dropped["FSDP 2 x TP 4"]
    assert "TP over 8 (data=1 x model=8): splits no work" in str(plan)


def test_tensor_parallel_that_a_users_rule_splits_is_kept():
    rules = [("params/w1", P(None, "model"))]  # small, but the user asks for it split
    _, plan = spmd.auto_strategy(_small_create, _step, SMALL_X, only="TP over 8", rules=rules)
    assert [c.name for c in plan.ranked] == ["TP over 8"], str(plan)


def test_a_batch_of_negative_size_is_a_batch_error():
    with pytest.raises(spmd.BatchError, match="0 or more") as info:
        spmd.auto_strategy(_create, _step, jax.ShapeDtypeStruct((-4, 256), jnp.float32))
    assert "negative_shapes={'batch[0]': (-4, 256)}" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"create_fn": 123}, "Received: create_fn=123, type='int'"),
        ({"step": "step"}, "Received: step='step', type='str'"),
    ],
)
def test_a_create_fn_or_step_that_is_no_function_is_an_error_naming_it(kwargs, said):
    kwargs = {"create_fn": _create, "step": _step, "batch": X} | kwargs
    with pytest.raises(spmd.ConfigurationError, match="is a function") as info:
        spmd.auto_strategy(**kwargs)
    assert said in str(info.value)


def test_only_an_empty_list_is_an_error():
    with pytest.raises(spmd.ConfigurationError, match="an empty list keeps none") as info:
        spmd.auto_strategy(_create, _step, X, only=[])
    assert "only=None for every candidate" in str(info.value)


def test_only_is_a_name_or_a_list_of_names():
    _, plan = spmd.auto_strategy(_create, _step, X, "v5e:2x2", only="FSDP over 4")
    assert [c.name for c in plan.candidates] == [
        "FSDP over 4",
        "FSDP over 4, optimizer state in host memory",
    ]
    with pytest.raises(spmd.ConfigurationError, match="only is a string, or a list of strings"):
        spmd.auto_strategy(_create, _step, X, "v5e:2x2", only=[8])


def test_only_matching_nothing_lists_the_candidates():
    with pytest.raises(spmd.ConfigurationError, match="none does") as info:
        spmd.auto_strategy(_create, _step, X, "v5e:2x2", only=["nothing"])
    assert "'data parallel', 'FSDP over 2'" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"args": jax.random.key(0)}, "args is the tuple of create_fn's arguments"),
        ({"devices_or_topology": 8}, "auto_strategy's target is a topology name"),
        ({"slices": 2}, "slices= goes with a topology name"),
        ({"slices": 0}, "slices"),
    ],
)
def test_arguments_auto_strategy_cannot_use_are_clear_errors(kwargs, said):
    kwargs = {"devices_or_topology": spmd.topology("v5e:2x2")} | kwargs
    with pytest.raises(spmd.ConfigurationError, match=said) as info:
        spmd.auto_strategy(_create, _step, X, **kwargs)
    assert "To fix" in str(info.value)


# ------------------------------------------------------------------ spmd plan's entry points

SCRIPT = """
import argparse, pathlib, sys
import jax, jax.numpy as jnp

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=512)
config, _ = parser.parse_known_args()
SEEN_ARGV = list(sys.argv)

def create(key):
    return {"w": jax.random.normal(key, (config.width, config.width))}

def step(state, x):
    g = jax.grad(lambda p: ((x @ p["w"]) ** 2).mean())(state)
    return jax.tree.map(lambda a, b: a - 0.1 * b, state, g), {}

def plan_inputs():
    return dict(create_fn=create, step=step,
                batch=(jax.ShapeDtypeStruct((32, config.width), jnp.float32),))

def plan_raises():
    raise RuntimeError("my data path is missing")

def plan_without_step():
    return dict(create_fn=create, batch=(jax.ShapeDtypeStruct((32, 512), jnp.float32),))

if __name__ == "__main__":
    pathlib.Path(sys.argv[0]).with_suffix(".trained").write_text("the training ran")
"""


def _plan(argv, capsys):
    from spmd._src.cli.main import main

    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "entry",
    [
        ["{path}:plan_inputs"],
        ["{path}"],  # plan_inputs() by default
        ["--", "python", "{path}", "--width", "256"],  # its arguments in sys.argv
        ["--", "{path}", "--width", "256"],
    ],
)
def test_spmd_plan_takes_a_script_path(entry, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    words = [w.format(path=script) for w in entry]
    code, out, err = _plan(["--target", "v5e:2x2", "--only", "FSDP over 4", *words], capsys)
    assert code == 0, err
    assert "auto_strategy for v5e:2x2" in out and "FSDP over 4" in out
    assert not script.with_suffix(".trained").exists()  # the script's __main__ block did not run
    seen = sys.modules["train"].SEEN_ARGV
    assert seen == [str(script), *(["--width", "256"] if "--width" in entry else [])]


def test_a_plan_function_that_raises_shows_its_traceback_under_one_line(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    code, out, err = _plan(["--target", "v5e:2x2", f"{script}:plan_raises"], capsys)
    assert code == 1 and not out
    first, *rest = err.splitlines()
    assert first.startswith("spmd plan: error: ") and "plan_raises() raised RuntimeError" in first
    assert "Traceback (most recent call last)" in err and 'raise RuntimeError("my data path' in err
    assert rest[-1] == "RuntimeError: my data path is missing"
    assert "plan_command.py" not in err  # the traceback is the user's code's


def test_a_plan_function_whose_dict_lacks_a_piece_names_it(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    code, out, err = _plan(["--target", "v5e:2x2", f"{script}:plan_without_step"], capsys)
    assert code == 1 and not out
    assert "missing=['step'], keys=['create_fn', 'batch']" in err


def test_a_module_that_raises_on_import_shows_its_traceback(tmp_path, capsys, monkeypatch):
    (tmp_path / "broken.py").write_text("import jax\nraise ValueError('import-time failure')\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = _plan(["broken:plan_inputs"], capsys)
    assert code == 1 and err.startswith("spmd plan: error: importing broken raised ValueError")
    assert err.rstrip().endswith("ValueError: import-time failure")
    assert "importlib" not in err and "broken.py" in err


def test_options_after_the_entry_are_honoured_and_words_after_dashes_are_the_scripts(
    tmp_path, capsys
):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    argv = [str(script), "--only", "FSDP over 4", "--target", "v5e:2x2", "--json"]
    code, out, err = _plan(
        [*argv, "--cache-dir", str(tmp_path / "cache"), "--", "--width", "256"], capsys
    )
    assert code == 0, err
    plan = json.loads(out)
    assert plan["target"].startswith("v5e:2x2") and sys.modules["train"].SEEN_ARGV[1:] == [
        "--width",
        "256",
    ]
    assert [c["name"] for c in plan["candidates"]] == ["FSDP over 4"]  # --only honoured
    assert plan["candidates"][0]["flops"] > 0 and plan["candidates"][0]["fits"] is True
    progress = [line for line in err.splitlines() if line.startswith("[1] FSDP over 4: ")]
    assert len(progress) == 1 and "compiled in " in progress[0] and "a step (est.)" in progress[0]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--target", "v5e-4", "--cpu-devices", "4", "m:f"], "--cpu-devices simulates CPU"),
        (["--slices", "2", "m:f"], "--slices counts TPU slices"),
        (["--target", "v5e-4", "m:f", "--", "--width", "2"], "only a script takes arguments"),
        (["m.py", "--width", "2"], "after the entry m.py, only spmd plan's options are read"),
        (["m.py", "--width", "2"], "spmd plan m.py -- --width 2"),
        (["m.py", "--only", "FSDP", "stray"], "['stray'] are not among them"),
        (["m:f", "--json", "stray"], "A module entry takes no arguments"),
        (["m.py", "--jobs", "0"], "--jobs"),
        (["--target", "v5e-4"], "give the model's entry point"),
    ],
)
def test_spmd_plan_options_that_would_do_nothing_are_errors(argv, said, capsys):
    with pytest.raises(SystemExit) as info:
        _plan(argv, capsys)
    assert info.value.code == 2 and said in capsys.readouterr().err


def test_a_script_path_whose_plan_inputs_returns_something_else_names_the_function(tmp_path):
    from spmd._src.cli.plan_command import load_entry

    script = tmp_path / "train.py"
    script.write_text("def plan_inputs():\n    return 42\n")
    with pytest.raises(spmd.ConfigurationError, match=r"train.py:plan_inputs\(\) returns") as info:
        load_entry(str(script))
    assert "returned='int'" in str(info.value)
