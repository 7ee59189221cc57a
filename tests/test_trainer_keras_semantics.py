"""Trainer and input edges: Keras' semantics where a port expects them, an error elsewhere.

Every test is a specification: a program ported from Keras / tf.distribute, or a
bad input, whose result is the right number (checked against a plain
one-device jax/optax loop, or a hand computation) or a clear spmd error before
any step. docs/trainer.md and docs/migration.md state each behaviour.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import MLP, labelled

import spmd

FEATURES, CLASSES, LR = 6, 3, 0.1


class CNN(nnx.Module):
    """The Keras multi-worker tutorial's model, shrunk: conv, relu, dense, dense (logits)."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), padding="VALID", rngs=rngs)
        self.dense = nnx.Linear(6 * 6 * 4, 16, rngs=rngs)
        self.out = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv(x)).reshape(x.shape[0], -1)
        return self.out(nnx.relu(self.dense(x)))


class BNNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.norm(self.hidden(x))))


def _data(n=64, seed=0):
    return labelled(n, FEATURES, CLASSES, seed)


def _strategy():
    return spmd.MirroredStrategy()


def _sce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _oracle(model, batches, per_example=_sce):
    """A plain one-device loop: SGD on the batch mean of the per-example loss.

    A batch's third element weighs the loss as Keras' SUM_OVER_BATCH_SIZE: sum(loss * w) / batch.
    Returns the trained module's params (as a pytree of numpy) and each step's loss.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.sgd(LR)
    opt_state = opt.init(params)

    def loss_fn(params, rest, x, y, w):
        live = nnx.merge(graphdef, params, rest, copy=True)  # BatchNorm updates its statistics
        per = per_example(live(x), y)
        return jnp.sum(per * w) / per.shape[0], nnx.split(live, nnx.Param, ...)[2]

    losses = []
    for batch in batches:
        x, y = jax.tree.map(jnp.asarray, batch[0]), jnp.asarray(batch[1])
        w = jnp.asarray(batch[2]) if len(batch) > 2 else jnp.ones(len(y))
        (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, x, y, w)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return jax.device_get(params), losses


def _params(trainer):
    return jax.device_get(nnx.split(trainer.model, nnx.Param, ...)[1])


def _close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=rtol, atol=atol), a, b)


def _trainer(model=None, loss="sparse_categorical_crossentropy", **kwargs):
    kwargs.setdefault("strategy", _strategy())
    return spmd.Trainer(model or MLP(nnx.Rngs(0)), optax.sgd(LR), loss, **kwargs)


# -- the Keras tutorial's program, ported: the one-device oracle's numbers -------------------


@pytest.mark.slow
@pytest.mark.parametrize("k, m", [(1, 1), (2, 1), (1, 2), (3, 2)])
def test_keras_tutorial_cnn_matches_the_one_device_oracle(k, m):
    rng = np.random.default_rng(3)
    x = rng.random((96, 8, 8, 1), dtype=np.float32)
    y = rng.integers(0, 10, 96).astype(np.int32)
    trainer = spmd.Trainer(
        CNN(nnx.Rngs(0)),
        optax.sgd(LR),
        "sparse_categorical_crossentropy",
        strategy=_strategy(),
        steps_per_execution=k,
        grad_accum_steps=m,
    )
    history = trainer.fit((x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 96, 16)] * 2
    params, losses = _oracle(CNN(nnx.Rngs(0)), batches)
    _close(_params(trainer), params)
    assert history.history["loss"] == pytest.approx(
        [np.mean(losses[:6]), np.mean(losses[6:])], rel=1e-5
    )


# -- metrics: names, accuracy -----------------------------------------------------------


@pytest.mark.parametrize("name", ["count", "loss", "weight_sum", "val_loss"])
def test_a_metric_named_like_a_key_of_the_logs_is_an_error(name):
    metric = spmd.losses.Metric(name, lambda out, lab: jnp.full(out.shape[0], 3.0))
    with pytest.raises(spmd.ConfigurationError, match=f"metric_name={name!r}"):
        _trainer(metrics=[metric])


def test_two_metrics_with_one_name_are_an_error():
    metric = spmd.losses.Metric("accuracy", lambda out, lab: jnp.zeros(out.shape[0]))
    with pytest.raises(spmd.ConfigurationError, match="every other metric"):
        _trainer(metrics=["accuracy", metric])


@pytest.mark.slow
@pytest.mark.parametrize("label_shape", ["(batch,)", "(batch, 1)"])
def test_accuracy_of_one_output_is_keras_binary_accuracy_at_threshold_half(label_shape):
    """Keras resolves "accuracy" for one output column to BinaryAccuracy(threshold=0.5):
    output > 0.5 against the 0/1 label (the raw output: it cannot know it is a logit)."""
    x, _ = _data()
    y = (x[:, 0] > 0).astype(np.int32)
    labels = y if label_shape == "(batch,)" else y[:, None]

    def bce(logits, labels):
        return optax.sigmoid_binary_cross_entropy(
            logits[:, 0], labels.reshape(-1).astype(jnp.float32)
        )

    model = MLP(nnx.Rngs(0), outputs=1)
    model.out.bias.value = jnp.full((1,), 0.25)  # outputs in (0, 0.5]: 0.5, not 0, decides
    trainer = _trainer(model, bce, metrics=["accuracy"])
    result = trainer.evaluate((x, labels), batch_size=16)
    out = np.asarray(trainer.model(jnp.asarray(x)))[:, 0]
    assert np.any((out > 0) & (out <= 0.5)), "the data must tell the thresholds apart"
    hand = sum(float(o > 0.5) == float(t) for o, t in zip(out, y, strict=True)) / len(y)
    assert result["accuracy"] == pytest.approx(hand, abs=1e-7)


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_history_holds_one_value_per_epoch_as_keras():
    history = _trainer(strategy=_strategy()).fit(_data(), batch_size=16, epochs=3, verbose=0)
    assert history.epoch == [0, 1, 2]
    assert set(history.history) == {"loss"}
    assert all(len(v) == 3 for v in history.history.values())


# -- callbacks as Keras' read them: one alone, logs a dict at every hook ---------------------


class KerasLogs(spmd.callbacks.Callback):
    """What a Keras callback reads: `logs["loss"]` at each batch's end, logs at every hook."""

    def __init__(self):
        self.losses, self.begins, self.kept = [], [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.begins.append(logs)

    def on_train_batch_begin(self, batch, logs=None):
        self.begins.append(logs)

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(logs["loss"])
        self.kept.append(logs)


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_keras_callback_reads_the_running_loss_at_every_batch():
    x, y = _data()
    callback = KerasLogs()  # one callback alone, not in a list: Keras takes it so
    history = _trainer().fit((x, y), batch_size=16, shuffle=False, verbose=0, callbacks=callback)
    _, losses = _oracle(
        MLP(nnx.Rngs(0)), [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    )
    running = np.cumsum(losses) / np.arange(1, 5)  # Keras' logs: the epoch's mean so far
    np.testing.assert_allclose(callback.losses, running, rtol=1e-5)
    assert callback.losses[-1] == pytest.approx(history.history["loss"][0])
    assert callback.begins == [{}] * 5  # the epoch's and each batch's begin: empty dicts


class KeepsLogs(spmd.callbacks.Callback):
    """Keeps each batch's logs without looking at them in the hook."""

    def __init__(self):
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(logs)


def test_batch_logs_looked_at_after_the_next_step_are_an_error_saying_to_copy_them():
    x, y = _data()
    callback = KeepsLogs()
    history = _trainer().fit((x, y), batch_size=16, verbose=0, callbacks=[callback])
    with pytest.raises(spmd.ContextError, match=r"self.seen = dict\(logs\)"):
        callback.logs[0]["loss"]  # the step after it reused their memory
    assert dict(callback.logs[-1]) == {"loss": pytest.approx(history.history["loss"][0])}


@pytest.mark.parametrize("verbose", [3, -1, "1", 1.0, None])
def test_verbose_is_one_of_keras_values(verbose):
    x, y = _data()
    trainer = _trainer()
    with pytest.raises(spmd._src.errors.ConfigurationError, match=f"verbose={verbose!r}"):
        trainer.fit((x, y), batch_size=16, verbose=verbose)
    with pytest.raises(spmd._src.errors.ConfigurationError, match=f"verbose={verbose!r}"):
        trainer.evaluate((x, y), batch_size=16, verbose=verbose)


@pytest.mark.parametrize("callbacks", [3, "History", {"h": spmd.callbacks.History()}])
def test_callbacks_neither_a_callback_nor_a_list_of_them_are_an_error(callbacks):
    x, y = _data()
    with pytest.raises(
        spmd._src.errors.ConfigurationError, match="list of spmd.callbacks.Callback"
    ):
        _trainer().fit((x, y), batch_size=16, verbose=0, callbacks=callbacks)
    with pytest.raises(spmd._src.errors.ConfigurationError, match="Callback instances"):
        _trainer().fit((x, y), batch_size=16, verbose=0, callbacks=[spmd.callbacks.History(), 3])


# -- the data: steps_per_epoch, sample weights -----------------------------------------------


@pytest.mark.slow
def test_steps_per_epoch_continues_the_data_across_epochs():
    """Keras: one iterator goes on across epochs; 4 batches, steps_per_epoch=2, epochs=2
    trains on batches 0, 1, 2, 3 (not 0, 1, 0, 1)."""
    x, y = _data()
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    trainer = _trainer()
    trainer.fit(batches, epochs=2, steps_per_epoch=2, verbose=0)
    params, _ = _oracle(MLP(nnx.Rngs(0)), batches)
    _close(_params(trainer), params)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["list", "arrays", "generator"])
def test_steps_per_epoch_starts_a_new_pass_when_the_data_runs_out(kind):
    """3 batches, steps_per_epoch=2, epochs=2: batches 0, 1 | 2, 0 (arrays likewise);
    a one-shot generator cannot start a second pass: a ConfigurationError."""
    x, y = _data(n=48)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 48, 16)]
    trainer = _trainer()
    data = {"list": batches, "arrays": (x, y), "generator": iter(batches)}[kind]
    if kind == "generator":
        with pytest.raises(spmd.ConfigurationError, match="one-shot"):
            trainer.fit(data, epochs=2, steps_per_epoch=2, verbose=0)
        assert trainer.iterations == 3
        return
    size = 16 if kind == "arrays" else None  # batch_size goes with arrays only, as in Keras
    history = trainer.fit(
        data, batch_size=size, epochs=2, steps_per_epoch=2, shuffle=False, verbose=0
    )
    params, losses = _oracle(MLP(nnx.Rngs(0)), [*batches, batches[0]])
    _close(_params(trainer), params)
    assert trainer.iterations == 4
    assert history.history["loss"] == pytest.approx(
        [np.mean(losses[:2]), np.mean(losses[2:])], rel=1e-5
    )


@pytest.mark.slow
def test_sample_weight_is_keras_sum_over_batch_size():
    """sum(loss * w) / the number of examples: weights of 2.0 double the gradient."""
    x, y = _data()
    w = np.random.default_rng(5).uniform(0.0, 3.0, len(x)).astype(np.float32)
    trainer = _trainer()
    history = trainer.fit((x, y, w), batch_size=16, epochs=1, shuffle=False, verbose=0)
    batches = [(x[i : i + 16], y[i : i + 16], w[i : i + 16]) for i in range(0, 64, 16)]
    params, losses = _oracle(MLP(nnx.Rngs(0)), batches)
    _close(_params(trainer), params)
    assert history.history["loss"] == pytest.approx([np.mean(losses)], rel=1e-5)


@pytest.mark.slow
def test_evaluate_reports_the_weighted_loss_over_every_example():
    """40 examples in batches of 16 (the last padded): sum(loss * w) / 40, metrics unweighted
    (Keras' `metrics`)."""
    x, y = _data(n=40)
    w = np.random.default_rng(6).uniform(0.0, 3.0, len(x)).astype(np.float32)
    trainer = _trainer(metrics=["accuracy"])
    result = trainer.evaluate((x, y, w), batch_size=16)
    logits = np.asarray(trainer.model(jnp.asarray(x)))
    per = np.asarray(_sce(jnp.asarray(logits), jnp.asarray(y)))
    assert result["loss"] == pytest.approx(float(np.sum(per * w) / 40), rel=1e-5)
    assert result["accuracy"] == pytest.approx(float(np.mean(logits.argmax(-1) == y)))


def test_evaluate_with_every_sample_weight_zero_is_an_error():
    x, y = _data()
    with pytest.raises(spmd.BatchError, match="sample_weight_sum=0.0"):
        _trainer().evaluate((x, y, np.zeros(len(x), np.float32)), batch_size=16)


def test_evaluate_with_a_nan_sample_weight_is_an_error_not_a_nan_loss():
    x, y = _data()
    w = np.ones(len(x), np.float32)
    w[3] = np.nan
    with pytest.raises(spmd.BatchError, match="sample_weight_sum=nan") as caught:
        _trainer().evaluate((x, y, w), batch_size=16)
    assert "np.isfinite(sample_weight).all()" in str(caught.value)


# -- models: BatchNorm, dropout, several outputs, several inputs ----------------------------


class DropNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(8, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.hidden(x))))


@pytest.mark.slow
@pytest.mark.parametrize("model", [BNNet, DropNet])
def test_a_batchnorm_or_dropout_model_trains(model):
    """docs/trainer.md: BatchNorm statistics and dropout RNG state are carried; for
    BatchNorm (deterministic) the update equals the one-device oracle's."""
    x, y = _data(n=32)
    trainer = _trainer(model(nnx.Rngs(0)))
    trainer.fit((x, y), batch_size=32, epochs=1, shuffle=False, verbose=0)
    if model is BNNet:
        params, _ = _oracle(BNNet(nnx.Rngs(0)), [(x, y)])
        _close(_params(trainer), params)


def _microbatch_oracle(model, batches, m):
    """grad_accum_steps=m with BatchNorm: microbatch j of a batch is its rows j, j+m, ...
    (each replica's share), normalised by its own statistics; one SGD step on the
    summed gradients over the batch's examples."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest, x, y):
        live = nnx.merge(graphdef, params, rest, copy=True)
        loss = jnp.sum(_sce(live(x), y))
        return loss, nnx.split(live, nnx.Param, ...)[2]

    for x, y in batches:
        grads = jax.tree.map(jnp.zeros_like, params)
        for j in range(m):
            g, rest = jax.grad(loss_fn, has_aux=True)(params, rest, x[j::m], y[j::m])
            grads = jax.tree.map(jnp.add, grads, g)
        params = jax.tree.map(lambda p, g, n=x.shape[0]: p - LR * g / n, params, grads)
    return jax.device_get(params)


@pytest.mark.slow
def test_grad_accum_with_batchnorm_normalises_each_microbatch():
    """Documented: with BatchNorm, grad_accum_steps=M normalises each microbatch by its own
    statistics (the update is that of M microbatches, not of the whole batch)."""
    x, y = _data()
    trainer = _trainer(BNNet(nnx.Rngs(0)), grad_accum_steps=2)
    trainer.fit((x, y), batch_size=32, epochs=1, shuffle=False, verbose=0)
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 64, 32)]
    _close(_params(trainer), _microbatch_oracle(BNNet(nnx.Rngs(0)), batches, 2))


@pytest.mark.slow
def test_padded_batches_with_batchnorm_statistics_are_an_error_before_any_step():
    """The mask keeps padding out of the loss, not out of BatchNorm's batch statistics."""
    x, y = _data(n=40)
    strategy = _strategy()
    padded = strategy.distribute_dataset(
        strategy.make_numpy_dataset((x, y), 32, drop_remainder=False)
    )
    trainer = _trainer(BNNet(nnx.Rngs(0)), strategy=strategy)
    with pytest.raises(spmd.BatchError, match="BatchNorm statistics"):
        trainer.fit(padded, epochs=1, verbose=0)
    assert trainer.iterations == 0


class TwoHeads(nnx.Module):
    def __init__(self, rngs):
        self.trunk = nnx.Linear(FEATURES, 8, rngs=rngs)
        self.a = nnx.Linear(8, 1, rngs=rngs)
        self.b = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.trunk(x))
        return self.a(h), self.b(h)


def _two_heads_loss(outputs, labels):
    a, b = outputs
    return (a[:, 0] - labels[:, 0]) ** 2 + jnp.mean((b - labels[:, 1:]) ** 2, -1)


@pytest.mark.slow
def test_a_model_with_two_outputs_trains_with_a_loss_of_its_own():
    x, _ = _data()
    y = np.stack([x[:, 0], x[:, 1], x[:, 2] * 2], 1).astype(np.float32)
    trainer = _trainer(TwoHeads(nnx.Rngs(0)), _two_heads_loss)
    trainer.fit((x, y), batch_size=16, epochs=1, shuffle=False, verbose=0)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    params, _ = _oracle(TwoHeads(nnx.Rngs(0)), batches, per_example=_two_heads_loss)
    _close(_params(trainer), params)
    a, b = trainer.predict(x, batch_size=16)
    want_a, want_b = trainer.model(jnp.asarray(x))
    _close((a, b), (np.asarray(want_a), np.asarray(want_b)))


@pytest.mark.parametrize("loss, metric", [(_two_heads_loss, "mse"), ("mse", None)])
def test_a_named_loss_or_builtin_metric_on_two_outputs_is_an_error(loss, metric):
    x, _ = _data()
    y = np.zeros((len(x), 3), np.float32)
    trainer = _trainer(TwoHeads(nnx.Rngs(0)), loss, metrics=[metric] if metric else [])
    name = f"metric {metric!r}" if metric else "loss 'mse'"
    with pytest.raises(spmd.ConfigurationError, match=name):
        trainer.fit((x, y), batch_size=16, verbose=0)
    assert trainer.iterations == 0


class Two(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(FEATURES, CLASSES, rngs=rngs)
        self.b = nnx.Linear(CLASSES, CLASSES, rngs=rngs)

    def __call__(self, inputs):
        x1, x2 = inputs
        return self.a(x1) + self.b(x2)


@pytest.mark.slow
def test_keras_list_of_inputs_is_the_models_inputs():
    """fit(([x1, x2], y)): the model gets [x1, x2] (Keras); predict([x1, x2], batch_size)."""
    x, y = _data()
    x2 = np.random.default_rng(1).normal(size=(len(x), CLASSES)).astype(np.float32)
    y = np.eye(CLASSES, dtype=np.float32)[y]
    trainer = _trainer(Two(nnx.Rngs(0)), "mse")
    trainer.fit(([x, x2], y), batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert trainer.iterations == 4
    batches = [([x[i : i + 16], x2[i : i + 16]], y[i : i + 16]) for i in range(0, 64, 16)]

    def mse(out, lab):
        return jnp.mean((out - lab) ** 2, -1)

    params, _ = _oracle(Two(nnx.Rngs(0)), batches, per_example=mse)
    _close(_params(trainer), params)
    want = np.asarray(trainer.model([jnp.asarray(x), jnp.asarray(x2)]))
    _close(trainer.predict([x, x2], batch_size=16), want)
    with pytest.raises(spmd.ConfigurationError, match="batch_size"):
        trainer.predict([x, x2])  # a list of inputs, or a list of batches: not guessed


# -- bad data: an error naming it, before any step -------------------------------------------


@pytest.mark.parametrize("loss", ["sparse_categorical_crossentropy", "mse"])
def test_a_zero_row_batch_in_an_iterable_is_a_batch_error(loss):
    x, _ = _data()
    y = np.zeros((0,), np.int32) if loss.startswith("sparse") else np.zeros((0, CLASSES))
    trainer = _trainer(loss=loss)
    with pytest.raises(spmd.BatchError, match="batch_size=0"):
        trainer.evaluate([(x[:0], y)])
    with pytest.raises(spmd.BatchError, match="has rows"):
        trainer.fit([(x[:0], y)] * 3, verbose=0)
    assert trainer.iterations == 0
    batches = [(x[:16], np.zeros(16, np.int32) if loss.startswith("sparse") else x[:16, :3])]
    with pytest.raises(spmd.BatchError, match="has rows"):  # a later one, too
        trainer.fit([*batches, (x[:0], y)], verbose=0)
    assert trainer.iterations == 0


@pytest.mark.parametrize("call", ["fit", "evaluate"])
def test_zero_row_arrays_are_a_batch_error(call):
    x, y = _data()
    with pytest.raises(spmd.BatchError, match=f"{call}_examples=0"):
        getattr(_trainer(), call)((x[:0], y[:0]), batch_size=16)


@pytest.mark.slow  # 5 s of CPU: over the fast tier's share (tests/tiers.py)
def test_fewer_examples_than_batch_size_train_one_partial_batch_as_keras_does():
    x, y = _data()
    trainer = _trainer()
    trainer.fit((x[:10], y[:10]), batch_size=16, shuffle=False, verbose=0)
    assert trainer.iterations == 1
    params, _ = _oracle(MLP(nnx.Rngs(0)), [(x[:10], y[:10])])
    _close(_params(trainer), params)


def test_x_and_y_of_different_lengths_are_an_error_naming_both_sizes():
    x, y = _data()
    with pytest.raises(spmd._src.errors.BatchError) as info:
        _trainer().fit((x, y[:-1]), batch_size=16, verbose=0)
    assert "Every array of the data must have the same leading (batch) size" in str(info.value)
    assert "leading_sizes=[63, 64]" in str(info.value)


def test_fewer_examples_than_batch_size_for_a_model_that_writes_state_names_both():
    """Its partial batch is never padded (BatchNorm statistics), so it would train on nothing."""
    x, y = _data()
    with pytest.raises(spmd.BatchError, match="batch_size=16, examples=10"):
        _trainer(BNNet(nnx.Rngs(0))).fit((x[:10], y[:10]), batch_size=16, verbose=0)


def test_validation_arrays_without_batch_size_fail_before_the_first_step():
    x, y = _data()
    strategy = _strategy()
    train = strategy.distribute_dataset(strategy.make_numpy_dataset((x, y), 16))
    trainer = _trainer(strategy=strategy)
    with pytest.raises(spmd.BatchError, match="needs batch_size"):
        trainer.fit(train, validation_data=(x, y), verbose=0)
    assert trainer.iterations == 0


def test_string_labels_are_a_batch_error():
    x, y = _data()
    with pytest.raises(spmd.BatchError):
        _trainer().fit((x, y.astype(str)), batch_size=16, verbose=0)


@pytest.mark.parametrize("call", ["evaluate", "validation_data"])
def test_a_dataset_that_drops_its_remainder_is_an_error_for_evaluation(call):
    """40 examples in batches of 16 with the default drop_remainder=True: 8 would be left out
    of evaluate's average; the error names remainder="pad"."""
    x, y = _data(n=40)
    strategy = _strategy()
    data = strategy.distribute_dataset(strategy.make_numpy_dataset((x, y), 16))
    assert data.num_dropped == 8
    trainer = _trainer(strategy=strategy)
    with pytest.raises(spmd.BatchError, match='remainder="pad"'):
        if call == "evaluate":
            trainer.evaluate(data)
        else:
            trainer.fit((x, y), batch_size=16, validation_data=data, verbose=0)
    assert trainer.iterations == 0


@pytest.mark.slow
def test_nan_inputs_stop_fit_with_iterations_the_steps_applied():
    x, y = _data()
    bad = x.copy()
    bad[20] = np.nan
    trainer = _trainer(steps_per_execution=2)
    with pytest.raises(spmd.NonFiniteLossError):
        trainer.fit((bad, y), batch_size=16, shuffle=False, verbose=0)
    assert trainer.iterations == int(trainer.host_state()["step"]) >= 2


@pytest.mark.slow
def test_a_generator_over_two_epochs_is_a_one_shot_error():
    x, y = _data()
    batches = ((x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16))
    with pytest.raises(spmd.ConfigurationError, match="one-shot"):
        _trainer().fit(batches, epochs=2, verbose=0)


# -- callbacks -------------------------------------------------------------------------------


class _Recording(spmd.callbacks.BackupAndRestore):
    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        save, self.saved = self.manager.save, []

        def recording(step, *args, **kwargs):
            if save(step, *args, **kwargs):
                self.saved.append(step)
            return True

        self.manager.save = recording


@pytest.mark.slow
def test_backup_and_restore_save_freq_with_steps_per_execution_never_skips_a_save(tmp_path):
    """save_freq=2, steps_per_execution=3: a backup after every call that crosses a multiple
    of 2 (batches 3, 6, 9, 12), not only when the count lands on one (6, 12)."""
    x, y = _data(n=192)
    backup = _Recording(str(tmp_path / "backup"), save_freq=2, delete_checkpoint=False)
    trainer = _trainer(steps_per_execution=3)
    trainer.fit((x, y), batch_size=16, callbacks=[backup], shuffle=False, verbose=0)
    assert backup.saved == [3, 6, 9, 12]
