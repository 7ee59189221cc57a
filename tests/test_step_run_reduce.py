"""The step, run/reduce/gather and the strategies, as ported programs expect them.

Each test is one behaviour that must hold: a program ported from tf.distribute
gives the numbers of a one-device `jax.jit` of the same function (or TF's own
expected numbers), and every misuse is an error that says what was expected,
what was received and how to fix it, never a wrong number, a crash or a raw
traceback from deep inside jax.
"""

import functools
import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from commands import run_program
from flax import nnx

import spmd
from spmd._src.errors import ConfigurationError, SpmdError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def strategy():
    return spmd.MirroredStrategy()


@pytest.fixture(scope="module")
def x():
    return jnp.arange(128.0, dtype=jnp.float32).reshape(64, 2)


def _clear(error: BaseException) -> bool:
    """An spmd error in the expected / received / fix form."""
    text = str(error)
    return isinstance(error, SpmdError) and "Received" in text and "fix" in text


# -- 1. crash: tied weights in a donated state ------------------------------------


@pytest.mark.slow
def test_state_with_one_array_twice_is_an_error_not_a_segfault():
    """Tied weights ({"embed": e, "unembed": e}) in a donated state: a named error.

    jax.jit on one device raises 'Attempt to donate the same buffer twice'; on a
    multi-device mesh XLA segfaults. spmd donates by default, so a pure pytree
    state with a shared leaf is caught before the program runs (in a subprocess,
    so that a crash fails this test instead of the suite).
    """
    script = textwrap.dedent(
        """
        import os
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax
        jax.config.update("jax_num_cpu_devices", 8)
        import jax.numpy as jnp, numpy as np, spmd
        s = spmd.MirroredStrategy()

        @s.step
        def step(state, x):
            return jax.tree.map(lambda a: a + x.sum(), state), x.sum()

        e = jnp.ones(4)
        try:
            step({"embed": e, "unembed": e}, np.ones((8, 2), np.float32))
        except spmd.ConfigurationError as error:
            print("CLEAR", error)
        except Exception as error:
            print("RAW", type(error).__name__, error)
        """
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = run_program([sys.executable, "-c", script], env, 240)
    assert done.returncode == 0, f"the process died (rc={done.returncode}): {done.stderr[-400:]}"
    assert "CLEAR" in done.stdout, done.stdout


# -- 2. silent wrong numbers: strategy.run's program cache ------------------------

_SCALE = {"s": 1.0}


def _global_helper(v):
    return v * _SCALE["s"]


@pytest.mark.cpu_mesh
def test_run_new_lambda_sees_a_global_helpers_new_value(strategy, x):
    """A fresh lambda each step calling a helper that reads a mutated global dict
    sees the new value, as jax.jit of each fresh lambda does (it is traced anew)."""
    got, want = [], []
    for scale in (1.0, 7.0):
        _SCALE["s"] = scale
        got.append(strategy.reduce("SUM", strategy.run(lambda v: _global_helper(v), args=(x,))))
        want.append(jax.jit(lambda v: _global_helper(v))(x).reshape(8, 8, 2).sum(0))
    np.testing.assert_allclose(got[1], want[1])


@pytest.mark.cpu_mesh
def test_run_new_lambda_sees_a_captured_helpers_mutated_closure(strategy, x):
    """A lambda capturing a function whose own closure is a dict sees the dict's new value."""
    box = {"s": 1.0}

    def helper(v):
        return v * box["s"]

    got = []
    for scale in (1.0, 5.0):
        box["s"] = scale
        got.append(strategy.reduce("SUM", strategy.run(lambda v: helper(v), args=(x,))))
    want = jax.jit(lambda v: helper(v))(x).reshape(8, 8, 2).sum(0)  # scale 5.0
    np.testing.assert_allclose(got[1], want)


@pytest.mark.cpu_mesh
def test_run_bound_method_sees_its_objects_new_attribute(strategy, x):
    """strategy.run(model.forward, ...) after model.scale changed sees the new value:
    each access makes a new bound method, traced anew, as jax.jit(model.forward)."""

    class Model:
        scale = 1.0

        def forward(self, v):
            return v * self.scale

    model = Model()
    strategy.run(model.forward, args=(x,))
    model.scale = 3.0
    got = strategy.reduce("SUM", strategy.run(model.forward, args=(x,)))
    want = jax.jit(model.forward)(x).reshape(8, 8, 2).sum(0)
    np.testing.assert_allclose(got, want)


# -- 3. silent wrong numbers: PerReplica and gather -------------------------------


def test_run_rejects_per_replica_with_more_values_than_replicas(strategy):
    """tf.distribute's PerReplica holds exactly one value per replica: 16 values on 8
    replicas is an error, not replica i silently getting value 2i."""
    values = spmd.PerReplica(jnp.arange(16.0))
    with pytest.raises(ConfigurationError) as info:
        strategy.run(lambda v: v * 1, args=(values,))
    assert _clear(info.value)


def test_reduce_rejects_per_replica_of_the_wrong_replica_count(strategy):
    """A PerReplica of 2 values reduced on an 8-replica strategy is an error."""
    with pytest.raises(ConfigurationError) as info:
        strategy.reduce("SUM", spmd.PerReplica(jnp.array([1.0, 2.0])))
    assert _clear(info.value)


@pytest.mark.parametrize("axis", [2, 5, -3])
def test_gather_rejects_an_axis_out_of_range(strategy, x, axis):
    """TF: `axis` is in [-rank, rank) of each replica's value; any other is an error
    (not, say, axis 5 taken as 5 % 2)."""
    per_replica = strategy.run(lambda v: v, args=(x,))  # each replica (8, 2)
    with pytest.raises(ConfigurationError) as info:
        strategy.gather(per_replica, axis=axis)
    assert _clear(info.value)


def test_gather_of_scalars_rejects_a_nonzero_axis(strategy, x):
    """Scalars per replica have no axis 3: only axis 0 gathers them."""
    per_replica = strategy.run(lambda v: v.sum(), args=(x,))
    with pytest.raises(ConfigurationError):
        strategy.gather(per_replica, axis=3)


def test_reduce_rejects_a_bool_axis(strategy, x):
    """axis is an int: True (not axis 1) and 0.5 are errors."""
    per_replica = strategy.run(lambda v: v, args=(x,))
    for axis in (True, 0.5):
        with pytest.raises(ConfigurationError):
            strategy.reduce("SUM", per_replica, axis=axis)


def test_tf_gather_same_shape_axis_1(strategy):
    """strategy_gather_test: [1, 2, 2] per replica gathered along axis 1 -> [1, 2 * n, 2]."""
    single = jnp.array([[[1, 2], [1, 2]]])
    per_replica = strategy.run(lambda: single)
    n = strategy.num_replicas_in_sync
    np.testing.assert_array_equal(
        strategy.gather(per_replica, axis=1), np.concatenate([single] * n, axis=1)
    )
    np.testing.assert_array_equal(
        strategy.gather(per_replica, axis=0), np.concatenate([single] * n, axis=0)
    )


# -- 4. the step's caches ----------------------------------------------------------


def test_static_tuple_one_then_one_point_zero_runs_the_float_program(strategy):
    """static k=(1,) then k=(1.0,) are two programs: (1,) == (1.0,), but static keys
    compare types at every level, not only the top one."""

    @strategy.step(static_argnames=("k",))
    def step(state, x, k=(1,)):
        return state, jnp.arange(3) * k[0]

    state = jnp.zeros(2)
    batch = np.ones((8, 2), np.float32)
    state, a = step(state, batch, k=(1,))
    state, b = step(state, batch, k=(1.0,))
    assert a.dtype == jnp.int32
    assert b.dtype == jnp.float32


def test_static_argnames_as_a_string_works_as_in_jax_jit(strategy):
    """static_argnames="scale" names one argument, as jax.jit takes it (not 5 letters)."""

    def fn(state, x, scale=1.0):
        return state, x.sum() * (2.0 if scale > 1 else 1.0)

    step = strategy.step(static_argnames="scale")(fn)
    batch = np.ones((8, 2), np.float32)
    _, got = step(jnp.zeros(2), batch, scale=3.0)
    _, want = jax.jit(fn, static_argnames="scale")(jnp.zeros(2), batch, scale=3.0)
    assert float(got) == float(want)


def test_batch_axis_out_of_range_is_an_error(strategy):
    """batch_axis is 0 or 1 (docs); -1 is an error, not a check of one axis and a split of another."""
    with pytest.raises(ConfigurationError):
        step = strategy.step(lambda s, x: (s, x.sum()), batch_axis=-1)
        step(jnp.zeros(2), np.ones((8, 3), np.float32))


def test_state_dict_gaining_a_key_in_place_is_a_clear_error_or_right(strategy):
    """The returned state dict gains a key in place: the fast path notices the new
    structure and the step runs the right program (no raw pytree error)."""

    @strategy.step
    def step(state, x):
        return jax.tree.map(lambda a: a + 1, state), x.sum()

    batch = np.ones((8, 2), np.float32)
    state, _ = step({"w": jnp.zeros(4)}, batch)
    state, _ = step(state, batch)
    state["b"] = jnp.zeros(2)
    try:
        state, _ = step(state, batch)
    except SpmdError as error:
        assert _clear(error)
    else:
        np.testing.assert_array_equal(state["b"], np.ones(2))


def test_non_static_string_kwarg_is_a_clear_error(strategy):
    """mode="train" not in static_argnames: an error that says to add it there."""

    @strategy.step
    def step(state, x, mode="eval"):
        return state, x.sum()

    with pytest.raises(ConfigurationError) as info:
        step(jnp.zeros(2), np.ones((8, 2), np.float32), mode="train")
    assert "static_argnames" in str(info.value)


def test_nnx_module_with_a_dict_attribute_runs_as_under_nnx_jit(strategy):
    """A module holding a plain config dict runs as under nnx.jit (its graphdef is
    unhashable, so it is keyed otherwise)."""

    class Model(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.config = {"scale": 2.0}

        def __call__(self, v):
            return self.lin(v) * self.config["scale"]

    batch = np.ones((8, 2), np.float32)
    want = nnx.jit(lambda m, v: m(v).sum())(Model(), batch)
    got = strategy.step(lambda m, v: m(v).sum())(Model(), batch)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# -- 5. run inside run, step inside run, cross-replica calls inside a step --------


def test_run_inside_run_is_a_runtime_error(strategy, x):
    """TF: run in a replica context raises RuntimeError (needs cross-replica context)."""

    def replica_fn(v):
        return strategy.run(lambda w: w * 2, args=(v,))

    with pytest.raises(RuntimeError) as info:
        strategy.run(replica_fn, args=(x,))
    assert _clear(info.value)


def test_step_inside_run_is_a_clear_error(strategy, x):
    """A global-view step called from a replica fn: a RuntimeError naming the context."""

    @strategy.step
    def step(state, v):
        return state + 1, v.sum()

    with pytest.raises(RuntimeError):
        strategy.run(lambda v: step(jnp.zeros(2), v)[1], args=(x,))


@pytest.mark.cpu_mesh
def test_other_strategys_run_inside_a_step_is_a_clear_error(strategy, x):
    """Another strategy's run traced inside this step: an error naming both strategies' meshes."""
    other = spmd.MirroredStrategy(jax.devices()[:2])

    @strategy.step
    def step(state, v):
        return state + 1, other.reduce("SUM", other.run(lambda w: w.sum(), args=(v,)))

    with pytest.raises(ConfigurationError):
        step(jnp.zeros(2), x)


@pytest.mark.cpu_mesh
def test_local_results_inside_a_step_is_a_clear_error_or_works(strategy, x):
    """local_results inside a step (one process): every replica's value, in order."""

    @strategy.step
    def step(state, v):
        out = strategy.run(lambda w: w.sum(), args=(v,))
        return state + 1, jnp.stack(strategy.local_results(out))

    try:
        _, got = step(jnp.zeros(2), x)
    except SpmdError as error:
        assert _clear(error)
    else:
        np.testing.assert_allclose(got, np.asarray(x).reshape(8, -1).sum(1))


# -- 6. bad input to constructors and run ------------------------------------------


def test_mirrored_strategy_of_one_device_object():
    """MirroredStrategy(jax.devices()[0]) is MirroredStrategy([jax.devices()[0]])."""
    assert spmd.MirroredStrategy(jax.devices()[0]).devices == (jax.devices()[0],)


@pytest.mark.cpu_mesh
def test_device_ids_may_be_numpy_integers():
    s = spmd.MirroredStrategy([np.int64(0), np.int32(3)])
    assert s.devices == (jax.devices()[0], jax.devices()[3])
    assert spmd.MirroredStrategy(np.int64(2)).devices == (jax.devices()[2],)
    with pytest.raises(ConfigurationError) as info:
        spmd.MirroredStrategy(2.0)
    assert _clear(info.value)


def test_strategy_of_a_non_mesh_is_a_clear_error():
    """Strategy("mesh"): a ConfigurationError asking for a Mesh."""
    with pytest.raises(ConfigurationError):
        spmd.Strategy("mesh")


@pytest.mark.parametrize("rules", [[("(", None)], ["w"], [("w", None, 1)]])
def test_bad_rules_are_rejected_when_the_strategy_is_built(strategy, rules):
    """A broken regex, a bare string, a 3-tuple: rejected by Strategy(...) itself,
    not at the first put or step."""
    with pytest.raises(ConfigurationError):
        spmd.Strategy(strategy.mesh, rules=rules)


def test_a_bad_rule_error_names_the_rule(strategy):
    with pytest.raises(ConfigurationError, match=r"rule=\('\(', None\)"):
        spmd.Strategy(strategy.mesh, rules=[("(", None)])
    with pytest.raises(ConfigurationError, match="spec"):
        spmd.Strategy(strategy.mesh, rules=[(".*", "model")])


def test_run_of_a_non_callable_is_a_clear_error(strategy, x):
    with pytest.raises(ConfigurationError):
        strategy.run(3, args=(x,))


def test_run_args_not_a_tuple_is_a_clear_error(strategy, x):
    """args=x (the forgotten comma of args=(x,)) is an error, not its rows as arguments."""
    with pytest.raises(ConfigurationError):
        strategy.run(lambda v: v, args=x)


@pytest.mark.parametrize(
    "fn, leaf, kind",
    [
        (lambda v: (v.sum(), "tag"), "out[1]", "str"),
        (lambda v: {"sum": v.sum(), "names": np.array(["a", "b"])}, "out['names']", "ndarray"),
        (lambda v: [v, object()], "out[1]", "object"),
    ],
)
def test_run_output_that_is_not_an_array_names_its_path_and_type(strategy, x, fn, leaf, kind):
    with pytest.raises(ConfigurationError, match="returns arrays and numbers") as caught:
        strategy.run(fn, args=(x,))
    assert f"output_leaf={leaf!r}" in str(caught.value) and kind in str(caught.value)
    assert _clear(caught.value)


def test_run_output_of_numbers_and_bools_comes_back_per_replica(strategy, x):
    out = strategy.run(lambda v: (v.sum(), 2, 0.5, True, np.float32(1)), args=(x,))
    assert [np.asarray(o.values).tolist() for o in out[1:]] == [
        [2] * 8,
        [0.5] * 8,
        [True] * 8,
        [1.0] * 8,
    ]


# -- 7. TF programs that run right (translations kept as regression tests) --------


def test_tf_custom_training_loop_mirrored_matches_one_device(strategy):
    """TF's 'Custom training with tf.distribute' tutorial: run + compute_average_loss +
    reduce(SUM) of the loss, gradients all-reduced; against one-device jax.jit SGD."""
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(64, 3)).astype(np.float32)
    ys = (xs @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
    w0 = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    global_batch = 16

    def per_example(params, x, y):
        return (x @ params["w"] + params["b"] - y) ** 2

    def replica_step(x, y, params):
        def loss_fn(p):
            return spmd.compute_average_loss(per_example(p, x, y), global_batch_size=global_batch)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = spmd.get_replica_context().all_reduce("SUM", grads)
        return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    @jax.jit
    def oracle(params, x, y):
        loss, grads = jax.value_and_grad(lambda p: per_example(p, x, y).mean())(params)
        return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    params, ref = w0, w0
    for i in range(0, 64, global_batch):
        x, y = xs[i : i + global_batch], ys[i : i + global_batch]
        loss, new = strategy.run(replica_step, args=(x, y), kwargs={"params": params})
        params = strategy.local_results(new)[0]  # every replica holds the same update
        ref_loss, ref = oracle(ref, x, y)
        np.testing.assert_allclose(strategy.reduce("SUM", loss), ref_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), params, ref)


def test_partial_functions_in_a_loop_are_right(strategy, x):
    """functools.partial(f, k=...) per call: each call's own k (a control)."""

    def mul(v, k):
        return v * k

    got = [
        strategy.reduce("SUM", strategy.run(functools.partial(mul, k=k), args=(x,)))
        for k in (1.0, 2.0)
    ]
    np.testing.assert_allclose(got[1], 2 * np.asarray(got[0]))


# -- 8. more edges: tied weights, options, reduce/gather of good values ------------


def test_tied_state_is_named_and_runs_without_donation(strategy):
    """The error names both paths; with donate=False the same state runs."""
    e = jnp.ones(4)

    def fn(state, x):
        return jax.tree.map(lambda a: a + x.sum(), state), x.sum()

    batch = np.ones((8, 2), np.float32)
    with pytest.raises(ConfigurationError, match="first='embed', second='unembed'"):
        strategy.step(fn)({"embed": e, "unembed": e}, batch)
    state, loss = strategy.step(fn, donate=False)({"embed": e, "unembed": e}, batch)
    np.testing.assert_allclose(state["unembed"], np.full(4, 17.0))
    assert float(loss) == 16.0


def test_tying_the_returned_state_in_place_is_caught_on_the_fast_path(strategy):
    """A leaf replaced in place by another of the state's own arrays: the fast path
    sees the changed leaf and the checked path names the tie."""

    @strategy.step
    def step(state, x):
        return jax.tree.map(lambda a: a + 1, state), x.sum()

    batch = np.ones((8, 2), np.float32)
    state, _ = step({"a": jnp.zeros(4), "b": jnp.zeros(4)}, batch)
    state, _ = step(state, batch)
    state["b"] = state["a"]
    with pytest.raises(ConfigurationError, match="donate=False"):
        step(state, batch)


@pytest.mark.parametrize(
    "options",
    [{"donate": "yes"}, {"donate": 1}, {"static_argnames": (1,)}, {"batch_axis": True}],
)
def test_step_options_are_checked_when_the_step_is_built(strategy, options):
    with pytest.raises(ConfigurationError) as info:
        strategy.step(lambda s, x: (s, x.sum()), **options)
    assert _clear(info.value)


def test_run_kwargs_not_a_dict_is_an_error(strategy, x):
    with pytest.raises(ConfigurationError, match="kwargs"):
        strategy.run(lambda v: v, args=(x,), kwargs=[1])


def test_context_errors_are_runtime_errors_and_configuration_errors(strategy, x):
    with pytest.raises(spmd.ContextError) as info:
        strategy.run(lambda v: strategy.run(lambda w: w, args=(v,)), args=(x,))
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ConfigurationError)


@pytest.mark.cpu_mesh
def test_gather_and_reduce_of_good_values_match_numpy(strategy, x):
    """Scalars gather along axis 0; a negative axis counts from the end; a plain
    value reduced along an axis out of its range is an error."""
    scalars = strategy.run(lambda v: v.sum(), args=(x,))
    np.testing.assert_allclose(strategy.gather(scalars), np.asarray(x).reshape(8, -1).sum(1))
    rows = strategy.run(lambda v: v, args=(x,))
    np.testing.assert_array_equal(strategy.gather(rows, axis=-2), x)
    np.testing.assert_array_equal(
        strategy.gather(rows, axis=np.int64(1)),
        np.concatenate(np.asarray(x).reshape(8, 8, 2), axis=1),
    )
    np.testing.assert_allclose(strategy.reduce("SUM", np.ones((2, 3)), axis=-1), [3.0, 3.0])
    with pytest.raises(ConfigurationError):
        strategy.reduce("SUM", np.ones((2, 3)), axis=2)


def test_run_inside_a_step_of_the_same_strategy_matches_one_device(strategy, x):
    """The control of the context checks: run of the step's own strategy is allowed."""

    @strategy.step
    def step(state, v):
        return state + 1, strategy.reduce("SUM", strategy.run(lambda w: (w * w).sum(), args=(v,)))

    _, got = step(jnp.zeros(2), x)
    np.testing.assert_allclose(got, (np.asarray(x) ** 2).sum())
