"""grain and tf.data pipelines as programs write them: one device's numbers, or a clear error.

MaxText-style grain pipelines (MapDataset.source().shuffle(seed).map().batch(),
to_iter_dataset, a DataLoader with an IndexSampler) and the tf.distribute
"Distributed input" guide's pipelines (repeat, steps_per_epoch, dataset
functions), checked against one-device oracles; then bad input and resumes,
each the exact record or a clear error. The loaders' own options (sharding,
file policies, saved positions): tests/test_loaders.py. Over 2 processes:
tests/multiprocess/test_loaders.py; resumed after a crash:
tests/multiprocess/test_loader_resume_mid_epoch.py.
"""

import itertools
import json

import grain
import jax
import numpy as np
import optax
import pytest
import tensorflow as tf
from flax import nnx

import spmd
from spmd._src.checkpoint.integrity import Damaged

N, BATCH, FEATURES = 96, 16, 4


@pytest.fixture(scope="module")
def strategy():
    return spmd.MirroredStrategy()


@pytest.fixture(scope="module")
def data():
    x = np.random.default_rng(0).normal(size=(N, FEATURES)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def _ids(dist_or_iterator, limit=None):
    return [np.asarray(b).tolist() for b in itertools.islice(dist_or_iterator, limit)]


def _json(state):
    return json.loads(json.dumps(state))


def _grain(seed=7, batch=BATCH):
    return grain.MapDataset.source(np.arange(N, dtype=np.int32)).shuffle(seed=seed).batch(batch)


def _range(loader, n):
    """0, 1, ..., n - 1 in batches of BATCH: a tf.data or a grain dataset."""
    if loader == "tf":
        return tf.data.Dataset.range(n).batch(BATCH)
    return grain.MapDataset.source(np.arange(n)).batch(BATCH)


class Linear(nnx.Module):
    def __init__(self, rngs):
        self.layer = nnx.Linear(FEATURES, 2, rngs=rngs)

    def __call__(self, x):
        return self.layer(x)


def _oracle(data, batches):
    """One device, plain nnx.jit SGD over the given index batches, in order."""
    x, y = data
    model = Linear(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, xb, yb):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(xb), yb).mean()

        optimizer.update(model, nnx.grad(loss_fn)(model))

    for index in batches:
        step(model, optimizer, x[index], y[index])
    return np.asarray(model.layer.kernel[...])


def _trainer(strategy):
    return spmd.Trainer(
        Linear(nnx.Rngs(0)), optax.sgd(0.1), "sparse_categorical_crossentropy", strategy=strategy
    )


def _kernel(trainer):
    return np.asarray(trainer.model.layer.kernel[...])


def _in_order(steps):
    return [np.arange(i * BATCH % N, i * BATCH % N + BATCH) for i in range(steps)]


# -- the programs give the one-device numbers --------------------------------------------------


@pytest.mark.slow
def test_maxtext_style_grain_pipeline_fits_like_one_device(strategy, data):
    x, y = data
    shuffled = grain.MapDataset.source(np.arange(N)).shuffle(seed=3)
    order = [np.asarray(b) for b in shuffled.batch(BATCH)]
    ds = shuffled.map(lambda i: (x[i], y[i])).batch(BATCH)
    trainer = _trainer(strategy)
    trainer.fit(ds, epochs=2, verbose=0)
    np.testing.assert_allclose(_kernel(trainer), _oracle(data, order * 2), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tf_data_dataset_fits_like_one_device(strategy, data):
    # fit(tf.data.Dataset) read the first batch as tf tensors and raised TypeError
    # ("Cannot interpret 'tf.float32' as a data type"); fixed in trainer/data.py host_first.
    trainer = _trainer(strategy)
    trainer.fit(tf.data.Dataset.from_tensor_slices(data).batch(BATCH), epochs=2, verbose=0)
    want = _oracle(data, _in_order(N // BATCH) * 2)
    np.testing.assert_allclose(_kernel(trainer), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["tf", "grain"])
def test_infinite_dataset_with_steps_per_epoch_goes_on_across_epochs(strategy, data, loader):
    if loader == "tf":
        ds = tf.data.Dataset.from_tensor_slices(data).batch(BATCH).repeat()
    else:
        ds = grain.MapDataset.source(list(zip(*data, strict=True))).repeat().batch(BATCH)
    trainer = _trainer(strategy)
    trainer.fit(ds, epochs=3, steps_per_epoch=4, verbose=0)  # 12 batches: 6 per pass, 2 passes
    np.testing.assert_allclose(_kernel(trainer), _oracle(data, _in_order(12)), rtol=1e-5, atol=1e-6)


def test_grain_iter_dataset_resumes_at_the_exact_batch(strategy):
    def make():
        source = grain.MapDataset.source(np.arange(64, dtype=np.int32)).shuffle(seed=3)
        return source.to_iter_dataset().batch(BATCH)

    iterator = iter(strategy.distribute_dataset(make()))
    first = _ids(iterator, 2)
    state = _json(iterator.get_state())
    rest = _ids(iterator)
    resumed = iter(strategy.distribute_dataset(make()))
    resumed.set_state(state)
    assert _ids(resumed) == rest and len(first + rest) == 4
    assert sorted(sum(first + rest, [])) == list(range(64))


def test_tf_dataset_function_batched_per_pipeline_sees_every_example_once(strategy):
    def dataset_fn(ctx):
        ds = tf.data.Dataset.range(N).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        return ds.batch(ctx.get_per_pipeline_batch_size(BATCH))

    seen = _ids(strategy.distribute_datasets_from_function(dataset_fn))
    assert seen == [list(range(i, i + BATCH)) for i in range(0, N, BATCH)]


def test_tf_data_elements_keep_their_shapes_and_jax_dtypes(strategy):
    ds = tf.data.Dataset.from_tensor_slices(
        {"image": np.zeros((N, 3, 2), np.float64), "label": np.arange(N)}
    ).batch(BATCH)
    first = next(iter(strategy.distribute_dataset(ds)))
    assert first["image"].shape == (BATCH, 3, 2) and first["image"].dtype == np.float32
    assert first["label"].dtype == np.int32  # 64-bit mode off: what jax.numpy gives too
    assert first["image"].sharding == strategy.batch_sharding(3)


# -- bad input: a clear error -------------------------------------------------------------------


def test_grain_batch_not_divisible_by_the_replicas_is_a_batch_error(strategy):
    ds = grain.MapDataset.source(np.arange(48)).batch(12)
    with pytest.raises(spmd.BatchError, match="split evenly over the 8 replicas"):
        _ids(strategy.distribute_dataset(ds))


@pytest.mark.parametrize("loader", ["tf", "grain"])
def test_ragged_last_batch_is_a_batch_error_that_says_drop_or_pad(strategy, loader):
    ds = _range(loader, 20)
    with pytest.raises(spmd.BatchError, match="remainder='drop'.*remainder='pad'"):
        _ids(strategy.distribute_dataset(ds))


def test_tf_dataset_function_batched_by_a_size_no_replica_split_is_an_error(strategy):
    def dataset_fn(ctx):  # tf.distribute's idiom, with a global batch of 16 over 8 replicas
        return tf.data.Dataset.range(N).batch(ctx.get_per_replica_batch_size(BATCH))

    with pytest.raises(spmd.BatchError, match="get_per_pipeline_batch_size"):
        _ids(strategy.distribute_datasets_from_function(dataset_fn))


def test_grain_data_loader_restored_with_another_seed_is_an_error(strategy):
    def loader(seed):
        sampler = grain.samplers.IndexSampler(
            N,
            shard_options=spmd.grain_shard_options(strategy),
            shuffle=True,
            num_epochs=1,
            seed=seed,
        )
        return grain.DataLoader(
            data_source=np.arange(N, dtype=np.int32),
            sampler=sampler,
            operations=[grain.transforms.Batch(BATCH)],
            worker_count=0,
        )

    iterator = iter(strategy.distribute_dataset(loader(3)))
    _ids(iterator, 2)
    resumed = iter(strategy.distribute_dataset(loader(4)))
    resumed.set_state(_json(iterator.get_state()))
    with pytest.raises(ValueError, match="seed=4"):  # grain's own check of its sampler
        _ids(resumed)


# -- more bad input, and resumes: the exact record or a clear error ---------------------------


def test_grain_pipeline_without_a_final_batch_says_to_batch(strategy):
    unbatched = grain.MapDataset.source(np.arange(N)).map(lambda i: i * 2)
    with pytest.raises(spmd.BatchError, match=r"\.batch\(") as caught:
        _ids(strategy.distribute_dataset(unbatched))
    assert "leading_sizes=[]" not in str(caught.value)


@pytest.mark.parametrize("loader", ["tf", "grain"])
def test_empty_dataset_is_a_batch_error(strategy, loader):
    ds = _range(loader, 0)
    with pytest.raises(spmd.BatchError, match="no batch|0 batches|empty"):
        _ids(strategy.distribute_dataset(ds))


@pytest.mark.parametrize("loader", ["tf", "grain"])
def test_string_leaf_is_a_batch_error_naming_the_leaf(strategy, loader):
    if loader == "tf":
        names = [f"r{i}" for i in range(N)]
        ds = tf.data.Dataset.from_tensor_slices(
            {"x": np.arange(N, dtype=np.float32), "name": names}
        ).batch(BATCH)
    else:
        records = [{"x": np.float32(i), "name": f"r{i}"} for i in range(N)]
        ds = grain.MapDataset.source(records).batch(BATCH)
    with pytest.raises(spmd.BatchError, match="name") as caught:
        _ids(strategy.distribute_dataset(ds))
    assert "str" in str(caught.value) or "object" in str(caught.value)


def test_grain_position_restored_into_another_seed_is_a_configuration_error(strategy):
    iterator = iter(strategy.distribute_dataset(_grain(seed=7)))
    _ids(iterator, 2)
    state = _json(iterator.get_state())
    other = iter(strategy.distribute_dataset(_grain(seed=8)))
    with pytest.raises(spmd.ConfigurationError, match="seed|other data|same data"):
        other.set_state(state)
        _ids(other, 1)


@pytest.mark.parametrize("loader", ["tf", "grain"])
def test_restore_with_another_global_batch_size_is_a_configuration_error(strategy, loader):
    def make(batch):
        return tf.data.Dataset.range(N).batch(batch) if loader == "tf" else _grain(7, batch)

    iterator = iter(strategy.distribute_dataset(make(BATCH)))
    _ids(iterator, 2)
    state = _json(iterator.get_state())
    bigger = iter(strategy.distribute_dataset(make(2 * BATCH)))
    with pytest.raises(spmd.ConfigurationError, match="global_batch_size"):
        bigger.set_state(state)
        _ids(bigger, 1)


def test_tf_shuffle_resumed_in_a_later_epoch_continues_at_the_exact_record(strategy):
    def make():
        return tf.data.Dataset.range(32).shuffle(32, seed=1).batch(8)  # reshuffle_each_iteration

    dist = strategy.distribute_dataset(make())
    _ids(dist)  # epoch 0
    iterator = iter(dist)
    first = _ids(iterator, 2)  # epoch 1, 2 batches
    state = _json(iterator.get_state())
    rest = _ids(iterator)
    restarted = strategy.distribute_dataset(make())  # a new process after a crash
    try:
        restarted.set_state(state)
        resumed = _ids(restarted)
    except spmd.ConfigurationError as e:  # or say it cannot, and why
        assert "reshuffle_each_iteration" in str(e)
        return
    assert resumed == rest
    assert sorted(sum(first + resumed, [])) == list(range(32))


class _StopAfter(spmd.callbacks.Callback):
    def __init__(self, batches):
        self.batches, self.seen = batches, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen >= self.batches:
            raise RuntimeError(f"still in epoch 0 after {self.seen} batches")


def test_fit_on_an_infinite_tf_dataset_without_steps_per_epoch_is_an_error(strategy, data):
    ds = tf.data.Dataset.from_tensor_slices(data).batch(BATCH).repeat()
    trainer = _trainer(strategy)
    with pytest.raises(spmd.ConfigurationError, match="steps_per_epoch"):
        trainer.fit(ds, epochs=1, verbose=0, callbacks=[_StopAfter(20)])


def test_tf_dataset_function_batched_per_replica_is_an_error(strategy):
    def dataset_fn(ctx):  # tf.distribute's idiom: a global batch of 64, 8 per replica
        return tf.data.Dataset.range(N * 8).batch(ctx.get_per_replica_batch_size(64))

    with pytest.raises((spmd.BatchError, spmd.ConfigurationError), match="get_per_pipeline_batch"):
        _ids(strategy.distribute_datasets_from_function(dataset_fn), 1)


def test_float64_state_with_64_bit_mode_off_is_restored_or_refused_never_damaged(tmp_path):
    assert not jax.config.jax_enable_x64
    state = {"w": np.arange(4, dtype=np.float64) / 3, "step": np.arange(3, dtype=np.int64)}
    try:
        with spmd.CheckpointManager(tmp_path / "ckpt") as ckpt:
            ckpt.save(1, state)
            ckpt.wait()
        with spmd.CheckpointManager(tmp_path / "ckpt") as ckpt:
            restored = ckpt.restore(1, target=state)
    except spmd.CheckpointError as e:  # refused: it says which dtype, and the 64-bit mode
        assert not isinstance(e, Damaged), str(e)
        assert "float64" in str(e) and "x64" in str(e)
        return
    assert restored["w"].dtype == np.float64  # or restored as saved, bit for bit
    np.testing.assert_array_equal(restored["w"], state["w"])
    np.testing.assert_array_equal(restored["step"], state["step"])
