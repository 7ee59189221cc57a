"""One process of the grain / tf.data checks; writes what it saw to OUT/process-<i>.json.

Usage: python loaders_worker.py grain|tf DATA_DIR OUT_DIR
"""

import sys

import spmd

info = spmd.initialize()

import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

WHICH, DATA, OUT = sys.argv[1:4]
N, BATCH = 192, 32
OPTIONS = spmd.InputOptions(host_timeout=60)
strategy = spmd.MultiWorkerMirroredStrategy()
me = jax.process_index()
results: dict = {"process": me}


def local_rows(array: jax.Array) -> list:
    """The rows of a batch array that this process's devices hold, in order."""
    shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards]).tolist()


def batches(iterator, limit=None) -> list:
    return [local_rows(b) for b in itertools.islice(iterator, limit)]


def grain_checks() -> None:
    import grain

    shard = spmd.grain_shard_options(strategy)
    results["shard"] = [shard.shard_index, shard.shard_count]
    per = BATCH // shard.shard_count

    def loader(seed=5):
        sampler = grain.samplers.IndexSampler(
            N, shard_options=shard, shuffle=True, num_epochs=1, seed=seed
        )
        return grain.DataLoader(
            data_source=np.arange(N, dtype=np.int32),
            sampler=sampler,
            operations=[grain.transforms.Batch(per)],
            worker_count=0,
        )

    dist = strategy.distribute_dataset(loader(), OPTIONS)
    results["loader"] = {"batches": batches(dist), "policy": dist.auto_shard_policy.name}

    def sliced():
        ds = grain.MapDataset.source(np.arange(N, dtype=np.int32)).shuffle(seed=9)
        return ds[shard.shard_index :: shard.shard_count].batch(per)

    off = spmd.InputOptions(auto_shard_policy="OFF", host_timeout=60)
    results["sliced"] = {"batches": batches(strategy.distribute_dataset(sliced(), off))}

    # Resume: 2 batches, a checkpoint, the rest; then a new pipeline restored from it.
    for name, make, options in (("loader", loader, OPTIONS), ("sliced", sliced, off)):
        iterator = iter(strategy.distribute_dataset(make(), options))
        first = batches(iterator, 2)
        directory = os.path.join(OUT, f"ckpt-{name}")
        with spmd.CheckpointManager(directory) as ckpt:
            ckpt.save(2, {"w": np.zeros(2, np.float32)}, data=iterator)
            ckpt.wait()
        rest = batches(iterator)
        resumed = iter(strategy.distribute_dataset(make(), options))
        with spmd.CheckpointManager(directory) as ckpt:
            ckpt.restore(2, target={"w": np.zeros(2, np.float32)}, data=resumed)
            position = ckpt.restore_data(2)
        results[f"resume_{name}"] = {
            "first": first,
            "rest": rest,
            "resumed": batches(resumed),
            "per_pipeline": position["per_pipeline"],
        }


def tf_checks() -> None:
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops import distribute as tf_distribute
    from tensorflow.python.distribute import input_ops

    files = sorted(os.path.join(DATA, f) for f in os.listdir(DATA) if f.endswith(".tfrecord"))

    def parse(record):
        return tf.io.parse_single_example(record, {"id": tf.io.FixedLenFeature([], tf.int64)})["id"]

    def pipeline():
        ds = tf.data.Dataset.from_tensor_slices(files)
        return ds.interleave(tf.data.TFRecordDataset, cycle_length=1).map(parse).batch(BATCH)

    for policy in ("FILE", "DATA"):
        options = spmd.InputOptions(auto_shard_policy=policy, host_timeout=60)
        dist = strategy.distribute_dataset(pipeline(), options)
        # tf.distribute's own pipeline for this worker (input_lib): rebatch to the
        # per-replica sizes, auto-shard, and one element per local replica each step.
        tf_options = tf.data.Options()
        tf_options.experimental_distribute.auto_shard_policy = getattr(
            tf.data.experimental.AutoShardPolicy, policy
        )
        sizes = tf_distribute.batch_sizes_for_worker(BATCH, 2, 2, me)
        ours = input_ops.auto_shard_dataset(
            pipeline().rebatch(sizes).with_options(tf_options), 2, me, 4
        )
        replicas = [b.tolist() for b in ours.as_numpy_iterator()]
        results[f"tf_{policy}"] = {
            "batches": batches(dist),
            "tf_replicas": replicas,
            "tf_steps": [replicas[i] + replicas[i + 1] for i in range(0, len(replicas), 2)],
            "policy": dist.auto_shard_policy.name,
        }


{"grain": grain_checks, "tf": tf_checks}[WHICH]()
with open(os.path.join(OUT, f"process-{me}.json"), "w") as f:
    json.dump(results, f)
