"""CheckpointManager.restore(partial=True): a part of a checkpoint, read and verified alone."""

import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from tests.test_checkpoint_faults import flip_bytes, make_state


def test_a_partial_target_reads_only_its_paths(tmp_path):
    state = {"params": {"w": jnp.arange(6.0).reshape(2, 3)}, "opt": {"m": jnp.ones(3)}}
    with spmd.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        part = ckpt.restore(1, target={"params": {"w": jnp.zeros((2, 3))}}, partial=True)
        np.testing.assert_array_equal(part["params"]["w"], state["params"]["w"])
        assert list(part) == ["params"]
        with pytest.raises(spmd.CheckpointError, match=r"in_checkpoint_not_in_target=\['opt/m'\]"):
            ckpt.restore(1, target={"params": state["params"]})  # not partial: the whole tree
        with pytest.raises(spmd.CheckpointError, match=r"in_target_not_in_checkpoint=\['x'\]"):
            ckpt.restore(1, target={**state, "x": jnp.ones(2)}, partial=True)
        with pytest.raises(spmd.ConfigurationError, match="partial"):
            ckpt.restore(1, target=state, partial="yes")


def test_only_the_arrays_read_are_verified(tmp_path):
    with spmd.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, make_state(1))
    flip_bytes(tmp_path / "1")  # in "w", the biggest array
    with spmd.CheckpointManager(tmp_path, read_only=True) as reader:
        b = reader.restore(1, target={"b": jnp.zeros(64)}, partial=True)["b"]
        np.testing.assert_array_equal(b, np.arange(64.0) + 1)
        with pytest.raises(spmd.CheckpointError, match=r"arrays=\['w'\]"):
            reader.restore(1, target={"w": jnp.zeros((128, 64))}, partial=True)
