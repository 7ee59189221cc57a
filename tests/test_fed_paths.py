"""Odd input to the fed paths' fast code: host transfers, the step's fast path, the
Trainer's hooks and NaN flag, each against a one-device oracle or Keras' semantics."""

import numpy as np
import optax
import pytest
from flax import nnx

import spmd


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


def _trainer(**kwargs):
    return spmd.Trainer(
        MLP(nnx.Rngs(0)),
        optax.sgd(0.1),
        "sparse_categorical_crossentropy",
        strategy=spmd.MirroredStrategy(),
        **kwargs,
    )


def _data(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def test_a_nan_at_an_epochs_last_batch_is_named_there():
    x, y = _data()
    x[63] = np.nan  # batch 3 of 4, epoch 0
    with pytest.raises(spmd.NonFiniteLossError, match=r"epoch=0.*batch_in_epoch=3"):
        _trainer().fit((x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)


def test_a_nan_in_the_second_one_batch_epoch_is_named_there():
    x, y = _data()
    x[16] = np.nan  # the second batch: epoch 1 with steps_per_epoch=1
    with pytest.raises(spmd.NonFiniteLossError, match=r"epoch=1.*batch_in_epoch=0"):
        _trainer().fit((x, y), batch_size=16, epochs=3, steps_per_epoch=1, shuffle=False, verbose=0)


def test_a_nan_is_named_after_the_trainer_state_is_replaced():
    trainer = _trainer()
    trainer.fit(_data(), batch_size=16, verbose=0)
    restored = _trainer()  # a new trainer given a trained state (as a restore does)
    restored.build()
    restored.state = trainer.state
    x, y = _data()
    x[16] = np.nan
    with pytest.raises(spmd.NonFiniteLossError, match=r"epoch=0.*batch_in_epoch=1"):
        restored.fit((x, y), batch_size=16, shuffle=False, verbose=0)


class Late(spmd.callbacks.Callback):
    """Adds a batch hook on itself once training begins."""

    def __init__(self):
        self.ends = []

    def on_train_begin(self, logs=None):
        self.on_train_batch_end = lambda batch, logs=None: self.ends.append(batch)


def test_a_hook_set_on_the_instance_when_training_begins_is_called():
    late = Late()
    _trainer().fit(_data(), batch_size=16, verbose=0, callbacks=[late])
    assert late.ends == [0, 1, 2, 3]


class Base(spmd.callbacks.Callback):
    def __init__(self):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(("base", batch))


class Child(Base):
    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(("child", batch))


def test_a_subclass_override_and_an_instance_override_are_called():
    child, patched = Child(), spmd.callbacks.Callback()
    calls = []
    patched.on_epoch_end = lambda epoch, logs=None: calls.append(epoch)
    _trainer().fit(_data(), batch_size=16, epochs=2, verbose=0, callbacks=[child, patched])
    assert child.ends == [("child", b) for b in range(4)] * 2
    assert calls == [0, 1]


def test_history_holds_one_value_per_epoch_as_keras():
    history = _trainer().fit(_data(), batch_size=16, epochs=3, verbose=0)
    assert history.epoch == [0, 1, 2]
    assert set(history.history) == {"loss"}
    assert all(len(v) == 3 for v in history.history.values())
