"""Trainer: a step whose update makes any part of the train state NaN or infinite stops fit,
naming the step and the leaf (a parameter, the optimizer state, the model's other state);
state that was already infinite (a sentinel) and padded rows raise no false alarm."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from models import MLP, labelled

import spmd

FEATURES, CLASSES = 6, 3


def _data(n=128, seed=0):
    return labelled(n, FEATURES, CLASSES, seed)


def _trainer(model=None, optimizer=None, **kwargs):
    return spmd.Trainer(
        model or MLP(nnx.Rngs(0)),
        optimizer or optax.adam(1e-3),
        "sparse_categorical_crossentropy",
        strategy=spmd.MirroredStrategy(),
        **kwargs,
    )


class HugeGradient(nnx.Module):
    """A finite loss whose gradient for `boost` is ~1e24: Adam's nu, its square, overflows
    to inf at the first step, while its update (mu / sqrt(nu)) is 0 and the parameters stay
    finite: `boost` silently stops training."""

    def __init__(self, rngs: nnx.Rngs):
        self.boost = nnx.Param(jnp.zeros(CLASSES))
        self.out = nnx.Linear(FEATURES, CLASSES, rngs=rngs)

    def __call__(self, x):
        boost = self.boost[...] * 1e25
        return self.out(x) + (boost - jax.lax.stop_gradient(boost))  # 0, with its gradient


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_an_optimizer_state_made_infinite_by_a_finite_loss_stops_fit_naming_it(
    steps_per_execution,
):
    trainer = _trainer(HugeGradient(nnx.Rngs(0)), steps_per_execution=steps_per_execution)
    with pytest.raises(spmd.NonFiniteLossError) as info:
        trainer.fit(_data(), batch_size=16, epochs=2, shuffle=False, verbose=0)
    text = str(info.value)
    assert "epoch=0" in text and "batch_in_epoch=0" in text and "global_step=0" in text, text
    assert "the loss at global_step=0 was finite" in text, text
    assert "the optimizer state at 'opt_state/0/nu/boost'" in text, text
    assert "clip_by_global_norm" in text


class Tally(nnx.Module):
    """A model whose training pass writes a statistic that overflows (its output is finite)."""

    def __init__(self, rngs: nnx.Rngs):
        self.out = nnx.Linear(FEATURES, CLASSES, rngs=rngs)
        self.energy = nnx.BatchStat(jnp.zeros(()))

    def __call__(self, x):
        self.energy[...] = self.energy[...] + jnp.sum(x**2) * 1e38
        return self.out(x)


def test_a_model_state_made_infinite_is_named_as_the_models_state():
    with pytest.raises(spmd.NonFiniteLossError) as info:
        _trainer(Tally(nnx.Rngs(0))).fit(_data(), batch_size=16, shuffle=False, verbose=0)
    text = str(info.value)
    assert "global_step=0" in text and "the model's other state at 'rest/energy'" in text, text


class SqrtAtZero(nnx.Module):
    """A finite output whose gradient is infinite: sqrt of a parameter that starts at 0."""

    def __init__(self, rngs: nnx.Rngs):
        self.shift = nnx.Param(jnp.zeros(FEATURES))
        self.out = nnx.Linear(FEATURES, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.out(x + jnp.sqrt(self.shift[...]))


def test_a_parameter_made_non_finite_is_named_as_a_parameter():
    trainer = _trainer(SqrtAtZero(nnx.Rngs(0)), optax.sgd(0.1), steps_per_execution=2)
    with pytest.raises(spmd.NonFiniteLossError) as info:
        trainer.fit(_data(), batch_size=16, shuffle=False, verbose=0)
    text = str(info.value)
    assert "global_step=0" in text and "the parameter at 'params/shift'" in text, text


def _keeps_infinity() -> optax.GradientTransformation:
    """A transformation whose state holds inf from its init on, as a sentinel (optax's
    reduce_on_plateau starts its best value at inf)."""
    return optax.GradientTransformation(
        lambda params: {"best": jnp.asarray(jnp.inf), "worst": jnp.asarray(-jnp.inf)},
        lambda updates, state, params=None: (updates, state),
    )


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_optimizer_state_infinite_from_its_init_is_no_alarm():
    trainer = _trainer(optimizer=optax.chain(_keeps_infinity(), optax.adam(1e-2)))
    history = trainer.fit(_data(), batch_size=16, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert float(trainer.state["opt_state"][0]["best"]) == np.inf


@pytest.mark.slow  # 5 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 12},  # 8 replicas: each batch padded to 16 with masked rows
        {"batch_size": 12, "steps_per_execution": 3},
        {"batch_size": 20, "grad_accum_steps": 2},  # each microbatch padded
    ],
    ids=["padded", "padded_steps_per_execution", "padded_microbatches"],
)
def test_padded_batches_raise_no_false_alarm(kwargs):
    fit = {"batch_size": kwargs.pop("batch_size")}
    trainer = _trainer(**kwargs)
    history = trainer.fit(_data(100), epochs=2, shuffle=False, verbose=0, **fit)
    assert np.isfinite(history.history["loss"]).all()
    assert int(jax.device_get(trainer.state["nan_step"])) == -1


@pytest.mark.parametrize("class_weight", [None, {0: 1.0, 1: 2.0, 2: 3.0}])
def test_a_nan_sample_weight_is_named_as_the_source_of_the_nan_loss(class_weight):
    x, y = _data(32)
    w = np.ones(32, np.float32)
    w[20] = np.nan  # in the second batch
    trainer = _trainer(optimizer=optax.sgd(0.1))
    with pytest.raises(spmd.NonFiniteLossError) as info:
        trainer.fit((x, y, w), batch_size=16, shuffle=False, class_weight=class_weight, verbose=0)
    text = str(info.value)
    assert "batch_in_epoch=1" in text and "sample weights of global_step=1 hold a NaN" in text
    assert "np.isfinite(sample_weight)" in text
