"""A slice of TensorFlow's own tf.distribute tests, translated to spmd with TF's expected numbers.

Sources (tensorflow/python/...): ops/nn_loss_scaling_utilities_test.py,
distribute/strategy_common_test.py, distribute/sharded_variable_test.py
(PartitionerTest). TF's `mirrored_strategy_with_cpu_1_and_2` is
`spmd.MirroredStrategy` over two devices. Where spmd differs on purpose the
test is an xfail(strict=True) whose reason cites docs/migration.md, so that
the difference stays deliberate. The multi-worker `testReduceHostTensor`
(reduce(SUM, 1.) on 2 workers is 2.) runs with real processes in
tests/multiprocess/test_reduce.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.partitioners import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner

MIGRATION = "docs/migration.md, 'Deliberate differences': "


@pytest.fixture
def two_replicas():
    return spmd.MirroredStrategy(jax.devices()[:2])


def _all_strategies():
    return [
        spmd.MirroredStrategy(),
        spmd.MirroredStrategy(jax.devices()[:2]),
        spmd.OneDeviceStrategy(),
        spmd.CentralStorageStrategy() if _has_host_memory() else spmd.MirroredStrategy(),
        spmd.ParameterServerStrategy(FixedShardsPartitioner(2)),
    ]


def _has_host_memory() -> bool:
    return "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}


# -- nn_loss_scaling_utilities_test.LossUtilitiesTest --------------------------------------


def test_compute_average_loss_global_batch_size():
    loss = spmd.compute_average_loss(jnp.array([1, 2, 3, 4, 5], jnp.float32), global_batch_size=10)
    assert float(loss) == 1.5


def test_compute_average_loss_default_global_batch_size(two_replicas):
    per_example_loss = jnp.array([2.5, 6.2, 5.0])
    loss = spmd.compute_average_loss(per_example_loss)  # without a strategy: one replica
    np.testing.assert_allclose(loss, (2.5 + 6.2 + 5.0) / 3, rtol=1e-6)
    with two_replicas.scope():  # TF's run replicates a plain tensor: here, a keyword argument
        per_replica_losses = two_replicas.run(
            spmd.compute_average_loss, kwargs={"per_example_loss": per_example_loss}
        )
        loss = two_replicas.reduce("SUM", per_replica_losses, axis=None)
    np.testing.assert_allclose(loss, (2.5 + 6.2 + 5.0) / 3, rtol=1e-6)


@pytest.mark.xfail(
    strict=True,
    raises=spmd.BatchError,
    reason=MIGRATION + "run splits positional arguments over the replicas; TF replicates them",
)
@pytest.mark.cpu_mesh
def test_compute_average_loss_positional_argument_replicated_as_in_tf(two_replicas):
    per_replica_losses = two_replicas.run(
        spmd.compute_average_loss, args=(jnp.array([2.5, 6.2, 5.0]),)
    )
    loss = two_replicas.reduce("SUM", per_replica_losses, axis=None)
    np.testing.assert_allclose(loss, (2.5 + 6.2 + 5.0) / 3, rtol=1e-6)


def test_compute_average_loss_sample_weights(two_replicas):
    def run(losses, weight):
        per_replica = two_replicas.run(
            spmd.compute_average_loss,
            kwargs={"per_example_loss": jnp.array(losses), "sample_weight": jnp.array(weight)},
        )
        return float(two_replicas.reduce("SUM", per_replica, axis=None))

    with two_replicas.scope():
        assert run([2.0, 4.0, 6.0], 2.0) == pytest.approx((2.0 + 4.0 + 6.0) * 2.0 / 3)
        assert run([2.0, 4.0, 6.0], [0.3, 0.5, 0.2]) == pytest.approx(
            (2.0 * 0.3 + 4.0 * 0.5 + 6.0 * 0.2) / 3
        )
        assert run([[2.0, 0.5], [4.0, 1.0]], [[0.3, 0.7], [0.2, 0.8]]) == pytest.approx(
            (2.0 * 0.3 + 0.5 * 0.7 + 4.0 * 0.2 + 1.0 * 0.8) / 2
        )


def test_compute_average_loss_invalid_sample_weights():
    with pytest.raises(ValueError, match="sample_weight"):
        spmd.compute_average_loss(
            jnp.array([2.5, 6.2, 5.0]), sample_weight=jnp.array([0.2, 0.8]), global_batch_size=10
        )


def test_compute_average_loss_dtype(two_replicas):
    with jax.enable_x64(True), two_replicas.scope():
        per_example_loss = jnp.array([2.0, 4.0, 6.0], jnp.float64)
        per_replica_losses = two_replicas.run(
            spmd.compute_average_loss,
            kwargs={"per_example_loss": per_example_loss, "sample_weight": 2},
        )
        loss = two_replicas.reduce("SUM", per_replica_losses, axis=None)
        assert loss.dtype == jnp.float64


def test_compute_average_loss_invalid_rank():
    with pytest.raises(ValueError, match="rank at least 1"):
        spmd.compute_average_loss(jnp.array(2.0))


@pytest.mark.xfail(
    strict=True,
    reason=MIGRATION + "in a scope outside run, loss helpers act as one replica "
    "(the global view of @strategy.step); TF raises RuntimeError",
)
def test_compute_average_loss_in_cross_replica_context(two_replicas):
    with two_replicas.scope(), pytest.raises(RuntimeError, match="cross replica context"):
        spmd.compute_average_loss(jnp.array([2.0, 3.0]))


def test_scale_regularization_loss(two_replicas):
    reg_losses = jnp.array([2.5, 6.2, 5.0])
    np.testing.assert_allclose(spmd.scale_regularization_loss(reg_losses), 2.5 + 6.2 + 5.0)
    with two_replicas.scope():
        per_replica_losses = two_replicas.run(
            spmd.scale_regularization_loss, kwargs={"regularization_loss": reg_losses}
        )
        loss = two_replicas.reduce("SUM", per_replica_losses, axis=None)
    np.testing.assert_allclose(loss, 2.5 + 6.2 + 5.0, rtol=1e-6)


@pytest.mark.xfail(
    strict=True,
    reason=MIGRATION + "in a scope outside run, loss helpers act as one replica "
    "(the global view of @strategy.step); TF raises RuntimeError",
)
def test_scale_regularization_loss_in_cross_replica_context(two_replicas):
    with two_replicas.scope(), pytest.raises(RuntimeError, match="cross replica context"):
        spmd.scale_regularization_loss(jnp.array([2.0, 3.0]))


# -- strategy_common_test: ReduceTest, ReplicaCtxAllReduceTest -----------------------------


@pytest.mark.parametrize("strategy", _all_strategies(), ids=lambda s: s.name)
def test_reduce_basic(strategy):
    # TF builds the per-replica ones with experimental_distribute_values_from_function;
    # in spmd a replica function returns them.
    per_replica_value = strategy.run(lambda: jnp.ones((), jnp.float32))
    with strategy.scope():
        assert float(strategy.reduce(spmd.ReduceOp.SUM, per_replica_value, axis=None)) == (
            1.0 * strategy.num_replicas_in_sync
        )
    assert float(strategy.reduce(spmd.ReduceOp.SUM, per_replica_value, axis=None)) == (
        1.0 * strategy.num_replicas_in_sync
    )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", _all_strategies(), ids=lambda s: s.name)
def test_reduce_axis(strategy):
    x = strategy.run(lambda: jnp.array([1.0, 2.0]))
    assert float(strategy.reduce(spmd.ReduceOp.MEAN, x, axis=0)) == 1.5
    assert float(strategy.reduce(spmd.ReduceOp.SUM, x, axis=0)) == 3 * strategy.num_replicas_in_sync


@pytest.mark.parametrize("strategy", _all_strategies(), ids=lambda s: s.name)
def test_replica_context_all_reduce(strategy):
    def replica_fn():
        return spmd.get_replica_context().all_reduce("SUM", jnp.asarray(1.0))

    got = strategy.experimental_local_results(strategy.run(replica_fn))[0]
    assert float(got) == 1.0 * strategy.num_replicas_in_sync


@pytest.mark.parametrize("strategy", _all_strategies(), ids=lambda s: s.name)
def test_replica_context_all_reduce_nested_input(strategy):
    # TF skips this one (b/122840926); spmd's all_reduce takes structures.
    def replica_fn():
        value = (jnp.asarray(1.0), jnp.asarray(2.0))
        return spmd.get_replica_context().all_reduce("SUM", value)

    got = strategy.experimental_local_results(strategy.run(replica_fn))[0]
    n = strategy.num_replicas_in_sync
    assert tuple(float(v) for v in got) == (1.0 * n, 2.0 * n)


@pytest.mark.cpu_mesh
def test_capture_replica_id():
    strategy = spmd.MirroredStrategy()
    ids = strategy.run(lambda: spmd.get_replica_context().replica_id_in_sync_group)
    assert [int(i) for i in strategy.local_results(ids)] == list(range(8))


# -- sharded_variable_test.PartitionerTest -------------------------------------------------


def test_fixed_shards_partitioner():
    assert FixedShardsPartitioner(num_shards=2)((10, 3), np.float32) == [2, 1]


def test_min_size_partitioner():
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), np.float32) == [2, 1]
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), np.float32) == [6, 1]


def test_max_size_partitioner():
    assert MaxSizePartitioner(max_shard_bytes=4)((6, 1), np.float32) == [6, 1]
    assert MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), np.float32) == [2, 1]
    assert MaxSizePartitioner(max_shard_bytes=1024)((6, 1), np.float32) == [1, 1]
