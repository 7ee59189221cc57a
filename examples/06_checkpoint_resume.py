"""Fault tolerance in a custom loop: checkpoint, crash, relaunch, lose nothing.

The seeds' story ("the cluster pauses until the preempted worker restarts, then
every worker reads the checkpoint") with `spmd.CheckpointManager`: the state,
the optimizer, the PRNG key and the data position are saved together; the
relaunched loop calls `restore_or_init` and continues with the next unseen
batch. This program runs the loop once uninterrupted, then again with a crash
in the middle and a restart, and checks that both end with bitwise-equal weights;
then a `SidecarEvaluator` (the evaluator task) evaluates the kept checkpoints of
this loop's own layout, reading the parameters at `params_key="params"`.
Under `spmd launch --max-restarts N` a real crash is relaunched the same way,
and a SIGTERM makes every process save at the same step and exit with code 42.

Run: python examples/06_checkpoint_resume.py [--devices 8] [--steps 24]
"""

import argparse
import sys
import tempfile

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
parser.add_argument("--steps", type=int, default=24)
args = parser.parse_args()

import spmd  # noqa: E402

spmd.initialize(local_device_count=args.devices)  # first thing, in every process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

GLOBAL_BATCH = 32
tx = optax.adam(1e-2)
strategy = spmd.ParameterServerStrategy(spmd.partitioners.FixedShardsPartitioner(4))


def create_state(key):
    k1, k2 = jax.random.split(key)
    params = {
        "w1": jax.random.normal(k1, (8, 64)) * 0.3,
        "w2": jax.random.normal(k2, (64, 1)) * 0.3,
    }
    return {"params": params, "opt": tx.init(params), "key": jax.random.key(1)}


@strategy.step
def train_step(state, x, y):
    key, dropout_key = jax.random.split(state["key"])

    def loss_fn(params):
        hidden = jnp.tanh(x @ params["w1"])
        keep = jax.random.bernoulli(
            dropout_key, 0.9, hidden.shape
        )  # dropout: the key must resume too
        return jnp.mean((jnp.where(keep, hidden / 0.9, 0.0) @ params["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "key": key}, loss


rng = np.random.default_rng(0)
x_all = rng.normal(size=(GLOBAL_BATCH * 8, 8)).astype(np.float32)
y_all = np.sin(x_all.sum(1, keepdims=True)).astype(np.float32)


def train(directory: str, crash_at: int | None) -> dict:
    """One launch of the job: restore or initialise, train to the end or crash."""
    dataset = strategy.distribute_dataset(
        strategy.make_numpy_dataset((x_all, y_all), GLOBAL_BATCH, shuffle=True, seed=0)
    )
    ckpt = spmd.CheckpointManager(directory, max_to_keep=2, save_interval_steps=5)
    batches = iter(dataset)
    with strategy.scope():
        state, step = ckpt.restore_or_init(create_state, jax.random.key(0), data=batches)
    if step:
        print(f"resumed at step {step}")
    while step < args.steps:
        try:
            x, y = next(batches)
        except StopIteration:  # an epoch ended: the next one reshuffles
            batches = iter(dataset)
            continue
        state, loss = train_step(state, x, y)
        step += 1
        ckpt.save(step, state, data=batches)
        if step == crash_at:
            ckpt.close()  # a crash: nothing after the last checkpoint survives
            return {}
    ckpt.save(step, state, data=batches, force=True)  # the last step, off the save interval
    ckpt.mark_final()  # the run ended: an evaluator beside it stops after this step
    ckpt.close()
    print(f"step {step}: loss {float(loss):.5f}")
    return jax.device_get(state["params"])


def predict(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def evaluate(directory: str) -> dict:
    """The evaluator task over this loop's checkpoints ({"params", "opt", "key"}): the model
    as an (init, apply) pair, its parameters read at "params", no other model state."""
    return spmd.SidecarEvaluator(
        (lambda key: create_state(key)["params"], predict),
        (x_all, y_all),
        directory,
        loss="mse",
        batch_size=GLOBAL_BATCH,
        strategy=spmd.OneDeviceStrategy(jax.devices()[0]),  # its own devices: resharded
        params_key="params",
        rest_key=None,
        final_grace=0,  # the run is over: end at its final step
    ).start()


with tempfile.TemporaryDirectory() as whole_dir, tempfile.TemporaryDirectory() as crash_dir:
    uninterrupted = train(whole_dir, crash_at=None)
    train(crash_dir, crash_at=args.steps // 2 + 2)  # dies 2 steps after a checkpoint
    resumed = train(crash_dir, crash_at=None)  # the relaunch
    history = evaluate(crash_dir)

same = all(np.array_equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
print("resumed run equals the uninterrupted one bitwise:", same)
want = float(np.mean((np.asarray(predict(resumed, x_all)) - y_all) ** 2))
last = history[args.steps]["loss"]
print(f"evaluator: steps {sorted(history)}, loss at step {args.steps} {last:.5f}")
sys.exit(0 if same and abs(last - want) < 1e-5 else 1)
