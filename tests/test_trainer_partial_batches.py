"""A smaller batch anywhere in the data is trained on, evaluated and predicted as Keras does.

Each number is checked against the one-device oracle: the same model trained by a
plain jax/optax loop on exactly the same batches, the short ones included, each
batch's loss the mean over its real rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorflow as tf
from flax import nnx
from models import MLP, labelled

import spmd
from spmd.partitioners import FixedShardsPartitioner

LR, EXAMPLES, BATCH = 0.1, 40, 16
STRATEGIES = {
    "mirrored": spmd.MirroredStrategy,
    "parameter_server": lambda: spmd.ParameterServerStrategy(
        variable_partitioner=FixedShardsPartitioner(2)
    ),
}


def _trainer(strategy=None):
    return spmd.Trainer(
        MLP(nnx.Rngs(0)),
        optax.sgd(LR),
        "sparse_categorical_crossentropy",
        metrics=("accuracy",),
        strategy=strategy or spmd.MirroredStrategy(),
    )


def _sce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def oracle(batches):
    """One device: SGD on each batch's sum(loss x weight) / its rows; the trained params."""
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    opt = optax.sgd(LR)
    opt_state = opt.init(params)

    def loss_fn(params, x, y, w):
        per = _sce(nnx.merge(graphdef, params)(x), y)
        return jnp.sum(per * w) / per.shape[0]

    for batch in batches:
        x, y = jnp.asarray(batch[0]), jnp.asarray(batch[1])
        w = jnp.asarray(batch[2]) if len(batch) > 2 else jnp.ones(len(y))
        grads = jax.grad(loss_fn)(params, x, y, w)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return nnx.merge(graphdef, params)


def assert_same_params(trainer, model):
    got = jax.device_get(nnx.state(trainer.model, nnx.Param))
    want = jax.device_get(nnx.state(model, nnx.Param))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), got, want)


def _cut(x, y, sizes):
    """Consecutive batches of `sizes` rows of (x, y)."""
    ends = np.cumsum(sizes)
    return [(x[e - s : e], y[e - s : e]) for s, e in zip(sizes, ends, strict=True)]


def _fit(kind, trainer, x, y):
    """Fits `trainer` on one of the streams a Keras user passes; returns the batches it
    trained on, in order (the oracle's input)."""
    if kind == "list_last_short":
        batches = _cut(x, y, [16, 16, 8])
        trainer.fit(batches, verbose=0)
        return batches
    if kind == "generator_mid_stream_short":
        batches = _cut(x, y, [16, 8, 16])
        trainer.fit((b for b in batches), verbose=0)
        return batches
    # tf.data's .batch(16).repeat() over 40 rows: 16, 16, 8, 16, 16, 8, ... an endless
    # stream whose short batch comes mid-stream; two epochs of 4 steps read 8 batches
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
    trainer.fit(ds, steps_per_epoch=4, epochs=2, verbose=0)
    return _cut(x, y, [16, 16, 8]) * 2 + _cut(x, y, [16, 16])


@pytest.mark.slow  # 4 s of CPU each
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize(
    "kind", ["list_last_short", "generator_mid_stream_short", "tf_data_repeat"]
)
def test_fit_trains_on_a_smaller_batch_anywhere_as_one_device_does(kind, strategy):
    x, y = labelled(EXAMPLES)
    trainer = _trainer(STRATEGIES[strategy]())
    batches = _fit(kind, trainer, x, y)
    assert trainer.iterations == len(batches)
    assert_same_params(trainer, oracle(batches))


@pytest.mark.parametrize("sizes", [[16, 8, 16], [16, 16, 8], [16, 4, 8, 16]])
def test_pad_if_partial_pads_a_smaller_batch_anywhere_and_masks_only_it(sizes):
    x = np.arange(sum(sizes), dtype=np.float32)[:, None]
    batches = [x[e - s : e] for s, e in zip(sizes, np.cumsum(sizes), strict=True)]
    options = spmd.InputOptions(remainder="pad_if_partial")
    out = list(spmd.MirroredStrategy().distribute_dataset([(b,) for b in batches], options))
    for batch, rows in zip(out, sizes, strict=True):
        assert np.shape(batch[0]) == (16, 1)  # the first batch's shape: one program
        if rows == 16:
            assert len(batch) == 1  # a whole batch carries no mask
            continue
        x_padded, mask = np.asarray(batch[0]), np.asarray(batch[1])
        assert mask.tolist() == [1.0] * rows + [0.0] * (16 - rows)
        assert (x_padded[rows:] == x_padded[rows - 1]).all()  # its last real row repeated


def test_a_batch_larger_than_the_first_is_still_an_error_under_pad_if_partial():
    batches = [(np.ones((8, 1), np.float32),), (np.ones((16, 1), np.float32),)]
    options = spmd.InputOptions(remainder="pad_if_partial")
    with pytest.raises(spmd.BatchError, match="batch_size=16, first_batch_size=8") as error:
        list(spmd.MirroredStrategy().distribute_dataset(batches, options))
    assert "at most as large as the first" in str(error.value)
    assert "put a largest batch first" in str(error.value)


@pytest.mark.slow  # 3 s of CPU
def test_a_smaller_batch_of_any_size_compiles_no_program_of_its_own():
    x, y = labelled(EXAMPLES)
    trainer = _trainer()
    batches = _cut(x, y, [16, 8, 16]) + [(x[:4], y[:4])]  # short batches of 8 and 4 rows
    trainer.fit(batches, verbose=0)
    # one program for whole batches, one for padded ones (their mask is an argument)
    assert trainer._step("train").cache_size() == 2
    assert_same_params(trainer, oracle(batches))


@pytest.mark.slow  # 3 s of CPU
def test_evaluate_and_predict_count_only_the_real_rows_of_a_short_batch():
    x, y = labelled(EXAMPLES, seed=1)
    trainer = _trainer()
    trainer.fit((x, y), batch_size=BATCH, verbose=0)
    model = trainer.model
    logits = np.asarray(model(jnp.asarray(x)))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)  # 16, 16, 8
    logs = trainer.evaluate(ds)
    np.testing.assert_allclose(logs["loss"], np.mean(_sce(logits, y)), rtol=1e-5)
    assert logs["accuracy"] == pytest.approx(np.mean(np.argmax(logits, -1) == y))
    out = trainer.predict(tf.data.Dataset.from_tensor_slices(x).batch(BATCH))
    assert out.shape == (EXAMPLES, 3)
    np.testing.assert_allclose(out, logits, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 4 s of CPU
@pytest.mark.parametrize("source", ["arrays", "tf_data"])
def test_class_weight_is_keras_per_class_sample_weight(source):
    x, y = labelled(EXAMPLES, seed=2)
    class_weight = {0: 0.5, 1: 2.0, 2: 3.0}
    w = np.asarray([class_weight[int(c)] for c in y], np.float32) * np.linspace(0.5, 1.5, EXAMPLES)
    trainer = _trainer()
    if source == "arrays":
        trainer.fit(
            (x, y, np.linspace(0.5, 1.5, EXAMPLES).astype(np.float32)),
            batch_size=BATCH,
            shuffle=False,
            class_weight=class_weight,
            verbose=0,
        )
    else:
        ds = tf.data.Dataset.from_tensor_slices(
            (x, y, np.linspace(0.5, 1.5, EXAMPLES).astype(np.float32))
        ).batch(BATCH)
        trainer.fit(ds, class_weight=class_weight, verbose=0)
    batches = [(x[i : i + BATCH], y[i : i + BATCH], w[i : i + BATCH]) for i in (0, 16, 32)]
    assert_same_params(trainer, oracle(batches))


@pytest.mark.slow  # 2 s of CPU
def test_a_sample_weight_column_of_shape_batch_by_one_weighs_as_a_vector():
    x, y = labelled(BATCH, seed=3)
    w = np.linspace(0.0, 2.0, BATCH).astype(np.float32)
    trainer = _trainer()
    trainer.fit([(x, y, w[:, None])], verbose=0)
    assert_same_params(trainer, oracle([(x, y, w)]))


@pytest.mark.slow  # 4 s of CPU
def test_steps_per_execution_runs_a_short_batch_among_whole_ones_as_one_device_does():
    x, y = labelled(EXAMPLES + 16)
    batches = _cut(x, y, [16, 8, 16, 16])  # K=2: (16, 8) mixes a padded batch with a whole one
    trainer = spmd.Trainer(
        MLP(nnx.Rngs(0)),
        optax.sgd(LR),
        "sparse_categorical_crossentropy",
        strategy=spmd.MirroredStrategy(),
        steps_per_execution=2,
    )
    trainer.fit(batches, verbose=0)
    assert trainer.iterations == 4
    assert_same_params(trainer, oracle(batches))
