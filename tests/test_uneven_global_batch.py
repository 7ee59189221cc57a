"""A global batch the replicas do not split evenly: padded with masked rows, or a mesh over
the devices that divide it; either way the training of the one-device oracle.

Eight simulated devices stand in for an elastic job's survivors: a global batch
of 6 on 4 replicas (6 does not divide over 4) against the same model, data and
seed on one device.
"""

import logging
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import spmd
from spmd._src.data.host_batches import pipeline_rows
from spmd._src.data.input_context import BlockContext, Padding, rows_of
from spmd._src.mesh import dividing_devices
from spmd._src.trainer.batch_checks import written_state

pytestmark = pytest.mark.cpu_mesh

FEATURES, BATCH = 4, 6
ROOT = Path(__file__).resolve().parents[1]


class Net(nnx.Module):
    """Dropout given its key at call time: the real rows must draw the oracle's bits."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.out(self.drop(jax.nn.relu(self.hidden(x)), rngs=rngs))


class BNNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.norm(self.hidden(x))))


def _data(n=36):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] > 0).astype(np.int32)


def _mirrored(replicas: int) -> spmd.Strategy:
    return spmd.MirroredStrategy(jax.devices()[:replicas])


def _fit(strategy, model=Net, optimizer=None, **kwargs):
    x, y = _data()
    trainer = spmd.Trainer(
        model(nnx.Rngs(0)), optimizer or optax.adam(1e-2), "sparse_categorical_crossentropy",
        metrics=("accuracy",), strategy=strategy, **kwargs,
    )  # fmt: skip
    history = trainer.fit((x, y), batch_size=BATCH, epochs=2, verbose=0)
    return trainer, history.history, jax.device_get(trainer.state["params"])


def _assert_close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _ids(strategy, batch, options=None, n=12):
    """The distributed batches of ids 0..n-1 in order, as numpy."""
    ds = strategy.make_numpy_dataset(np.arange(n, dtype=np.int32), batch)
    return strategy.distribute_dataset(ds, options)


# -- the random numbers of the real rows ---------------------------------------------------


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
def test_the_random_bits_of_the_first_rows_do_not_depend_on_the_rows_padded_after_them():
    """Padding at the end keeps Dropout's draws: with jax's partitionable threefry (on by
    default) every element's bits come from its own index, so the first 6 rows of an
    (8, 16) draw are the (6, 16) draw."""
    assert jax.config.jax_threefry_partitionable
    key = jax.random.key(3)
    for draw in (jax.random.bits, jax.random.uniform, lambda k, s: jax.random.bernoulli(k, 0.5, s)):
        np.testing.assert_array_equal(np.asarray(draw(key, (8, 16)))[:6], draw(key, (6, 16)))


# -- the Trainer pads on its own --------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_fit():
    """The one-device fit with no options, run once: the oracle of the plain fit on 4
    replicas and the trained model whose evaluate and predict the 4 replicas' must equal."""
    return _fit(_mirrored(1))


@pytest.mark.slow  # 11 s of CPU: over the fast tier's share (tests/tiers.py)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"grad_accum_steps": 2}, {"steps_per_execution": 3}],
    ids=["plain", "grad_accum_steps", "steps_per_execution"],
)
def test_fit_with_a_batch_of_6_on_4_replicas_with_dropout_equals_one_device(kwargs, plain_fit):
    """Each batch is padded to 8 rows (with 2 microbatches too: 8 = 4 x 2), the padding
    masked out of the loss, the metrics and the gradient's divisor."""
    _, want_history, want = _fit(_mirrored(1), **kwargs) if kwargs else plain_fit
    trainer, history, got = _fit(_mirrored(4), **kwargs)
    assert trainer.iterations == 12
    _assert_close(got, want)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(history[name], want_history[name], rtol=1e-5, err_msg=name)


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_evaluate_and_predict_with_a_batch_of_6_on_4_replicas_count_each_example_once(plain_fit):
    x, y = _data(n=40)  # 7 batches of 6, the last of 4: padded twice over
    one, _, _ = plain_fit
    four = spmd.Trainer(Net(nnx.Rngs(0)), optax.adam(1e-2), "sparse_categorical_crossentropy",
                        metrics=("accuracy",), strategy=_mirrored(4))  # fmt: skip
    four.build()
    four.load_state(one.host_state())
    want, got = one.evaluate((x, y), batch_size=BATCH), four.evaluate((x, y), batch_size=BATCH)
    assert got == pytest.approx(want, rel=1e-6)
    np.testing.assert_allclose(
        four.predict(x, batch_size=BATCH), one.predict(x, batch_size=BATCH), rtol=1e-6
    )
    assert four.predict(x, batch_size=BATCH).shape == (40, 2)


def test_a_model_with_batchnorm_statistics_on_a_padded_batch_is_an_error_before_any_step():
    """Padded rows would enter the batch statistics: the error names the ways out."""
    trainer = spmd.Trainer(
        BNNet(nnx.Rngs(0)), optax.sgd(0.1), "sparse_categorical_crossentropy",
        strategy=_mirrored(4),
    )  # fmt: skip
    x, y = _data()
    with pytest.raises(spmd.BatchError) as info:
        trainer.fit((x, y), batch_size=BATCH, verbose=0)
    text = str(info.value)
    assert "BatchNorm statistics" in text and "num_replicas_in_sync=4" in text, text
    assert "batch_rows=8" in text and "global_batch_size=" in text, text
    assert trainer.iterations == 0


@pytest.mark.slow  # 3 s of CPU: over the fast tier's share (tests/tiers.py)
def test_batchnorm_trains_as_on_one_device_over_the_devices_that_divide_the_batch():
    """MultiWorkerMirroredStrategy(global_batch_size=6) over 8 devices takes 6: nothing
    padded, so a model with BatchNorm statistics trains, on the whole batch's statistics.
    (SGD: Adam would blow up the rounding noise of the bias before BatchNorm, whose
    gradient is 0.)"""
    strategy = spmd.MultiWorkerMirroredStrategy(global_batch_size=BATCH)
    assert strategy.num_replicas_in_sync == 6 and strategy.batch_axes == ("host", "replica")
    _, want_history, want = _fit(_mirrored(1), BNNet, optax.sgd(0.1))
    _, history, got = _fit(strategy, BNNet, optax.sgd(0.1))
    _assert_close(got, want)
    np.testing.assert_allclose(history["loss"], want_history["loss"], rtol=1e-5)


class Running(nnx.Variable):
    """A user's own statistic (an RL observation normalizer's running mean): no BatchStat."""


class RunningMeanNet(nnx.Module):
    """Training updates a running mean of the inputs and the count of rows it has seen."""

    def __init__(self, rngs: nnx.Rngs):
        self.mean = Running(jnp.zeros(FEATURES))
        self.count = Running(jnp.zeros(()))
        self.out = nnx.Linear(FEATURES, 2, rngs=rngs)
        self.deterministic = False

    def __call__(self, x):
        if not self.deterministic:
            n = x.shape[0]
            total = self.mean[...] * self.count[...] + x.sum(0)
            self.mean[...] = total / (self.count[...] + n)
            self.count[...] = self.count[...] + n
        return self.out(x - self.mean[...])


class HeldDropoutNet(nnx.Module):
    """Dropout with the rngs it holds: its RNG state changes every step, from no row."""

    def __init__(self, rngs: nnx.Rngs):
        self.out = nnx.Linear(FEATURES, 2, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.out(x))


@pytest.mark.parametrize(
    "model, written",
    [
        (Net, []),
        (HeldDropoutNet, []),
        (BNNet, ["norm/mean (BatchStat)", "norm/var (BatchStat)"]),
        (RunningMeanNet, ["count (Running)", "mean (Running)"]),
    ],
)
def test_the_state_a_training_pass_writes_is_found_by_one_trace(model, written):
    trainer = spmd.Trainer(model(nnx.Rngs(0)), optax.sgd(0.1), "mse", strategy=_mirrored(4))
    trainer.build()
    assert written_state(trainer, jnp.zeros((8, FEATURES))) == written


def test_a_running_mean_of_its_own_on_a_padded_batch_is_an_error_naming_it_before_any_step():
    """Not only BatchNorm: any state the training pass writes would count the padded rows."""
    trainer = spmd.Trainer(
        RunningMeanNet(nnx.Rngs(0)), optax.sgd(0.1), "sparse_categorical_crossentropy",
        strategy=_mirrored(4),
    )  # fmt: skip
    with pytest.raises(spmd.BatchError) as info:
        trainer.fit(_data(), batch_size=BATCH, verbose=0)
    text = str(info.value)
    assert "written_variables=['count (Running)', 'mean (Running)']" in text, text
    assert "batch_rows=8" in text and "MultiWorkerMirroredStrategy(global_batch_size=" in text
    assert trainer.iterations == 0 and float(trainer.model.count[...]) == 0.0


def test_a_running_mean_of_its_own_is_exact_over_the_devices_that_divide_the_batch():
    """The way out the error names: 6 of the 8 devices, nothing padded, every row counted once."""
    x, y = _data()
    trainer = spmd.Trainer(
        RunningMeanNet(nnx.Rngs(0)), optax.sgd(0.1), "sparse_categorical_crossentropy",
        strategy=spmd.MultiWorkerMirroredStrategy(global_batch_size=BATCH),
    )  # fmt: skip
    trainer.fit((x, y), batch_size=BATCH, shuffle=False, verbose=0)
    assert float(trainer.model.count[...]) == len(x)
    np.testing.assert_allclose(trainer.model.mean[...], x.mean(0), rtol=1e-5, atol=1e-6)


# -- a custom loop opts in --------------------------------------------------------------------


def test_a_custom_loop_that_opts_in_gets_padded_batches_with_a_mask_at_every_replica_count():
    """uneven_batch="pad": a PaddedBatch whether padded (4 replicas) or not (2), so one
    loop serves every size; padding repeats the last real row, masked."""
    options = spmd.InputOptions(uneven_batch="pad")
    padded = next(iter(_ids(_mirrored(4), BATCH, options)))
    assert isinstance(padded, spmd.PaddedBatch)
    np.testing.assert_array_equal(padded.inputs[0], [0, 1, 2, 3, 4, 5, 5, 5])
    np.testing.assert_array_equal(padded.mask, [1, 1, 1, 1, 1, 1, 0, 0])
    assert padded.mask.sharding == _mirrored(4).batch_sharding(1)
    even = next(iter(_ids(_mirrored(2), BATCH, options)))
    assert isinstance(even, spmd.PaddedBatch)
    np.testing.assert_array_equal(even.mask, np.ones(BATCH))


def test_pad_if_uneven_masks_only_the_batches_it_pads_and_microbatches_round_further():
    options = spmd.InputOptions(uneven_batch="pad_if_uneven")
    assert type(next(iter(_ids(_mirrored(2), BATCH, options)))) is not spmd.PaddedBatch
    assert next(iter(_ids(_mirrored(4), BATCH, options))).mask.shape == (8,)
    twice = spmd.InputOptions(uneven_batch="pad", microbatches=2)
    assert next(iter(_ids(_mirrored(4), 10, twice, n=20))).mask.shape == (16,)  # 4 x 2 x 2
    assert Padding("pad", 3).rows(8, 4) == 12 and Padding("error").rows(6, 4) == 0


def test_a_position_saved_on_4_padded_replicas_resumes_on_2_at_the_same_examples():
    """A position counts global batches of the data's 6 rows, never the 8 placed."""
    options = spmd.InputOptions(uneven_batch="pad")
    four = iter(_ids(_mirrored(4), BATCH, options, n=24))
    next(four)
    state = four.get_state()
    assert state["global_batch_size"] == BATCH and state["batch"] == 1
    two = _ids(_mirrored(2), BATCH, options, n=24)
    two.set_state(state)
    np.testing.assert_array_equal(next(iter(two)).inputs[0], np.arange(6, 12))


def test_a_dataset_function_that_opts_in_feeds_its_rows_padded():
    """The function asks its rows per pipeline of a batch 4 replicas do not split: 6."""
    asked = []

    def dataset_fn(ctx):
        asked.append(ctx.get_per_pipeline_batch_size(BATCH))
        return [np.arange(6, dtype=np.int32), np.arange(6, 12, dtype=np.int32)]

    options = spmd.InputOptions(uneven_batch="pad")
    batches = list(_mirrored(4).distribute_datasets_from_function(dataset_fn, options))
    assert asked == [BATCH] and [b.mask.shape for b in batches] == [(8,), (8,)]
    np.testing.assert_array_equal(batches[1].inputs[0], [6, 7, 8, 9, 10, 11, 11, 11])


def test_without_opting_in_a_custom_loop_gets_an_error_naming_both_ways_out():
    with pytest.raises(spmd.BatchError) as info:
        _ids(_mirrored(4), BATCH)
    text = str(info.value)
    assert "global_batch_size=6" in text and "num_replicas_in_sync=4" in text, text
    assert "multiple of 4 (e.g. 8" in text and 'uneven_batch="pad"' in text, text
    with pytest.raises(spmd.ConfigurationError, match="uneven_batch is one of"):
        spmd.InputOptions(uneven_batch="round")
    with pytest.raises(spmd.ConfigurationError, match="microbatches"):
        spmd.InputOptions(microbatches=0)


def _input_md_padded_loop() -> str:
    """docs/input.md's custom loop over a padding dataset (the block that opts in)."""
    text = (ROOT / "docs" / "input.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    return next(b for b in blocks if 'uneven_batch="pad"' in b and "train_step" in b)


def _run_input_md_loop(replicas: int) -> tuple[np.ndarray, list[warnings.WarningMessage]]:
    """The docs' loop on `replicas` devices, 36 rows of 5 features in 2 classes; the weights
    it ends with, and the warnings it gave."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(36, 5)).astype(np.float32)
    names = {
        "spmd": spmd, "jax": jax, "jnp": jnp, "np": np, "optax": optax,
        "strategy": _mirrored(replicas), "x": x, "y": (x[:, 0] > 0).astype(np.int32),
        "w": np.zeros((5, 2), np.float32),
    }  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(_input_md_padded_loop(), names)
    return np.asarray(names["w"]), caught


def test_the_padded_custom_loop_of_the_docs_trains_on_4_replicas_as_on_one_and_warns_nothing():
    """docs/input.md's recipe: the mask as sample_weight and the global batch size you batch by
    (6) as global_batch_size; at 4 replicas each batch is padded to 8 rows."""
    got, caught = _run_input_md_loop(4)
    want, _ = _run_input_md_loop(1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not [w for w in caught if "compute_average_loss" in str(w.message)], caught


def _padded_step(strategy, **loss_kwargs):
    """A step whose loss leaves the mask or the divisor to compute_average_loss's defaults."""

    @strategy.step
    def step(w, xb, yb, mask):
        def loss_fn(w):
            per_example = (xb @ w - yb) ** 2
            given = {"sample_weight": mask, "global_batch_size": BATCH}
            given.update(loss_kwargs)
            return spmd.compute_average_loss(per_example, **given)

        return w - 0.1 * jax.grad(loss_fn)(w)

    return step


@pytest.mark.parametrize(
    "leave_out, says",
    [
        ({"global_batch_size": None}, "without global_batch_size it divides by all 8 rows"),
        ({"sample_weight": None}, "without sample_weight the padded rows enter the sum"),
    ],
    ids=["no_global_batch_size", "no_mask"],
)
def test_compute_average_loss_on_a_padded_batch_without_the_mask_or_real_rows_warns(
    leave_out, says
):
    strategy = _mirrored(4)
    x = np.arange(12 * 3, dtype=np.float32).reshape(12, 3) / 36
    dist = strategy.distribute_dataset(
        strategy.make_numpy_dataset((x, x.sum(1)), BATCH), spmd.InputOptions(uneven_batch="pad")
    )
    step, w = _padded_step(strategy, **leave_out), np.zeros(3, np.float32)
    with pytest.warns(UserWarning, match=says) as caught:
        for xb, yb, mask in dist:
            w = step(w, xb, yb, mask)
    text = str(caught[0].message)
    assert caught[0].filename == __file__  # the step's line that called it
    assert "batch_rows=8, data_global_batch_size=6" in text, text
    assert "global_batch_size=6, sample_weight=mask" in text, text
    # The loop is over: a step on batches that are not padded warns no more.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _padded_step(strategy, **leave_out)(w, x[:8], x[:8].sum(1), np.ones(8, np.float32))


# -- the devices that divide the batch --------------------------------------------------------


def _devices(processes: int, each: int) -> list:
    return [
        SimpleNamespace(process_index=p, id=p * 100 + i)
        for p in range(processes)
        for i in range(each)
    ]


def test_the_devices_that_divide_a_batch_are_the_most_spread_over_every_process():
    chosen = dividing_devices(_devices(2, 2), 6)  # 3 of 4: 2 in process 0, 1 in process 1
    assert [(d.process_index, d.id) for d in chosen] == [(0, 0), (0, 1), (1, 100)]
    assert len(dividing_devices(_devices(3, 2), 6)) == 6
    assert [d.process_index for d in dividing_devices(_devices(4, 2), 6)] == [0, 0, 1, 1, 2, 3]
    with pytest.raises(spmd.ConfigurationError) as info:  # 2 devices for 3 processes
        dividing_devices(_devices(3, 2), 2)
    assert "largest_dividing_count=2" in str(info.value) and "num_processes=3" in str(info.value)
    assert len(spmd.MultiWorkerMirroredStrategy(global_batch_size=7).devices) == 7
    with pytest.raises(spmd.ConfigurationError, match="global_batch_size"):
        spmd.MultiWorkerMirroredStrategy(global_batch_size=0)


def test_the_devices_a_dividing_strategy_leaves_idle_are_logged_with_why(caplog):
    caplog.set_level(logging.WARNING, logger="spmd.strategy")
    spmd.MultiWorkerMirroredStrategy(global_batch_size=5)  # 5 of the 8 devices
    text = caplog.text
    assert "MultiWorkerMirroredStrategy(global_batch_size=5) uses 5 of the 8 devices" in text
    assert "3 stay idle" in text and "global_batch_size=None" in text, text
    caplog.clear()
    spmd.MultiWorkerMirroredStrategy(global_batch_size=16)  # every device: nothing to say
    assert "idle" not in caplog.text


def test_unequal_blocks_are_fed_by_data_sharding_only():
    """Process 1 of 2 holds replica 2 of 3: rows 4-5 of a batch of 6; a pipeline of its own
    (FILE, OFF, a dataset function) cannot be an unequal part."""
    ctx = BlockContext(2, 1, 3, (2, 3))
    assert rows_of(ctx, 6) == (4, 6) and rows_of(spmd.InputContext(2, 1, 4), 8) == (4, 8)
    with pytest.raises(spmd.ConfigurationError, match="unequal numbers of replicas"):
        pipeline_rows(6, ctx, Padding())
