"""`strategy.run` shares compiled programs between functions, never their results' shape.

Functions whose traced programs print alike share one compiled program; what
the printed program leaves out (the output structure, the Python functions of
callbacks) is part of the key, so each function gets its own structure and its
own Python code; custom derivative rules are not, as a shared program only runs. The oracle is plain numpy: the
value each replica sees and the sum over replicas.
"""

import collections

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd.strategy import per_replica

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


def test_custom_derivative_rules_of_equal_programs_are_their_own(strategy):
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


# Structures with the two leaves "own" and "total" somewhere, None leaves between.
_KEYS = st.sampled_from(["a", "b", "c", "loss", "x"])


def _with_leaves(leaves):
    """A random container (dict, tuple, list, namedtuple) around `leaves` and Nones."""

    def wrap(children):
        return st.one_of(
            st.just(tuple(children)),
            st.just(list(children)),
            st.lists(_KEYS, min_size=len(children), max_size=len(children), unique=True).map(
                lambda keys: dict(zip(keys, children, strict=True))
            ),
            *(
                [st.just(Pair(*children)), st.just(OtherPair(*children))]
                if len(children) == 2
                else []
            ),
        )

    return (
        st.lists(st.just(None), max_size=1)
        .flatmap(lambda nones: st.permutations(list(leaves) + nones))
        .flatmap(
            lambda children: st.one_of(
                wrap(children),
                # nested: the first child inside a container of its own
                wrap([children[0]]).flatmap(lambda inner: wrap([inner, *children[1:]])),
            )
        )
    )


_STRUCTURES = st.one_of(
    _with_leaves(["own", "total"]),
    _with_leaves(["total", "own"]),
)


@settings(max_examples=25, deadline=None)
@given(structures=st.lists(_STRUCTURES, min_size=2, max_size=4), order=st.randoms())
def test_any_structures_in_any_order_match_the_oracle(strategy, structures, order):
    calls = [i for i in range(len(structures)) for _ in range(2)]
    order.shuffle(calls)
    for i in calls:
        _assert_matches(strategy.run(_returning(structures[i]), args=(X,)), structures[i])
