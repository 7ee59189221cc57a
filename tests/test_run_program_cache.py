"""`strategy.run` shares compiled programs between functions, never their results' shape.

Functions whose traced programs print alike share one compiled program; what
the printed program leaves out (the output structure, the Python functions of
callbacks, the arrays a nested `jax.jit` closes over) is part of the key, so each function gets its own structure and its
own Python code. A shared program only runs on concrete arrays: a `run` that
reads a traced value (differentiated by an enclosing `jax.grad`, its arguments
or a value its function closes over) runs its function's own program, so each
function is differentiated with its own custom derivative rules. The oracles
are plain numpy (the value each replica sees and the sum over replicas) and the
same per-replica function on one device under `jax.vmap`.
"""

import collections
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd._src.strategy import per_replica

with warnings.catch_warnings():  # a deprecated alias of jax.jit, still found in ported code
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        from jax.experimental.pjit import pjit as _pjit
    except ImportError:
        _pjit = None

# The oracles are N = 8 replicas' values: the eight CPU devices.
pytestmark = pytest.mark.cpu_mesh

N = 8
X = np.arange(N, dtype=np.float32) + 1.0
Pair = collections.namedtuple("Pair", "first second")
OtherPair = collections.namedtuple("OtherPair", "first second")


@pytest.fixture(scope="module")
def strategy():
    return spmd.MirroredStrategy()


def _own_and_total(v):
    """The two leaves every function below returns: its replica's value and the sum."""
    return v, spmd.get_replica_context().all_reduce("SUM", v)


def _returning(structure):
    """A new function whose jaxpr is `_own_and_total`'s and whose output is `structure`.

    `structure` is a pytree whose two leaves are the strings "own" and "total".
    """

    def fn(v):
        own, total = _own_and_total(v)
        return jax.tree.map({"own": own, "total": total}.__getitem__, structure)

    return fn


def _expected(structure):
    """The oracle: replica i's own value is X[i], every replica's total is X.sum()."""
    per_replica = {"own": X.reshape(N, 1), "total": np.full((N, 1), X.sum())}
    return jax.tree.map(per_replica.__getitem__, structure)


def _assert_matches(out, structure):
    expected = _expected(structure)
    out_values = jax.tree.map(
        lambda x: np.asarray(x.values), out, is_leaf=lambda x: isinstance(x, spmd.PerReplica)
    )
    assert jax.tree.structure(out_values) == jax.tree.structure(expected), (out, structure)
    jax.tree.map(np.testing.assert_array_equal, out_values, expected)


@pytest.mark.parametrize(
    "second",
    [
        ("own", "total"),
        {"b": "own", "c": "total"},
        ["own", "total"],
        {"b": "total", "a": "own"},
        Pair("own", "total"),
        OtherPair("own", "total"),
        {"a": ("own", None), "b": ["total"]},
    ],
    ids=["tuple", "other_keys", "list", "swapped_keys", "namedtuple", "other_namedtuple", "nested"],
)
def test_a_function_of_the_same_program_gets_its_own_structure(strategy, second):
    first = {"a": "own", "b": "total"}
    _assert_matches(strategy.run(_returning(first), args=(X,)), first)
    _assert_matches(strategy.run(_returning(second), args=(X,)), second)
    _assert_matches(strategy.run(_returning(first), args=(X,)), first)


def test_a_new_lambda_of_the_same_structure_still_shares_one_program(strategy):
    structure = {"loss": "total", "x": "own"}
    strategy.run(_returning(structure), args=(X,))
    programs = len(per_replica._BY_JAXPR)
    for _ in range(3):
        _assert_matches(strategy.run(_returning(structure), args=(X,)), structure)
    assert len(per_replica._BY_JAXPR) == programs


def test_callbacks_of_equal_programs_call_their_own_function(strategy):
    seen = []

    def calling(tag):
        def fn(v):
            jax.debug.callback(lambda _: seen.append(tag), v)
            return v

        return fn

    strategy.run(calling("first"), args=(X,))
    jax.effects_barrier()
    strategy.run(calling("second"), args=(X,))
    jax.effects_barrier()
    assert set(seen) == {"first", "second"}


def test_pure_callbacks_of_equal_programs_compute_their_own_values(strategy):
    def scaled_by(k):
        def fn(v):
            spec = jax.ShapeDtypeStruct(v.shape, v.dtype)
            return jax.pure_callback(lambda a: np.asarray(a) * k, spec, v)

        return fn

    for k in (2.0, 3.0, 2.0):
        out = strategy.run(scaled_by(k), args=(X,))
        np.testing.assert_array_equal(np.asarray(out.values).ravel(), X * k)


def test_custom_derivative_rules_used_inside_fn_are_their_own(strategy):
    # jax.grad inside fn: the rule's arithmetic is in each function's own jaxpr.
    def with_backward_scale(k):
        @jax.custom_vjp
        def ident(v):
            return v

        ident.defvjp(lambda v: (v, None), lambda _, g: (g * k,))
        return lambda v: jax.grad(lambda w: ident(w).sum())(v)

    for k in (2.0, 5.0, 2.0):
        out = strategy.run(with_backward_scale(k), args=(X,))
        np.testing.assert_array_equal(np.asarray(out.values).ravel(), np.full(N, k))


def test_a_new_lambda_calling_a_function_with_a_custom_derivative_shares_one_program(strategy):
    # jax.nn.relu is a custom_jvp: each trace wraps its rule in a new function,
    # which a shared program never calls; a new lambda each call compiles once.
    strategy.run(lambda v: jax.nn.relu(v - 2.0), args=(X,))
    programs = len(per_replica._BY_JAXPR)
    for _ in range(3):
        out = strategy.run(lambda v: jax.nn.relu(v - 2.0), args=(X,))
        np.testing.assert_array_equal(np.asarray(out.values).ravel(), np.maximum(X - 2.0, 0))
    assert len(per_replica._BY_JAXPR) == programs


def _doubling_with_backward_scale(k):
    """2 * v with a custom_vjp whose backward rule says k: every k traces to one jaxpr."""

    @jax.custom_vjp
    def double(v):
        return v * 2.0

    def backward(_, g):
        return (g * k,)

    double.defvjp(lambda v: (v * 2.0, None), backward)
    return double


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_functions_of_equal_jaxprs_differentiated_through_run_use_their_own_rules(strategy):
    """fn closes over the value jax.grad differentiates (w): each function's gradient is
    its own backward rule's, in any order, after its program ran (and was shared)
    on concrete values; the oracle is the same function on one device."""
    doubles = {k: _doubling_with_backward_scale(k) for k in (10.0, 100.0)}
    assert str(jax.make_jaxpr(doubles[10.0])(X)) == str(jax.make_jaxpr(doubles[100.0])(X))
    for k in (10.0, 100.0, 10.0, 100.0):
        double = doubles[k]
        strategy.run(lambda v, double=double: double(v * 3.0), args=(X,))  # shared

        def total(w, double=double):
            per = strategy.run(lambda v: double(v * w), args=(X,))
            return strategy.reduce("SUM", per).sum()

        want = jax.grad(lambda w, double=double: double(jnp.asarray(X) * w).sum())(3.0)
        assert float(want) == k * X.sum()
        assert float(jax.grad(total)(3.0)) == float(want)


def test_run_differentiated_inside_a_step_with_fn_closing_over_the_state(strategy):
    """The same inside a compiled step: fn closes over the state being differentiated."""

    @strategy.step
    def step(w, x):
        def loss(w):
            per = strategy.run(lambda v: v * w, args=(X,))
            return strategy.reduce("SUM", per).sum() + 0.0 * x.sum()

        grad = jax.grad(loss)(w)
        return w - 0.01 * grad, grad

    w, grad = step(np.float32(1.0), np.ones(N, np.float32))
    assert float(grad) == X.sum()
    assert float(w) == pytest.approx(1.0 - 0.01 * X.sum())


def test_differentiating_through_run_uses_each_functions_own_derivative_rule(strategy):
    def with_tangent_scale(k):
        @jax.custom_jvp
        def ident(v):
            return v

        ident.defjvp(lambda primals, tangents: (primals[0], tangents[0] * k))
        return ident

    for k in (2.0, 5.0, 2.0):
        ident = with_tangent_scale(k)
        strategy.run(ident, args=(X,))  # run eagerly first: its program is shared

        def total(x, ident=ident):
            return strategy.reduce("SUM", strategy.run(ident, args=(x,)), axis=None).sum()

        np.testing.assert_array_equal(jax.grad(total)(X), np.full(N, k))


def test_named_scopes_of_equal_programs_name_their_own_ops(strategy):
    # A profile names each op by its scope: a shared program would show the
    # first function's names for the second's ops.
    def scoped(name):
        def fn(v):
            with jax.named_scope(name):
                return v * 2.0

        return fn

    for name in ("encoder", "decoder"):
        strategy.run(scoped(name), args=(X,))
        program = per_replica._BY_FUNCTION[next(reversed(per_replica._BY_FUNCTION))]
        assert name in program.lower(X).as_text(debug_info=True)


# Structures 1 to 3 containers deep holding the leaves "own" and "total" (in either
# order) and up to two None leaves, anywhere.
_KEYS = ["a", "b", "c", "loss", "x"]


def _wrap(draw, children):
    """One random container (tuple, list, dict, namedtuple) around `children`."""
    kinds = ["tuple", "list", "dict"] + (["pair", "other_pair"] if len(children) == 2 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "dict":
        keys = draw(st.permutations(_KEYS))[: len(children)]
        return dict(zip(keys, children, strict=True))
    wrap = {"tuple": tuple, "list": list, "pair": lambda c: Pair(*c)}
    return wrap.get(kind, lambda c: OtherPair(*c))(children)


def _nest(draw, items, depth):
    """`items` in a container whose consecutive runs of items may nest `depth - 1` deeper."""
    children, start = [], 0
    while start < len(items):
        size = draw(st.integers(1, len(items) - start))
        run = items[start : start + size]
        start += size
        if depth > 1 and draw(st.booleans()):
            children.append(_nest(draw, run, depth - 1))
        else:
            children += run
    return _wrap(draw, children)


@st.composite
def _structures(draw):
    leaves = draw(st.permutations(["own", "total"]))
    nones = draw(st.integers(0, 2))
    items = list(leaves) + [None] * nones
    positions = draw(st.permutations(range(len(items))))
    return _nest(draw, [items[i] for i in positions], draw(st.integers(1, 3)))


def _one_device_oracle(structure):
    """The per-replica function on one device: jax.vmap over the replicas, psum for the
    all-reduce, its leaves put in `structure`."""

    def replica(v):
        values = {"own": v, "total": jax.lax.psum(v, "replicas")}
        return jax.tree.map(lambda name: values[name][None], structure)

    with jax.default_device(jax.devices()[0]):
        return jax.jit(jax.vmap(replica, axis_name="replicas"))(X)


@pytest.mark.slow  # 9 s of CPU: over the fast tier's share (tests/tiers.py)
@settings(max_examples=25, deadline=None)
@given(structures=st.lists(_structures(), min_size=2, max_size=4), order=st.randoms())
def test_any_structures_in_any_order_match_the_oracle(strategy, structures, order):
    calls = [i for i in range(len(structures)) for _ in range(2)]
    order.shuffle(calls)
    oracles = [_one_device_oracle(structure) for structure in structures]
    for i in calls:
        out = strategy.run(_returning(structures[i]), args=(X,))
        _assert_matches(out, structures[i])
        oracle = oracles[i]
        got = jax.tree.map(
            lambda x: np.asarray(x.values), out, is_leaf=lambda x: isinstance(x, spmd.PerReplica)
        )
        assert jax.tree.structure(got) == jax.tree.structure(oracle)
        jax.tree.map(np.testing.assert_array_equal, got, jax.tree.map(np.asarray, oracle))


class _Dense(nn.Module):
    """A linen layer: its params go into `run`'s function by functools.partial."""

    @nn.compact
    def __call__(self, v):
        return nn.Dense(1)(v)


_ROWS = np.arange(2 * N, dtype=np.float32).reshape(N, 2) / N


def _jit_closing_over(w):
    """A jitted helper over the current weights, as a training loop rebuilds each epoch."""
    predict = jax.jit(lambda v: v @ w)
    return lambda v: predict(v)


def _jit_in_jit_closing_over(w):
    """jax.jit two deep, each level closing over its own array."""
    inner = jax.jit(lambda v: jnp.tanh(v @ w))
    outer = jax.jit(lambda v: inner(v) * w.sum())
    return lambda v: outer(v)


def _pjit_closing_over(w):
    """jax.experimental.pjit (ported code still calls it), closing over the weights."""
    if _pjit is None:
        pytest.skip("this JAX has no jax.experimental.pjit")
    predict = _pjit(lambda v: jnp.tanh(v @ w) * w.sum())
    return lambda v: predict(v)


def _jitted_apply_of(w):
    model = _Dense()
    params = model.init(jax.random.key(0), _ROWS[:1])
    params = jax.tree.map(lambda p: p + w.sum(), params)
    apply = jax.jit(functools.partial(model.apply, params))
    return lambda v: apply(v)


def _apply_of(w):
    model = _Dense()
    params = model.init(jax.random.key(0), _ROWS[:1])
    return functools.partial(model.apply, jax.tree.map(lambda p: p * w.sum(), params))


@pytest.mark.slow  # 4 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize(
    "make",
    [_jit_closing_over, _jit_in_jit_closing_over, _pjit_closing_over, _jitted_apply_of, _apply_of],
    ids=["jit", "jit_in_jit", "pjit", "jitted_partial_apply", "partial_apply"],
)
def test_functions_whose_nested_jit_closes_over_other_arrays_get_their_own_values(strategy, make):
    """Each epoch a new helper closes over new weights: the printed programs are equal
    (a nested jaxpr prints its constants as variables), the values are each epoch's.
    The oracle is each replica's row through the same function on one device."""
    for epoch in (1.0, 2.0, 3.0, 1.0):
        fn = make(jnp.full((2, 1), epoch))
        out = np.asarray(strategy.run(fn, args=(_ROWS,)).values)
        with jax.default_device(jax.devices()[0]):
            want = np.stack([np.asarray(fn(_ROWS[i : i + 1])) for i in range(N)])
        np.testing.assert_allclose(out, want, rtol=1e-6)
