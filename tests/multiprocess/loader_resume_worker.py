"""One process of a port of a MaxText-style grain loader and a tf.data loop, crashed mid-epoch.

Usage: python loader_resume_worker.py crash|resume OUT_DIR

`crash` reads 2 batches of each loader, saves a checkpoint with the
iterator's position, reads one batch more and dies (os._exit) without
closing anything. `resume` restores the latest checkpoint into new
pipelines and reads the rest of the epoch, and reads a whole epoch of fresh
pipelines as the oracle. Each writes what this process saw to
OUT/<phase>-<i>.json.
"""

import sys

import spmd

info = spmd.initialize()

import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

PHASE, OUT = sys.argv[1:3]
N, BATCH = 192, 32
strategy = spmd.MultiWorkerMirroredStrategy()
me = jax.process_index()


def grain_loader():
    """MaxText's way: each JAX process its shard of an ArrayRecord-like source, by grain."""
    sampler = grain.samplers.IndexSampler(
        N,
        shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
        shuffle=True,
        num_epochs=1,
        seed=5,
    )
    return grain.DataLoader(
        data_source=np.arange(N, dtype=np.int32),
        sampler=sampler,
        operations=[grain.transforms.Batch(BATCH // jax.process_count())],
        worker_count=0,
    )


def tf_pipeline():
    """The tf.distribute guide's way: one pipeline of global batches, sharded by DATA."""
    return tf.data.Dataset.range(N).shuffle(N, seed=1).batch(BATCH)


LOADERS = {"grain": grain_loader, "tf": tf_pipeline}
OPTIONS = spmd.InputOptions(host_timeout=60)


def local_rows(array: jax.Array) -> list:
    shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards]).tolist()


def batches(iterator, limit=None) -> list:
    return [local_rows(b) for b in itertools.islice(iterator, limit)]


def crash() -> None:
    results, iterators = {}, []
    for name, make in LOADERS.items():
        dist = strategy.distribute_dataset(make(), OPTIONS)
        iterator = iter(dist)
        results[name] = {"first": batches(iterator, 2), "policy": dist.auto_shard_policy.name}
        ckpt = spmd.CheckpointManager(os.path.join(OUT, f"ckpt-{name}"))
        ckpt.save(2, {"w": np.zeros(2, np.float32)}, data=iterator)
        ckpt.wait()
        results[name]["after"] = batches(iterator, 1)  # read past the checkpoint, then die
        iterators.append((iterator, ckpt))
    with open(os.path.join(OUT, f"crash-{me}.json"), "w") as f:
        json.dump(results, f)
    os._exit(3)


def resume() -> None:
    results = {}
    for name, make in LOADERS.items():
        iterator = iter(strategy.distribute_dataset(make(), OPTIONS))
        with spmd.CheckpointManager(os.path.join(OUT, f"ckpt-{name}")) as ckpt:
            step = ckpt.latest_step()
            ckpt.restore(step, target={"w": np.zeros(2, np.float32)}, data=iterator)
        results[name] = {
            "step": step,
            "resumed": batches(iterator),
            "oracle": batches(strategy.distribute_dataset(make(), OPTIONS)),
        }
    with open(os.path.join(OUT, f"resume-{me}.json"), "w") as f:
        json.dump(results, f)


crash() if PHASE == "crash" else resume()
