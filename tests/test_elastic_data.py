"""A data position saved on N processes restores on M when it maps, and is an error when not.

A position counts global batches of a recorded global batch size, i.e. global
examples. Under DATA sharding every process keeps its rows of the same global
batches, so the position means the same examples on any process count (an
elastic job that shrinks or grows loses and repeats nothing). Under FILE
sharding each process reads its own files: the batches depend on the count,
and a position saved with another count is an error naming it.
"""

import numpy as np
import pytest

import spmd

BATCH = 16


@pytest.fixture
def strategy():
    return spmd.MirroredStrategy()


def _saved_on_two_processes(state: dict) -> dict:
    """`state` as two processes (two input pipelines) would have saved it."""
    return {**state, "num_input_pipelines": 2}


def test_a_data_sharded_position_from_two_processes_restores_on_one(strategy):
    def dist():
        ids = np.arange(8 * BATCH)
        return strategy.distribute_dataset(
            strategy.make_numpy_dataset(ids, BATCH, shuffle=True, seed=3)
        )

    whole = [np.asarray(b) for b in dist()]
    it = iter(dist())
    next(it), next(it), next(it)
    state = _saved_on_two_processes(it.get_state())
    assert state["auto_shard_policy"] == "DATA"
    resumed = dist()
    resumed.set_state(state)
    rest = [np.asarray(b) for b in resumed]
    np.testing.assert_array_equal(np.concatenate(rest), np.concatenate(whole[3:]))


def test_a_file_sharded_position_from_two_processes_is_an_error_on_one(strategy, tmp_path):
    files = []
    for i in range(3):  # 3 files over 2 pipelines: they do not even divide
        np.save(tmp_path / f"part-{i}.npy", np.arange(i * 32, (i + 1) * 32, dtype=np.float32))
        files.append(str(tmp_path / f"part-{i}.npy"))
    dist = strategy.distribute_dataset(spmd.FileDataset(files, BATCH))
    assert dist.auto_shard_policy is spmd.AutoShardPolicy.FILE
    state = _saved_on_two_processes({**dist.get_state(), "batch": 2})
    with pytest.raises(spmd.ConfigurationError) as info:
        dist.set_state(state)
    text = str(info.value)
    for word in ("num_input_pipelines", "2 saved, 1 now", "auto_shard_policy='DATA'"):
        assert word in text, text
