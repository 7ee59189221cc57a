"""spmd.Trainer on spmd.DiLoCo: fit equals the paper's DiLoCo in plain JAX, and resumes exactly."""

import jax
import numpy as np
import optax
import pytest
from diloco_reference import INNER, batches, create, logits, make_step, reference
from flax import nnx

import spmd
from spmd.testing import assert_trees_allclose

pytestmark = pytest.mark.cpu_mesh
TOL = {"rtol": 1e-5, "atol": 1e-6}  # float32: the Trainer sums a batch's losses, then divides
STEPS, BATCH, ISLANDS, H = 7, 32, 2, 3


def _model():
    return (lambda key: create(key)["params"], logits)


def _data():
    data = batches(STEPS, batch=BATCH)
    return np.concatenate([x for x, _ in data]), np.concatenate([y for _, y in data])


def _trainer(inner="sgd"):
    strategy = spmd.DiLoCo(islands=ISLANDS, sync_every=H)
    return spmd.Trainer(
        _model(), INNER[inner], "sparse_categorical_crossentropy", strategy=strategy
    )


def _oracle(inner):
    params = create(jax.random.key(0))["params"]
    state = {"params": params, "opt": INNER[inner].init(params)}
    return reference(state, make_step(inner), batches(STEPS, batch=BATCH), ISLANDS, H)


@pytest.mark.slow  # 20 s of CPU: an NNX module's fit, its evaluate and predict programs
def test_fit_of_an_nnx_module_on_two_islands_equals_the_paper():
    from test_diloco_nnx_state import MLP, _params

    module = MLP(nnx.Rngs(0))
    start = _params(module)
    strategy = spmd.DiLoCo(islands=ISLANDS, sync_every=H)
    trainer = spmd.Trainer(
        module, INNER["sgd"], "sparse_categorical_crossentropy", strategy=strategy
    )
    history = trainer.fit(_data(), batch_size=BATCH, shuffle=False, verbose=0)
    state = {"params": start, "opt": INNER["sgd"].init(start)}
    want = reference(state, make_step("sgd"), batches(STEPS, batch=BATCH), ISLANDS, H)
    assert trainer.model is module  # holding the global parameters
    assert_trees_allclose(jax.device_get(_params(module)), want[0], **TOL)
    np.testing.assert_allclose(history.history["loss"], [np.mean(want[2])], **TOL)
    x, _ = _data()
    np.testing.assert_allclose(trainer.predict(x, batch_size=BATCH), logits(want[0], x), **TOL)


@pytest.mark.slow  # 20 s of CPU each: init, inner, sync, evaluate programs of two islands
@pytest.mark.parametrize("inner", ["sgd", "adamw"])
def test_fit_on_two_islands_equals_the_paper(inner):
    trainer = _trainer(inner)
    history = trainer.fit(_data(), batch_size=BATCH, shuffle=False, verbose=0)
    want_global, want_islands, want_losses = _oracle(inner)
    state = trainer.state
    assert_trees_allclose(jax.device_get(state.params), want_global, **TOL)
    for i, island in enumerate(want_islands):
        got = jax.tree.map(lambda x, i=i: np.asarray(x)[i], state.islands["params"])
        assert_trees_allclose(got, island["params"], **TOL)
    np.testing.assert_allclose(history.history["loss"], [np.mean(want_losses)], **TOL)
    assert int(trainer.entry("step")) == STEPS and int(state.step) == STEPS
    # evaluate and the model read the global parameters
    assert_trees_allclose(jax.device_get(trainer.model), want_global, **TOL)
    x, y = _data()
    want_loss = optax.softmax_cross_entropy_with_integer_labels(logits(want_global, x), y).mean()
    np.testing.assert_allclose(trainer.evaluate((x, y), batch_size=BATCH)["loss"], want_loss, **TOL)


@pytest.mark.parametrize("option", ["steps_per_execution", "grad_accum_steps"])
def test_options_with_no_island_form_say_to_leave_them_at_one(option):
    with pytest.raises(spmd.ConfigurationError, match=f"leave {option} at 1") as caught:
        spmd.Trainer(
            _model(),
            INNER["sgd"],
            "mse",
            strategy=spmd.DiLoCo(islands=2),
            **{option: 4},
        )
    assert f"Received: {option}=4" in str(caught.value)


@pytest.mark.slow  # 3 s of CPU: the Trainer's model and checks
def test_a_batch_the_islands_replicas_do_not_divide_is_a_batch_error():
    with pytest.raises(spmd.BatchError, match="8 replicas \\(2 islands x 4\\)") as caught:
        _trainer().fit(_data(), batch_size=30, verbose=0)
    assert "Received: batch_size=30, num_replicas_in_sync=8" in str(caught.value)
    assert "e.g. 32" in str(caught.value)


@pytest.mark.slow  # 40 s of CPU: two fits, compiles of the inner, sync and restore programs
def test_backup_and_restore_on_diloco_resumes_exactly(tmp_path):
    """Interrupted after epoch 1 of 2 (mid-H: 7 steps an epoch, H=3); the resumed fit
    ends with the state of one that ran through."""
    data = _data()
    through = _trainer()
    through.fit(data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)

    class Interrupt(spmd.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                raise KeyboardInterrupt

    backup = spmd.callbacks.BackupAndRestore(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        _trainer().fit(
            data,
            batch_size=BATCH,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[backup, Interrupt()],
        )
    resumed, again = _trainer(), spmd.callbacks.BackupAndRestore(str(tmp_path))
    resumed.fit(data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[again])
    assert again.restored_step == STEPS  # the backup at epoch 1's end, mid-H (7 % 3)
    assert resumed.iterations == through.iterations == 2 * STEPS
    assert_trees_allclose(
        jax.device_get(resumed.state), jax.device_get(through.state), rtol=0, atol=0
    )


@pytest.mark.slow  # 6 s of CPU: the Trainer's model, checks and one inner step
@pytest.mark.parametrize("source", ["list", "tf.data"])
def test_a_short_batch_of_an_iterable_is_a_batch_error_naming_drop_remainder(source):
    """Arrays' last partial batch is dropped (said at WARNING); an iterable's short batch,
    which fit would pad, is an error, not a step of an island on padding only."""
    x, y = _data()
    if source == "list":
        data = [(x[:BATCH], y[:BATCH]), (x[BATCH : BATCH + 12], y[BATCH : BATCH + 12])]
    else:
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices((x[: BATCH + 12], y[: BATCH + 12])).batch(BATCH)
    with pytest.raises(spmd.BatchError, match="trains on whole batches only") as caught:
        _trainer().fit(data, verbose=0)
    assert "num_replicas_in_sync=8" in str(caught.value)
    assert "drop_remainder=True" in str(caught.value)
