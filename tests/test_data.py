"""Input distribution on 8 devices in one process: sharding, padding, position, prefetch."""

import gc
import json
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from spmd._src.data.input_context import input_context
from spmd._src.data.prefetch import INLINE_S

N, BATCH, FEATURES, CLASSES = 1001, 64, 5, 3


@pytest.fixture(scope="module")
def strategy():
    return spmd.MirroredStrategy()


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=n).astype(np.int32)
    return x, y, np.arange(n, dtype=np.int32)


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "spmd-prefetch" and t.is_alive()]


def _wait_no_threads(timeout=5.0):
    deadline = time.monotonic() + timeout
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return _prefetch_threads()


def _assert_teaches(error: Exception, *words: str):
    text = str(error)
    assert "Received:" in text and "To fix:" in text, text
    for word in words:
        assert word in text, text


# -- InputContext, AutoShardPolicy, InputOptions -------------------------------


def test_input_context_batch_sizes():
    ctx = spmd.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16
    assert ctx.get_per_pipeline_batch_size(64) == 32
    with pytest.raises(spmd.BatchError) as info:
        ctx.get_per_replica_batch_size(66)
    _assert_teaches(info.value, "global_batch_size=66", "68")


@pytest.mark.cpu_mesh
def test_input_context_of_strategies(strategy):
    assert input_context(strategy) == spmd.InputContext(1, 0, 8)
    assert input_context(spmd.get_strategy()) == spmd.InputContext(1, 0, 1)


def test_policy_and_options_are_checked():
    assert spmd.AutoShardPolicy.parse("file") is spmd.AutoShardPolicy.FILE
    with pytest.raises(spmd.ConfigurationError):
        spmd.AutoShardPolicy.parse("shards")
    assert (
        spmd.InputOptions(auto_shard_policy="data").auto_shard_policy is spmd.AutoShardPolicy.DATA
    )
    for bad in ({"prefetch": -1}, {"remainder": "keep"}, {"host_timeout": 0}):
        with pytest.raises(spmd.ConfigurationError) as info:
            spmd.InputOptions(**bad)
        _assert_teaches(info.value)


# -- make_numpy_dataset ---------------------------------------------------------


@pytest.mark.parametrize("drop_remainder", [True, False])
def test_numpy_dataset_every_example_once(strategy, drop_remainder):
    x, y, ids = _data()
    ds = strategy.make_numpy_dataset((x, ids), BATCH, shuffle=True, drop_remainder=drop_remainder)
    dist = strategy.distribute_dataset(ds)
    seen = []
    for element in dist:
        xb, idb = element[:2]
        assert xb.shape == (BATCH, FEATURES) and xb.sharding == strategy.batch_sharding(2)
        np.testing.assert_array_equal(np.asarray(xb), x[np.asarray(idb)])
        keep = np.asarray(element[2]) > 0 if not drop_remainder else slice(None)
        seen += np.asarray(idb)[keep].tolist()
    want = N - N % BATCH if drop_remainder else N
    assert len(seen) == len(set(seen)) == want == dist.num_examples
    assert dist.num_batches == (15 if drop_remainder else 16)


def test_numpy_shuffle_is_deterministic_per_seed_and_epoch(strategy):
    ids = np.arange(256)

    def epochs(seed, count=2):
        dist = strategy.distribute_dataset(
            strategy.make_numpy_dataset(ids, 64, shuffle=True, seed=seed)
        )
        return [np.concatenate([np.asarray(b) for b in dist]) for _ in range(count)]

    first, again, other = epochs(1), epochs(1), epochs(2)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert sorted(first[0]) == sorted(first[1]) == list(range(256))
    assert not np.array_equal(first[0], first[1])  # a new order each epoch
    assert not np.array_equal(first[0], other[0])  # a new order for another seed


@pytest.mark.cpu_mesh
def test_numpy_dataset_bad_input(strategy):
    x, y, _ = _data()
    with pytest.raises(spmd.BatchError) as info:  # known before reading: no batch needed
        strategy.distribute_dataset(strategy.make_numpy_dataset((x, y), 66))
    _assert_teaches(info.value, "66", "72")
    assert 'uneven_batch="pad"' in str(info.value)
    with pytest.raises(spmd.BatchError) as info:
        strategy.make_numpy_dataset((x, y[:-1]), 64)
    _assert_teaches(info.value, "[1000, 1001]")


# -- exact metrics on uneven data -------------------------------------------------


def eval_metrics(strategy, x, y, batch_size=BATCH, options=None):
    """Mean loss and accuracy of a fixed linear classifier, via padded, masked batches."""
    w = np.random.default_rng(1).normal(size=(FEATURES, CLASSES)).astype(np.float32)

    @strategy.step(donate=False)
    def eval_step(params, xb, yb, mask):
        logits = xb @ params["w"]
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
        correct = (jnp.argmax(logits, -1) == yb).astype(jnp.float32)
        average = spmd.compute_average_loss(
            per_example, global_batch_size=len(x), sample_weight=mask
        )
        return params, {
            "loss_sum": jnp.sum(per_example * mask),
            "correct": jnp.sum(correct * mask),
            "count": jnp.sum(mask),
            "average": average,
        }

    params = {"w": w}
    dist = strategy.distribute_dataset(
        strategy.make_numpy_dataset((x, y), batch_size, drop_remainder=False), options
    )
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0, "average": 0.0}
    for xb, yb, mask in dist:
        params, metrics = eval_step(params, xb, yb, mask)
        for k in totals:
            totals[k] += float(metrics[k])
    assert eval_step.cache_size() == 1  # the padded last batch has the same shapes
    logits = x.astype(np.float64) @ w
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want_loss = float(np.mean(-logp[np.arange(len(y)), y]))
    want_accuracy = float(np.mean(np.argmax(logits, -1) == y))
    return totals, want_loss, want_accuracy


def test_exact_metrics_over_1001_examples(strategy):
    x, y, _ = _data()
    totals, want_loss, want_accuracy = eval_metrics(strategy, x, y)
    assert totals["count"] == N
    assert totals["loss_sum"] / N == pytest.approx(want_loss, rel=1e-5)
    assert totals["average"] == pytest.approx(want_loss, rel=1e-5)
    assert totals["correct"] / N == want_accuracy


# -- iterator position ----------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
def test_position_round_trips(strategy, prefetch):
    _, _, ids = _data()
    options = spmd.InputOptions(prefetch=prefetch)

    def dist():
        return strategy.distribute_dataset(
            strategy.make_numpy_dataset(ids, BATCH, shuffle=True, seed=3), options
        )

    whole = [np.asarray(b) for b in dist()]
    it = iter(dist())
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert state["epoch"] == 0 and state["batch"] == 5 and state["seed"] == 3
    it.close()

    resumed = iter(dist())
    resumed.set_state(state)
    np.testing.assert_array_equal(np.asarray(next(resumed)), whole[5])
    fresh = dist()
    fresh.set_state(state)
    rest = [np.asarray(b) for b in fresh]
    assert len(rest) == len(whole) - 5
    np.testing.assert_array_equal(rest[0], whole[5])
    assert fresh.get_state()["epoch"] == 1 and fresh.get_state()["batch"] == 0


def test_position_of_a_later_epoch(strategy):
    ids = np.arange(128)
    dist = strategy.distribute_dataset(strategy.make_numpy_dataset(ids, 64, shuffle=True))
    epoch0 = [np.asarray(b) for b in dist]
    it = iter(dist)
    second = np.asarray(next(it))
    assert it.get_state()["epoch"] == 1
    assert not np.array_equal(second, epoch0[0])
    again = strategy.distribute_dataset(strategy.make_numpy_dataset(ids, 64, shuffle=True))
    again.set_state({"epoch": 1, "batch": 0})
    np.testing.assert_array_equal(np.asarray(next(iter(again))), second)


def test_position_belongs_to_its_data(strategy):
    ids = np.arange(128)
    dist = strategy.distribute_dataset(strategy.make_numpy_dataset(ids, 64, shuffle=True, seed=1))
    state = dist.get_state()
    other = strategy.distribute_dataset(strategy.make_numpy_dataset(ids, 64, shuffle=True, seed=2))
    with pytest.raises(spmd.ConfigurationError) as info:
        other.set_state(state)
    _assert_teaches(info.value, "seed")
    with pytest.raises(spmd.ConfigurationError):
        iter(other).set_state({"epoch": "zero"})


def test_generic_iterable_resumes_by_replaying(strategy):
    batches = [np.full((8,), i, np.int32) for i in range(6)]
    it = iter(strategy.distribute_dataset(batches))
    next(it), next(it)
    state = it.get_state()
    resumed = iter(strategy.distribute_dataset(batches))
    resumed.set_state(state)
    assert [int(b[0]) for b in resumed] == [2, 3, 4, 5]


def test_generator_is_read_once(strategy):
    dist = strategy.distribute_dataset(np.ones(8) for _ in range(2))
    assert len(list(dist)) == 2
    with pytest.raises(spmd.ConfigurationError) as info:
        list(dist)  # a second epoch would silently be empty
    _assert_teaches(info.value, "dataset=generator")


# -- uneven and bad batches from an iterable ---------------------------------------------


def _batches(sizes):
    start = 0
    for size in sizes:
        yield (np.arange(start, start + size, dtype=np.float32), np.ones(size, np.int32))
        start += size


def test_partial_last_batch(strategy):
    with pytest.raises(spmd.BatchError) as info:
        list(strategy.distribute_dataset(_batches([16, 16, 8])))
    _assert_teaches(info.value, "remainder='pad'", "batch_size=8")

    dropped = list(
        strategy.distribute_dataset(_batches([16, 16, 8]), spmd.InputOptions(remainder="drop"))
    )
    assert len(dropped) == 2

    padded = list(
        strategy.distribute_dataset(_batches([16, 16, 8]), spmd.InputOptions(remainder="pad"))
    )
    assert [len(e) for e in padded] == [3, 3, 3]  # (x, y, mask)
    x, _, mask = padded[-1]
    assert np.asarray(mask).tolist() == [1.0] * 8 + [0.0] * 8
    assert np.asarray(x)[8:].tolist() == [39.0] * 8  # a real row repeated, not zeros


def test_padded_dict_batches_come_with_the_mask(strategy):
    data = [{"x": np.ones((16, 2), np.float32)}, {"x": np.ones((4, 2), np.float32)}]
    out = list(strategy.distribute_dataset(data, spmd.InputOptions(remainder="pad")))
    batch, mask = out[-1]
    assert batch["x"].shape == (16, 2) and float(np.asarray(mask).sum()) == 4


@pytest.mark.parametrize(
    "sizes, words",
    [
        ([16, 8, 16], ["batch_index=1", "Every batch but the last"]),
        ([16, 24], ["batch_size=24"]),
        ([12, 12], ["global_batch_size=12", "multiple of 8"]),
    ],
)
@pytest.mark.cpu_mesh
def test_bad_batch_sizes(strategy, sizes, words):
    with pytest.raises(spmd.BatchError) as info:
        list(strategy.distribute_dataset(_batches(sizes)))
    _assert_teaches(info.value, *words)


def test_ragged_batch(strategy):
    ragged = [(np.ones((16, 2)), np.ones(15))]
    with pytest.raises(spmd.BatchError) as info:
        list(strategy.distribute_dataset(ragged))
    _assert_teaches(info.value, "[15, 16]")


# -- files -----------------------------------------------------------------------------


def _write_files(tmp_path, sizes):
    paths, start = [], 0
    for i, size in enumerate(sizes):
        path = tmp_path / f"part-{i}.npz"
        ids = np.arange(start, start + size, dtype=np.int32)
        np.savez(path, id=ids, x=ids.astype(np.float32)[:, None] * np.ones(3, np.float32))
        paths.append(str(path))
        start += size
    return paths


def test_file_dataset_auto_picks_file_and_says_so(strategy, tmp_path, caplog):
    files = _write_files(tmp_path, [40, 50, 38])  # batches cross file boundaries
    with caplog.at_level(logging.INFO, logger="spmd.data"):
        dist = strategy.distribute_dataset(spmd.FileDataset(files, 32, drop_remainder=False))
    assert dist.auto_shard_policy is spmd.AutoShardPolicy.FILE
    assert "AutoShardPolicy.AUTO chose FILE" in caplog.text
    seen = []
    for batch, mask in dist:
        seen += np.asarray(batch["id"])[np.asarray(mask) > 0].tolist()
    assert seen == list(range(128))


def test_file_policy_needs_files(strategy, tmp_path):
    with pytest.raises(spmd.ConfigurationError) as info:
        strategy.distribute_dataset([np.ones(8)], spmd.InputOptions(auto_shard_policy="FILE"))
    _assert_teaches(info.value, "FileDataset")
    one_file = spmd.FileDataset(_write_files(tmp_path, [64]), 32)
    with pytest.raises(spmd.ConfigurationError) as info:
        one_file.files_for(spmd.InputContext(2, 1, 8))
    _assert_teaches(info.value, "num_files=1", "num_input_pipelines=2")


# -- distribute_datasets_from_function ----------------------------------------------------


@pytest.mark.cpu_mesh
def test_from_function_gets_its_context(strategy):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        rows = ctx.get_per_pipeline_batch_size(32)
        return [np.arange(i * rows, (i + 1) * rows) for i in range(3)]

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    assert contexts == [spmd.InputContext(1, 0, 8)]  # called eagerly, once
    assert np.concatenate([np.asarray(b) for b in dist]).tolist() == list(range(96))
    assert np.concatenate([np.asarray(b) for b in dist]).tolist() == list(range(96))
    assert len(contexts) == 2  # called again for the second pass
    with pytest.raises(spmd.ConfigurationError):
        strategy.distribute_datasets_from_function(
            dataset_fn, spmd.InputOptions(auto_shard_policy="DATA")
        )


# -- prefetch -----------------------------------------------------------------------------


def test_producer_error_surfaces_in_consumer(strategy):
    def failing():
        yield np.ones(8)
        yield np.ones(8)
        raise RuntimeError("disk on fire")

    it = iter(strategy.distribute_dataset(failing()))
    next(it), next(it)
    with pytest.raises(RuntimeError, match="disk on fire"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert not _wait_no_threads()


def test_prefetch_runs_ahead_by_its_depth_and_stops(strategy, monkeypatch):
    monkeypatch.setattr(spmd._src.data.iterator, "INLINE_S", 0.01)
    produced = []

    def counting():  # slow: each batch takes longer than the consumer's thread is given
        for i in range(100):
            time.sleep(0.03)
            produced.append(i)
            yield np.full(8, i)

    it = iter(strategy.distribute_dataset(counting(), spmd.InputOptions(prefetch=3)))
    # the first batch (not timed) and two slow ones in the consumer's thread start the thread
    assert [int(next(it)[0]) for _ in range(3)] == [0, 1, 2]
    deadline = time.monotonic() + 5
    while len(produced) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # time to run further ahead, if it wrongly would
    # 3 consumed, 3 in the queue, one held by the blocked producer, one looked ahead
    assert 6 <= len(produced) <= 8
    assert _prefetch_threads()
    assert int(next(it)[0]) == 3
    it.close()
    assert not _wait_no_threads()


def test_a_cheap_pipeline_is_placed_without_a_thread(strategy, monkeypatch):
    """A batch that comes in under INLINE_S is placed by the consumer's own next():
    a second Python thread would only compete with the step's dispatch for the GIL."""
    assert 0 < INLINE_S < 0.001
    monkeypatch.setattr(spmd._src.data.iterator, "INLINE_S", 10.0)  # cheap whatever the load
    data = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)
    it = iter(strategy.distribute_dataset(strategy.make_numpy_dataset(data, 16)))
    seen = [np.asarray(next(it)) for _ in range(3)]
    assert not _prefetch_threads()
    seen += [np.asarray(b) for b in it]
    np.testing.assert_array_equal(np.concatenate(seen), data)


def test_a_pipeline_that_turns_slow_starts_the_thread_and_keeps_every_batch(strategy, monkeypatch):
    monkeypatch.setattr(spmd._src.data.iterator, "INLINE_S", 0.5)

    def turning(n=40):
        for i in range(n):
            if i >= 10:  # read one ahead: the 10th batch is the first slow one
                time.sleep(0.6 if i < 13 else 0.0)
            yield np.full(8, i, np.float32)

    it = iter(strategy.distribute_dataset(turning(), spmd.InputOptions(prefetch=2)))
    values = [int(next(it)[0]) for _ in range(9)]
    assert not _prefetch_threads()
    values += [int(next(it)[0]) for _ in range(2)]  # the 10th and 11th: two slow in a row
    assert _prefetch_threads()
    values += [int(b[0]) for b in it]
    assert values == list(range(40))
    assert not _wait_no_threads()


def test_dropped_iterator_stops_its_thread(strategy):
    dist = strategy.distribute_dataset([np.ones(8)] * 50)
    for _ in dist:
        break  # the for loop drops the iterator
    gc.collect()
    assert not _wait_no_threads()


def test_step_takes_distributed_batches(strategy):
    @strategy.step
    def train_step(state, x, y):
        loss = jnp.mean((x @ state["w"] - y) ** 2)
        grad = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(state["w"])
        return {"w": state["w"] - 0.1 * grad}, loss

    x, y = np.ones((128, 4), np.float32), np.ones((128, 1), np.float32)
    state = {"w": np.zeros((4, 1), np.float32)}
    for xb, yb in strategy.distribute_dataset(strategy.make_numpy_dataset((x, y), 32)):
        state, loss = train_step(state, xb, yb)
    assert train_step.cache_size() == 1 and float(loss) < 1.0


@settings(max_examples=60, deadline=None)
@given(
    examples=st.integers(1, 90),
    batch=st.sampled_from([8, 16, 24]),
    drop=st.booleans(),
    remainder=st.sampled_from([None, "drop", "pad", "error"]),
    policy=st.sampled_from(["AUTO", "DATA", "OFF"]),
    shuffle=st.booleans(),
)
def test_num_batches_is_the_number_of_batches_yielded(
    strategy, examples, batch, drop, remainder, policy, shuffle
):
    ds = strategy.make_numpy_dataset(
        np.arange(examples, dtype=np.float32), batch, shuffle=shuffle, drop_remainder=drop
    )
    options = spmd.InputOptions(auto_shard_policy=policy, remainder=remainder, prefetch=0)
    if remainder == "error" and examples % batch:  # known ahead: raised before any batch
        with pytest.raises(spmd.BatchError, match="smaller than the others"):
            strategy.distribute_dataset(ds, options)
        return
    dist = strategy.distribute_dataset(ds, options)
    yielded = list(dist)
    assert dist.num_batches == len(yielded)
    padded = isinstance(yielded[-1], spmd.PaddedBatch) if yielded else False
    real = sum(int(np.asarray(b.mask).sum()) for b in yielded) if padded else len(yielded) * batch
    assert padded == ((remainder or ("drop" if drop else "pad")) == "pad")
    assert real == (examples if padded else examples // batch * batch)
    assert dist.num_examples in (None, real)  # None: OFF does not know the others' arrays


def test_dataset_position_does_not_depend_on_garbage_collection(strategy):
    """An iterator dropped mid-epoch reports where it stopped, collected or not."""
    ids = np.arange(128)
    positions = []
    for collect in (False, True):
        dist = strategy.distribute_dataset(strategy.make_numpy_dataset(ids, 16))
        for i, _ in enumerate(dist):
            if i == 2:
                break  # the iterator is dropped after 3 batches
        if collect:
            gc.collect()
        positions.append((dist.get_state()["epoch"], dist.get_state()["batch"]))
    assert positions == [(0, 3), (0, 3)]
    it = iter(dist)
    next(it)
    it.close()  # closed: the data goes on where the next iter() starts
    assert (dist.get_state()["epoch"], dist.get_state()["batch"]) == (2, 0)
    dist.set_state({"epoch": 2, "batch": 1})
    assert (dist.get_state()["epoch"], dist.get_state()["batch"]) == (2, 1)
