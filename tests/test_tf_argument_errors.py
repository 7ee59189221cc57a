"""Errors keep tf.distribute's contracts: types, and a batch's arguments by their own names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd

LOSS = jnp.arange(4.0)


@pytest.mark.parametrize("size", [10.0, np.float32(10.0), jnp.array([10]), "10"])
def test_a_global_batch_size_of_the_wrong_type_is_a_type_error_too(size):
    with pytest.raises(spmd.ArgumentTypeError, match="global_batch_size") as caught:
        spmd.compute_average_loss(LOSS, global_batch_size=size)
    assert isinstance(caught.value, TypeError)
    assert isinstance(caught.value, spmd.ConfigurationError)


@pytest.mark.parametrize("size", [0, -3])
def test_a_global_batch_size_below_one_is_a_value_error_not_a_type_error(size):
    with pytest.raises(spmd.ConfigurationError, match="positive integer") as caught:
        spmd.compute_average_loss(LOSS, global_batch_size=size)
    assert not isinstance(caught.value, TypeError)


def test_a_step_names_its_own_arguments_when_their_batch_sizes_differ():
    strategy = spmd.MirroredStrategy()

    @strategy.step
    def train_step(state, images, labels):
        return state, {"n": images.sum() + labels.sum()}

    state = strategy.put({"w": np.zeros(2, np.float32)})
    with pytest.raises(spmd.BatchError) as caught:
        train_step(state, np.zeros((16, 3), np.float32), np.zeros(8, np.float32))
    text = str(caught.value)
    assert "images=16, labels=8" in text
    assert "make images and labels the same length" in text
    assert "x and y" not in text


def test_a_step_with_star_args_names_them_by_position():
    strategy = spmd.MirroredStrategy()

    @strategy.step
    def train_step(state, *batch):
        return state, {"n": sum(b.sum() for b in batch)}

    state = strategy.put({"w": np.zeros(2, np.float32)})
    with pytest.raises(spmd.BatchError, match=r"batch\[0\]=8, batch\[1\]=16"):
        train_step(state, np.zeros(8, np.float32), np.zeros(16, np.float32))


def test_a_ragged_batch_names_an_argument_called_like_a_field_of_the_error():
    strategy = spmd.MirroredStrategy()

    @strategy.step
    def train_step(state, leading_sizes, labels):
        return state, {"n": leading_sizes.sum() + labels.sum()}

    state = strategy.put({"w": np.zeros(2, np.float32)})
    with pytest.raises(spmd.BatchError, match=r"leading_sizes=16, labels=8"):
        train_step(state, np.zeros(16, np.float32), np.zeros(8, np.float32))


def test_a_ragged_nested_argument_is_named_with_its_sizes():
    strategy = spmd.MirroredStrategy()

    @strategy.step
    def train_step(state, features):
        return state, {"n": jax.tree.reduce(lambda a, b: a + b.sum(), features, 0.0)}

    state = strategy.put({"w": np.zeros(2, np.float32)})
    features = {"a": np.zeros(8, np.float32), "b": np.zeros(16, np.float32)}
    with pytest.raises(spmd.BatchError, match=r"features=\[8, 16\]"):
        train_step(state, features)
