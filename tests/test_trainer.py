"""Trainer: the same trajectory as a plain one-device NNX loop, exact evaluate/predict, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import MLP, labelled, nnx_update, xent

import spmd
from spmd.testing import assert_trees_allclose

N, FEATURES, CLASSES, BATCH = 1001, 6, 3, 64


@nnx.jit(static_argnums=0)
def _mlp(seed):
    """The MLP, its initializers compiled as one program (not one per operation, ~0.6 s
    of CPU less the first time); the same weights, bit for bit, as built eagerly."""
    return MLP(nnx.Rngs(seed), features=FEATURES, hidden=32, outputs=CLASSES)


def _trainer(tx, seed=0, strategy=None, **options):
    """The MLP fit with sparse categorical cross-entropy, on MirroredStrategy by default."""
    strategy = strategy or spmd.MirroredStrategy()
    return spmd.Trainer(
        _mlp(seed), tx, "sparse_categorical_crossentropy", strategy=strategy, **options
    )


@pytest.fixture(scope="module")
def data():
    return labelled(N, FEATURES, CLASSES)


def plain_loop(x, y, epochs, tx):
    """The oracle: one device, plain nnx.jit, batches in order, the last partial one trained
    on (its loss a mean over its rows); an epoch's loss the mean over its examples (Keras')."""
    model = _mlp(0)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, xb, yb):
        return nnx_update(model, optimizer, xent, xb, yb)

    losses = []
    for _ in range(epochs):
        epoch = [
            float(step(model, optimizer, x[i : i + BATCH], y[i : i + BATCH]))
            * len(y[i : i + BATCH])
            for i in range(0, N, BATCH)
        ]
        losses.append(sum(epoch) / N)
    return model, losses


@pytest.fixture(scope="module")
def adam_oracle(data):
    """Two epochs of Adam in the plain loop: every strategy and option below must follow it."""
    return plain_loop(*data, epochs=2, tx=optax.adam(1e-2))


@pytest.mark.parametrize(
    "strategy, options",
    [
        (spmd.MirroredStrategy, {}),
        (lambda: spmd.ParameterServerStrategy(spmd.partitioners.FixedShardsPartitioner(4)), {}),
        (spmd.MirroredStrategy, {"steps_per_execution": 4}),
        (spmd.MirroredStrategy, {"grad_accum_steps": 2}),
        (spmd.CentralStorageStrategy, {}),
    ],
)
def test_fit_follows_the_one_device_trajectory(data, adam_oracle, strategy, options):
    x, y = data
    oracle, oracle_losses = adam_oracle
    trainer = _trainer(optax.adam(1e-2), strategy=strategy(), **options)
    history = trainer.fit((x, y), batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], oracle_losses, rtol=1e-5)
    assert_trees_allclose(
        nnx.state(trainer.model, nnx.Param), nnx.state(oracle, nnx.Param), rtol=1e-4, atol=1e-5
    )


@pytest.mark.slow
def test_evaluate_and_predict_are_exact_over_every_example(data):
    x, y = data
    trainer = _trainer(optax.sgd(0.1), seed=1, metrics=("accuracy",))
    trainer.fit((x, y), batch_size=BATCH, epochs=1, verbose=0)
    predictions = trainer.predict(x, batch_size=BATCH)
    assert predictions.shape == (N, CLASSES)
    logits = np.asarray(
        trainer.model(jnp.asarray(x))
    )  # the same model, one call, every row in order
    np.testing.assert_allclose(predictions, logits, rtol=1e-5, atol=1e-5)
    per_example = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, y))
    result = trainer.evaluate((x, y), batch_size=BATCH)
    assert result["loss"] == pytest.approx(per_example.mean(), rel=1e-5)
    assert result["accuracy"] == pytest.approx((logits.argmax(-1) == y).mean(), abs=1e-9)


@pytest.mark.slow
def test_history_and_validation_metrics(data):
    x, y = data
    trainer = _trainer(optax.adam(1e-2), metrics=("accuracy",))
    history = trainer.fit(
        (x, y), batch_size=BATCH, epochs=2, validation_data=(x[:300], y[:300]), verbose=0
    )
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert history.epoch == [0, 1] and len(history.history["val_accuracy"]) == 2
    assert history.history["loss"][1] < history.history["loss"][0]


@pytest.mark.slow
def test_init_apply_pair_and_other_losses():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)

    def init(key):
        return {"w": jax.random.normal(key, (3, 1)) * 0.1}

    def apply(params, x):
        return x @ params["w"]

    trainer = spmd.Trainer(
        (init, apply), optax.sgd(0.1), "mse", metrics=("mae",), strategy=spmd.MirroredStrategy()
    )
    history = trainer.fit((x, y), batch_size=32, epochs=20, verbose=0)
    assert history.history["loss"][-1] < 1e-3
    np.testing.assert_allclose(np.asarray(trainer.model["w"]).ravel(), [1.0, -2.0, 0.5], atol=0.05)


@pytest.mark.slow
def test_early_stopping_stops_and_restores_best(data):
    x, y = data

    class Worse(spmd.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["val_loss"] = float(epoch)  # gets worse every epoch

    stop = spmd.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True)
    trainer = _trainer(optax.adam(1e-2))
    history = trainer.fit((x, y), batch_size=BATCH, epochs=10, callbacks=[Worse(), stop], verbose=0)
    assert history.epoch == [0, 1] and stop.stopped_epoch == 1
    best = stop.best_state["params"]["out"]["bias"]  # the weights of epoch 0, the best one
    np.testing.assert_array_equal(
        np.asarray(jax.device_get(trainer.state["params"]["out"]["bias"])), np.asarray(best)
    )


@pytest.mark.parametrize(
    "make, fragment",
    [
        (
            lambda x, y: spmd.Trainer(_mlp(0), optax.sgd(0.1), "cross_entropy"),
            "loss='cross_entropy'",
        ),
        (
            lambda x, y: spmd.Trainer(_mlp(0), optax.sgd(0.1), "mse", metrics=("f1",)),
            "metric='f1'",
        ),
        (
            lambda x, y: spmd.Trainer(_mlp(0), optax.sgd(0.1), "mse", steps_per_execution=0),
            "steps_per_execution=0",
        ),
        (lambda x, y: spmd.Trainer(object(), optax.sgd(0.1), "mse"), "model='object'"),
    ],
)
def test_bad_configuration_teaches(data, make, fragment):
    with pytest.raises(spmd.ConfigurationError) as info:
        make(*data)
    assert fragment in str(info.value) and "To fix:" in str(info.value)


@pytest.mark.cpu_mesh
def test_bad_data_teaches(data):
    x, y = data
    trainer = _trainer(optax.sgd(0.1))
    with pytest.raises(spmd.BatchError, match="needs batch_size"):
        trainer.fit((x, y), epochs=1, verbose=0)
    with pytest.raises(spmd.BatchError, match=r"integer class ids of shape \(64,\)"):
        trainer.fit((x, np.eye(CLASSES, dtype=np.float32)[y]), batch_size=BATCH, verbose=0)


@pytest.mark.slow
def test_predict_and_evaluate_on_an_iterable_of_xy_batches_keep_every_row(data):
    """The padding mask is known by type: an (x, y) batch's y is never taken for a mask."""
    x, y = data[0][:100], data[1][:100]
    trainer = _trainer(optax.sgd(0.1), seed=1, metrics=("accuracy",))
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 96, 32)]
    predictions = trainer.predict(batches)
    logits = np.asarray(trainer.model(jnp.asarray(x)))
    assert predictions.shape == (96, CLASSES)
    np.testing.assert_allclose(predictions, logits[:96], rtol=1e-5, atol=1e-5)
    ragged = [*batches, (x[96:], y[96:])]  # a last partial batch is padded, not dropped
    np.testing.assert_allclose(trainer.predict(ragged), logits, rtol=1e-5, atol=1e-5)
    per_example = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, y))
    result = trainer.evaluate(ragged)
    assert result["loss"] == pytest.approx(per_example.mean(), rel=1e-5)
    assert result["accuracy"] == pytest.approx((logits.argmax(-1) == y).mean(), abs=1e-9)


def test_padded_batch_is_a_tuple_and_a_pytree():
    strategy = spmd.MirroredStrategy()
    ds = strategy.make_numpy_dataset((np.arange(20.0), np.arange(20)), 8, drop_remainder=False)
    batches = list(strategy.distribute_dataset(ds))
    assert all(isinstance(b, spmd.PaddedBatch) for b in batches)
    xb, yb, mask = batches[-1]
    assert batches[-1].mask is mask and len(batches[-1].inputs) == 2
    np.testing.assert_array_equal(np.asarray(mask), [1, 1, 1, 1, 0, 0, 0, 0])
    doubled = jax.tree.map(lambda a: a * 2, batches[0])
    assert isinstance(doubled, spmd.PaddedBatch)
    np.testing.assert_array_equal(np.asarray(doubled.inputs[0]), np.arange(8.0) * 2)
