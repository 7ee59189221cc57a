"""placement="offload_optimizer": the optimizer state in pinned_host between steps, the
parameters on the devices, the same numbers as one device, a lower device peak.

The oracle of every run is the same model, data and seed on one device with the
state all in device memory.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from models import MLP, labelled

import spmd
from spmd.testing import assert_trees_allclose

LAYERS, WIDTH = 4, 32
TX = optax.adam(1e-2)


def _create(key, layers=LAYERS, width=WIDTH):
    keys = jax.random.split(key, layers)
    params = {f"w{i}": jax.random.normal(k, (width, width)) * 0.2 for i, k in enumerate(keys)}
    return {"params": params, "opt": TX.init(params)}


def _loss(params, x):
    h = x
    for i in range(len(params)):
        h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean((h - x) ** 2)


def _step(state, x):
    loss, grads = jax.value_and_grad(_loss)(state["params"], x)
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def _batches(n=4, rows=16, width=WIDTH):
    rng = np.random.default_rng(0)
    return [rng.normal(size=(rows, width)).astype(np.float32) for _ in range(n)]


def _run(strategy, step=_step):
    state = strategy.init(_create, jax.random.key(0))
    compiled = strategy.step(step)
    losses = []
    for x in _batches():
        state, loss = compiled(state, x)
        losses.append(float(loss))
    return losses, state, compiled


def _kinds(state):
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {spmd._src.rules.path_str(p): leaf.sharding.memory_kind for p, leaf in flat}


def _one_device(**options):
    mesh = spmd.make_mesh({"data": 1}, jax.devices()[:1])
    return spmd.Strategy(mesh, placement="offload_optimizer", **options)


def _fsdp(**options):  # the eight CPU devices, every matrix and its moments split in 8
    mesh = spmd.make_mesh({"fsdp": 8})
    rules = [(r".*w\d+", P("fsdp"))]
    return spmd.Strategy(mesh, rules, placement="offload_optimizer", **options)


STRATEGIES = [
    pytest.param(_one_device, id="one_device"),
    pytest.param(_fsdp, id="fsdp_over_8", marks=pytest.mark.cpu_mesh),
]


@pytest.fixture(scope="module")
def oracle():
    """The one-device run (state all in device memory): losses and final state, run once."""
    want_losses, want, _ = _run(spmd.OneDeviceStrategy())
    return want_losses, jax.device_get(want)


@pytest.mark.slow  # 7 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("make", STRATEGIES)
def test_a_pytree_adam_state_with_its_optimizer_in_host_memory_matches_one_device(make, oracle):
    want_losses, want = oracle
    got_losses, got, step = _run(make())
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    assert_trees_allclose(jax.device_get(got), want, rtol=1e-6, atol=1e-7)
    kinds = _kinds(got)
    assert {kinds[p] for p in kinds if p.startswith("opt/0/mu/")} == {"pinned_host"}
    assert {kinds[p] for p in kinds if p.startswith("opt/0/nu/")} == {"pinned_host"}
    assert {kinds[p] for p in kinds if p.startswith("params/")} == {"device"}
    assert kinds["opt/0/count"] == "device"  # a scalar stays on the device
    assert step.cache_size() == 1


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_the_parameters_are_donated_and_the_host_leaves_kept():
    strategy = _one_device()
    state = strategy.init(_create, jax.random.key(0))
    params, moments = jax.tree.leaves(state["params"]), jax.tree.leaves(state["opt"][0].mu)
    strategy.step(_step)(state, _batches(1)[0])
    assert all(p.is_deleted() for p in params)
    assert not any(m.is_deleted() for m in moments)


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
def test_offload_keeps_in_host_memory_only_the_leaves_its_regex_names(oracle):
    strategy = _one_device(offload=r"opt/.*/nu/.*")  # Adam's second moment alone
    want_losses, want = oracle
    got_losses, got, _ = _run(strategy)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    assert_trees_allclose(jax.device_get(got), want, rtol=1e-6, atol=1e-7)
    on_host = sorted(p for p, kind in _kinds(got).items() if kind == "pinned_host")
    assert on_host == [f"opt/0/nu/w{i}" for i in range(LAYERS)]


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_clipped_optimizer_and_a_step_reading_its_moments_match_one_device():
    tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2))

    def create(key):
        params = _create(key)["params"]
        return {"params": params, "opt": tx.init(params)}

    def step(state, x):  # the global norm joins every gradient; the metric every moment
        loss, grads = jax.value_and_grad(_loss)(state["params"], x)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        moment = sum(jnp.sum(m) for m in jax.tree.leaves(opt[1][0].mu))
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, (
            loss,
            moment,
        )

    results = []
    for strategy in (spmd.OneDeviceStrategy(), _one_device()):
        state = strategy.init(create, jax.random.key(0))
        compiled = strategy.step(step)
        for x in _batches():
            state, metrics = compiled(state, x)
        results.append((jax.device_get(state), jax.device_get(metrics)))
    assert_trees_allclose(results[1], results[0], rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_an_nnx_optimizer_is_found_by_its_opt_state_path():
    def run(strategy):
        model = MLP(nnx.Rngs(0), features=6, hidden=16, outputs=3)
        opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
        nnx.update((model, opt), strategy.put(nnx.state((model, opt))))

        @strategy.step(donate=True)
        def step(state, x, y):
            model, opt = state

            def loss(model):
                return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model(x), y))

            value, grads = nnx.value_and_grad(loss)(model)
            opt.update(model, grads)
            return value

        x, y = labelled(64)
        losses = [float(step((model, opt), x[i : i + 16], y[i : i + 16])) for i in range(0, 64, 16)]
        return losses, nnx.state((model, opt))

    want_losses, want = run(spmd.OneDeviceStrategy())
    got_losses, got = run(_one_device())
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    assert_trees_allclose(jax.device_get(got), want, rtol=1e-6, atol=1e-7)
    kinds = _kinds(got)
    assert {kinds[p] for p in kinds if "/opt_state/0/mu/" in p} == {"pinned_host"}
    assert {kinds[p] for p in kinds if p.startswith("0/")} == {"device"}  # the model


@pytest.mark.slow  # 6 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("options", [{}, {"steps_per_execution": 2}])
def test_the_trainer_with_its_optimizer_in_host_memory_follows_one_device(options):
    x, y = labelled(256)

    def fit(strategy):
        model = MLP(nnx.Rngs(0), features=6, hidden=16, outputs=3)
        trainer = spmd.Trainer(
            model, optax.adam(1e-2), "sparse_categorical_crossentropy", strategy=strategy, **options
        )
        history = trainer.fit((x, y), batch_size=32, epochs=2, shuffle=False, verbose=0)
        return trainer, history.history["loss"]

    oracle, want = fit(spmd.OneDeviceStrategy())
    trainer, got = fit(_one_device())
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert_trees_allclose(
        jax.device_get(trainer.state["params"]), jax.device_get(oracle.state["params"]), rtol=1e-6
    )
    kinds = _kinds(trainer.state)
    assert {kinds[p] for p in kinds if p.startswith("opt_state/0/mu/")} == {"pinned_host"}
    assert {kinds[p] for p in kinds if p.startswith("params/")} == {"device"}
    assert trainer.evaluate((x, y), batch_size=32) == pytest.approx(
        oracle.evaluate((x, y), batch_size=32), rel=1e-6
    )


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_checkpoint_restores_the_optimizer_into_host_memory(tmp_path):
    strategy = _one_device()
    state = strategy.init(_create, jax.random.key(0))
    state, _ = strategy.step(_step)(state, _batches(1)[0])
    manager = spmd.CheckpointManager(tmp_path, async_save=False)
    manager.save(1, state)
    with strategy.scope():
        restored = manager.restore(target=strategy.abstract_state(_create, jax.random.key(0)))
    manager.close()
    assert _kinds(restored) == _kinds(state)
    assert_trees_allclose(jax.device_get(restored), jax.device_get(state), rtol=0, atol=0)
    strategy.step(_step)(restored, _batches(1)[0])  # and it trains on


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_named_strategy_takes_the_placement_by_replace(oracle):
    strategy = dataclasses.replace(spmd.OneDeviceStrategy(), placement="offload_optimizer")
    want_losses, _ = oracle
    got_losses, got, _ = _run(strategy)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    assert "pinned_host" in _kinds(got).values()


# --- what the compiled program needs ----------------------------------------------


def _explained(strategy, layers=8, width=256):
    abstract = strategy.abstract_state(_create, jax.random.key(0), layers=layers, width=width)
    x = jax.ShapeDtypeStruct((64, width), jnp.float32)
    return strategy.explain(_step, abstract, x)


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_explain_counts_the_moments_in_host_memory_and_a_lower_device_peak_on_cpu():
    mesh = spmd.make_mesh({"data": 1}, jax.devices()[:1])
    device = _explained(spmd.Strategy(mesh))
    offloaded = _explained(spmd.Strategy(mesh, placement="offload_optimizer"))
    params = 8 * 256 * 256 * 4
    assert device.state_host_bytes == 0 and device.state_bytes >= 3 * params
    assert offloaded.state_host_bytes == 2 * params  # Adam's two moments
    assert offloaded.state_bytes < params + 1024  # the parameters and the step count
    assert offloaded.peak_bytes < device.peak_bytes - params
    assert "state (host memory)         4.00 MiB" in str(offloaded)


libtpu = pytest.importorskip("libtpu", reason="the TPU compiler (the tpu-compile extra)")


@pytest.mark.slow  # 4 s of CPU: over the fast tier's share (tests/tiers.py)
def test_on_a_tpu_slice_the_compiler_needs_less_hbm_with_the_optimizer_offloaded():
    topo = spmd.topology("v5e:2x2")
    mesh = spmd.make_mesh({"fsdp": 4}, topo)
    rules = [(r".*w\d+", P("fsdp"))]
    device = _explained(spmd.Strategy(mesh, rules), width=1024)
    offloaded = _explained(spmd.Strategy(mesh, rules, placement="offload_optimizer"), width=1024)
    quarter = 8 * 1024 * 1024 * 4 // 4  # one device's share of the parameters
    assert offloaded.state_host_bytes == 2 * quarter
    assert offloaded.peak_bytes < device.peak_bytes  # the TPU compiler's memory analysis
    r = offloaded.roofline
    assert r.host_bytes == 2 * quarter and r.host_s == pytest.approx(2 * quarter / 15e9)
    assert offloaded.step_seconds > device.step_seconds  # the host link costs time
    assert "host link time" in str(offloaded)


# --- what cannot work -------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"offload": r"opt/.*"}, "offload names the leaves placement='offload_optimizer'"),
        (
            {"placement": "offload_optimizer", "offload": "opt/(.*"},
            "Each offload regex compiles",
        ),
        ({"placement": "offload_optimizer", "offload": [3]}, "offload is a regex"),
        ({"placement": "offload_optimizer", "offload": []}, "offload names at least one regex"),
        ({"placement": "offload_optimizer", "offload": ()}, "pass offload=None for the default"),
        ({"placement": "optimizer"}, "placement is one of"),
    ],
)
def test_offload_options_that_cannot_work_are_clear_errors(options, said):
    mesh = spmd.make_mesh({"data": 1}, jax.devices()[:1])
    with pytest.raises(spmd.ConfigurationError, match=said) as info:
        spmd.Strategy(mesh, **options)
    assert "To fix" in str(info.value)


def test_a_training_step_with_no_optimizer_state_warns_that_nothing_is_offloaded():
    strategy = _one_device()
    state = strategy.put({"w": jnp.ones((4, 4))})
    with pytest.warns(UserWarning, match="has none, so every leaf stays in device memory"):
        strategy.step(lambda s, x: ({"w": s["w"] - x.mean()}, 0.0))(state, np.ones((2, 4)))
    assert _kinds(state) == {"w": "device"}


def test_diloco_refuses_an_inner_strategy_that_offloads():
    with pytest.raises(spmd.ConfigurationError, match="placement='device'"):
        spmd.DiLoCo(inner=_one_device(), islands=1, sync_every=2, outer_optimizer=optax.sgd(0.7))
