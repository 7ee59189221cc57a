"""Host-placed (pinned_host) state is not donated and
only its pinned_host leaves move inside the step; the accelerator test mode; examples/07.

Every host-placed run is checked against OneDeviceStrategy (the oracle): same model,
data and seed on one device. A strict xfail is a defect found; a plain test pins a
case that was checked and holds.
"""

import gc
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from models import mse, nnx_update

import spmd

ROOT = Path(__file__).resolve().parent.parent
TX = optax.adam(1e-2)


def _batches(n=5, rows=32, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(rows, 8)).astype(np.float32),
            rng.normal(size=(rows, 2)).astype(np.float32),
        )
        for _ in range(n)
    ]


def _close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol),
        jax.device_get(a),
        jax.device_get(b),
    )


def _host_strategy(index):
    """Host-placed strategies: the named one (0) and a custom one sharded over 4x2 (1)."""
    if index == 0:
        return spmd.CentralStorageStrategy()
    mesh = spmd.make_mesh({"replica": 4, "model": 2})
    return spmd.Strategy(
        mesh, [(r".*kernel", P(None, "model"))], batch_axes=("replica",), placement="host"
    )


# The sharded one needs the eight CPU devices; the named one runs on a GPU's pinned_host too.
HOST_INDEX = [
    pytest.param(0, id="central"),
    pytest.param(1, id="custom_sharded_host", marks=pytest.mark.cpu_mesh),
]


# --- NNX model + nnx.Optimizer ----------------------------------------------------


class _Mlp(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def _nnx_step(state, x, y):
    return nnx_update(*state, mse, x, y)


def _nnx_run(strategy, donate, read_between=False):
    model = _Mlp(nnx.Rngs(0))
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    with strategy.scope():
        nnx.update((model, opt), strategy.put(nnx.state((model, opt))))
    step = strategy.step(donate=donate)(_nnx_step)
    losses = []
    for x, y in _batches():
        losses.append(float(step((model, opt), x, y)))
        if read_between:
            jax.tree.map(np.asarray, nnx.state((model, opt)))
    return losses, nnx.state((model, opt))


@pytest.mark.slow
@pytest.mark.parametrize("donate", [None, True])
@pytest.mark.parametrize("index", HOST_INDEX)
def test_nnx_model_and_optimizer_on_host_placement_match_one_device(index, donate):
    want_losses, want = _nnx_run(spmd.OneDeviceStrategy(), donate)
    got_losses, got = _nnx_run(_host_strategy(index), donate, read_between=True)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    _close(got, want)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(got)}
    assert kinds == {"pinned_host"}


@pytest.mark.slow
def test_donate_true_on_host_placement_keeps_the_callers_nnx_arrays_alive():
    """Pins today's behaviour: donate=True is silently not donated on a host placement
    (docs/api.md still says donate=True NNX arrays 'are deleted')."""
    strategy = spmd.CentralStorageStrategy()
    model = _Mlp(nnx.Rngs(0))
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    nnx.update((model, opt), strategy.put(nnx.state((model, opt))))
    before = jax.tree.leaves(nnx.state(model))
    x, y = _batches(1)[0]
    strategy.step(donate=True)(_nnx_step)((model, opt), x, y)
    assert not any(leaf.is_deleted() for leaf in before)


# --- PRNG keys in the state --------------------------------------------------------


def _key_create(key):
    k1, k2 = jax.random.split(key)
    return {
        "w": jax.random.normal(k1, (8, 2)) * 0.1,
        "key": k2,
        "opt": TX.init({"w": jnp.zeros((8, 2))}),
    }


def _key_step(state, x, y):
    key, sub = jax.random.split(state["key"])
    keep = jax.random.bernoulli(sub, 0.8, x.shape)
    xd = jnp.where(keep, x / 0.8, 0.0)

    def loss_fn(w):
        return jnp.mean((xd @ w - y) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(state["w"])
    updates, opt = TX.update({"w": g}, state["opt"], {"w": state["w"]})
    return {"w": state["w"] + updates["w"], "key": key, "opt": opt}, loss


def _key_run(strategy, read_between=False):
    state = strategy.init(_key_create, jax.random.key(1))
    step = strategy.step(_key_step)
    losses = []
    for x, y in _batches(6):
        state, loss = step(state, x, y)
        losses.append(float(loss))
        if read_between:
            np.asarray(state["w"])
            jax.random.key_data(state["key"]).block_until_ready()
    return losses, state


@pytest.mark.slow
@pytest.mark.parametrize("index", HOST_INDEX)
def test_a_state_with_a_prng_key_on_host_placement_matches_one_device(index):
    want_losses, want = _key_run(spmd.OneDeviceStrategy())
    got_losses, got = _key_run(_host_strategy(index), read_between=True)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    np.testing.assert_array_equal(
        jax.random.key_data(got["key"]), jax.random.key_data(jax.device_get(want["key"]))
    )
    _close(got["w"], want["w"])
    assert got["key"].sharding.memory_kind == "device"
    assert got["w"].sharding.memory_kind == "pinned_host"


class _DropNet(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.l2 = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.l1(x))))


def _rngs_run(strategy):
    model = _DropNet(nnx.Rngs(0, dropout=3))
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    nnx.update((model, opt), strategy.put(nnx.state((model, opt))))
    step = strategy.step(_nnx_step)
    losses = [float(step((model, opt), x, y)) for x, y in _batches(5)]
    return losses, nnx.state(model, nnx.Param)


@pytest.mark.slow
def test_nnx_rngs_in_the_model_on_central_storage_match_one_device():
    want_losses, want = _rngs_run(spmd.OneDeviceStrategy())
    got_losses, got = _rngs_run(spmd.CentralStorageStrategy())
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    _close(got, want)


# --- Trainer: Dropout + BatchNorm, grad_accum_steps, steps_per_execution -----------


class _BnNet(nnx.Module):
    def __init__(self, rngs):
        # no bias before BatchNorm: its gradient is zero and adam would amplify rounding
        self.l1 = nnx.Linear(8, 16, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def _cls_data(n=128):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, rng.integers(0, 3, size=n).astype(np.int32)


def _fit(strategy, epochs=3, callbacks=(), **options):
    trainer = spmd.Trainer(
        _BnNet(nnx.Rngs(0)),
        optax.adam(1e-2),
        "sparse_categorical_crossentropy",
        ["accuracy"],
        strategy=strategy,
        **options,
    )
    history = trainer.fit(
        _cls_data(),
        batch_size=32,
        epochs=epochs,
        verbose=0,
        shuffle=False,
        callbacks=list(callbacks),
    )
    return trainer, history.history


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [{}, {"grad_accum_steps": 2}, {"steps_per_execution": 2}],
    ids=["plain", "grad_accum_2", "spe_2"],
)
def test_trainer_with_dropout_and_batchnorm_on_central_storage_matches_one_device(options):
    one, want = _fit(spmd.OneDeviceStrategy(), **options)
    central, got = _fit(spmd.CentralStorageStrategy(), **options)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-5)
    _close(central.state["params"], one.state["params"], rtol=1e-4, atol=1e-5)
    host = [leaf for leaf in jax.tree.leaves(central.state["params"])]
    assert {leaf.sharding.memory_kind for leaf in host} == {"pinned_host"}


class _Stop(Exception):
    pass


class _Interrupt(spmd.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.trainer.iterations == 6:
            raise _Stop


def _interrupted_then_resumed(tmp_path, close_first, save_freq=3):
    whole, _ = _fit(spmd.CentralStorageStrategy(), epochs=3)
    backup = str(tmp_path / "backup")
    first = spmd.callbacks.BackupAndRestore(backup, save_freq=save_freq)
    with pytest.raises(_Stop):
        _fit(spmd.CentralStorageStrategy(), epochs=3, callbacks=[first, _Interrupt()])
    assert first.manager is None  # fit released it (on_train_abort): the backups stay
    resumed, _ = _fit(
        spmd.CentralStorageStrategy(),
        epochs=3,
        callbacks=[spmd.callbacks.BackupAndRestore(backup, save_freq=save_freq)],
    )
    for a, b in zip(
        jax.tree.leaves(jax.device_get(resumed.state)),
        jax.tree.leaves(jax.device_get(whole.state)),
        strict=True,
    ):
        np.testing.assert_array_equal(_raw(a), _raw(b))


def _raw(x):
    """A leaf as numpy; PRNG keys by their key data."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


@pytest.mark.slow
def test_backup_and_restore_on_central_storage_resumes_to_the_uninterrupted_weights(tmp_path):
    _interrupted_then_resumed(tmp_path, close_first=True)


@pytest.mark.slow
def test_a_fit_interrupted_by_an_exception_resumes_in_the_same_process(tmp_path):
    _interrupted_then_resumed(tmp_path, close_first=False)


@pytest.mark.slow
def test_a_backup_at_an_epochs_last_batch_resumes_at_the_next_epoch(tmp_path):
    """4 batches per epoch, save_freq=4, stopped at iteration 6: the backup is iteration 4."""
    _interrupted_then_resumed(tmp_path, close_first=True, save_freq=4)


# --- pytree steps: metrics only, mixed dtypes ---------------------------------------


def _create(key):
    w = jax.random.normal(key, (8, 2)) * 0.1
    return {"w": w, "opt": TX.init(w)}


def _train(state, x, y):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(state["w"])
    updates, opt = TX.update(g, state["opt"], state["w"])
    return {"w": state["w"] + updates, "opt": opt}, loss


@pytest.mark.slow
def test_a_metrics_only_step_on_central_storage_reads_the_state_and_matches_one_device():
    def evaluate(state, x, y):
        return {"loss": jnp.mean((x @ state["w"] - y) ** 2), "sum": jnp.sum(x @ state["w"])}

    out = {}
    for strategy in (spmd.OneDeviceStrategy(), spmd.CentralStorageStrategy()):
        state = strategy.init(_create, jax.random.key(0))
        ev = strategy.step(donate=False)(evaluate)
        out[strategy.name] = [jax.device_get(ev(state, x, y)) for x, y in _batches(3)]
        assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
    _close(out["CentralStorageStrategy"], out["OneDeviceStrategy"])


def _mixed_create(key):
    return {
        "w": jax.random.normal(key, (8, 2)).astype(jnp.bfloat16),
        "count": jnp.zeros((), jnp.int32),
        "flags": jnp.zeros((3,), jnp.bool_),
        "ema": jnp.zeros((8, 2), jnp.float32),
    }


def _mixed_step(state, x, y):
    w = state["w"].astype(jnp.float32)
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    w = w - 0.1 * g
    count = state["count"] + 1
    flags = state["flags"].at[count % 3].set(loss > 0.5)
    return {
        "w": w.astype(jnp.bfloat16),
        "count": count,
        "flags": flags,
        "ema": 0.9 * state["ema"] + 0.1 * w,
    }, loss


@pytest.mark.slow
@pytest.mark.parametrize("index", HOST_INDEX)
def test_int_bool_bf16_leaves_on_host_placement_match_one_device(index):
    runs = {}
    for name, strategy in (("one", spmd.OneDeviceStrategy()), ("host", _host_strategy(index))):
        state = strategy.init(_mixed_create, jax.random.key(0))
        step = strategy.step(_mixed_step)
        losses = []
        for x, y in _batches(5):
            state, loss = step(state, x, y)
            losses.append(float(loss))
            np.asarray(state["flags"])  # a host read between steps
        runs[name] = (losses, jax.device_get(state))
    np.testing.assert_allclose(runs["host"][0], runs["one"][0], rtol=1e-2)
    for key in ("count", "flags"):
        np.testing.assert_array_equal(runs["host"][1][key], runs["one"][1][key])
    _close(runs["host"][1]["ema"], runs["one"][1]["ema"], rtol=1e-2, atol=1e-3)
    assert runs["host"][1]["w"].dtype == jnp.bfloat16


# --- an NNX step that adds Variables (structure change) ------------------------------


class _Lazy(nnx.Module):
    def __init__(self, rngs, sow=False):
        self.l1, self.sows = nnx.Linear(8, 2, rngs=rngs), sow

    def __call__(self, x):
        y = self.l1(x)
        if self.sows:
            self.sow(nnx.Intermediate, "act", jnp.mean(y))
        return y


def _grow_step(state, x, y):
    loss = nnx_update(*state, mse, x, y)
    state[0].counter = nnx.BatchStat(jnp.sum(x))  # a Variable the step adds
    return loss


def _grow_run(strategy, sow=False):
    model = _Lazy(nnx.Rngs(0), sow)
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    nnx.update((model, opt), strategy.put(nnx.state((model, opt))))
    step = strategy.step(_grow_step)
    losses = [float(step((model, opt), x, y)) for x, y in _batches(3)]
    return losses, model


@pytest.mark.slow
def test_an_nnx_step_that_adds_variables_on_central_storage_matches_one_device():
    want_losses, want = _grow_run(spmd.OneDeviceStrategy())
    got_losses, got = _grow_run(spmd.CentralStorageStrategy())
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    _close(nnx.state(got), nnx.state(want))
    assert got.counter[...].sharding.memory_kind == "pinned_host"
    assert got.l1.kernel[...].sharding.memory_kind == "pinned_host"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_sown_intermediate_that_grows_each_step_runs_as_under_nnx_jit():
    model = _Lazy(nnx.Rngs(0), sow=True)
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    jitted = nnx.jit(_grow_step)
    want = [float(jitted((model, opt), x, y)) for x, y in _batches(3)]
    got_losses, got = _grow_run(spmd.OneDeviceStrategy(), sow=True)
    np.testing.assert_allclose(got_losses, want, rtol=1e-5)
    assert len(got.act.get_value()) == len(model.act.get_value()) == 3
    _close(got.act.get_value(), model.act.get_value())


# --- checkpoint (async save) mid-run, memory held across steps, explain --------------


@pytest.mark.slow
def test_async_checkpoint_then_steps_then_restore_continues_bitwise_on_central_storage(tmp_path):
    strategy = spmd.CentralStorageStrategy()
    step = strategy.step(_train)
    data = _batches(6)
    state = strategy.init(_create, jax.random.key(0))
    uninterrupted = []
    for x, y in data:
        state, loss = step(state, x, y)
        uninterrupted.append(np.asarray(loss))
    final = jax.device_get(state)

    state = strategy.init(_create, jax.random.key(0))
    with spmd.CheckpointManager(tmp_path / "ckpt") as manager:
        for x, y in data[:3]:
            state, _ = step(state, x, y)
        manager.save(3, state)  # async: the next steps run while it writes
        for x, y in data[3:5]:
            state, _ = step(state, x, y)
        manager.wait()
        restored = manager.restore(3, target=strategy.abstract_state(_create, jax.random.key(0)))
    assert {a.sharding.memory_kind for a in jax.tree.leaves(restored)} == {"pinned_host"}
    losses = []
    for x, y in data[3:]:
        restored, loss = step(restored, x, y)
        losses.append(np.asarray(loss))
    np.testing.assert_array_equal(np.stack(losses), np.stack(uninterrupted[3:]))
    for a, b in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(final), strict=True):
        np.testing.assert_array_equal(a, b)


def _live_count_after(strategy, steps):
    def create(key):
        return {"w": jax.random.normal(key, (1024, 1024)) * 1e-3}  # 4 MiB

    def sgd(state, x):
        return {"w": state["w"] * 0.999 + jnp.mean(x)}, jnp.sum(state["w"][0])

    state = strategy.init(create, jax.random.key(0))
    step = strategy.step(sgd)
    x = np.ones((8, 4), np.float32)
    counts = []
    for i in range(steps):
        state, loss = step(state, x)
        if i % 50 == 49:
            np.asarray(loss)
            gc.collect()
            counts.append(len(jax.live_arrays()))
    jax.block_until_ready(state)
    return counts


@pytest.mark.slow
def test_many_central_storage_steps_keep_no_old_states_alive():
    """The host-placed state is no longer donated: old states must still be freed."""
    counts = _live_count_after(spmd.CentralStorageStrategy(), 200)
    assert counts[-1] <= counts[0] + 2, counts


@pytest.mark.slow
@pytest.mark.cpu_mesh
def test_explain_of_a_host_placed_step_aliases_nothing_and_counts_host_bytes():
    x, y = _batches(1)[0]
    one = spmd.OneDeviceStrategy()
    want = one.explain(_train, one.abstract_state(_create, jax.random.key(0)), x, y)
    for strategy in (_host_strategy(0), _host_strategy(1)):
        report = strategy.explain(_train, strategy.abstract_state(_create, jax.random.key(0)), x, y)
        assert report.alias_bytes == 0  # nothing donated
        assert report.state_bytes == 0
        assert report.state_host_bytes == want.state_bytes > 0
    assert want.alias_bytes > 0  # a device-placed pytree state is donated


# --- examples/07 as a library, imported as bench/bench_gpu.py does -------------------


def _lm():
    sys.path.insert(0, str(ROOT))
    from bench import bench_gpu

    return bench_gpu.example()


def _lm_losses(cfg, steps=3):
    ex = _lm()
    strategy = spmd.OneDeviceStrategy()
    state = strategy.init(lambda: ex.create(cfg))
    step = strategy.step(ex.train_step)
    return [float(step(state, tokens)) for tokens in ex.batches(cfg, steps)]


@pytest.mark.slow
def test_lm_remat_gives_the_losses_of_no_remat():
    ex = _lm()
    cfg = ex.LMConfig(layers=2, seq=16, batch=8)
    plain = _lm_losses(cfg)
    remat = _lm_losses(ex.LMConfig(layers=2, seq=16, batch=8, remat=True))
    np.testing.assert_allclose(remat, plain, rtol=1e-5)
    assert plain[-1] < plain[0]


@pytest.mark.slow
def test_lm_xla_attention_gives_the_losses_of_the_default():
    ex = _lm()
    default = _lm_losses(ex.LMConfig(seq=16, batch=8))
    xla = _lm_losses(ex.LMConfig(seq=16, batch=8, attention="xla"))
    np.testing.assert_allclose(xla, default, rtol=1e-6)


@pytest.mark.slow
def test_lm_an_unknown_attention_implementation_is_an_error_naming_it():
    ex = _lm()
    with pytest.raises(ValueError, match="bogus"):
        _lm_losses(ex.LMConfig(seq=16, batch=8, attention="bogus"), steps=1)


def test_lm_config_refuses_heads_that_do_not_divide_dim():
    ex = _lm()
    try:
        ex.LMConfig(heads=3, dim=64)
    except ValueError as error:
        assert "heads" in str(error) and "dim" in str(error)
    else:
        raise AssertionError("LMConfig(heads=3, dim=64) was accepted")


# --- tests/conftest.py's SPMD_TEST_PLATFORM ------------------------------------------


def _pytest_mesh(platform):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if platform is None:
        env.pop("SPMD_TEST_PLATFORM", None)
    else:
        env["SPMD_TEST_PLATFORM"] = platform
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            "tests/test_mesh.py",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.slow
def test_spmd_test_platform_cpu_runs_as_when_unset():
    unset, cpu = _pytest_mesh(None), _pytest_mesh("cpu")
    assert unset.returncode == cpu.returncode == 0, cpu.stdout[-2000:]
    summary = [line for line in cpu.stdout.splitlines() if " passed" in line]
    assert (
        summary
        and summary[-1].split(" in ")[0]
        == [line for line in unset.stdout.splitlines() if " passed" in line][-1].split(" in ")[0]
    )


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["gpuu", ""])
def test_a_mistyped_or_empty_spmd_test_platform_never_runs_silently_on_cpu(platform):
    result = _pytest_mesh(platform)
    assert result.returncode != 0
    assert " passed" not in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["gpuu", ""])
def test_a_mistyped_spmd_test_platform_is_a_usage_error_naming_the_variable(platform):
    result = _pytest_mesh(platform)
    out = result.stdout + result.stderr
    assert result.returncode == 4, out[-2000:]
    assert "INTERNALERROR" not in out and "SPMD_TEST_PLATFORM" in out


# --- what the step says about donation on a host placement ---------------------------


def _tied_step(state, x):
    return {"a": state["a"] * 0.5, "b": state["b"] + jnp.mean(x)}, jnp.sum(state["a"])


def test_one_array_at_two_paths_of_a_host_placed_state_is_not_refused_as_donated():
    x = np.ones((8, 2), np.float32)
    results = {}
    for strategy, donate in (
        (spmd.OneDeviceStrategy(), False),
        (spmd.CentralStorageStrategy(), None),
    ):
        w = strategy.put(jnp.ones((4, 2)))
        state, loss = strategy.step(donate=donate)(_tied_step)({"a": w, "b": w}, x)
        results[strategy.name] = jax.device_get((state, loss))
    _close(results["CentralStorageStrategy"], results["OneDeviceStrategy"])


def test_step_donates_says_false_on_a_host_placement():
    step = spmd.CentralStorageStrategy().step(_tied_step)
    assert step.donates(False) is False


@pytest.mark.slow
def test_many_central_storage_steps_of_an_nnx_model_keep_no_old_arrays_alive():
    strategy = spmd.CentralStorageStrategy()
    model = _Mlp(nnx.Rngs(0))
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)
    nnx.update((model, opt), strategy.put(nnx.state((model, opt))))
    step = strategy.step(_nnx_step)
    x, y = _batches(1)[0]
    counts = []
    for i in range(200):
        loss = step((model, opt), x, y)
        if i % 50 == 49:
            np.asarray(loss)
            gc.collect()
            counts.append(len(jax.live_arrays()))
    assert counts[-1] <= counts[0] + 2, counts
