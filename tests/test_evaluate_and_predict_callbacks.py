"""evaluate, fit's validation and predict call the test and predict hooks in Keras' order
(Keras 3's `Trainer.evaluate` / `predict`: begin, then per batch begin and end with its
logs, then end; fit validates with its own callbacks before `on_epoch_end`), and read
nothing per batch for callbacks that do not override the batch hooks."""

import numpy as np
import optax
import pytest
from flax import nnx
from models import MLP

import spmd
from spmd._src.trainer import trainer as trainer_module


def _data(n=100):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def _trainer():
    return spmd.Trainer(
        MLP(nnx.Rngs(0), features=4, hidden=8, outputs=2),
        optax.sgd(0.1),
        "sparse_categorical_crossentropy",
        metrics=("accuracy",),
        strategy=spmd.MirroredStrategy(),
    )


class Recorder(spmd.callbacks.Callback):
    """Every hook it overrides, in call order, with its arguments."""

    def __init__(self):
        self.calls = []

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch, logs))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("train_batch_end", batch))

    def on_test_begin(self, logs=None):
        self.calls.append(("test_begin",))

    def on_test_batch_begin(self, batch, logs=None):
        self.calls.append(("test_batch_begin", batch))

    def on_test_batch_end(self, batch, logs=None):
        self.calls.append(("test_batch_end", batch, logs))

    def on_test_end(self, logs=None):
        self.calls.append(("test_end", logs))

    def on_predict_begin(self, logs=None):
        self.calls.append(("predict_begin",))

    def on_predict_batch_begin(self, batch, logs=None):
        self.calls.append(("predict_batch_begin", batch))

    def on_predict_batch_end(self, batch, logs=None):
        self.calls.append(("predict_batch_end", batch, logs))

    def on_predict_end(self, logs=None):
        self.calls.append(("predict_end",))

    def names(self):
        return [
            call[:2] if "batch" in call[0] or call[0] == "epoch_end" else call[:1]
            for call in self.calls
        ]


def _test_calls(batches: int) -> list[tuple]:
    calls = [("test_begin",)]
    for i in range(batches):
        calls += [("test_batch_begin", i), ("test_batch_end", i)]
    return [*calls, ("test_end",)]


def test_evaluate_calls_the_test_hooks_in_keras_order_with_each_batchs_logs():
    x, y = _data()
    trainer, recorder = _trainer(), Recorder()
    result = trainer.evaluate((x, y), batch_size=32, callbacks=[recorder])
    assert recorder.names() == _test_calls(4)  # 100 rows: 3 batches of 32 and one of 4
    assert recorder.calls[-1][1] == result
    for batch, logs in [(c[1], c[2]) for c in recorder.calls if c[0] == "test_batch_end"]:
        rows = min(32 * (batch + 1), 100)  # the oracle: an evaluation of those rows alone
        assert logs == pytest.approx(trainer.evaluate((x[:rows], y[:rows]), batch_size=32))
    assert recorder.calls[-2][2] == pytest.approx(result)


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_fit_validates_with_its_callbacks_before_on_epoch_end():
    x, y = _data(64)
    recorder = Recorder()
    _trainer().fit(
        (x, y), batch_size=32, epochs=2, validation_data=(x, y), callbacks=[recorder], verbose=0
    )
    epoch = [("train_batch_end", 0), ("train_batch_end", 1), *_test_calls(2)]
    assert recorder.names() == [*epoch, ("epoch_end", 0), *epoch, ("epoch_end", 1)]
    ends = [c for c in recorder.calls if c[0] in ("test_end", "epoch_end")]
    for (_, validation), (_, _, logs) in zip(ends[::2], ends[1::2], strict=True):
        assert validation == {k[4:]: v for k, v in logs.items() if k.startswith("val_")}


def test_predict_calls_the_predict_hooks_in_keras_order_with_each_batchs_outputs():
    x, _ = _data()
    recorder = Recorder()
    out = _trainer().predict(x, batch_size=32, callbacks=[recorder])
    batches = [c for c in recorder.names() if c[0].startswith("predict_batch")]
    assert recorder.names() == [("predict_begin",), *batches, ("predict_end",)]
    assert batches == [(f"predict_batch_{w}", i) for i in range(4) for w in ("begin", "end")]
    outputs = [c[2]["outputs"] for c in recorder.calls if c[0] == "predict_batch_end"]
    assert [len(o) for o in outputs] == [32, 32, 32, 4]  # the padded batch's real rows
    np.testing.assert_array_equal(np.concatenate(outputs), out)


class EndOnly(spmd.callbacks.Callback):
    def on_test_end(self, logs=None):
        self.logs = logs


@pytest.mark.parametrize("callback, reads", [(EndOnly, 1), (Recorder, 4 + 1)])
def test_batch_logs_are_read_only_for_a_callback_that_overrides_the_batch_end(
    monkeypatch, callback, reads
):
    x, y = _data()
    trainer = _trainer()
    calls = []
    averages = trainer_module.averages
    monkeypatch.setattr(trainer_module, "averages", lambda s: calls.append(1) or averages(s))
    trainer.evaluate((x, y), batch_size=32, callbacks=[callback()])
    assert len(calls) == reads
