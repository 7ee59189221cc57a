"""Trainer.fit's per-step work: hooks dispatched only to the callbacks that override them
(on the class or the instance, set before or during training), batch logs read from the
devices only when a callback looks at them, batch checks once per
batch signature, and the NaN flag read at most every interval yet naming the step, the
epoch and the batch of the first NaN (also at an epoch's end, and after the state is
replaced)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from models import MLP, labelled

import spmd
from spmd._src.trainer import batch_checks
from spmd._src.trainer import trainer as trainer_module


def _data(n=160):
    return labelled(n, features=4, classes=2)


def _trainer(**kwargs):
    return spmd.Trainer(
        MLP(nnx.Rngs(0), features=4, hidden=8, outputs=2),
        optax.sgd(0.1),
        "sparse_categorical_crossentropy",
        strategy=spmd.MirroredStrategy(),
        **kwargs,
    )


class Batches(spmd.callbacks.Callback):
    def __init__(self):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


def test_hooks_are_dispatched_to_the_callbacks_that_override_them():
    counting, patched = Batches(), spmd.callbacks.Callback()
    seen = []
    patched.on_epoch_end = lambda epoch, logs=None: seen.append(epoch)  # on the instance
    hooks = spmd.callbacks.CallbackList([counting, patched], trainer=None, params={})
    assert not hooks.overrides("on_train_batch_begin")
    assert hooks.overrides("on_train_batch_end") and hooks.overrides("on_epoch_end")
    hooks.on_train_batch_begin(0)  # nobody's: a no-op
    hooks.on_train_batch_end(3)
    hooks.on_epoch_end(1, {"loss": 0.5})
    assert counting.ends == [3] and seen == [1]


@pytest.mark.slow
def test_fit_calls_batch_hooks_in_order_with_the_batch_index():
    callback = Batches()
    _trainer().fit(_data(), batch_size=16, epochs=2, callbacks=[callback], verbose=0)
    assert callback.ends == list(range(10)) * 2


class Late(spmd.callbacks.Callback):
    """Adds a batch hook on itself once training begins."""

    def __init__(self):
        self.ends = []

    def on_train_begin(self, logs=None):
        self.on_train_batch_end = lambda batch, logs=None: self.ends.append(batch)


def test_a_hook_set_on_the_instance_when_training_begins_is_called():
    late = Late()
    _trainer().fit(_data(64), batch_size=16, verbose=0, callbacks=[late])
    assert late.ends == [0, 1, 2, 3]


class Base(spmd.callbacks.Callback):
    def __init__(self):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(("base", batch))


class Child(Base):
    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(("child", batch))


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_subclass_override_and_an_instance_override_are_called():
    child, patched = Child(), spmd.callbacks.Callback()
    calls = []
    patched.on_epoch_end = lambda epoch, logs=None: calls.append(epoch)
    _trainer().fit(_data(64), batch_size=16, epochs=2, verbose=0, callbacks=[child, patched])
    assert child.ends == [("child", b) for b in range(4)] * 2
    assert calls == [0, 1]


class Looks(Batches):
    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(logs["loss"])


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("callback, reads", [(Batches, 2), (Looks, 2 + 2 * 4)])
def test_batch_logs_are_read_from_the_devices_only_when_a_callback_looks(
    monkeypatch, callback, reads
):
    """Each epoch's end reads the metrics once; a batch's logs, only when looked at."""
    trainer, callback = _trainer(), callback()
    metric_reads = []
    get = jax.device_get

    def counting(tree):
        if isinstance(tree, dict) and "weight_sum" in tree:  # the metric sums
            metric_reads.append(tree)
        return get(tree)

    monkeypatch.setattr(trainer_module.jax, "device_get", counting)
    trainer.fit(_data(64), batch_size=16, epochs=2, verbose=0, callbacks=[callback])
    assert len(callback.ends) == 8 and len(metric_reads) == reads


@pytest.mark.slow
def test_batch_form_is_checked_once_per_signature(monkeypatch):
    calls = []
    check_rows = batch_checks.check_rows
    monkeypatch.setattr(
        batch_checks,
        "check_rows",
        lambda batch, what: calls.append(what) or check_rows(batch, what),
    )
    _trainer().fit(_data(), batch_size=16, epochs=3, verbose=0)
    assert calls == ["fit", "fit"]  # the precheck, then the first batch of the one shape


def test_a_new_batch_shape_is_still_checked():
    x, y = _data()
    batches = [(x[:16], y[:16]), (x[16:32], y[16:32]), (x[32:32], y[32:32])]  # last has no rows
    with pytest.raises(spmd.BatchError, match="has rows"):
        _trainer().fit(batches, verbose=0)


@pytest.mark.slow
def test_the_nan_flag_is_read_at_most_every_interval(monkeypatch):
    monkeypatch.setattr(trainer_module, "_NAN_READ_S", 3600.0)
    trainer = _trainer()
    trainer.fit(_data(), batch_size=16, verbose=0)  # compiles: the steps below are fast
    reads = []
    get = jax.device_get

    def counting(tree):
        if tree is trainer.state.get("nan_step"):
            reads.append(tree)
        return get(tree)

    monkeypatch.setattr(trainer_module.jax, "device_get", counting)
    trainer.fit(_data(), batch_size=16, epochs=2, verbose=0)
    assert len(reads) <= 2 + 2  # each epoch's end, and at most one read between per epoch


@pytest.mark.slow
def test_a_nan_is_still_named_by_its_step_when_read_late(monkeypatch):
    monkeypatch.setattr(trainer_module, "_NAN_READ_S", 3600.0)
    x, y = _data()
    x = x.copy()
    x[16 * 4 + 1] = np.nan  # batch 4 of epoch 0
    with pytest.raises(spmd.NonFiniteLossError, match="batch_in_epoch=4"):
        _trainer().fit((x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)


@pytest.mark.slow
def test_a_nan_at_an_epochs_last_batch_is_named_there():
    x, y = _data(64)
    x[63] = np.nan  # batch 3 of 4, epoch 0
    with pytest.raises(spmd.NonFiniteLossError, match=r"epoch=0.*batch_in_epoch=3"):
        _trainer().fit((x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_nan_in_the_second_one_batch_epoch_is_named_there():
    x, y = _data(64)
    x[16] = np.nan  # the second batch: epoch 1 with steps_per_epoch=1
    with pytest.raises(spmd.NonFiniteLossError, match=r"epoch=1.*batch_in_epoch=0"):
        _trainer().fit((x, y), batch_size=16, epochs=3, steps_per_epoch=1, shuffle=False, verbose=0)


@pytest.mark.slow
def test_a_nan_is_named_after_the_trainer_state_is_replaced():
    trainer = _trainer()
    trainer.fit(_data(64), batch_size=16, verbose=0)
    restored = _trainer()  # a new trainer given a trained state (as a restore does)
    restored.build()
    restored.state = trainer.state
    x, y = _data(64)
    x[16] = np.nan
    with pytest.raises(spmd.NonFiniteLossError, match=r"epoch=0.*batch_in_epoch=1"):
        restored.fit((x, y), batch_size=16, shuffle=False, verbose=0)
