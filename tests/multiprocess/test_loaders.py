"""grain and tf.data over 2 real processes x 2 devices: each loader's own sharding, every
example exactly once, and grain's state saved and restored by CheckpointManager."""

import json
import os
import sys
from pathlib import Path

import pytest

from spmd.testing import run_processes

WORKER = Path(__file__).with_name("loaders_worker.py")
N = 192
pytestmark = pytest.mark.multiprocess


def _run(which, tmp_path_factory, data=None):
    data, out = data or tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("out")
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    run_processes(
        [sys.executable, str(WORKER), which, str(data), str(out)],
        2,
        devices_per_process=2,
        timeout=300,
        env=env,
    )
    return [json.loads((out / f"process-{i}.json").read_text()) for i in range(2)]


@pytest.fixture(scope="module")
def grain_run(tmp_path_factory):
    return _run("grain", tmp_path_factory)


def _flat(batches):
    return [i for batch in batches for i in batch]


@pytest.mark.parametrize("key", ["loader", "sliced"])
def test_grain_every_example_exactly_once(grain_run, key):
    ids = [_flat(r[key]["batches"]) for r in grain_run]
    assert all(ids) and set(ids[0]).isdisjoint(ids[1])
    assert sorted(ids[0] + ids[1]) == list(range(N))


def test_grain_shards_by_the_input_pipelines(grain_run):
    assert [r["shard"] for r in grain_run] == [[0, 2], [1, 2]]
    assert {r["loader"]["policy"] for r in grain_run} == {"OFF"}  # found the sampler's sharding


@pytest.mark.parametrize("key", ["loader", "sliced"])
def test_grain_resume_continues_at_the_exact_example(grain_run, key):
    for result in grain_run:
        resume = result[f"resume_{key}"]
        assert resume["resumed"] == resume["rest"]
        assert resume["first"] + resume["rest"] == result[key]["batches"]
        assert sorted(resume["per_pipeline"]) == ["0", "1"]  # every pipeline's grain state
    loader = grain_run[0]["resume_loader"]["per_pipeline"]
    assert loader["0"] != loader["1"]  # each process restores its own


# -- tf.data: 4 TFRecord files of 48 ids, global batch 32, tf.distribute's FILE and DATA --------

FILES, PER_FILE, BATCH = 4, 48, 32


@pytest.fixture(scope="module")
def tf_run(tmp_path_factory):
    import tensorflow as tf

    data = tmp_path_factory.mktemp("tfrecords")
    for f in range(FILES):
        with tf.io.TFRecordWriter(str(data / f"part-{f}.tfrecord")) as writer:
            for i in range(f * PER_FILE, (f + 1) * PER_FILE):
                feature = tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))
                example = tf.train.Example(features=tf.train.Features(feature={"id": feature}))
                writer.write(example.SerializeToString())
    return _run("tf", tmp_path_factory, data)


def _cut(ids, size):
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def test_tf_file_each_process_reads_whole_files_i_mod_n(tf_run):
    per = BATCH // 2
    for index, result in enumerate(tf_run):
        files = range(index, FILES, 2)  # tf.distribute FILE: worker i reads files i::n
        want = _cut([i for f in files for i in range(f * PER_FILE, (f + 1) * PER_FILE)], per)
        assert result["tf_FILE"]["batches"] == want == result["tf_FILE"]["tf_steps"]
        assert result["tf_FILE"]["policy"] == "FILE"
    assert sorted(i for r in tf_run for i in _flat(r["tf_FILE"]["batches"])) == list(range(N))


def test_tf_data_each_process_keeps_every_nth_element(tf_run):
    per = BATCH // 2
    for index, result in enumerate(tf_run):
        # tf.distribute DATA: every worker reads everything and keeps elements i::n of the
        # rebatched stream; per process (one element per process) that is its rows of each
        # global batch, which is what spmd gives.
        assert result["tf_DATA"]["batches"] == _cut(list(range(N)), per)[index::2]
        # With 2 replicas per worker tf.distribute rebatches per replica, so worker i
        # keeps per-replica elements i::n: the same examples in every step, given to the
        # replicas in another order than spmd's contiguous block per process.
        assert result["tf_DATA"]["tf_replicas"] == _cut(list(range(N)), per // 2)[index::2]
    for step in range(N // BATCH):
        ours = sorted(r["tf_DATA"]["batches"][step][i] for r in tf_run for i in range(per))
        theirs = sorted(i for r in tf_run for i in r["tf_DATA"]["tf_steps"][step])
        assert ours == theirs == list(range(step * BATCH, (step + 1) * BATCH))
