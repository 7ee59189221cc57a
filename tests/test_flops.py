"""spmd._src.flops and Explanation.matmul_flops against XLA's own count and the textbook formula.

XLA's cost analysis on CPU is the oracle for loop-free programs of products
and convolutions (on CPU no library call hides them); a scan is checked
against the same work written out, and a transformer step against PaLM's
6 N T + 12 L d s T.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmd
from spmd._src.flops import matmul_flops

NHWC = {"dimension_numbers": ("NHWC", "HWIO", "NHWC")}


def counted(f, *args):
    return matmul_flops(jax.jit(f).trace(*args).jaxpr)


def xla(f, *args):
    return jax.jit(f).lower(*args).compile().cost_analysis()["flops"]


def conv(**kw):
    return lambda x, k: jax.lax.conv_general_dilated(x, k, **NHWC, **kw)


def loss_of(f):
    return lambda a, b: f(a, b).sum()


CASES = {
    "matmul": (lambda x, w: x @ w, (8, 16), (16, 32)),
    "batched einsum": (lambda a, b: jnp.einsum("bqd,bkd->bqk", a, b), (3, 5, 7), (3, 6, 7)),
    "conv valid": (conv(window_strides=(1, 1), padding="VALID"), (2, 10, 10, 3), (3, 3, 3, 4)),
    "conv strided same": (conv(window_strides=(2, 2), padding="SAME"), (2, 9, 9, 3), (3, 3, 3, 4)),
    "conv grouped": (
        conv(window_strides=(1, 1), padding="SAME", feature_group_count=2),
        (2, 8, 8, 4),
        (3, 3, 2, 6),
    ),
    "conv dilated": (
        conv(window_strides=(1, 1), padding="SAME", rhs_dilation=(2, 2)),
        (1, 9, 9, 2),
        (3, 3, 2, 2),
    ),
}


@pytest.mark.cpu_mesh
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("grad", [None, 0, 1], ids=["forward", "grad lhs", "grad rhs"])
def test_products_and_convolutions_count_as_xla_does(name, grad):
    f, a, b = CASES[name]
    f = f if grad is None else jax.grad(loss_of(f), argnums=grad)
    args = (jnp.ones(a), jnp.ones(b))
    assert counted(f, *args) == xla(f, *args) > 0


def test_a_scan_counts_its_body_length_times_where_xla_counts_it_once():
    w, x = jnp.ones((6, 16, 16)), jnp.ones((4, 16))

    def scanned(w, x):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]

    def written_out(w, x):
        for i in range(6):
            x = jnp.tanh(x @ w[i])
        return x

    for f in (scanned, jax.grad(loss_of(scanned), argnums=(0, 1))):
        g = written_out if f is scanned else jax.grad(loss_of(written_out), argnums=(0, 1))
        assert counted(f, w, x) == counted(g, w, x) == matmul_flops(jax.make_jaxpr(g)(w, x))
    assert counted(scanned, w, x) == 6 * 2 * 4 * 16 * 16
    assert xla(scanned, w, x) < counted(scanned, w, x)  # why explain counts for itself


def test_cond_counts_its_larger_branch_and_dead_work_is_not_counted():
    x = jnp.ones((8, 8))

    def f(p, x):
        return jax.lax.cond(p, lambda x: x @ x @ x, lambda x: x @ x, x)

    assert counted(f, True, x) == 2 * (2 * 8 * 8 * 8)

    def dead(x):
        _ = x @ x  # nothing uses it: XLA drops it, so does the count
        return x + 1

    assert counted(dead, x) == 0


@pytest.mark.cpu_mesh
def test_shard_map_counts_every_shard():
    mesh = spmd.make_mesh({"d": 8})
    per_shard = jax.shard_map(lambda a: a @ a.T, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    x = jnp.ones((64, 16))
    assert counted(per_shard, x) == 8 * (2 * 8 * 8 * 16)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["one_device", "mirrored"])
def test_explain_counts_a_transformer_step_as_palm_does(strategy):
    from bench import bench_gpu  # the example's LM and its bf16 train step, as MFU uses them

    lm = bench_gpu.example()
    cfg = lm.LMConfig(vocab=64, dim=32, heads=4, mlp=64, layers=3, seq=16, batch=8, attention="xla")
    create, step = bench_gpu.lm_pure(cfg)
    s = spmd.OneDeviceStrategy() if strategy == "one_device" else spmd.MirroredStrategy()
    report = s.explain(step, s.abstract_state(create), np.asarray(next(lm.batches(cfg, 1))))
    n = cfg.layers * (4 * cfg.dim**2 + 2 * cfg.dim * cfg.mlp) + cfg.dim * cfg.vocab
    tokens = cfg.batch * cfg.seq
    palm = 6 * n * tokens + 12 * cfg.layers * cfg.dim * cfg.seq * tokens
    assert report.matmul_flops == palm  # the whole step, whatever the strategy
    assert "matmul FLOPs (all devices)" in str(report)
