"""ParameterServerStrategy with variable partitioners: large variables sharded, trained in sync.

tf.distribute's parameter servers hold shards of large variables, cut by a
`variable_partitioner`. spmd keeps tf.distribute's partitioners, but the shards live on
the workers' own devices (ZeRO-3 / FSDP): XLA gathers a variable where the step uses it
and reduce-scatters its gradient. For each partitioner this prints how every variable
is split and what one device holds (`strategy.explain`), trains, and checks the weights
against MirroredStrategy, which keeps every variable whole on every device.

Run: python examples/05_parameter_server.py [--devices 8] [--steps 20]
"""

import argparse
import sys

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

import spmd  # noqa: E402

spmd.initialize(local_device_count=args.devices)  # first thing, in every process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

VOCAB, DIM, HIDDEN, SEQ, GLOBAL_BATCH = 2048, 64, 256, 16, 64  # embedding: 512 KiB
tx = optax.adam(1e-2)


def create_state(key):
    k1, k2, k3 = jax.random.split(key, 3)
    params = {
        "embedding": jax.random.normal(k1, (VOCAB, DIM)) * 0.1,
        "hidden": {
            "kernel": jax.random.normal(k2, (DIM, HIDDEN)) / DIM**0.5,
            "bias": jnp.zeros(HIDDEN),
        },
        "out": {"kernel": jax.random.normal(k3, (HIDDEN, 2)) / HIDDEN**0.5, "bias": jnp.zeros(2)},
    }
    return {"params": params, "opt": tx.init(params)}


def train_step(state, tokens, labels):
    def loss_fn(p):
        pooled = p["embedding"][tokens].mean(axis=1)  # a lookup: XLA gathers the rows it needs
        hidden = jax.nn.relu(pooled @ p["hidden"]["kernel"] + p["hidden"]["bias"])
        logits = hidden @ p["out"]["kernel"] + p["out"]["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def batches(steps):
    """Token sequences; the label says whether most tokens come from the lower half."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        tokens = rng.integers(0, VOCAB, (GLOBAL_BATCH, SEQ)).astype(np.int32)
        yield tokens, ((tokens < VOCAB // 2).mean(axis=1) > 0.5).astype(np.int32)


def train(strategy, initial):
    specs = strategy.state_spec(initial)["params"]
    for path, spec in jax.tree_util.tree_flatten_with_path(specs)[0]:
        print(f"  {jax.tree_util.keystr(path, simple=True, separator='/'):<14} {spec}")
    with strategy.scope():
        state = strategy.put(initial)  # each shard goes to its devices
        step = strategy.step(train_step)
        report = strategy.explain(step, state, *next(batches(1)))
        print(
            f"  state per device {report.state_bytes / 1024:.0f} KiB, collectives: "
            f"{', '.join(f'{c.kind} x{c.count}' for c in report.collectives.values())}"
        )
        losses = []
        for x, y in strategy.distribute_dataset(batches(args.steps)):
            state, loss = step(state, x, y)
            losses.append(float(loss))
    print(
        f"  loss, mean of the first and last 5 steps: {np.mean(losses[:5]):.4f} -> "
        f"{np.mean(losses[-5:]):.4f}"
    )
    return jax.device_get(state["params"]), losses, report.state_bytes


initial = jax.device_get(jax.jit(create_state)(jax.random.key(0)))  # one start for all
print("MirroredStrategy: every variable whole on every device")
oracle, _, mirrored_bytes = train(spmd.MirroredStrategy(), initial)
ok = True
partitioners = spmd.partitioners
for partitioner in (
    partitioners.MinSizePartitioner(min_shard_bytes=64 << 10),  # shards of 64 KiB or more
    partitioners.FixedShardsPartitioner(num_shards=4),  # 4 shards (fewer if too short)
    partitioners.MaxSizePartitioner(max_shard_bytes=128 << 10),  # no shard over 128 KiB
):
    print(f"\nParameterServerStrategy({partitioner})")
    strategy = spmd.ParameterServerStrategy(variable_partitioner=partitioner)
    params, losses, state_bytes = train(strategy, initial)
    gap = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(oracle), strict=True)
    )
    print(f"  largest weight difference from MirroredStrategy: {gap:.1e}")
    learned = np.mean(losses[-5:]) < np.mean(losses[:5])
    ok = ok and gap < 1e-4 and learned and state_bytes < mirrored_bytes / 2
sys.exit(0 if ok else 1)
