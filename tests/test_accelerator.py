"""CentralStorageStrategy end to end: state in `pinned_host`, against one device.

On CPU `pinned_host` is the devices' own memory; with `SPMD_TEST_PLATFORM=gpu`
on a GPU machine (tests/conftest.py) these run on the GPU, where it is host
memory across the PCIe bus and a host read of a state leaf is a zero-copy view
of it (the case `read_between` covers).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import spmd

TX = optax.adam(1e-2)


def create(key):
    k1, k2 = jax.random.split(key)
    params = {
        "w1": jax.random.normal(k1, (16, 64)) * 0.1,
        "w2": jax.random.normal(k2, (64, 4)) * 0.1,
    }
    return {"params": params, "opt": TX.init(params), "step": jnp.zeros((), jnp.int32)}


def train_step(state, x, y):
    def loss_fn(p):
        return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = TX.update(grads, state["opt"], state["params"])
    new = {"params": optax.apply_updates(state["params"], updates), "opt": opt}
    return {**new, "step": state["step"] + 1}, loss


def batches(n=4):
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(32, 16)).astype(np.float32), rng.normal(size=(32, 4)).astype(np.float32))
        for _ in range(n)
    ]


def run(strategy, read_between=False):
    state = strategy.init(create, jax.random.key(0))
    step = strategy.step(train_step)
    losses = []
    for x, y in batches():
        state, loss = step(state, x, y)
        losses.append(float(loss))
        if read_between:  # a host read of every leaf: zero-copy views of pinned_host buffers
            jax.tree.map(np.asarray, state)
    return jax.device_get(state), losses


@pytest.mark.slow
def test_central_storage_keeps_the_state_in_host_memory_and_matches_one_device():
    oracle, oracle_losses = run(spmd.OneDeviceStrategy())
    strategy = spmd.CentralStorageStrategy()
    state = strategy.init(create, jax.random.key(0))
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state)} == {"pinned_host"}
    got, losses = run(strategy, read_between=True)
    np.testing.assert_allclose(losses, oracle_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, oracle)


def test_central_storage_frees_device_memory_per_explain():
    strategy = spmd.CentralStorageStrategy()
    state = strategy.abstract_state(create, jax.random.key(0))
    x, y = batches(1)[0]
    report = strategy.explain(train_step, state, x, y)
    mirrored = spmd.OneDeviceStrategy().explain(
        train_step, spmd.OneDeviceStrategy().abstract_state(create, jax.random.key(0)), x, y
    )
    assert report.state_bytes == 0
    assert report.state_host_bytes == mirrored.state_bytes > 0


@pytest.mark.slow
def test_trainer_with_dropout_fits_on_central_storage_like_one_device():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.drop = nnx.Linear(16, 32, rngs=rngs), nnx.Dropout(0.1, rngs=rngs)
            self.l2 = nnx.Linear(32, 3, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(nnx.relu(self.l1(x))))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 16)).astype(np.float32)
    y = rng.integers(0, 3, size=128).astype(np.int32)
    histories = {}
    for strategy in (spmd.OneDeviceStrategy(), spmd.CentralStorageStrategy()):
        trainer = spmd.Trainer(
            Net(nnx.Rngs(0)),
            optax.adam(1e-2),
            "sparse_categorical_crossentropy",
            ["accuracy"],
            strategy=strategy,
        )
        histories[strategy.name] = trainer.fit(
            (x, y), batch_size=32, epochs=3, verbose=0, shuffle=False
        ).history
    one, central = histories["OneDeviceStrategy"], histories["CentralStorageStrategy"]
    np.testing.assert_allclose(central["loss"], one["loss"], rtol=1e-5)
    assert central["accuracy"] == one["accuracy"]


@pytest.mark.slow
def test_checkpoint_of_a_central_storage_state_restores_bitwise(tmp_path):
    strategy = spmd.CentralStorageStrategy()
    state = strategy.init(create, jax.random.key(0))
    step = strategy.step(train_step)
    for x, y in batches(2):
        state, _ = step(state, x, y)
    with spmd.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(2, state)
        manager.wait()
        restored = manager.restore(2, target=strategy.put(jax.device_get(state)))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert a.sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x, y = batches(3)[2]
    np.testing.assert_array_equal(
        np.asarray(step(restored, x, y)[1]), np.asarray(step(state, x, y)[1])
    )


@pytest.mark.slow
def test_a_host_placed_state_is_read_not_donated():
    """Donating host buffers would save no device memory, and on a GPU a host read of
    one (np.asarray, a metric, a checkpoint) makes donating it an XLA error."""
    x, y = batches(1)[0]
    for strategy, donated in (
        (spmd.OneDeviceStrategy(), True),
        (spmd.CentralStorageStrategy(), False),
    ):
        state = strategy.init(create, jax.random.key(0))
        strategy.step(train_step)(state, x, y)
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state)) is donated
