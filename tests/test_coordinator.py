"""spmd.ClusterCoordinator: the parameter server tutorial's custom loop, ported with its structure.

TensorFlow's tutorial ("Parameter server training with ParameterServerStrategy",
custom training loop): a `step_fn(iterator)` that takes `next(iterator)`, runs the
replica function and returns the summed loss (here the replica function is a
`@strategy.step`, the global view, in place of `strategy.run(replica_fn)` and
`strategy.reduce`; tests/test_diloco.py runs those inside a DiLoCo step); a per-worker dataset from
`coordinator.create_per_worker_dataset(per_worker_dataset_fn)`; epochs of
`coordinator.schedule(step_fn, args=(per_worker_iterator,))` with a
`coordinator.join()` at each epoch's end and the accuracy read there; a final
`schedule(...).fetch()` of the loss. Here the numbers must equal the plain
step loop's exactly: the coordinator runs the same programs, in the same order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from commands import run_program

import spmd

pytestmark = pytest.mark.cpu_mesh
FEATURES, GLOBAL_BATCH, EPOCHS, STEPS_PER_EPOCH = 6, 16, 3, 4
tx = optax.rmsprop(0.1)  # the tutorial's RMSprop(learning_rate=0.1)


def create(key):
    params = {"kernel": jax.random.normal(key, (FEATURES, 1)) * 0.1, "bias": jnp.zeros(1)}
    return {"params": params, "opt": tx.init(params)}


def train_step(state, x, y):
    """The tutorial's replica_fn: binary cross-entropy, compute_average_loss, apply_gradients."""

    def loss_fn(p):
        logits = (x @ p["kernel"] + p["bias"])[:, 0]
        per_example = optax.sigmoid_binary_cross_entropy(logits, y)
        # The batch each synchronous job averages over: the global batch, or one DiLoCo
        # island's share of it (a TF worker's own batch); passing GLOBAL_BATCH is an error there.
        return spmd.compute_average_loss(per_example), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    correct = jnp.sum((logits > 0) == (y > 0.5))
    new = {"params": optax.apply_updates(state["params"], updates), "opt": opt}
    return new, {"loss": loss, "correct": correct}


def dataset_fn(input_context):
    """Each process's share of endless (features, label) batches, as the tutorial's dataset_fn."""
    rng = np.random.default_rng(input_context.input_pipeline_id)
    batch = input_context.get_per_replica_batch_size(GLOBAL_BATCH) * (
        input_context.num_replicas_in_sync // input_context.num_input_pipelines
    )
    while True:
        x = rng.normal(size=(batch, FEATURES)).astype(np.float32)
        yield x, (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.float32)


def _ported(strategy):
    """The tutorial's loop, line for line where JAX allows (the state is threaded, not mutated)."""
    coordinator = spmd.ClusterCoordinator(strategy)
    step = strategy.step(train_step)
    state = strategy.init(create, jax.random.key(0))
    accuracy = {"correct": 0, "count": 0}  # tf.keras.metrics.Accuracy's two variables

    def step_fn(iterator):
        nonlocal state
        batch_data, labels = next(iterator)
        state, metrics = step(state, batch_data, labels)
        accuracy["correct"] = accuracy["correct"] + jnp.sum(metrics["correct"])
        accuracy["count"] += GLOBAL_BATCH
        return metrics["loss"]

    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)
    epochs = []
    for _ in range(EPOCHS):
        accuracy.update(correct=0, count=0)  # accuracy.reset_state()
        for _ in range(STEPS_PER_EPOCH):
            coordinator.schedule(step_fn, args=(per_worker_iterator,))
        coordinator.join()  # wait at epoch boundaries
        assert coordinator.done()
        epochs.append(float(accuracy["correct"]) / accuracy["count"])
    loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
    return epochs, float(np.mean(loss.fetch())), state


def _plain(strategy):
    step = strategy.step(train_step)
    state = strategy.init(create, jax.random.key(0))
    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    epochs = []
    for _ in range(EPOCHS):
        correct = 0
        for _ in range(STEPS_PER_EPOCH):
            state, metrics = step(state, *next(iterator))
            correct += int(np.sum(np.asarray(metrics["correct"])))
        epochs.append(correct / (STEPS_PER_EPOCH * GLOBAL_BATCH))
    state, metrics = step(state, *next(iterator))
    return epochs, float(np.mean(np.asarray(metrics["loss"]))), state


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda: spmd.ParameterServerStrategy(spmd.partitioners.FixedShardsPartitioner(2)),
        lambda: spmd.DiLoCo(islands=2, sync_every=3),
    ],
    ids=["parameter_server", "diloco"],
)
def test_the_tutorials_loop_equals_the_plain_step_loop(make):
    epochs, loss, state = _ported(make())
    want_epochs, want_loss, want_state = _plain(make())
    assert epochs == want_epochs
    assert loss == want_loss
    spmd.testing.assert_trees_allclose(state, want_state, rtol=0, atol=0)
    assert epochs[-1] > 0.8  # it learns


def test_schedule_returns_before_the_devices_finish_and_fetch_waits():
    strategy = spmd.MirroredStrategy()
    coordinator = spmd.ClusterCoordinator(strategy)
    big = jnp.ones((512, 512))
    value = coordinator.schedule(lambda: (big @ big @ big).sum())
    assert isinstance(value, spmd.RemoteValue)
    assert value.fetch() == np.float32(512.0**4)
    assert value.done()
    assert coordinator.fetch({"a": value, "b": 1}) == {"a": np.float32(512.0**4), "b": 1}


def test_an_error_in_a_scheduled_function_is_raised_by_join_and_fetch_then_forgotten():
    coordinator = spmd.ClusterCoordinator(spmd.MirroredStrategy())

    def fails():
        raise ValueError("bad batch")

    value = coordinator.schedule(fails)  # returns: TF raises at join / fetch, not here
    with pytest.raises(ValueError, match="bad batch"):
        value.fetch()
    with pytest.raises(ValueError, match="bad batch"):
        coordinator.join()
    coordinator.join()  # forgotten once raised
    coordinator.schedule(fails)
    with pytest.raises(ValueError, match="bad batch"):
        coordinator.schedule(lambda: 1)  # the next schedule raises the kept error


def test_a_returned_state_donated_to_the_next_step_is_waited_for_and_named_on_fetch():
    """step_fn returns the state, which the next scheduled step donates: join waits for
    everything (the donating step waited for it) and succeeds; fetching that value says
    which one it is, that the next step took it, and how to keep it."""
    strategy = spmd.MirroredStrategy()
    step = strategy.step(train_step)
    coordinator = spmd.ClusterCoordinator(strategy)
    state = strategy.init(create, jax.random.key(0))
    x = np.ones((GLOBAL_BATCH, FEATURES), np.float32)
    y = np.ones(GLOBAL_BATCH, np.float32)

    def step_fn():
        nonlocal state
        state, metrics = step(state, x, y)
        return state, metrics["loss"]

    values = [coordinator.schedule(step_fn) for _ in range(3)]
    coordinator.join()
    with pytest.raises(spmd.ConfigurationError, match="donated to that step") as info:
        values[0].fetch()
    text = str(info.value)
    assert "remote_value='step_fn (schedule call 1)'" in text
    assert "0/params/kernel" in text and "donate=False" in text
    with pytest.raises(spmd.ConfigurationError, match="schedule call 2"):
        coordinator.fetch(values[1:])
    last_state, loss = values[2].fetch()  # the last one was taken by no step
    assert np.isfinite(loss) and last_state["params"]["kernel"].shape == (FEATURES, 1)


def test_an_exhausted_iterator_in_a_scheduled_function_is_an_out_of_range_error():
    """TF's coordinator raises tf.errors.OutOfRangeError there; spmd's is also a
    StopIteration, so a loop catching either ends its epoch."""
    coordinator = spmd.ClusterCoordinator(spmd.MirroredStrategy())
    iterator = iter([np.ones(4), np.ones(4)])
    values = [coordinator.schedule(lambda: next(iterator).sum()) for _ in range(3)]
    assert values[1].fetch() == 4.0
    with pytest.raises(spmd.OutOfRangeError, match="read past the end of its iterator") as info:
        values[2].fetch()
    assert "schedule call 3" in str(info.value)
    assert isinstance(info.value, StopIteration) and isinstance(info.value, spmd.SpmdError)
    with pytest.raises(StopIteration):
        coordinator.join()
    coordinator.join()  # forgotten once raised, as any kept error


def test_the_schedule_that_raises_a_kept_error_does_not_run_its_function():
    """As docs/diloco.md says: every function scheduled before the error ran, the one whose
    schedule raises it does not; done() raises a kept error as join() does."""
    coordinator = spmd.ClusterCoordinator(spmd.MirroredStrategy())
    ran = []

    def fails():
        ran.append("fails")
        raise ValueError("bad batch")

    coordinator.schedule(lambda: ran.append("first"))
    coordinator.schedule(fails)
    with pytest.raises(ValueError, match="bad batch"):
        coordinator.schedule(lambda: ran.append("after"))
    assert ran == ["first", "fails"]
    coordinator.schedule(fails)
    with pytest.raises(ValueError, match="bad batch"):
        coordinator.done()
    assert coordinator.done()


def test_bad_arguments_say_what_to_do():
    with pytest.raises(spmd.ConfigurationError, match="coordinates a spmd strategy"):
        spmd.ClusterCoordinator("ps")
    coordinator = spmd.ClusterCoordinator(spmd.MirroredStrategy())
    with pytest.raises(spmd.ConfigurationError, match="a sequence of arguments"):
        coordinator.schedule(lambda x: x, args=5)
    with pytest.raises(spmd.ConfigurationError, match="a sequence of arguments"):
        coordinator.schedule("step_fn")


LAST_SCHEDULE_FAILS = """
import sys
import spmd

coordinator = spmd.ClusterCoordinator(spmd.MirroredStrategy())


def step():
    raise ValueError("the last step's loss went wrong")


coordinator.schedule(lambda: 1)
value = coordinator.schedule(step)
if sys.argv[1] == "fetch":
    try:
        value.fetch()
    except ValueError:
        print("handled")
elif sys.argv[1] == "join":
    try:
        coordinator.join()
    except ValueError:
        print("handled")
print("end of program", flush=True)
"""


@pytest.mark.slow  # 3 interpreters importing jax: ~9 s of CPU
@pytest.mark.parametrize("ending", ["nothing", "fetch", "join"])
def test_an_error_no_call_raised_is_raised_at_the_programs_end(ending):
    """A last schedule's error with no join: exit 1 and the traceback, not a silent 0."""
    import os
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = run_program([sys.executable, "-c", LAST_SCHEDULE_FAILS, ending], env, 300)
    assert "end of program" in done.stdout, done.stderr[-3000:]
    if ending != "nothing":  # raised to the program, which handled it: nothing at exit
        assert (done.returncode, done.stderr) == (0, ""), done.stderr[-3000:]
        assert "handled" in done.stdout
        return
    assert done.returncode == 1, done.stderr[-3000:]
    err = done.stderr
    assert "the program ended without any of them raising this one" in err, err
    assert "Received: function='step (schedule call 2)', error='ValueError'" in err, err
    assert "To fix: call coordinator.join() after the last schedule()" in err, err
    assert "ValueError: the last step's loss went wrong" in err and "Traceback" in err, err
