"""One process of the input-distribution checks; writes what it saw to OUT/process-<i>.json.

Usage: python data_worker.py DATA_DIR OUT_DIR
DATA_DIR holds eval.npz (x, y, w: the uneven evaluation set and the model) and
part-*.npz files; every check runs on every process, and each bad input is
caught and recorded with how long the error took to come.
"""

import logging
import sys

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

import spmd  # noqa: E402

info = spmd.initialize()

import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

DATA, OUT = sys.argv[1], sys.argv[2]
OPTIONS = spmd.InputOptions(host_timeout=30)
strategy = spmd.MultiWorkerMirroredStrategy()
me = jax.process_index()
results: dict = {"process": me, "replicas": strategy.num_replicas_in_sync}


def local_rows(array: jax.Array) -> np.ndarray:
    """The rows of a batch array that this process's devices hold, in order."""
    shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def ids_seen(dist, id_of=lambda e: e[0], mask_of=None) -> list[int]:
    seen = []
    for element in dist:
        ids = local_rows(id_of(element))
        keep = local_rows(mask_of(element)) > 0 if mask_of else slice(None)
        seen += ids[keep].tolist()
    return seen


def expect_error(name: str, fn) -> None:
    start = time.monotonic()
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - recorded for the test to judge
        results[name] = {
            "type": type(error).__name__,
            "message": str(error),
            "seconds": time.monotonic() - start,
        }
    else:
        results[name] = {"type": None, "seconds": time.monotonic() - start}


# -- every example exactly once, and exact metrics on 1,001 examples ---------------------
evaluation = np.load(os.path.join(DATA, "eval.npz"))
x, y, w = evaluation["x"], evaluation["y"], evaluation["w"]
ids = np.arange(len(x), dtype=np.int32)


@strategy.step(donate=False)
def eval_step(params, xb, yb, idb, mask):
    logits = xb @ params["w"]
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
    correct = (jnp.argmax(logits, -1) == yb).astype(jnp.float32)
    average = spmd.compute_average_loss(per_example, global_batch_size=len(x), sample_weight=mask)
    return params, {"average": average, "correct": jnp.sum(correct * mask), "count": jnp.sum(mask)}


params = {"w": w}
totals = {"average": 0.0, "correct": 0.0, "count": 0.0}
seen = []
dist = strategy.distribute_dataset(
    strategy.make_numpy_dataset((x, y, ids), 64, drop_remainder=False), OPTIONS
)
for xb, yb, idb, mask in dist:
    params, metrics = eval_step(params, xb, yb, idb, mask)
    totals = {k: v + float(metrics[k]) for k, v in totals.items()}
    seen += local_rows(idb)[local_rows(mask) > 0].tolist()
results["numpy_data"] = {"ids": seen, "totals": totals, "policy": dist.auto_shard_policy.name}

# -- FileDataset under FILE (AUTO picks it) and DATA ------------------------------------
files = sorted(glob.glob(os.path.join(DATA, "part-*.npz")))
by_file = strategy.distribute_dataset(spmd.FileDataset(files, 64), OPTIONS)
results["file"] = {
    "ids": ids_seen(by_file, id_of=lambda e: e["id"]),
    "policy": by_file.auto_shard_policy.name,
}
by_data = strategy.distribute_dataset(
    spmd.FileDataset(files, 64), spmd.InputOptions(auto_shard_policy="DATA", host_timeout=30)
)
results["file_data"] = {
    "ids": ids_seen(by_data, id_of=lambda e: e["id"]),
    "policy": by_data.auto_shard_policy.name,
}


# -- distribute_datasets_from_function -----------------------------------------------------
def dataset_fn(ctx: spmd.InputContext):
    results["context"] = [ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync]
    rows = ctx.get_per_pipeline_batch_size(64)
    mine = np.arange(320)[ctx.input_pipeline_id :: ctx.num_input_pipelines]
    return [mine[i : i + rows] for i in range(0, len(mine), rows)]


results["function"] = {
    "ids": ids_seen(strategy.distribute_datasets_from_function(dataset_fn, OPTIONS), lambda e: e)
}

# -- iterator position: stop after k batches, restore, next is batch k --------------------
shuffled = strategy.make_numpy_dataset(ids, 64, shuffle=True, seed=7)
whole = [local_rows(b).tolist() for b in strategy.distribute_dataset(shuffled, OPTIONS)]
it = iter(strategy.distribute_dataset(shuffled, OPTIONS))
for _ in range(3):
    next(it)
state = json.loads(json.dumps(it.get_state()))
it.close()
resumed = iter(strategy.distribute_dataset(shuffled, OPTIONS))
resumed.set_state(state)
results["position"] = {
    "state": state,
    "next": local_rows(next(resumed)).tolist(),
    "want": whole[3],
}
resumed.close()

# -- bad input: a clear error on every process --------------------------------------------
one_file = spmd.FileDataset(files[:1], 64)
expect_error(
    "fewer_files",
    lambda: strategy.distribute_dataset(one_file, spmd.InputOptions(auto_shard_policy="FILE")),
)
expect_error(
    "not_divisible",
    lambda: strategy.distribute_dataset(strategy.make_numpy_dataset(ids, 66), OPTIONS),
)
expect_error(
    "not_divisible_function",
    lambda: list(strategy.distribute_datasets_from_function(lambda ctx: [np.ones(15)], OPTIONS)),
)
expect_error(
    "ragged",
    lambda: list(strategy.distribute_dataset([(np.ones((64, 2)), np.ones(60))], OPTIONS)),
)


def uneven_counts(ctx):  # process 1 has one batch more
    return [np.ones(32)] * (3 + ctx.input_pipeline_id)


def uneven_shapes(ctx):  # process 1 batches by 16 rows, process 0 by 32
    return [np.ones(32 // (1 + ctx.input_pipeline_id))] * 3


def failing(ctx):  # process 1's pipeline fails at its third batch
    yield np.ones(32)
    yield np.ones(32)
    if ctx.input_pipeline_id == 1:
        raise OSError("process 1 lost its disk")
    yield np.ones(32)


for name, fn in [("count", uneven_counts), ("shape", uneven_shapes), ("failure", failing)]:
    expect_error(
        f"disagree_{name}",
        lambda fn=fn: list(strategy.distribute_datasets_from_function(fn, OPTIONS)),
    )

# DATA: every process must read the same global batches (each keeps its rows)
mixed = [np.arange(32, dtype=np.float32) + 100 * (i + me * (i == 2)) for i in range(4)]
expect_error("disagree_content", lambda: list(strategy.distribute_dataset(mixed, OPTIONS)))
own_seed = strategy.make_numpy_dataset(ids, 64, shuffle=True, seed=me)
expect_error("disagree_seed", lambda: list(strategy.distribute_dataset(own_seed, OPTIONS)))
unchecked = spmd.InputOptions(host_timeout=30, check_contents=False)
expect_error("unchecked_content", lambda: list(strategy.distribute_dataset(mixed, unchecked)))

with open(os.path.join(OUT, f"process-{me}.json"), "w") as f:
    json.dump(results, f)
print(f"process {me} of {jax.process_count()}: done", flush=True)
