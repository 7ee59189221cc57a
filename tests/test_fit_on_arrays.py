"""Trainer.fit on numpy arrays, against a one-device SGD loop.

An unshuffled full batch of a NumpyDataset is now a copied slice (a gather
otherwise). Every run is checked against a plain `jax.jit` SGD loop on one
device fed the rows numpy says each batch holds (`np.random.default_rng([seed,
epoch]).permutation(n)` when shuffling; the last partial batch trained on, its loss a mean
over its own rows, as Keras trains it).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import spmd

LR = 0.05


class Named(nnx.Module):
    """A linear regression on a dict of named inputs ("a": 3 features, "b": 1)."""

    def __init__(self, rngs: nnx.Rngs):
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.concatenate([x["a"], x["b"]], axis=-1))


class Plain(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


@pytest.fixture(scope="module", params=["1dev", "8dev"])
def strategy(request):
    if request.param == "1dev":
        return spmd.OneDeviceStrategy(jax.devices()[0])
    return spmd.MirroredStrategy()


def _data(n=100, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x @ rng.normal(size=(4, 2)) + 0.1).astype(np.float32)
    w = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
    return x, y, w


def _trainer(strategy, module=Plain):
    return spmd.Trainer(module(nnx.Rngs(0)), optax.sgd(LR), "mse", strategy=strategy)


def _oracle(module, x, y, w, batch_size, epochs, shuffle, steps=None, seed=0):
    """Plain jax.jit SGD on one device over the rows each batch must hold."""
    graphdef, params = nnx.split(module(nnx.Rngs(0)), nnx.Param)

    @jax.jit
    def step(params, xb, yb, wb):
        def loss(p):
            out = nnx.merge(graphdef, p)(xb)
            return jnp.sum(jnp.mean((out - yb) ** 2, -1) * wb) / yb.shape[0]

        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads)

    n, per_pass = len(y), -(-len(y) // batch_size)
    total = epochs * (steps or per_pass)  # Keras: one stream of batches across epochs
    for i in range(total):
        p, b = divmod(i, per_pass)  # pass p of the data, its batch b
        order = np.random.default_rng([seed, p]).permutation(n) if shuffle else np.arange(n)
        rows = order[b * batch_size : (b + 1) * batch_size]
        xb = jax.tree.map(lambda a, r=rows: a[r], x)
        params = step(params, xb, y[rows], w[rows] if w is not None else np.ones(len(rows)))
    return jax.tree.leaves(params)


def _close(trainer, oracle, exact=False):
    got = jax.tree.leaves(jax.device_get(trainer.state["params"]))
    assert len(got) == len(oracle)
    for a, b in zip(got, oracle, strict=True):
        if exact:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_fit_on_arrays_a_batch_size_not_dividing_the_examples(strategy, shuffle, weighted):
    x, y, w = _data(100)
    trainer = _trainer(strategy)
    data = (x, y, w) if weighted else (x, y)
    trainer.fit(data, batch_size=16, epochs=3, shuffle=shuffle, verbose=0)
    assert trainer.iterations == 3 * 7  # 6 batches of 16 and one of 4, as Keras
    _close(trainer, _oracle(Plain, x, y, w if weighted else None, 16, 3, shuffle))


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize("shuffle", [False, True])
def test_fit_on_arrays_trains_on_the_last_partial_batch_as_keras_does(strategy, shuffle):
    """10 examples in batches of 4: 3 steps an epoch (Keras' count), the last on 2 examples,
    padded and masked for the replicas, its loss a mean over those 2: equal to one device's
    hand-written loop over the same batches."""
    x, y, _ = _data(10)
    trainer = _trainer(strategy)
    history = trainer.fit((x, y), batch_size=4, epochs=2, shuffle=shuffle, verbose=0)
    assert trainer.iterations == 6
    _close(trainer, _oracle(Plain, x, y, None, 4, 2, shuffle))
    assert np.isfinite(history.history["loss"]).all()


class Normed(nnx.Module):
    """A training pass that writes state (BatchNorm statistics)."""

    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.norm(x))


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_model_that_writes_state_drops_the_partial_batch_and_says_so(strategy, caplog):
    """Padded rows would enter BatchNorm's statistics, so the partial batch is never padded
    for such a model: it is dropped, as before, and a WARNING says so (docs/migration.md)."""
    x, y, _ = _data(20)
    trainer = _trainer(strategy, Normed)
    with caplog.at_level("WARNING", logger="spmd.trainer"):
        trainer.fit((x, y), batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert trainer.iterations == 2
    [record] = [r for r in caplog.records if r.name == "spmd.trainer"]
    assert record.levelname == "WARNING"
    assert "fit drops the last partial batch of each epoch, 4 of 20 examples" in record.message
    assert "norm/" in record.message


@pytest.mark.slow
@pytest.mark.parametrize("shuffle", [False, True])
def test_fit_on_a_dict_of_named_inputs_with_steps_per_epoch(strategy, shuffle):
    x, y, w = _data(96)
    named = {"b": x[:, 3:], "a": x[:, :3]}
    trainer = _trainer(strategy, Named)
    trainer.fit(
        (named, y, w), batch_size=16, epochs=2, steps_per_epoch=4, shuffle=shuffle, verbose=0
    )
    assert trainer.iterations == 8
    _close(trainer, _oracle(Named, named, y, w, 16, 2, shuffle, steps=4))


@pytest.mark.slow
def test_fit_on_fortran_order_and_strided_arrays_equals_contiguous(strategy):
    x, y, _ = _data(128)
    wide = np.zeros((256, 4), np.float32)
    wide[::2] = x
    views = (np.asfortranarray(x), wide[::2])
    for view in views:
        trainer = _trainer(strategy)
        trainer.fit((view, np.asfortranarray(y)), batch_size=32, epochs=2, shuffle=False, verbose=0)
        _close(trainer, _oracle(Plain, x, y, None, 32, 2, False))


@pytest.mark.slow
def test_fit_on_float64_and_int_x_is_cast_as_jax_jit_casts(strategy):
    x, y, _ = _data(64)
    trainer = _trainer(strategy)
    trainer.fit(
        (x.astype(np.float64), y.astype(np.float64)), batch_size=16, shuffle=False, verbose=0
    )
    _close(trainer, _oracle(Plain, x, y, None, 16, 1, False))


def test_mutating_x_after_fit_leaves_the_trained_params(strategy):
    x, y, _ = _data(64)
    trainer = _trainer(strategy)
    trainer.fit((x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)
    before = [np.array(a) for a in jax.tree.leaves(jax.device_get(trainer.state["params"]))]
    x[:] = np.nan
    y[:] = 1e6
    jax.block_until_ready(trainer.state)
    after = jax.tree.leaves(jax.device_get(trainer.state["params"]))
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


class Scribble(spmd.callbacks.Callback):
    """Overwrites the caller's x after each batch (a program reusing its array mid-fit)."""

    def __init__(self, x):
        self.x = x

    def on_train_batch_end(self, batch, logs=None):
        self.x[:] = batch + 1.0


@pytest.mark.slow
def test_mutating_x_during_fit_is_read_by_the_batches_not_yet_read(strategy):
    """Documents what happens: the dataset holds a view of the caller's x (no copy up
    front); each batch is copied when the reader takes it, one batch of lookahead at
    most (prefetch), so the batches read after a change see it. The oracle: batch b
    holds x's rows as the callback left them before b was read, with prefetch off."""
    x, y, _ = _data(64)
    original = x.copy()
    trainer = _trainer(strategy)
    dist = strategy.distribute_dataset(
        strategy.make_numpy_dataset((x, y), 16), spmd.InputOptions(prefetch=0)
    )
    trainer.fit(dist, epochs=1, verbose=0, callbacks=[Scribble(x)])
    expected = original.copy()
    for b in range(1, 4):
        expected[b * 16 : (b + 1) * 16] = float(b)
    _close(trainer, _oracle(Plain, expected, y, None, 16, 1, False))


class _Stop(Exception):
    pass


class _Interrupt(spmd.callbacks.Callback):
    def __init__(self, at):
        self.at = at

    def on_train_batch_end(self, batch, logs=None):
        if self.trainer.iterations == self.at:
            raise _Stop


@pytest.mark.slow
@pytest.mark.parametrize("shuffle", [False, True])
def test_backup_and_restore_mid_epoch_resumes_bitwise(strategy, tmp_path, shuffle):
    x, y, w = _data(100)
    backup = str(tmp_path / "backup")

    def fit(*callbacks):
        trainer = _trainer(strategy)
        options = {"batch_size": 16, "epochs": 3, "shuffle": shuffle, "verbose": 0}
        trainer.fit((x, y, w), callbacks=list(callbacks), **options)
        return trainer

    whole = fit()
    with pytest.raises(_Stop):
        fit(spmd.callbacks.BackupAndRestore(backup, save_freq=4), _Interrupt(10))
    resumed = fit(spmd.callbacks.BackupAndRestore(backup, save_freq=4))
    assert resumed.iterations == whole.iterations == 21  # 7 batches an epoch, the last of 4
    _close(resumed, jax.tree.leaves(jax.device_get(whole.state["params"])), exact=True)
    _close(whole, _oracle(Plain, x, y, w, 16, 3, shuffle))


@pytest.mark.slow
def test_fit_on_bfloat16_arrays_equals_the_oracle_on_the_same_rows(strategy):
    """Arrays go through NumpyDataset, which places bfloat16 as the pipeline path does."""
    x, y, _ = _data(64)
    xb = x.astype(ml_dtypes.bfloat16)
    trainer = _trainer(strategy)
    trainer.fit((xb, y), batch_size=16, shuffle=False, verbose=0)
    _close(trainer, _oracle(Plain, xb, y, None, 16, 1, False))


@pytest.mark.slow
def test_fit_on_an_iterable_of_bfloat16_batches(strategy):
    x, y, _ = _data(64)
    xb = x.astype(ml_dtypes.bfloat16)
    batches = [(xb[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    trainer = _trainer(strategy)
    trainer.fit(batches, verbose=0)
    _close(trainer, _oracle(Plain, xb, y, None, 16, 1, False))
