"""What a step runs: the right program for every call, and misuse as a clear error."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmd


def _mirrored():
    return spmd.MirroredStrategy()


def _sgd(state, x, scale=1.0):
    loss = jnp.mean((x @ state["w"]) ** 2) * scale
    return {"w": state["w"] - 0.1 * scale * jnp.mean(x, 0)[:, None]}, loss


def _state():
    return {"w": np.arange(4, dtype=np.float32).reshape(4, 1) / 10}


X = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)


def _oracle(state, x, scale=1.0):
    return jax.tree.map(np.asarray, jax.jit(_sgd, static_argnames="scale")(state, x, scale=scale))


def test_static_kwarg_dropped_on_the_next_call_runs_the_default_program():
    step = _mirrored().step(donate=False, static_argnames=("scale",))(_sgd)
    state = _state()
    state, loss_100 = step(state, X, scale=100.0)
    expect_state, expect_loss = _oracle(_oracle(_state(), X, 100.0)[0], X)
    state, loss = step(state, X)
    np.testing.assert_allclose(loss, expect_loss, rtol=1e-6)
    np.testing.assert_allclose(state["w"], expect_state["w"], rtol=1e-6)


@pytest.mark.slow
def test_static_kwarg_changed_between_calls_runs_each_program():
    step = _mirrored().step(static_argnames=("scale",))(_sgd)
    state, want = _state(), _state()
    for scale in (1.0, 3.0, 3, 1.0, -0.0, 0.0):
        state, loss = step(state, X, scale=scale)
        want, want_loss = _oracle(want, X, scale)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        np.testing.assert_allclose(state["w"], want["w"], rtol=1e-6)


@dataclasses.dataclass(frozen=True)
class _Config:
    """A static config: its fields are static values as a bare static value is."""

    sign: float
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class _Outer:
    config: _Config


def _signed(state, x, config):
    """copysign(1, sign) * sum(x), doubled where scale is True (not where it is 1)."""
    config = getattr(config, "config", config)
    doubled = 2.0 if config.scale is True else 1.0
    return state, {"value": jnp.copysign(1.0, config.sign) * x.sum() * doubled}


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize(
    "configs",
    [
        (_Config(0.0), _Config(-0.0)),
        (_Config(1.0, scale=1), _Config(1.0, scale=True)),
        (_Outer(_Config(0.0)), _Outer(_Config(-0.0))),
    ],
    ids=["signed_zero", "int_and_bool", "nested"],
)
def test_static_values_that_compare_equal_inside_a_dataclass_run_their_own_programs(configs):
    """0.0 and -0.0 (1 and True) compare equal, inside a frozen dataclass too, but may
    compute different numbers: each config runs its own program; the oracle is the
    function called with that config, outside any step."""
    step = _mirrored().step(donate=False, static_argnames=("config",))(_signed)
    ones = np.ones((8, 4), np.float32)
    for config in (*configs, *configs):
        _, got = step(_state(), ones, config=config)
        want = _signed(_state(), ones, config)[1]["value"]
        np.testing.assert_array_equal(np.asarray(got["value"]), np.asarray(want))


def test_non_static_kwarg_dropped_then_given_runs_the_right_values():
    step = _mirrored().step(_sgd)
    state, want = _state(), _state()
    for kwargs in ({"scale": 2.0}, {}, {"scale": jnp.float32(5.0)}, {}):
        state, loss = step(state, X, **kwargs)
        want, want_loss = _oracle(want, X, float(kwargs.get("scale", 1.0)))
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        np.testing.assert_allclose(state["w"], want["w"], rtol=1e-6)


def test_batch_of_another_shape_or_dtype_after_a_hot_call_runs_the_right_program():
    step = _mirrored().step(_sgd)
    state, want = _state(), _state()
    for x in (X, np.concatenate([X, X + 1]), X.astype(np.float16), X[:8]):
        state, loss = step(state, x)
        want, want_loss = _oracle(want, x)
        np.testing.assert_allclose(loss, want_loss, rtol=2e-3)
        np.testing.assert_allclose(state["w"], want["w"], rtol=2e-3)


def test_a_state_leaf_replaced_in_place_is_seen():
    step = _mirrored().step(_sgd)
    state, _ = step(_state(), X)
    state["w"] = np.ones((4, 1), np.float32)  # the same dict, a new leaf
    state, loss = step(state, X)
    want, want_loss = _oracle({"w": np.ones((4, 1), np.float32)}, X)
    np.testing.assert_allclose(state["w"], want["w"], rtol=1e-6)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)


# -- the step's return is unambiguous ---------------------------------------------------


def test_a_single_array_state_returning_only_the_loss_is_an_error():
    step = _mirrored().step(lambda w, x: jnp.mean((x @ w) ** 2))
    with pytest.raises(spmd.ConfigurationError, match="must return the new state"):
        step(np.ones((4, 1), np.float32), X)


def test_a_scalar_state_with_a_bare_scalar_return_is_ambiguous():
    step = _mirrored().step(lambda w, x: w + jnp.sum(x))
    with pytest.raises(spmd.ConfigurationError, match=r"must return \(state, metrics\)"):
        step(np.float32(0.0), X)


def test_a_loss_of_the_states_shape_but_another_dtype_is_not_the_state():
    step = _mirrored().step(lambda w, x: (jnp.sum(x).astype(jnp.int32), w))
    with pytest.raises(spmd.ConfigurationError, match="same structure, shapes and dtypes"):
        step(np.float32(0.0), X)


def test_a_single_array_state_returned_alone_or_first_is_the_new_state():
    bare = _mirrored().step(lambda w, x: w - jnp.mean(x, 0)[:, None])
    first = _mirrored().step(lambda w, x: (w - jnp.mean(x, 0)[:, None], jnp.sum(x)))
    w = np.ones((4, 1), np.float32)
    want = w - X.mean(0)[:, None]
    np.testing.assert_allclose(bare(w, X), want, rtol=1e-6)
    new, total = first(w, X)
    np.testing.assert_allclose(new, want, rtol=1e-6)
    np.testing.assert_allclose(total, X.sum(), atol=1e-5)


# -- NNX objects belong in the state ----------------------------------------------------


def _model_and_optimizer():
    import optax

    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def test_an_nnx_optimizer_passed_by_keyword_is_an_error():
    model, optimizer = _model_and_optimizer()

    @_mirrored().step
    def step(model, x, optimizer):
        return jnp.mean(model(x))

    with pytest.raises(spmd.ConfigurationError, match="belong|NNX objects") as info:
        step(model, X, optimizer=optimizer)
    assert "Optimizer" in str(info.value) and "state" in str(info.value)


def test_an_nnx_object_as_a_later_positional_argument_is_an_error():
    model, optimizer = _model_and_optimizer()
    step = _mirrored().step(lambda model, optimizer, x: jnp.mean(model(x)))
    with pytest.raises(spmd.ConfigurationError, match="first argument") as info:
        step(model, optimizer, X)
    assert "by keyword" in str(info.value)


# -- bad batches: zero rows, strings and objects ----------------------------------------


def test_a_batch_of_zero_rows_is_a_batch_error():
    step = _mirrored().step(_sgd)
    with pytest.raises(spmd.BatchError, match="at least one example"):
        step(_state(), np.zeros((0, 4), np.float32))


def test_an_abstract_batch_of_negative_size_is_a_batch_error_not_jaxs():
    strategy = _mirrored()
    with pytest.raises(spmd.BatchError, match="0 or more") as info:
        strategy.explain(_sgd, _state(), jax.ShapeDtypeStruct((-8, 4), jnp.float32))
    assert "negative_shapes={'batch[0]': (-8, 4)}" in str(info.value)


@pytest.mark.parametrize(
    "batch", [np.array(["a"] * 8), np.array([object()] * 8, dtype=object)], ids=["str", "object"]
)
def test_a_string_or_object_batch_is_a_batch_error(batch):
    step = _mirrored().step(lambda s, x: (s, 0.0))
    with pytest.raises(spmd.BatchError, match="array of numbers") as info:
        step(_state(), batch)
    assert str(batch.dtype) in str(info.value)


# -- the state: donated, a leaf not an array, placed by another strategy ---------------


def test_reusing_a_donated_state_says_it_was_donated():
    step = _mirrored().step(_sgd)
    placed = spmd.MirroredStrategy().put(_state())
    step(placed, X)
    with pytest.raises(spmd.ConfigurationError, match="donated to an earlier call") as info:
        step(placed, X)
    assert "donate=False" in str(info.value)


def test_a_donated_state_consumed_by_another_step_is_not_run_on_the_fast_path():
    strategy = _mirrored()
    a, b = strategy.step(_sgd), strategy.step(_sgd)
    state, _ = a(_state(), X)
    b(state, X)  # donates `state`, which `a` returned last
    with pytest.raises(spmd.ConfigurationError, match="donated"):
        a(state, X)


def test_a_state_leaf_that_is_not_an_array_is_named():
    step = _mirrored().step(lambda s, x: (s, 0.0))
    with pytest.raises(spmd.ConfigurationError, match="Every leaf of a state") as info:
        step({"w": np.ones(2, np.float32), "name": "mlp"}, X)
    assert "'name'" in str(info.value)


@pytest.mark.cpu_mesh
def test_a_state_placed_by_another_strategy_says_which_and_how_to_move_it():
    two_d = spmd.Strategy(spmd.make_mesh({"data": 4, "model": 2}), name="TwoD")
    placed = two_d.put(_state())
    step = _mirrored().step(_sgd)
    with pytest.raises(spmd.ConfigurationError, match=r"strategy\.put") as info:
        step(placed, X)
    assert "TwoD" in str(info.value)
    state, loss = step(_mirrored().put(jax.device_get(placed)), X)
    np.testing.assert_allclose(loss, _oracle(_state(), X)[1], rtol=1e-6)


def test_an_unhashable_static_kwarg_is_named():
    step = _mirrored().step(static_argnames=("sizes",))(lambda s, x, sizes: (s, 0.0))
    with pytest.raises(spmd.ConfigurationError, match="hashable") as info:
        step(_state(), X, sizes=[1, 2])
    assert "sizes" in str(info.value) and "tuple" in str(info.value)


@pytest.mark.cpu_mesh
def test_a_spec_naming_one_axis_twice_is_an_error():
    mesh = spmd.make_mesh({"data": 4, "model": 2})
    with pytest.raises(spmd.ConfigurationError, match="at most once") as info:
        spmd.Strategy(mesh, rules=[(".*", P("model", "model"))])
    assert "'.*'" in str(info.value)
    with pytest.raises(spmd.ConfigurationError, match="at most once"):
        spmd.Strategy(mesh, batch_axes=("data", "data"))


def test_duplicate_devices_in_a_strategy_are_an_error():
    device = jax.devices()[0]
    for make in (spmd.MirroredStrategy, spmd.CentralStorageStrategy):
        with pytest.raises(spmd.ConfigurationError, match="once"):
            make([device, device])
    with pytest.raises(spmd.ConfigurationError, match="once"):
        spmd.ParameterServerStrategy(devices=[device, device])
    with pytest.raises(spmd.ConfigurationError, match="once"):
        spmd.make_mesh({"x": 2}, [device, device])


# -- device lists and scopes ----------------------------------------------------------


@pytest.mark.parametrize(
    "devices, ids",
    [
        (["/cpu:0", "/cpu:1"], [0, 1]),
        (["/device:CPU:2", "CPU:3"], [2, 3]),
        (["/job:worker/replica:0/task:0/device:CPU:1"], [1]),
        ([4, 5], [4, 5]),
        ("/cpu:7", [7]),
    ],
)
@pytest.mark.cpu_mesh
def test_tf_device_strings_and_integer_ids_name_devices(devices, ids):
    strategy = spmd.MirroredStrategy(devices)
    assert [d.id for d in strategy.devices] == ids
    assert (
        spmd.OneDeviceStrategy(ids[0] if isinstance(devices, str) else devices[0]).devices[0].id
        == ids[0]
    )


@pytest.mark.cpu_mesh
@pytest.mark.parametrize("bad", ["/gpu:0", "/cpu:99", "cpu", 99, None, 1.5, "/task:5/cpu:0"])
def test_device_names_that_name_no_device_are_configuration_errors(bad):
    with pytest.raises(spmd.ConfigurationError, match="jax.Device, an integer device id"):
        spmd.MirroredStrategy([bad])
    with pytest.raises(spmd.ConfigurationError, match="jax.Device, an integer device id"):
        spmd.OneDeviceStrategy(bad if bad is not None else "nope")


def test_opening_another_strategys_scope_inside_a_scope_is_a_runtime_error():
    a, b = _mirrored(), spmd.OneDeviceStrategy()
    with a.scope(), pytest.raises(RuntimeError, match="do not nest"), b.scope():
        pass
    with a.scope(), pytest.raises(spmd.ConfigurationError), b.scope():
        pass
