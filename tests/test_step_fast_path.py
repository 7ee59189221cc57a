"""The step's fast path: flat states of any shape, steady calls, metrics as the in-flight handle.

Each program runs as a user would write it and is checked per step against an
oracle: the same function, data and seed under plain `jax.jit` on one device (or,
for the one-line steady-call steps, the numbers worked out by hand).
"""

import collections
import contextlib
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import spmd
from spmd._src.strategy import step as step_module
from spmd._src.strategy.step import CPU_MAX_IN_FLIGHT

STEPS = 12  # past CPU_MAX_IN_FLIGHT, so the queue bound fires
X = np.arange(16, dtype=np.float32).reshape(8, 2)  # one batch, fed again every call
SLOW = pytest.mark.slow  # the cases beyond the fast tier's (one device, no donation, ps)


@pytest.fixture(autouse=True)
def _no_hang():
    """Every test here is short: one that hangs (a queue waiting forever) fails instead."""

    def _raise(*_):
        raise TimeoutError("the test hung past 240 s")

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(240)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _strategy(name):
    if name == "one":
        return spmd.OneDeviceStrategy()
    if name == "mirrored":
        return spmd.MirroredStrategy()
    if name == "mirrored_one_device":
        return spmd.MirroredStrategy(devices=jax.devices()[:1])
    if name == "central":
        return spmd.CentralStorageStrategy()
    if name == "ps":
        return spmd.ParameterServerStrategy(spmd.partitioners.FixedShardsPartitioner(8))
    mesh = spmd.make_mesh({"data": 4, "model": 2})
    rules = [("k", P("model")), ("extra", P("data"))]
    return spmd.Strategy(mesh, rules=rules, batch_axes=("data",))


def _data(i):
    rng = np.random.default_rng(i)
    return rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16,)).astype(np.float32)


def _close(a, b):
    if jnp.issubdtype(jnp.result_type(a), jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # an all-reduce's rounding


def _same(tree, oracle):
    leaves, expected = jax.tree.leaves(tree), jax.tree.leaves(oracle)
    assert len(leaves) == len(expected)
    for a, b in zip(leaves, expected, strict=True):
        assert jnp.result_type(a) == jnp.result_type(b)
        _close(a, b)


def _against_oracle(step, fn, init, steps=STEPS, between=None):
    """Runs `step` and `jax.jit(fn)` side by side, comparing every output per step."""
    oracle = jax.jit(fn)
    state, expected = init(), init()
    for i in range(steps):
        if between is not None:
            state, expected = between(i, state), between(i, expected)
        out, out_oracle = step(state, *_data(i)), oracle(expected, *_data(i))
        state, expected = out[0], out_oracle[0]
        _same(out[1:], out_oracle[1:])
        _same(state, expected)
        assert type(state) is type(expected)
    return state


# --- states of every shape ---------------------------------------------------------


def _linear_loss(w, b, x, y):
    return jnp.mean((x @ w + b - y) ** 2)


def dict_init():  # keys not sorted, nested lists/tuples, None, bf16 and an int32 counter
    return {
        "zz": jnp.ones((3,), jnp.bfloat16),
        "params": {"w": jnp.zeros(8), "b": jnp.zeros(())},
        "aa": [jnp.int32(0), (None, jnp.ones((2, 2)))],
        "m": None,
    }


def dict_step(state, x, y):
    loss, g = jax.value_and_grad(_linear_loss, (0, 1))(
        state["params"]["w"], state["params"]["b"], x, y
    )
    params = {"w": state["params"]["w"] - 0.1 * g[0], "b": state["params"]["b"] - 0.1 * g[1]}
    counter, (none, m) = state["aa"]
    new = {
        "m": None,
        "params": params,
        "zz": state["zz"] * 2,
        "aa": [counter + 1, (none, m + loss)],
    }
    return new, {"loss": loss, "count": counter}


NT = collections.namedtuple("NT", ["w", "lr", "meta"])


def nt_init():  # numpy scalars and a python float among the leaves
    return NT(jnp.zeros(8), np.float32(0.1), (None, [np.int32(3), 2.0]))


def nt_step(state, x, y):
    loss, g = jax.value_and_grad(_linear_loss)(state.w, 0.0, x, y)
    return NT(state.w - state.lr * g, state.lr, state.meta), loss


def ts_init():
    params = {"w": jnp.zeros(8), "b": jnp.zeros((), jnp.bfloat16)}
    return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))


def ts_step(state, x, y):
    def loss_fn(p):
        return _linear_loss(p["w"], p["b"].astype(jnp.float32), x, y)

    loss, g = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=g), loss


def raw_key_init():
    return {"key": jax.random.PRNGKey(1), "w": jnp.zeros(8)}


def key_step(state, x, y):
    key, sub = jax.random.split(state["key"])
    loss, g = jax.value_and_grad(_linear_loss)(state["w"], 0.0, x, y)
    noise = jax.random.normal(sub, (8,)) * 0.01
    return {"key": key, "w": state["w"] - 0.1 * g + noise}, loss


def typed_key_init():
    return {"key": jax.random.key(0), "w": jnp.zeros(8)}


def empty_init():  # a state with no array at all
    return {"a": (), "b": None}


def empty_step(state, x, y):
    return state, jnp.sum(x)


STATES = {
    "dict": (dict_init, dict_step),
    "namedtuple": (nt_init, nt_step),
    "train_state": (ts_init, ts_step),
    "raw_key": (raw_key_init, key_step),
    "typed_key": (typed_key_init, key_step),
    "empty": (empty_init, empty_step),
}


@pytest.mark.slow  # 5 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("donate", [None, pytest.param(False, marks=SLOW)])
@pytest.mark.parametrize("strategy", [pytest.param("one", marks=SLOW), "mirrored", "central"])
@pytest.mark.parametrize("kind", sorted(STATES))
def test_a_state_of_any_shape_trains_as_jit_does(kind, strategy, donate):
    init, fn = STATES[kind]
    step = _strategy(strategy).step(fn, donate=donate)
    _against_oracle(step, fn, init)
    assert step.cache_size() == 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dict", "raw_key", "empty"])
def test_a_sharded_state_trains_as_jit_does(kind):
    init, fn = STATES[kind]
    step = _strategy("ps").step(fn)
    _against_oracle(step, fn, init)
    assert step.cache_size() == 1


def test_a_typed_key_state_compiles_once_on_mirrored():
    step = _strategy("mirrored").step(key_step)
    _against_oracle(step, key_step, typed_key_init, steps=6)
    assert step.cache_size() == 1


@pytest.mark.slow
def test_a_flax_train_state_trains_on_parameter_server():
    step = _strategy("ps").step(ts_step)
    _against_oracle(step, ts_step, ts_init, steps=3)


def test_explain_takes_a_state_with_python_scalars():
    strategy = _strategy("mirrored")
    step = strategy.step(nt_step)
    step(nt_init(), *_data(0))  # the step runs it
    explanation = strategy.explain(step, nt_init(), *_data(0))
    assert explanation.state_bytes == 8 * 4 + 4 + 4 + 4


@pytest.mark.cpu_mesh
@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "state_bytes", "host_bytes", "alias_bytes"),
    [("mirrored", 2056, 0, 2056), ("ps", 264, 0, 264), ("central", 0, 2056, 0)],
)
def test_explain_and_lower_report_the_flat_state(strategy, state_bytes, host_bytes, alias_bytes):
    def fn(state, x):
        new = {**state, "w": state["w"] * state["lr"] + jnp.mean(x), "n": state["n"] + 1}
        return new, jnp.sum(state["w"])

    strategy = _strategy(strategy)
    state = {"w": np.ones((64, 8), np.float32), "lr": np.float32(0.5), "n": np.int32(0), "z": None}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
    x = np.ones((16, 4), np.float32)
    for given in (state, abstract):
        step = strategy.step(fn)
        explanation = strategy.explain(step, given, x)
        assert explanation.state_bytes == state_bytes  # 64*8*4 (/8 when sharded) + 8
        assert explanation.state_host_bytes == host_bytes
        assert explanation.alias_bytes == alias_bytes  # donated, except a host state
        _, pure = step.lower(given, x)
        assert jax.tree.structure(pure) == jax.tree.structure(state)


# --- the fast path when the user changes the returned state in place -----------------


def _mutator(kind):
    def replace(s):
        s["k"] = jnp.full((8,), 2.0)
        return s

    def add(s):
        s["new"] = jnp.ones(())
        return s

    def swap(s):
        s["k"], s["extra"] = s["extra"], s["k"]
        return s

    def numpy(s):
        s["k"] = np.full((8,), 3.0, np.float32)
        return s

    def remove(s):
        del s["extra"]
        return s

    def placed(s):  # a leaf replaced by this strategy's own placement of a new value
        s["k"] = s["k"] * 0 + 5.0
        return s

    return {
        "replace": replace,
        "add": add,
        "swap": swap,
        "numpy": numpy,
        "remove": remove,
        "placed": placed,
    }[kind]


def mut_init():
    return {"k": jnp.arange(8.0) / 8, "b": jnp.zeros(()), "extra": jnp.ones((8,))}


def mut_step(state, x, y):
    loss, g = jax.value_and_grad(_linear_loss, (0, 1))(state["k"], state["b"], x, y)
    return {**state, "k": state["k"] - 0.1 * g[0], "b": state["b"] - 0.1 * g[1]}, loss


def _mutated_run(strategy, kind, donate):
    mutate = _mutator(kind)
    step = _strategy(strategy).step(mut_step, donate=donate)
    _against_oracle(
        step, mut_step, mut_init, steps=6, between=lambda i, s: mutate(s) if i == 3 else s
    )


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("donate", [None, pytest.param(False, marks=SLOW)])
@pytest.mark.parametrize("kind", ["replace", "add", "swap", "numpy", "remove", "placed"])
@pytest.mark.parametrize("strategy", ["mirrored", pytest.param("ps", marks=SLOW)])
def test_a_state_changed_in_place_is_honoured(strategy, kind, donate):
    _mutated_run(strategy, kind, donate)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["add", "swap", "numpy", "remove"])
def test_a_host_state_changed_in_place_is_honoured(kind):
    _mutated_run("central", kind, None)


@pytest.mark.cpu_mesh
def test_a_two_d_state_with_a_leaf_in_another_layout_is_a_configuration_error():
    with pytest.raises(spmd.ConfigurationError, match="extra"):
        _mutated_run("2d", "swap", None)


def _honoured_or_spmd_error(strategy, mutate):
    step = _strategy(strategy).step(mut_step)
    with contextlib.suppress(spmd.SpmdError):  # a clear error is fine too
        _against_oracle(
            step, mut_step, mut_init, steps=6, between=lambda i, s: mutate(s) if i == 3 else s
        )


def test_a_host_state_leaf_replaced_by_a_new_array_is_honoured_or_refused():
    _honoured_or_spmd_error("central", _mutator("replace"))


@pytest.mark.cpu_mesh
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ps", "2d"])
def test_a_sharded_state_leaf_put_on_one_device_is_honoured_or_refused(strategy):
    def one_device(s):
        s["k"] = jax.device_put(jnp.full((8,), 4.0), jax.devices()[3])
        return s

    _honoured_or_spmd_error(strategy, one_device)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["delete", "donate_elsewhere"])
@pytest.mark.parametrize("strategy", ["mirrored", "one"])
def test_a_leaf_deleted_between_calls_is_a_configuration_error(strategy, how):
    step = _strategy(strategy).step(mut_step)
    state = mut_init()
    for i in range(3):
        state, _ = step(state, *_data(i))
    if how == "delete":
        state["k"].delete()
    else:
        jax.jit(lambda a: a + 1, donate_argnums=0)(state["k"])
    with pytest.raises(spmd.ConfigurationError):
        step(state, *_data(3))


# --- steady calls: what the fast path skips, and what it still catches -------------------


def _sgd(state, x):
    loss = jnp.sum(x) * jnp.sum(state["w"])
    return {"w": state["w"] - 0.01 * jnp.sum(x)}, loss


def test_a_batch_sharding_is_one_object_per_rank():
    strategy = _strategy("mirrored")
    assert strategy.batch_sharding(2) is strategy.batch_sharding(2)
    assert strategy.batch_sharding(1, axis=1) is strategy.batch_sharding(0, axis=1)
    assert strategy.batch_sharding(2) is not strategy.batch_sharding(2, axis=1)


def test_a_steady_call_flattens_the_state_once(monkeypatch):
    strategy = _strategy("mirrored")
    step = strategy.step(_sgd)
    batch = strategy.distribute_batch(X)
    state, _ = step({"w": jnp.ones(4)}, batch)
    state, _ = step(state, batch)
    flattened = []
    real = step_module._flatten
    monkeypatch.setattr(step_module, "_flatten", lambda t: flattened.append(t) or real(t))
    state, loss = step(state, batch)
    assert len(flattened) == 2  # the state, then the batch
    np.testing.assert_allclose(state["w"], np.ones(4) - 3 * 0.01 * X.sum(), rtol=1e-6)


def test_a_leaf_replaced_in_place_after_steady_calls_is_read():
    strategy = _strategy("mirrored")
    step = strategy.step(_sgd)
    state, _ = step({"w": jnp.ones(4)}, X)
    state, _ = step(state, X)
    state["w"] = strategy.put(jnp.full(4, 2.0))  # same shape, dtype and layout
    state, loss = step(state, X)
    assert float(loss) == pytest.approx(X.sum() * 8.0)
    np.testing.assert_allclose(state["w"], np.full(4, 2.0) - 0.01 * X.sum(), rtol=1e-6)


def test_a_leaf_of_another_shape_replaced_in_place_runs_its_own_program():
    step = _strategy("mirrored").step(_sgd)
    state, _ = step({"w": jnp.ones(4)}, X)
    state, _ = step(state, X)
    state["w"] = jnp.ones(6)
    state, loss = step(state, X)
    assert state["w"].shape == (6,) and step.cache_size() == 2
    assert float(loss) == pytest.approx(X.sum() * 6.0)


def test_a_state_donated_by_another_step_is_named_after_steady_calls():
    strategy = _strategy("mirrored")
    a, b = strategy.step(_sgd), strategy.step(_sgd)
    state, _ = a({"w": jnp.ones(4)}, X)
    state, _ = a(state, X)
    b(state, X)
    with pytest.raises(spmd.ConfigurationError, match="donated"):
        a(state, X)


# --- metrics as the in-flight handle -------------------------------------------------


def _grad(state, x, y):
    return mut_step({**state, "extra": jnp.ones(8)}, x, y)


def m_init():
    return {"k": jnp.arange(8.0) / 8, "b": jnp.zeros(())}


def _strip(fn):
    def step(state, x, y):
        new, loss = _grad(state, x, y)
        return fn({"k": new["k"], "b": new["b"]}, state, loss)

    step.__name__ = fn.__name__
    return step


METRICS = {
    "dict": _strip(lambda new, old, loss: (new, {"loss": loss, "k0": new["k"][0]})),
    "nested": _strip(lambda new, old, loss: (new, ({"a": [loss, (loss * 2,)]}, None), loss + 1)),
    "scalar": _strip(lambda new, old, loss: (new, loss)),
    "new_state_twice": _strip(lambda new, old, loss: (new, new["k"])),
    "whole_state_twice": _strip(lambda new, old, loss: (new, new)),
    "input_forwarded": _strip(lambda new, old, loss: (new, old["b"])),
    "empty": _strip(lambda new, old, loss: (new, {})),
    "zero_size_first": _strip(lambda new, old, loss: (new, {"a": jnp.zeros((0,)), "l": loss})),
}


@pytest.mark.slow  # 5 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("after", ["keep", "delete"])
@pytest.mark.parametrize("donate", [True, pytest.param(False, marks=SLOW)])
@pytest.mark.parametrize("strategy", ["mirrored", pytest.param("one", marks=SLOW)])
@pytest.mark.parametrize("kind", sorted(METRICS))
def test_metrics_of_any_form_are_the_in_flight_handle(kind, strategy, donate, after):
    fn = METRICS[kind]
    step = _strategy(strategy).step(fn, donate=donate)
    oracle = jax.jit(fn)
    state, expected = m_init(), m_init()
    for i in range(STEPS):
        out, out_oracle = step(state, *_data(i)), oracle(expected, *_data(i))
        state, expected = out[0], out_oracle[0]
        _same(out, out_oracle)
        if after == "delete":  # the user drops the metrics' buffers at once
            for leaf in jax.tree.leaves(out[1:]):
                if not any(leaf is s for s in jax.tree.leaves(state)):
                    leaf.delete()
    assert step.cache_size() == 1


@pytest.mark.parametrize("strategy", ["mirrored", "one"])
def test_a_metric_fed_back_into_the_donated_state_trains_as_jit_does(strategy):
    fn = METRICS["dict"]
    step = _strategy(strategy).step(fn, donate=True)
    oracle = jax.jit(fn)
    state, expected = m_init(), m_init()
    for i in range(STEPS):
        (state, m), (expected, e) = step(state, *_data(i)), oracle(expected, *_data(i))
        _same((state, m), (expected, e))
        state, expected = {**state, "b": m["loss"]}, {**expected, "b": e["loss"]}


def test_a_metric_fed_back_into_a_host_state_is_a_configuration_error():
    step = _strategy("central").step(METRICS["dict"])
    state, m = step(m_init(), *_data(0))
    with pytest.raises(spmd.ConfigurationError, match="strategy.put"):
        step({**state, "b": m["loss"]}, *_data(1))


def _evaluate(state, x, y):
    return {"loss": _linear_loss(state["k"], state["b"], x, y), "k": state["k"]}


def _read_only_loop(strategy, place):
    strategy = _strategy(strategy)
    step = strategy.step(_evaluate, donate=False)
    state = strategy.put(m_init()) if place else m_init()
    for i in range(STEPS):
        _same(step(state, *_data(i)), jax.jit(_evaluate)(m_init(), *_data(i)))
    _same(state, m_init())
    return step


@pytest.mark.parametrize("strategy", ["mirrored", "central", "ps"])
def test_a_step_that_only_reads_a_placed_state_keeps_it(strategy):
    assert _read_only_loop(strategy, place=True).cache_size() == 1


@pytest.mark.parametrize("strategy", ["mirrored", "one", "mirrored_one_device"])
def test_a_step_that_only_reads_an_unplaced_state_compiles_once(strategy):
    # On a mesh of one device, the state's arrays are already there but with a
    # one-device sharding, which jit would trace again for (seen on one GPU).
    assert _read_only_loop(strategy, place=False).cache_size() == 1


def test_a_step_that_only_reads_an_unplaced_host_state_runs_every_call():
    _read_only_loop("central", place=False)


def _heavy(state, x):
    w = state["w"]
    for _ in range(20):
        w = jnp.tanh(w @ w)
    return {"w": w, "b": state["b"]}, {"loss": jnp.sum(w), "x": state["b"] * 2}


def _unfinished_past_the_bound(after):
    """Calls run past `CPU_MAX_IN_FLIGHT + 1` ago that have not finished (the bound waits
    for them); `after` is what the user does with each call's metrics."""
    step = _strategy("mirrored").step(_heavy, donate=after == "feed_back")
    # 256x256: a call takes far longer than its dispatch, so with the bound lifted 11 of
    # the 11 calls checked are unfinished ("keep", "delete"); at a sixth of 512's CPU.
    state = {"w": jnp.eye(256) * 0.5, "b": jnp.ones(())}
    x = np.ones((8, 2), np.float32)
    state, _ = step(state, x)
    jax.block_until_ready(state)
    handles, unfinished = [], 0
    for _ in range(16):
        state, metrics = step(state, x)
        if after == "delete":
            metrics["loss"].delete()
        elif after == "feed_back":
            state = {"w": state["w"], "b": metrics["loss"]}
        handles.append(metrics["x"])
        if len(handles) > CPU_MAX_IN_FLIGHT + 1:
            unfinished += not handles[-(CPU_MAX_IN_FLIGHT + 2)].is_ready()
    jax.block_until_ready(state)
    return unfinished


@pytest.mark.slow
def test_the_queue_bound_waits_on_kept_metrics(monkeypatch):
    assert _unfinished_past_the_bound("keep") == 0
    # and the check can fail: with the bound lifted, the calls run behind their dispatch
    monkeypatch.setattr(step_module, "CPU_MAX_IN_FLIGHT", 1_000)
    assert _unfinished_past_the_bound("keep") > 0


@pytest.mark.cpu_mesh
@pytest.mark.slow
@pytest.mark.parametrize("after", ["delete", "feed_back"])
def test_the_queue_bound_waits_when_the_metrics_were_deleted(after):
    assert _unfinished_past_the_bound(after) == 0


# --- keyword arguments and the Trainer ------------------------------------------------


def kw_step(state, x, y, *, lr, mode="sgd"):
    loss, g = jax.value_and_grad(_linear_loss, (0, 1))(state["k"], state["b"], x, y)
    scale = 1.0 if mode == "sgd" else 0.5
    return {"k": state["k"] - lr * scale * g[0], "b": state["b"] - lr * scale * g[1]}, loss


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["mirrored", "ps"])
def test_static_and_traced_keywords_in_a_steady_loop(strategy):
    step = _strategy(strategy).step(kw_step, static_argnames="mode")
    oracle = jax.jit(kw_step, static_argnames="mode")
    state, expected = m_init(), m_init()
    for i in range(STEPS):
        kwargs = {"lr": jnp.float32(0.1 / (i + 1)), "mode": "half" if i % 3 == 0 else "sgd"}
        (state, loss), (expected, e) = (
            step(state, *_data(i), **kwargs),
            oracle(expected, *_data(i), **kwargs),
        )
        _same((state, loss), (expected, e))
    assert step.cache_size() == 2  # one program per static mode


@pytest.mark.slow
def test_the_trainer_with_steps_per_execution_trains_as_one_step_at_a_time():
    from flax import nnx

    class Linear(nnx.Module):
        def __init__(self, rngs):
            self.out = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.out(x)

    x, y = _data(0)
    labels = (y > 0).astype(np.int32)
    weights = []
    for strategy, per_execution in (("one", 1), ("mirrored", 4)):
        trainer = spmd.Trainer(
            Linear(nnx.Rngs(0)),
            optax.sgd(0.1),
            "sparse_categorical_crossentropy",
            strategy=_strategy(strategy),
            steps_per_execution=per_execution,
        )
        trainer.fit(
            (np.tile(x, (4, 1)), np.tile(labels, 4)),
            batch_size=8,
            epochs=2,
            shuffle=False,
            verbose=0,
        )
        assert trainer.iterations == 16
        weights.append(nnx.state(trainer.model, nnx.Param))
    _same(weights[1], weights[0])
