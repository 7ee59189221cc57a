"""Preflight: explain()'s numbers against the arrays' real shard sizes and the program's collectives."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd
from spmd._src.explain import parse_collectives
from spmd.partitioners import FixedShardsPartitioner

IN, OUT, BATCH = 256, 128, 64
tx = optax.adam(1e-3)


def create(key):
    params = {"w": jax.random.normal(key, (IN, OUT)), "b": jnp.zeros(OUT)}
    return {"params": params, "opt": tx.init(params)}


def train_step(state, x, y):
    def loss(p):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    value, grads = jax.value_and_grad(loss)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, value


BATCHES = (
    jax.ShapeDtypeStruct((BATCH, IN), jnp.float32),
    jax.ShapeDtypeStruct((BATCH, OUT), jnp.float32),
)


def _real_bytes_per_device(state):
    per_device = {}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        spmd.MirroredStrategy,
        spmd.OneDeviceStrategy,
        lambda: spmd.ParameterServerStrategy(FixedShardsPartitioner(8)),
        lambda: spmd.Strategy(
            spmd.make_mesh({"data": 4, "model": 2}),
            rules=[(r".*w", jax.sharding.PartitionSpec(None, "model"))],
        ),
    ],
)
@pytest.mark.cpu_mesh
def test_state_bytes_match_the_real_shards(make):
    strategy = make()
    abstract = strategy.abstract_state(create, jax.random.key(0))
    report = strategy.explain(train_step, abstract, *BATCHES)
    placed = strategy.init(create, jax.random.key(0))
    assert report.state_bytes == _real_bytes_per_device(placed)
    assert report.input_bytes == (BATCH // strategy.num_replicas_in_sync) * (IN + OUT) * 4
    assert report.alias_bytes == report.state_bytes  # the donated state is reused in place
    assert report.flops >= 2 * BATCH * IN * OUT / strategy.num_replicas_in_sync
    assert report.peak_bytes >= report.state_bytes
    assert "per device" in str(report)


@pytest.mark.cpu_mesh
def test_sharded_state_is_one_over_n():
    full = spmd.MirroredStrategy().explain(
        train_step, spmd.MirroredStrategy().abstract_state(create, jax.random.key(0)), *BATCHES
    )
    ps = spmd.ParameterServerStrategy(FixedShardsPartitioner(8))
    sharded = ps.explain(train_step, ps.abstract_state(create, jax.random.key(0)), *BATCHES)
    assert sharded.state_bytes * 8 == pytest.approx(full.state_bytes, rel=0.01)


@pytest.mark.cpu_mesh
@pytest.mark.slow
def test_collectives_are_counted():
    strategy = spmd.MirroredStrategy()
    report = strategy.explain(
        train_step, strategy.abstract_state(create, jax.random.key(0)), *BATCHES
    )
    assert report.collectives["all-reduce"].count >= 1
    # the gradients of w and b are all-reduced: at least their bytes
    assert report.collectives["all-reduce"].bytes >= (IN * OUT + OUT) * 4
    one = spmd.OneDeviceStrategy()
    assert (
        one.explain(train_step, one.abstract_state(create, jax.random.key(0)), *BATCHES).collectives
        == {}
    )
    ps = spmd.ParameterServerStrategy(FixedShardsPartitioner(8))
    gathered = ps.explain(train_step, ps.abstract_state(create, jax.random.key(0)), *BATCHES)
    assert (
        gathered.collectives["all-gather"].bytes >= IN * OUT * 4
    )  # w is gathered where it is used


def test_central_storage_state_is_in_host_memory():
    strategy = spmd.CentralStorageStrategy()
    report = strategy.explain(
        train_step, strategy.abstract_state(create, jax.random.key(0)), *BATCHES
    )
    assert report.state_bytes == 0 and report.state_host_bytes > 0


@pytest.mark.slow
def test_explain_runs_nothing_and_takes_a_step():
    strategy = spmd.MirroredStrategy()
    step = strategy.step(train_step)
    strategy.explain(step, strategy.abstract_state(create, jax.random.key(0)), *BATCHES)
    state = strategy.init(create, jax.random.key(0))
    step(state, np.zeros((BATCH, IN), np.float32), np.zeros((BATCH, OUT), np.float32))
    assert step.cache_size() == 1  # explain's program is the one the step then runs


def test_parse_collectives():
    hlo = """
  %all-reduce.3 = (f32[128]{0}, f32[128,256]{1,0}, f32[]) all-reduce(%a, %b, %c), channel_id=3
  %all-gather = f32[256,128]{1,0} all-gather(%param.2), channel_id=1, dimensions={0}
  %ags = (bf16[8,4]{1,0}, bf16[64,4]{1,0}) all-gather-start(%p), channel_id=2
  %agd = bf16[64,4]{1,0} all-gather-done(%ags)
  %fusion = f32[8,128]{1,0} fusion(%param.1, %all-gather), kind=kCustom
"""
    found = parse_collectives(hlo)
    assert found["all-reduce"].count == 1 and found["all-reduce"].bytes == (128 + 128 * 256 + 1) * 4
    assert found["all-gather"].count == 2
    assert found["all-gather"].bytes == 256 * 128 * 4 + 64 * 4 * 2


def test_parse_collectives_reads_tuples_with_index_comments():
    hlo = "  %ar = (f32[4]{0}, /*index=5*/f32[2,2]{1,0}) all-reduce(%a, %b), channel_id=3\n"
    assert parse_collectives(hlo)["all-reduce"].bytes == (4 + 4) * 4
