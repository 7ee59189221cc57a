"""Trainer: losses and metrics per example, and every misuse of its data an error, not a guess."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import MLP, labelled

import spmd

FEATURES, CLASSES = 6, 3


class Seq(nnx.Module):
    """(batch, time, features) -> (batch, time, classes) logits."""

    def __init__(self, rngs: nnx.Rngs):
        self.out = nnx.Linear(FEATURES, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


def _data(n=128, seed=0):
    return labelled(n, FEATURES, CLASSES, seed)


def _trainer(model=None, loss="sparse_categorical_crossentropy", **kwargs):
    model = model or MLP(nnx.Rngs(0))
    return spmd.Trainer(model, optax.sgd(0.1), loss, strategy=spmd.MirroredStrategy(), **kwargs)


# -- default metrics, metrics that fit the loss, per-example reduction -----------------------


@pytest.mark.slow
def test_regression_with_two_outputs_trains_with_the_default_metrics():
    x, _ = _data()
    y = np.stack([x[:, 0] - x[:, 1], 2 * x[:, 2]], 1).astype(np.float32)
    trainer = _trainer(MLP(nnx.Rngs(0), outputs=2), "mse")
    history = trainer.fit((x, y), batch_size=16, epochs=2, verbose=0)
    assert set(history.history) == {"loss"}  # Keras' default: no metrics
    out = np.asarray(trainer.model(jnp.asarray(x)))
    result = trainer.evaluate((x, y), batch_size=16)
    assert result == {"loss": pytest.approx(np.mean((out - y) ** 2), rel=1e-5)}


@pytest.mark.parametrize(
    "loss, metric",
    [("mse", "accuracy"), ("mae", "accuracy"), ("sparse_categorical_crossentropy", "mae")],
)
def test_a_metric_that_does_not_fit_the_loss_names_both(loss, metric):
    with pytest.raises(spmd.ConfigurationError) as info:
        _trainer(loss=loss, metrics=(metric,))
    assert f"metric='{metric}'" in str(info.value) and f"loss='{loss}'" in str(info.value)


@pytest.mark.slow
def test_sequence_losses_and_metrics_are_means_over_every_non_batch_axis():
    """(batch, time, classes) logits: one loss value per example, the mean over its steps.

    With time == batch the per-step values would broadcast against the (batch,)
    weights without an error; the mean must still be the one-device mean.
    """
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 8, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(40, 8)).astype(np.int32)
    per_step = spmd.losses.Metric("per_step", lambda out, lab: (out.argmax(-1) == lab) * 1.0)
    trainer = _trainer(Seq(nnx.Rngs(0)), metrics=("accuracy", per_step))
    result = trainer.evaluate((x, y), batch_size=8)
    logits = np.asarray(trainer.model(jnp.asarray(x)))
    oracle = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    assert result["loss"] == pytest.approx(float(np.mean(oracle)), rel=1e-5)
    assert result["accuracy"] == pytest.approx(float(np.mean(logits.argmax(-1) == y)), abs=1e-7)
    assert result["per_step"] == pytest.approx(result["accuracy"], abs=1e-7)


def test_a_loss_that_returns_a_batch_mean_is_an_error():
    x, y = _data()
    trainer = _trainer(loss=lambda out, lab: jnp.mean((out[:, 0] - lab) ** 2))
    with pytest.raises(spmd.BatchError, match="one value per example"):
        trainer.fit((x, y.astype(np.float32)), batch_size=16, verbose=0)


def test_a_metric_that_fails_on_the_shapes_names_the_metric_and_the_loss():
    x, y = _data()
    bad = spmd.losses.Metric("bad", lambda out, lab: out @ lab)
    trainer = _trainer(metrics=(bad,))
    with pytest.raises(spmd.BatchError) as info:
        trainer.fit((x, y), batch_size=16, verbose=0)
    assert "metric 'bad'" in str(info.value)
    assert "'sparse_categorical_crossentropy'" in str(info.value)


def test_accuracy_with_a_loss_of_your_own_follows_the_label_shapes():
    x, y = _data()

    def my_ce(out, lab):
        return optax.softmax_cross_entropy_with_integer_labels(out, lab)

    trainer = _trainer(loss=my_ce, metrics=("accuracy",))
    result = trainer.evaluate((x, y), batch_size=16)
    logits = np.asarray(trainer.model(jnp.asarray(x)))
    assert result["accuracy"] == pytest.approx(float(np.mean(logits.argmax(-1) == y)))


# -- the Trainer's arguments: what a Keras user passes, an error naming spmd's --------------


@pytest.mark.parametrize(
    "name, equivalent",
    [
        ("adam", "optax.adam(0.001)"),
        ("SGD", "optax.sgd(0.01)"),
        ("rmsprop", "optax.rmsprop(0.001)"),
    ],
)
def test_a_keras_optimizer_name_is_an_error_naming_optax_s_equivalent(name, equivalent):
    with pytest.raises(spmd.ConfigurationError, match="optax GradientTransformation") as info:
        spmd.Trainer(MLP(nnx.Rngs(0)), name, "mse", strategy=spmd.MirroredStrategy())
    assert f"optimizer={name!r}" in str(info.value) and f"pass {equivalent}" in str(info.value)


@pytest.mark.parametrize("optimizer", ["adamx", None, 0.1])
def test_an_optimizer_without_init_and_update_is_an_error_at_construction(optimizer):
    with pytest.raises(spmd.ConfigurationError, match="optax GradientTransformation") as info:
        spmd.Trainer(MLP(nnx.Rngs(0)), optimizer, "mse", strategy=spmd.MirroredStrategy())
    assert "optax.adam(1e-3)" in str(info.value)


@pytest.mark.parametrize(
    "strategy, call",
    [
        ("mirrored", "spmd.MirroredStrategy()"),
        ("OneDeviceStrategy", "spmd.OneDeviceStrategy()"),
        (spmd.MirroredStrategy, "spmd.MirroredStrategy()"),  # the constructor, not called
        (8, "spmd.MirroredStrategy()"),
    ],
)
def test_a_strategy_name_or_constructor_is_an_error_naming_the_call_to_pass(strategy, call):
    with pytest.raises(spmd.ConfigurationError, match="runs on a spmd.Strategy") as info:
        spmd.Trainer(MLP(nnx.Rngs(0)), optax.sgd(0.1), "mse", strategy=strategy)
    assert f"pass a strategy, e.g. strategy={call}" in str(info.value)
    assert "or a spmd.DiLoCo" in str(info.value)  # a Trainer runs on either


# -- fit's arguments -------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [0, -1, 2.5, True])
def test_steps_per_epoch_must_be_positive(steps):
    x, y = _data()
    with pytest.raises(spmd.ConfigurationError, match=f"steps_per_epoch={steps!r}"):
        _trainer().fit((x, y), batch_size=16, steps_per_epoch=steps, verbose=0)


def test_a_dict_of_x_and_y_is_an_error_that_says_how():
    x, y = _data()
    with pytest.raises(spmd.ConfigurationError) as info:
        _trainer().fit({"x": x, "y": y}, batch_size=16, verbose=0)
    assert "dict with keys ['x', 'y']" in str(info.value) and '(d["x"], d["y"])' in str(info.value)


@pytest.mark.slow
def test_named_inputs_are_a_dict_as_x():
    class Named(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(4, CLASSES, rngs=rngs), nnx.Linear(2, CLASSES, rngs=rngs)

        def __call__(self, x):
            return self.a(x["a"]) + self.b(x["b"])

    x, y = _data()
    named = {"a": x[:, :4], "b": x[:, 4:]}
    trainer = _trainer(Named(nnx.Rngs(0)))
    trainer.fit((named, y), batch_size=16, epochs=1, shuffle=False, verbose=0)
    logits = np.asarray(trainer.model({k: jnp.asarray(v) for k, v in named.items()}))
    np.testing.assert_allclose(trainer.predict(named, batch_size=16), logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make, received",
    [
        (lambda x, y: (x, list(y)), "y='a list of 128 numbers'"),
        (
            lambda x, y: (x.tolist(), y.tolist()),
            "x='a list of 128 lists', y='a list of 128 numbers'",
        ),
        (lambda x, y: (x, tuple(y.tolist())), "y='a tuple of 128 numbers'"),
    ],
)
def test_python_lists_of_examples_are_an_error_saying_to_convert_them(make, received):
    """A list is read as an iterable of batches: a list of numbers is not guessed to be y."""
    x, y = _data()
    trainer = _trainer()
    with pytest.raises(spmd.ConfigurationError, match="read as an iterable of batches") as info:
        trainer.fit(make(x, y), batch_size=16, verbose=0)
    assert received in str(info.value) and "np.asarray(" in str(info.value)
    with pytest.raises(spmd.ConfigurationError, match="read as an iterable of batches"):
        trainer.evaluate(make(x, y), batch_size=16)
    assert trainer.iterations == 0


def test_predict_on_a_python_list_of_rows_is_an_error_saying_to_convert_it():
    x, _ = _data()
    with pytest.raises(spmd.ConfigurationError, match=r"predict\(np.asarray\(x\)") as info:
        _trainer().predict(x.tolist(), batch_size=16)
    assert "x='a list of 128 lists'" in str(info.value)


def test_inputs_the_first_layer_does_not_take_are_a_batch_error_naming_shape_and_layer():
    x, y = _data()
    trainer = _trainer()
    with pytest.raises(spmd.BatchError, match=r"x_shape=\(16, 5\)") as info:
        trainer.fit((x[:, :5], y), batch_size=16, verbose=0)
    assert "layer='Linear(in_features=6)'" in str(info.value)
    cause = info.value.__cause__  # JAX's own error, kept
    assert isinstance(cause, TypeError) and "contracting dimensions" in str(cause)
    assert trainer.iterations == 0
    with pytest.raises(spmd.BatchError, match=r"x_shape=\(16, 4\)") as info:
        trainer.predict(x[:, :4], batch_size=16)
    assert "Linear(in_features=6)" in str(info.value)


class _Broken(nnx.Module):
    """A model whose own code has a bug: a TypeError that is no shape error."""

    def __init__(self, rngs: nnx.Rngs):
        self.out = nnx.Linear(FEATURES, CLASSES, rngs=rngs)
        self.scale = None

    def __call__(self, x):
        return self.out(x) * self.scale()


def test_a_type_error_of_the_models_own_code_is_left_as_it_is():
    x, y = _data()
    with pytest.raises(TypeError, match="not callable") as info:
        _trainer(_Broken(nnx.Rngs(0))).fit((x, y), batch_size=16, verbose=0)
    assert not isinstance(info.value, spmd.SpmdError)


# -- grad accumulation, validation data checked before the first epoch ------------------------


@pytest.mark.cpu_mesh
def test_grad_accum_steps_that_do_not_divide_a_distributed_datasets_per_replica_batch():
    """fit pads arrays for its microbatches itself; a dataset built without them is named."""
    x, y = _data()
    trainer = _trainer(grad_accum_steps=3)  # 64 rows over 8 replicas: 8 each, not 3 parts
    strategy = trainer.strategy
    dataset = strategy.distribute_dataset(strategy.make_numpy_dataset((x, y), 64))
    with pytest.raises(spmd.BatchError) as info:
        trainer.fit(dataset, verbose=0)
    text = str(info.value)
    assert "grad_accum_steps=3" in text and "per_replica_batch_size=8" in text, text
    assert "microbatches=3" in text, text


class _Count(spmd.callbacks.Callback):
    batches = 0

    def on_train_batch_end(self, batch, logs=None):
        _Count.batches += 1


@pytest.mark.parametrize(
    "make_validation, fragment",
    [
        (lambda x, y: (x, np.eye(CLASSES, dtype=np.float32)[y]), "y (3,) float"),
        (lambda x, y: (x[:, :4], y), "validation_data must look like the training data"),
        (lambda x, y: [(x[:16], y[:16] + 5)], "class ids in [0, 2]"),
    ],
)
def test_validation_data_is_checked_before_the_first_epoch(make_validation, fragment):
    x, y = _data()
    _Count.batches = 0
    with pytest.raises(spmd.BatchError) as info:
        _trainer().fit(
            (x, y),
            batch_size=16,
            validation_data=make_validation(x, y),
            callbacks=[_Count()],
            verbose=0,
        )
    assert fragment in str(info.value) and _Count.batches == 0


# -- NaN loss stops training; labels out of range --------------------------------------------


def test_labels_out_of_range_in_the_first_batch_are_an_error():
    x, y = _data()
    with pytest.raises(spmd.BatchError, match=r"class ids in \[0, 2\]"):
        _trainer().fit((x, np.where(np.arange(len(y)) == 3, -1, y)), batch_size=16, verbose=0)


@pytest.mark.slow
def test_a_nan_loss_stops_fit_naming_the_epoch_and_step():
    x, y = _data()
    y = y.copy()
    y[16 * 5 + 2] = CLASSES  # batch 5 of epoch 0: past the first-batch check
    with pytest.raises(spmd.NonFiniteLossError) as info:
        _trainer().fit((x, y), batch_size=16, epochs=3, shuffle=False, verbose=0)
    assert "epoch=0" in str(info.value) and "batch_in_epoch=5" in str(info.value)
    assert isinstance(info.value, FloatingPointError)


class SqrtAtZero(nnx.Module):
    """A finite output whose gradient is infinite: sqrt of a parameter that starts at 0."""

    def __init__(self, rngs: nnx.Rngs):
        self.shift = nnx.Param(jnp.zeros(FEATURES))
        self.out = nnx.Linear(FEATURES, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(x + jnp.sqrt(self.shift[...]))


@pytest.mark.slow
def test_a_finite_loss_whose_update_is_not_finite_names_its_own_step():
    x, y = _data()
    trainer = _trainer(SqrtAtZero(nnx.Rngs(0)))
    with pytest.raises(spmd.NonFiniteLossError) as info:
        trainer.fit((x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)
    text = str(info.value)
    assert "epoch=0" in text and "batch_in_epoch=0" in text and "global_step=0" in text
    assert "the loss at global_step=0 was finite" in text and "update" in text
    assert "clip_by_global_norm" in text


@pytest.mark.slow
def test_a_non_finite_loss_is_still_named_as_the_loss():
    x, y = _data()
    y = y.copy()
    y[16 + 2] = CLASSES  # batch 1 (past the first-batch check): its loss is NaN
    with pytest.raises(spmd.NonFiniteLossError) as info:
        _trainer().fit((x, y), batch_size=16, epochs=1, shuffle=False, verbose=0)
    text = str(info.value)
    assert "global_step=1" in text and "The loss is finite at every step" in text


@pytest.mark.slow
def test_a_negative_label_is_a_nan_loss_not_a_wrong_one():
    per = spmd.losses.LOSSES["sparse_categorical_crossentropy"](
        jnp.ones((2, 4)), jnp.array([1, -1])
    )
    assert np.isfinite(per[0]) and np.isnan(per[1])


@pytest.mark.slow
def test_terminate_on_nan_can_be_switched_off():
    x, y = _data()
    y = y.copy()
    y[16 * 5 + 2] = CLASSES
    trainer = _trainer(terminate_on_nan=False)
    history = trainer.fit((x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert np.isnan(history.history["loss"]).all()
