"""grain and tf.data as spmd input, against the real packages (the test extra installs them).

Over 2 real processes: tests/multiprocess/test_loaders.py.
"""

import itertools

import grain
import jax
import numpy as np
import pytest
import tensorflow as tf

import spmd
from spmd._src.data.grain_source import GrainPositions
from spmd._src.data.tf_source import plan_tf

N, BATCH = 96, 16


@pytest.fixture(scope="module")
def strategy():
    return spmd.MirroredStrategy()


def _ids(dist_or_iterator, limit=None):
    return [np.asarray(b).tolist() for b in itertools.islice(dist_or_iterator, limit)]


class Counted:
    """A grain map that counts the records it reads: what a resume reads again."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return x


def _pipeline(count=None, seed=7):
    ds = grain.MapDataset.source(np.arange(N, dtype=np.int32)).shuffle(seed=seed)
    return (ds.map(count) if count else ds).batch(BATCH)


# -- grain ------------------------------------------------------------------------------------


def test_grain_every_example_once_in_grain_order(strategy):
    dist = strategy.distribute_dataset(_pipeline())
    seen = _ids(dist)
    oracle = [np.asarray(b).tolist() for b in _pipeline()]
    assert seen == oracle and sorted(sum(seen, [])) == list(range(N))
    assert dist.auto_shard_policy is spmd.AutoShardPolicy.DATA


def test_grain_shard_options_are_the_input_pipeline(strategy):
    options = spmd.grain_shard_options(strategy)
    assert isinstance(options, grain.sharding.ShardOptions)
    assert (options.shard_index, options.shard_count, options.drop_remainder) == (0, 1, True)


def test_grain_resume_at_the_exact_batch_through_checkpoint_manager(strategy, tmp_path):
    dist = strategy.distribute_dataset(_pipeline())
    iterator = iter(dist)
    before = _ids(iterator, limit=2)
    state = {"w": np.zeros(3, np.float32)}
    with spmd.CheckpointManager(tmp_path / "ckpt") as ckpt:
        ckpt.save(2, state, data=iterator)
        ckpt.wait()
    rest = _ids(iterator)
    saved = iterator.get_state()
    assert (saved["epoch"], saved["batch"], saved["per_pipeline"]) == (1, 0, None)  # next epoch

    count = Counted()
    resumed = iter(strategy.distribute_dataset(_pipeline(count)))
    with spmd.CheckpointManager(tmp_path / "ckpt") as ckpt:
        ckpt.restore(2, target=state, data=resumed)
        position = ckpt.restore_data(2)
    assert position["per_pipeline"] == {"0": {"next_index": 2}}  # grain's own state
    assert _ids(resumed) == rest and len(before) == 2
    assert count.calls == N - 2 * BATCH  # grain's set_state: the first batches are not read again


def test_grain_data_loader_state_is_saved_as_json(strategy, tmp_path):
    def loader():
        sampler = grain.samplers.IndexSampler(
            N, shard_options=spmd.grain_shard_options(strategy), shuffle=True, num_epochs=1, seed=3
        )
        return grain.DataLoader(
            data_source=np.arange(N, dtype=np.int32),
            sampler=sampler,
            operations=[grain.transforms.Batch(BATCH)],
            worker_count=0,
        )

    dist = strategy.distribute_dataset(loader())
    assert dist.auto_shard_policy is spmd.AutoShardPolicy.DATA  # one shard: a global batch
    iterator = iter(dist)
    _ids(iterator, limit=3)
    with spmd.CheckpointManager(tmp_path / "ckpt") as ckpt:
        ckpt.save(3, {"w": np.zeros(1, np.float32)}, data=iterator)
        ckpt.wait()
    rest = _ids(iterator)
    resumed = iter(strategy.distribute_dataset(loader()))
    with spmd.CheckpointManager(tmp_path / "ckpt") as ckpt:
        ckpt.restore(3, target={"w": np.zeros(1, np.float32)}, data=resumed)
    assert _ids(resumed) == rest and len(rest) == N // BATCH - 3


def test_grain_iterator_closed_and_read_again_goes_on(strategy):
    count = Counted()
    iterator = iter(strategy.distribute_dataset(_pipeline(count)))
    first = _ids(iterator, limit=1)
    iterator.close()
    rest = _ids(iterator)
    assert first + rest == [np.asarray(b).tolist() for b in _pipeline()]


def test_grain_file_policy_is_an_error(strategy):
    with pytest.raises(spmd.ConfigurationError, match="grain shards records"):
        strategy.distribute_dataset(_pipeline(), spmd.InputOptions(auto_shard_policy="FILE"))


def test_grain_loader_sharded_for_other_pipelines_is_an_error(strategy):
    sampler = grain.samplers.IndexSampler(
        N, shard_options=grain.sharding.ShardOptions(1, 2), shuffle=False, num_epochs=1
    )
    loader = grain.DataLoader(
        data_source=np.arange(N), sampler=sampler, operations=[grain.transforms.Batch(8)]
    )
    with pytest.raises(spmd.ConfigurationError, match="shard_index=1"):
        strategy.distribute_dataset(loader)


def test_grain_position_without_this_pipeline_is_an_error():
    positions = GrainPositions(_pipeline(), pipeline=1, keep=4)
    with pytest.raises(spmd.ConfigurationError, match="saved_pipelines"):
        positions.seek({"epoch": 0, "batch": 2, "per_pipeline": {"0": {"next_index": 2}}})


def test_grain_position_of_a_batch_no_longer_kept_is_an_error(strategy):
    positions = GrainPositions(_pipeline(), pipeline=0, keep=2)
    elements, _ = positions.open(0, 0)
    list(elements)
    assert positions.state(0, N // BATCH) == {"0": {"next_index": N // BATCH}}
    with pytest.raises(spmd.ConfigurationError, match="no longer|near the one"):
        positions.state(0, 1)


def test_grain_training_matches_one_device(strategy):
    x = np.random.default_rng(0).normal(size=(N, 4)).astype(np.float32)
    ds = grain.MapDataset.source(x).batch(BATCH)

    def loss(w, xb):
        return jnp_mean_square(xb @ w)

    w = np.ones((4,), np.float32)
    step = jax.jit(lambda w, xb: w - 0.1 * jax.grad(loss)(w, xb))
    got = w
    for xb in strategy.distribute_dataset(ds):
        got = step(got, xb)
    want = w
    for start in range(0, N, BATCH):
        want = step(want, jax.device_put(x[start : start + BATCH], jax.devices()[0]))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def jnp_mean_square(v):
    return (v**2).mean()


# -- tf.data ----------------------------------------------------------------------------------


def _tf_options(policy):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = getattr(
        tf.data.experimental.AutoShardPolicy, policy
    )
    return options


@pytest.fixture(scope="module")
def tfrecords(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tfrecords")
    for f in range(4):
        with tf.io.TFRecordWriter(str(folder / f"part-{f}.tfrecord")) as writer:
            for i in range(f * 24, (f + 1) * 24):
                feature = tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))
                writer.write(
                    tf.train.Example(
                        features=tf.train.Features(feature={"id": feature})
                    ).SerializeToString()
                )
    return sorted(str(p) for p in folder.glob("*.tfrecord"))


def _records(files, batch=BATCH):
    def parse(record):
        return tf.io.parse_single_example(record, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"]

    ds = tf.data.Dataset.from_tensor_slices(files)
    return ds.interleave(tf.data.TFRecordDataset, cycle_length=1).map(parse).batch(batch)


def test_tf_data_pads_the_last_batch(strategy):
    ds = tf.data.Dataset.from_tensor_slices(np.arange(100, dtype=np.int32)).batch(16)
    dist = strategy.distribute_dataset(ds, spmd.InputOptions(remainder="pad"))
    seen = np.concatenate([np.asarray(b)[np.asarray(m) > 0] for b, m in dist])
    assert seen.tolist() == list(range(100))
    assert dist.auto_shard_policy is spmd.AutoShardPolicy.DATA


def test_tf_data_file_policy_reads_the_files_in_order(strategy, tfrecords):
    dist = strategy.distribute_dataset(
        _records(tfrecords), spmd.InputOptions(auto_shard_policy="FILE")
    )
    assert _ids(dist) == [list(range(i, i + BATCH)) for i in range(0, N, BATCH)]
    assert dist.auto_shard_policy is spmd.AutoShardPolicy.FILE


def test_tf_data_auto_follows_the_datasets_own_policy(strategy, tfrecords):
    ds = _records(tfrecords).with_options(_tf_options("FILE"))
    assert strategy.distribute_dataset(ds).auto_shard_policy is spmd.AutoShardPolicy.FILE
    ds = _records(tfrecords).with_options(_tf_options("OFF"))
    assert strategy.distribute_dataset(ds).auto_shard_policy is spmd.AutoShardPolicy.OFF


def test_tf_data_policies_that_disagree_are_an_error(strategy, tfrecords):
    ds = _records(tfrecords).with_options(_tf_options("FILE"))
    with pytest.raises(spmd.ConfigurationError, match="dataset_auto_shard_policy='FILE'"):
        strategy.distribute_dataset(ds, spmd.InputOptions(auto_shard_policy="DATA"))
    with pytest.raises(spmd.ConfigurationError, match="HINT"):
        strategy.distribute_dataset(_records(tfrecords).with_options(_tf_options("HINT")))


def test_tf_data_file_without_files_is_an_error():
    ds = tf.data.Dataset.range(64).batch(16)
    two_pipelines = spmd.InputContext(2, 0, 8)  # what process 0 of 2 sees
    with pytest.raises(spmd.ConfigurationError, match="reads files"):
        plan_tf(ds, two_pipelines, spmd.InputOptions(auto_shard_policy="FILE"))


@pytest.mark.parametrize("pipeline", [0, 1])
def test_tf_data_file_with_fewer_files_than_pipelines_is_an_error(tfrecords, pipeline):
    # TF itself fails pipeline 0 when it reads, and gives pipeline 1 no data at all.
    with pytest.raises(spmd.ConfigurationError, match="at least one per input pipeline"):
        plan_tf(
            _records(tfrecords[:1]),
            spmd.InputContext(2, pipeline, 8),
            spmd.InputOptions(auto_shard_policy="FILE"),
        )


def test_tf_data_file_without_a_final_batch_is_an_error(strategy, tfrecords):
    unbatched = _records(tfrecords).unbatch()
    with pytest.raises(spmd.BatchError, match="batch"):
        strategy.distribute_dataset(unbatched, spmd.InputOptions(auto_shard_policy="FILE"))


# -- the saved position holds every pipeline's grain state ------------------------------------


def _votes(monkeypatch, votes):
    from spmd._src.checkpoint import guard as checkpoint_guard

    monkeypatch.setattr(checkpoint_guard, "agree", lambda what, value, timeout: votes)
    return checkpoint_guard.every_pipeline


def test_saved_position_gathers_every_pipelines_grain_state(monkeypatch):
    every_pipeline = _votes(
        monkeypatch,
        {0: {"0": {"next_index": 2}}, 1: {"1": {"next_index": 2}}, 2: {"1": {"next_index": 2}}},
    )
    position = every_pipeline({"epoch": 0, "batch": 2, "per_pipeline": {"0": {}}}, 1.0)
    assert position["per_pipeline"] == {"0": {"next_index": 2}, "1": {"next_index": 2}}
    assert (
        every_pipeline({"epoch": 0, "batch": 0, "per_pipeline": None}, 1.0)["per_pipeline"] is None
    )


def test_processes_of_one_pipeline_at_different_grain_states_is_an_error(monkeypatch):
    every_pipeline = _votes(monkeypatch, {0: {"0": {"next_index": 2}}, 1: {"0": {"next_index": 3}}})
    with pytest.raises(spmd.CheckpointError, match="same source position"):
        every_pipeline({"epoch": 0, "batch": 2, "per_pipeline": {"0": {}}}, 1.0)


def _shuffled_tfrecords(directory):
    for f in range(2):
        with tf.io.TFRecordWriter(f"{directory}/t-{f}.tfrecord") as writer:
            for i in range(16):
                writer.write(tf.io.serialize_tensor(tf.constant(f * 16 + i, tf.int64)).numpy())
    files = tf.data.Dataset.list_files(f"{directory}/t-*.tfrecord", shuffle=False)
    ds = files.interleave(tf.data.TFRecordDataset, cycle_length=1)
    ds = ds.map(lambda s: tf.io.parse_tensor(s, tf.int64)).shuffle(32, seed=1).batch(8)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
    return ds.with_options(options)


def test_tf_file_sharded_reshuffling_pipeline_resumes_a_later_pass_at_the_exact_record(
    strategy, tmp_path
):
    dist = strategy.distribute_dataset(_shuffled_tfrecords(tmp_path))
    epoch0 = _ids(dist)
    iterator = iter(dist)
    first = _ids(iterator, 2)
    state = iterator.get_state()
    rest = _ids(iterator)
    assert sorted(sum(first + rest, [])) == list(range(32)) and first + rest != epoch0
    resumed = strategy.distribute_dataset(_shuffled_tfrecords(tmp_path))
    resumed.set_state(state)
    assert _ids(resumed) == rest


def test_reshuffling_tf_pass_read_again_in_the_same_dataset_is_a_configuration_error(strategy):
    dist = strategy.distribute_dataset(tf.data.Dataset.range(32).shuffle(32, seed=1).batch(8))
    iterator = iter(dist)
    _ids(iterator, 2)
    state = iterator.get_state()
    _ids(iterator)
    _ids(dist)  # pass 1
    dist.set_state(state)  # back to pass 0, whose order tf.data cannot give again
    with pytest.raises(spmd.ConfigurationError, match="reshuffle_each_iteration"):
        _ids(dist)
