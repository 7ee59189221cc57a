"""spmd.attention: the sequence split over a `context` axis equals one device's attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from spmd.testing import assert_trees_allclose

pytestmark = pytest.mark.cpu_mesh

DATA_CONTEXT = {"data": 2, "context": 4}
CONTEXT_MODEL_DATA = {"context": 2, "model": 2, "data": 2}
# float32: the same per-row arithmetic, summed in another order by the gather's gradient;
# bfloat16: the inputs' 8-bit mantissa, a few ulps of outputs ~1.
TOL = {jnp.float32: {"rtol": 1e-5, "atol": 1e-5}, jnp.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def qkv(heads=4, kv_heads=2, length=16, dtype=jnp.float32, batch=4, head_dim=8):
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(batch, length, heads, head_dim)] + [(batch, length, kv_heads, head_dim)] * 2
    return [jax.random.normal(key, s).astype(dtype) for key, s in zip(keys, shapes, strict=True)]


def loss_of(fn, **kwargs):
    return lambda q, k, v: jnp.sum(fn(q, k, v, **kwargs).astype(jnp.float32) ** 2)


def strategy(axes):
    mesh = spmd.make_mesh(axes)
    return spmd.Strategy(mesh=mesh, batch_axes=("data",))


def run_both(axes, args, causal, **kwargs):
    """(spmd.attention on `axes`, one device's jax.nn attention): outputs and gradients."""
    ref = {"is_causal": causal, **{k: v for k, v in kwargs.items() if k == "scale"}}
    want = jax.jit(jax.nn.dot_product_attention, static_argnames="is_causal")(*args, **ref)
    want_grads = jax.jit(jax.grad(loss_of(jax.nn.dot_product_attention, **ref), (0, 1, 2)))(*args)
    s = strategy(axes)
    if "model" in axes:  # tensor parallel: the heads split over `model`, as a TP layer makes them
        heads = NamedSharding(s.mesh, P("data", None, "model"))
        args = jax.device_put(args, heads)
    with s.scope():
        got = jax.jit(lambda q, k, v: spmd.attention(q, k, v, causal=causal, **kwargs))(*args)
        grads = jax.jit(jax.grad(loss_of(spmd.attention, causal=causal, **kwargs), (0, 1, 2)))(
            *args
        )
    return (got, grads), (want, want_grads)


@pytest.mark.parametrize(
    "axes, causal, heads, dtype",
    [
        pytest.param(DATA_CONTEXT, True, (4, 2), jnp.float32),
        pytest.param(
            CONTEXT_MODEL_DATA,
            True,
            (4, 2),
            jnp.float32,
            marks=pytest.mark.slow,  # 2 s of CPU
        ),
        pytest.param(DATA_CONTEXT, False, (4, 1), jnp.float32, marks=pytest.mark.slow),  # 2 s
        pytest.param(
            CONTEXT_MODEL_DATA,
            False,
            (4, 4),
            jnp.float32,
            marks=pytest.mark.slow,  # 2 s of CPU
        ),
        pytest.param(DATA_CONTEXT, True, (4, 2), jnp.bfloat16, marks=pytest.mark.slow),  # 2 s
        pytest.param(
            CONTEXT_MODEL_DATA,
            False,
            (4, 2),
            jnp.bfloat16,
            marks=pytest.mark.slow,  # 2 s of CPU
        ),
    ],
)
def test_equals_one_device_forward_and_gradients(axes, causal, heads, dtype):
    args = qkv(*heads, dtype=dtype)
    got, want = run_both(axes, args, causal)
    assert got[0].dtype == dtype and got[0].shape == args[0].shape
    to32 = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float32), tree)  # noqa: E731
    assert_trees_allclose(to32(got), to32(want), **TOL[dtype])


@pytest.mark.slow  # 2 s of CPU
def test_scale_and_segment_ids_equal_the_masked_one_device_attention():
    q, k, v = qkv()
    segments = jnp.asarray(np.repeat([[0] * 5 + [1] * 7 + [2] * 4], 4, axis=0))
    same = (segments[:, :, None] == segments[:, None, :])[:, None]
    causal = jnp.tril(jnp.ones((16, 16), bool))[None, None]
    want = jax.nn.dot_product_attention(q, k, v, mask=same & causal, scale=0.3)
    with strategy(DATA_CONTEXT).scope():
        fn = lambda q, k, v, s: spmd.attention(  # noqa: E731
            q, k, v, causal=True, scale=0.3, segment_ids=s
        )
        got = jax.jit(fn)(q, k, v, segments)
        pair = jax.jit(lambda q, k, v, s: spmd.attention(q, k, v, segment_ids=(s, s)))(
            q, k, v, segments
        )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    want_pair = jax.nn.dot_product_attention(q, k, v, mask=same)
    np.testing.assert_allclose(pair, want_pair, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # 2 s of CPU
def test_a_mask_is_split_by_its_query_rows_and_combined_with_causal():
    q, k, v = qkv()
    mask = jax.random.bernoulli(jax.random.key(3), 0.5, (4, 1, 16, 16)) | jnp.eye(16, dtype=bool)
    causal = jnp.tril(jnp.ones((16, 16), bool))[None, None]
    want = jax.nn.dot_product_attention(q, k, v, mask=mask & causal)
    with strategy(DATA_CONTEXT).scope():
        fn = lambda q, k, v, m: spmd.attention(q, k, v, causal=True, mask=m)  # noqa: E731
        got = jax.jit(fn)(q, k, v, mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_program_gathers_keys_and_values_and_keeps_queries_split():
    q, k, v = qkv()
    with strategy(DATA_CONTEXT).scope():
        fn = jax.jit(lambda q, k, v: spmd.attention(q, k, v, causal=True))
        hlo = fn.lower(q, k, v).compile().as_text()
        out = fn(q, k, v)
    assert "all-gather" in hlo
    assert out.sharding.spec[1] == "context"  # the output stays split


@pytest.mark.slow  # 3 s of CPU
def test_without_a_context_axis_it_is_plain_attention():
    q, k, v = qkv()
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(spmd.attention(q, k, v, causal=True), want, rtol=1e-6, atol=1e-6)
    with strategy({"data": 8}).scope():
        np.testing.assert_allclose(spmd.attention(q, k, v, causal=True), want, rtol=1e-6, atol=1e-6)
    with strategy({"data": 8, "context": 1}).scope():
        hlo = jax.jit(lambda q, k, v: spmd.attention(q, k, v)).lower(q, k, v).as_text()
    assert "all_gather" not in hlo


def _error(exc, fn, *args, **kwargs):
    with pytest.raises(exc) as caught:
        fn(*args, **kwargs)
    text = str(caught.value)
    assert "Received:" in text and "To fix:" in text
    return text


def zeros(length, heads=4, kv_heads=2):
    return [jnp.zeros((4, length, h, 8)) for h in (heads, kv_heads, kv_heads)]


def test_a_length_that_does_not_divide_the_context_axis_is_an_error():
    q, k, v = zeros(10)
    with strategy(DATA_CONTEXT).scope():
        text = _error(spmd.ConfigurationError, spmd.attention, q, k, v)
    assert "q_length=10" in text and "axis_size=4" in text
    q, k, v = zeros(2)  # blocks under one row each
    with strategy(DATA_CONTEXT).scope():
        _error(spmd.ConfigurationError, jax.jit(spmd.attention), q, k, v)


@pytest.mark.parametrize(
    "shapes, words",
    [
        (((2, 8, 4, 8), (2, 8, 2, 8), (2, 8, 2, 4)), "one shape"),
        (((2, 8, 4, 8), (3, 8, 2, 8), (3, 8, 2, 8)), "same batch"),
        (((2, 8, 4, 8), (2, 8, 3, 8), (2, 8, 3, 8)), "multiple of the key/value heads"),
        (((8, 4, 8), (8, 4, 8), (8, 4, 8)), "rank 4"),
    ],
)
def test_bad_shapes_are_errors(shapes, words):
    q, k, v = (jnp.zeros(s) for s in shapes)
    assert words in _error(spmd.ConfigurationError, spmd.attention, q, k, v)


def test_bad_dtypes_and_segment_ids_are_errors():
    q, k, v = zeros(16)
    assert "one dtype" in _error(
        spmd.ConfigurationError, spmd.attention, q, k.astype(jnp.bfloat16), v
    )
    for mask in (jnp.ones((4, 1, 1, 16), bool), jnp.ones((4, 1, 16, 16), jnp.float32)):
        assert "mask" in _error(spmd.ConfigurationError, spmd.attention, q, k, v, mask=mask)
    bad = jnp.zeros((4, 15), jnp.int32)
    assert "segment_ids" in _error(
        spmd.ConfigurationError, spmd.attention, q, k, v, segment_ids=bad
    )


def test_inside_the_per_replica_view_the_context_axis_is_manual_and_refused():
    q, k, v = qkv()
    s = strategy(DATA_CONTEXT)

    def per_replica(q, k, v):
        return spmd.attention(q, k, v)

    with s.scope():
        jitted = jax.jit(
            jax.shard_map(per_replica, in_specs=P(None, "context"), out_specs=P(None, "context"))
        )
        assert "manual" in _error(spmd.ContextError, jitted, q, k, v)
