"""Property: every call of a step equals the same function jitted on one device.

Random state pytrees and dtypes, strategies (1-D, 2-D, sharded), static and
non-static keyword arguments and batch shapes varied between calls, and the
state passed back as returned or as a fresh copy: each call must run the
program its own arguments ask for.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import spmd
from spmd.partitioners import FixedShardsPartitioner

pytestmark = pytest.mark.cpu_mesh  # every test here uses the eight CPU devices


@functools.cache
def _strategies() -> dict:
    return {
        "mirrored": spmd.MirroredStrategy(),
        "two_d": spmd.Strategy(
            spmd.make_mesh({"data": 4, "model": 2}),
            rules=[(r".*w", P(None, "model"))],
            batch_axes=("data",),
        ),
        "parameter_server": spmd.ParameterServerStrategy(FixedShardsPartitioner(2)),
        "one_device": spmd.OneDeviceStrategy(),
    }


DTYPES = {"float32": (np.float32, 1e-5), "bfloat16": (jnp.bfloat16, 3e-2)}


def train(state, x, scale=1.0, *, mode="add"):
    """A step whose every number depends on the state, the batch and both kwargs."""
    signal = jnp.mean(x) * scale
    new = {}
    for name, leaf in state.items():
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            new[name] = leaf + x.shape[0]
        elif mode == "add":
            new[name] = (leaf + signal.astype(leaf.dtype)).astype(leaf.dtype)
        else:
            new[name] = (leaf * (1 + signal).astype(leaf.dtype)).astype(leaf.dtype)
    return new, {"signal": signal, "rows": x.shape[0]}


ORACLE = jax.jit(train, static_argnames="mode")

leaf_names = st.sampled_from(["w", "b", "step", "v"])
calls = st.lists(
    st.fixed_dictionaries(
        {
            "rows": st.sampled_from([8, 16, 24]),
            "scale": st.one_of(st.none(), st.sampled_from([0.5, 2.0, -1.0])),
            "mode": st.one_of(st.none(), st.sampled_from(["add", "mul"])),
            "fresh_state": st.booleans(),
        }
    ),
    min_size=2,
    max_size=4,
)


def _state(names: list[str], dtype) -> dict:
    out = {}
    for i, name in enumerate(sorted(set(names))):
        if name == "step":
            out[name] = np.int32(0)
        else:
            out[name] = (np.arange(8, dtype=np.float32).reshape(4, 2) / (i + 4)).astype(dtype)
    return out


def _kwargs(call: dict) -> dict:
    return {k: call[k] for k in ("scale", "mode") if call[k] is not None}


@pytest.mark.slow
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
    database=None,
)
@given(
    name=st.sampled_from(sorted(_strategies())),
    dtype=st.sampled_from(sorted(DTYPES)),
    names=st.lists(leaf_names, min_size=1, max_size=3),
    donate=st.booleans(),
    calls=calls,
)
def test_every_call_matches_the_one_device_oracle(name, dtype, names, donate, calls):
    np_dtype, tol = DTYPES[dtype]
    step = _strategies()[name].step(donate=donate, static_argnames=("mode",))(train)
    state = _state(names, np_dtype)
    want = jax.tree.map(np.asarray, state)
    for i, call in enumerate(calls):
        x = np.linspace(-1, 1 + i, call["rows"] * 3, dtype=np.float32).reshape(-1, 3)
        if call["fresh_state"]:
            state = jax.tree.map(lambda a: np.array(jax.device_get(a)), state)
        state, metrics = step(state, x, **_kwargs(call))
        want, want_metrics = ORACLE(want, x, **_kwargs(call))
        for key in want:
            np.testing.assert_allclose(
                np.asarray(state[key], np.float32),
                np.asarray(want[key], np.float32),
                rtol=tol,
                atol=tol,
                err_msg=f"call {i} {call}: state[{key!r}]",
            )
        np.testing.assert_allclose(metrics["signal"], want_metrics["signal"], rtol=1e-5, atol=1e-6)
        assert int(metrics["rows"]) == call["rows"]
