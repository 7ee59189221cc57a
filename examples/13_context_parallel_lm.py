"""Context parallelism: a transformer LM whose sequence is split over a `context` mesh axis.

Long sequences make attention's [length, length] scores the largest thing a
device holds. `spmd.attention` splits the sequence over a `context` axis of the
mesh: each device keeps its block of the queries, gathers the keys and values
(few: grouped-query heads), and attends at its rows' global positions, so the
scores on each device fall by the size of the axis. It equals
`jax.nn.dot_product_attention` on one device, so the model is written once: this
one trains on a {data: 2, context: 4} mesh (batch over `data`, sequence over
`context`) and on one device, and the script fails if their losses differ.

Run: python examples/13_context_parallel_lm.py [--steps 30] [--data 2 --context 4]
"""

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import spmd


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention: two query heads share a key/value head
    layers: int = 2
    seq: int = 64  # a multiple of the context axis: each device holds seq / context tokens
    batch: int = 8


class Block(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        head_dim, kv = cfg.dim // cfg.heads, cfg.kv_heads * cfg.dim // cfg.heads
        self.cfg, self.head_dim = cfg, head_dim
        self.norm1, self.norm2 = nnx.RMSNorm(cfg.dim, rngs=rngs), nnx.RMSNorm(cfg.dim, rngs=rngs)
        self.wq = nnx.Linear(cfg.dim, cfg.dim, use_bias=False, rngs=rngs)
        self.wkv = nnx.Linear(cfg.dim, 2 * kv, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(cfg.dim, cfg.dim, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(cfg.dim, 4 * cfg.dim, rngs=rngs)
        self.down = nnx.Linear(4 * cfg.dim, cfg.dim, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).reshape(b, t, self.cfg.heads, self.head_dim)
        k, v = jnp.split(self.wkv(h).reshape(b, t, 2 * self.cfg.kv_heads, self.head_dim), 2, 2)
        # The one line context parallelism asks for: on a mesh with a `context` axis the
        # sequence is split over it; without one, it is jax.nn.dot_product_attention.
        out = spmd.attention(q, k, v, causal=True, axis="context")
        x = x + self.wo(out.reshape(b, t, -1))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class LM(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (cfg.seq, cfg.dim)) * 0.02)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.out = nnx.Linear(cfg.dim, cfg.vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def create(cfg: Config):
    model = LM(cfg, nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


def train_step(state, tokens):
    model, optimizer = state

    def loss_fn(model):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = model(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def batches(cfg: Config, steps: int):
    """A toy language: each sequence counts up by its own stride, modulo the vocabulary."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        start = rng.integers(0, cfg.vocab, (cfg.batch, 1))
        stride = rng.integers(1, 4, (cfg.batch, 1))
        yield ((start + stride * np.arange(cfg.seq + 1)) % cfg.vocab).astype(np.int32)


def train(strategy, cfg: Config, steps: int):
    state = strategy.init(lambda: create(cfg))
    step = strategy.step(train_step)
    losses = [float(step(state, t)) for t in strategy.distribute_dataset(batches(cfg, steps))]
    return state[0], losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--context", type=int, default=4)
    args = parser.parse_args()

    spmd.initialize(local_device_count=args.data * args.context)

    cfg = Config()
    context = spmd.Strategy(
        mesh=spmd.make_mesh({"data": args.data, "context": args.context}), batch_axes=("data",)
    )
    runs = {}
    for strategy in (spmd.OneDeviceStrategy(), context):
        model, losses = train(strategy, cfg, args.steps)
        runs[strategy.name] = (model, losses)
        print(f"{strategy}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")

    (one, want), (model, got) = runs["OneDeviceStrategy"], runs["Strategy"]
    loss_gap = float(np.max(np.abs(np.array(got) - np.array(want))))
    weight_gap = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(jax.device_get(nnx.state(model))),
            jax.tree.leaves(jax.device_get(nnx.state(one))),
            strict=True,
        )
    )
    print(f"largest difference from one device: loss {loss_gap:.1e}, weights {weight_gap:.1e}")
    if loss_gap > 1e-3 or weight_gap > 1e-3 or got[-1] > 0.5 * got[0]:
        print("FAILED: context parallel training does not match one device (or did not learn)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
