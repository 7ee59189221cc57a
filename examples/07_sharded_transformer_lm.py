"""A small transformer language model on a 2-D (data x model) mesh: tensor parallel + data parallel.

`spmd.Strategy(mesh=spmd.make_mesh({"data": -1, "model": 2}), rules=[...])`: the rules
split the attention projections and the MLP Megatron-style over `model` (query, key,
value and the MLP's first layer by columns, their output layers by rows; Adam's moments
follow the same paths), and the batch over `data`. The model code has no sharding in
it: XLA propagates the layouts and inserts the collectives. A few steps of training
are checked against the same steps on one device.

Run: python examples/07_sharded_transformer_lm.py [--devices 8] [--steps 30]
"""

import argparse
import sys

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (even)")
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

import spmd  # noqa: E402

spmd.initialize(local_device_count=args.devices)  # first thing, in every process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

VOCAB, DIM, HEADS, MLP, LAYERS, SEQ, GLOBAL_BATCH = 32, 64, 4, 256, 2, 32, 16
tx = optax.adam(3e-3)

# The layers are stacked on a leading axis (scanned), so each spec starts with None.
RULES = [
    (r".*/attn/(wq|wk|wv)", P(None, None, "model")),  # by columns: 2 of the 4 heads a device
    (r".*/attn/wo", P(None, "model", None)),  # by rows: partial sums, all-reduced by XLA
    (r".*/mlp/w_in", P(None, None, "model")),
    (r".*/mlp/w_out", P(None, "model", None)),
    (r".*", None),  # everything else (embeddings, norms, Adam's step count) replicated
]


def create_state(key):
    keys = iter(jax.random.split(key, 8))

    def dense(*shape):  # (layers, in, out) or (in, out)
        return jax.random.normal(next(keys), shape) / shape[-2] ** 0.5

    layers = {
        "attn": {w: dense(LAYERS, DIM, DIM) for w in ("wq", "wk", "wv", "wo")},
        "mlp": {"w_in": dense(LAYERS, DIM, MLP), "w_out": dense(LAYERS, MLP, DIM)},
        "norm1": jnp.ones((LAYERS, DIM)),
        "norm2": jnp.ones((LAYERS, DIM)),
    }
    params = {"embed": dense(VOCAB, DIM), "layers": layers, "unembed": dense(DIM, VOCAB)}
    return {"params": params, "opt": tx.init(params)}


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6) * scale


def attention(p, x):
    b, t, _ = x.shape
    q, k, v = (jnp.reshape(x @ p[w], (b, t, HEADS, DIM // HEADS)) for w in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (DIM // HEADS) ** 0.5
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)  # causal
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
    return out.reshape(b, t, DIM) @ p["wo"]


def block(x, layer):
    x = x + attention(layer["attn"], rms_norm(x, layer["norm1"]))
    h = jax.nn.gelu(rms_norm(x, layer["norm2"]) @ layer["mlp"]["w_in"])
    return x + h @ layer["mlp"]["w_out"], None


def logits_fn(params, tokens):
    x, _ = jax.lax.scan(block, params["embed"][tokens], params["layers"])
    return x @ params["unembed"]


def train_step(state, tokens):
    def loss_fn(params):
        logits = logits_fn(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def batches(steps):
    """A toy language: each sequence counts up by its own stride, modulo the vocabulary."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        start = rng.integers(0, VOCAB, (GLOBAL_BATCH, 1))
        stride = rng.integers(1, 4, (GLOBAL_BATCH, 1))
        yield ((start + stride * np.arange(SEQ + 1)) % VOCAB).astype(np.int32)


def train(strategy, state):
    with strategy.scope():
        state = strategy.put(state)
        step = strategy.step(train_step)
        losses = []
        for tokens in strategy.distribute_dataset(batches(args.steps)):
            state, loss = step(state, tokens)
            losses.append(float(loss))
    return state, losses


strategy = spmd.Strategy(
    mesh=spmd.make_mesh({"data": -1, "model": 2}), rules=RULES, batch_axes=("data",)
)
print(f"{strategy}: {strategy.num_replicas_in_sync} data-parallel replicas x 2-way tensor parallel")
with strategy.scope():  # created in place: no device ever holds a whole sharded kernel
    initial = strategy.init(create_state, jax.random.key(0))
initial_copy = jax.device_get(initial)  # for the one-device run (the step donates `initial`)
state, losses = train(strategy, initial)
for path, leaf in jax.tree_util.tree_flatten_with_path(state["params"])[0]:
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    shard = leaf.addressable_shards[0].data.shape
    print(f"  {name:<18} {str(leaf.sharding.spec):<24} {leaf.shape} -> {shard} per device")
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")

oracle_state, oracle_losses = train(spmd.OneDeviceStrategy(), initial_copy)
loss_gap = float(np.max(np.abs(np.array(losses) - np.array(oracle_losses))))
weight_gap = max(
    float(np.max(np.abs(a - b)))
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state["params"])),
        jax.tree.leaves(jax.device_get(oracle_state["params"])),
        strict=True,
    )
)
print(f"largest difference from one device: loss {loss_gap:.1e}, weights {weight_gap:.1e}")
wq = state["params"]["layers"]["attn"]["wq"]
sharded = wq.addressable_shards[0].data.shape == (LAYERS, DIM, DIM // 2)
ok = sharded and losses[-1] < 0.5 * losses[0] and loss_gap < 1e-3 and weight_gap < 1e-3
sys.exit(0 if ok else 1)
