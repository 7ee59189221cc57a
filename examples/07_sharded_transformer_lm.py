"""A small transformer language model, annotated with logical axis names, on any strategy.

The model says what each dimension of its weights is, in flax's (and MaxText's)
logical names: `nnx.with_partitioning(init, ("layers", "embed", "heads"))`. A
strategy's `logical_axis_rules` say where those names go on its mesh. On a 2-D
(data x model) mesh the rules split the attention projections and the MLP
Megatron-style over `model` (query, key, value and the MLP's first layer by
columns, their output layers by rows; Adam's moments follow), and the batch over
`data`. The same model runs unchanged on OneDevice, Mirrored and ParameterServer
strategies, which replicate the names they do not map (ParameterServer then
shards by its partitioner), and every run gives the same losses.

The model is sized by an `LMConfig` and importable (bench/bench_gpu.py trains a
large one for its MFU figure); run as a script, it trains the small default.

Run: python examples/07_sharded_transformer_lm.py [--devices 8] [--steps 30]
Plan it for a TPU slice (no TPU needed; its plan_inputs()):
     spmd plan --target v5p-256 examples/07_sharded_transformer_lm.py
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

# Where the model's logical names go on a (data, model) mesh: heads and the MLP's
# hidden units over `model`; everything else replicated.
LOGICAL_AXIS_RULES = [
    ("heads", "model"),
    ("mlp", "model"),
    ("embed", None),
    ("vocab", None),
    ("layers", None),
]


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """The model's sizes and the batch it trains on (global batch of `seq + 1` tokens)."""

    vocab: int = 32
    dim: int = 64
    heads: int = 4
    mlp: int = 256
    layers: int = 2
    seq: int = 32
    batch: int = 16
    attention: str | None = None  # jax.nn.dot_product_attention's implementation ("cudnn", "xla")
    remat: bool = False  # recompute each layer's elementwise work in the backward pass

    def __post_init__(self):
        if self.dim % self.heads or min(self.dim, self.heads, self.layers, self.seq) < 1:
            raise ValueError(
                f"LMConfig needs positive sizes and heads dividing dim; got dim={self.dim}, "
                f"heads={self.heads}, layers={self.layers}, seq={self.seq}."
            )


class TransformerLM(nnx.Module):
    """Layers stacked on a leading axis (scanned); every weight says what its axes are."""

    def __init__(self, cfg: LMConfig, rngs: nnx.Rngs):
        def dense(names, *shape):  # (layers, in, out) or (in, out), annotated
            init = lambda key, shape, dtype: jax.random.normal(key, shape, dtype) / shape[-2] ** 0.5  # noqa: E731
            return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, jnp.float32))

        self.heads, self.attention, self.remat = cfg.heads, cfg.attention, cfg.remat
        self.embed = dense(("vocab", "embed"), cfg.vocab, cfg.dim)
        self.attn = nnx.Dict(
            {
                w: dense(("layers", "embed", "heads"), cfg.layers, cfg.dim, cfg.dim)
                for w in ("wq", "wk", "wv")
            }
        )
        self.attn["wo"] = dense(("layers", "heads", "embed"), cfg.layers, cfg.dim, cfg.dim)
        self.w_in = dense(("layers", "embed", "mlp"), cfg.layers, cfg.dim, cfg.mlp)
        self.w_out = dense(("layers", "mlp", "embed"), cfg.layers, cfg.mlp, cfg.dim)
        self.norm1 = nnx.Param(jnp.ones((cfg.layers, cfg.dim)))
        self.norm2 = nnx.Param(jnp.ones((cfg.layers, cfg.dim)))
        self.unembed = dense(("embed", "vocab"), cfg.dim, cfg.vocab)

    def __call__(self, tokens):
        layers = {
            "attn": {w: v[...] for w, v in self.attn.items()},
            "mlp": {"w_in": self.w_in[...], "w_out": self.w_out[...]},
            "norm1": self.norm1[...],
            "norm2": self.norm2[...],
        }

        def body(x, layer):
            return block(x, layer, self.heads, self.attention)

        if self.remat:  # keep the matmuls' outputs, recompute the rest: less memory, bigger batches
            body = jax.checkpoint(
                body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
            )
        x, _ = jax.lax.scan(body, self.embed[...][tokens], layers)
        return x @ self.unembed[...]


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6) * scale


def attention(p, x, heads, implementation=None):
    b, t, dim = x.shape
    q, k, v = (jnp.reshape(x @ p[w], (b, t, heads, dim // heads)) for w in ("wq", "wk", "wv"))
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    return out.reshape(b, t, dim) @ p["wo"]


def block(x, layer, heads, implementation=None):
    x = x + attention(layer["attn"], rms_norm(x, layer["norm1"]), heads, implementation)
    h = jax.nn.gelu(rms_norm(x, layer["norm2"]) @ layer["mlp"]["w_in"])
    return x + h @ layer["mlp"]["w_out"], None


def create(cfg: LMConfig = LMConfig()):
    model = TransformerLM(cfg, nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


def train_step(state, tokens):
    model, optimizer = state

    def loss_fn(model):
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def plan_inputs(cfg: LMConfig = LMConfig(batch=256)):
    """What `spmd plan` compiles each layout with: the model's pieces, nothing allocated.

    The batch is 256 sequences: two for each of v5p-256's 128 chips.
    """
    return dict(
        create_fn=lambda: create(cfg),
        step=train_step,
        args=(),
        batch=(jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32),),
        logical_axis_rules=LOGICAL_AXIS_RULES,
    )


def batches(cfg: LMConfig, steps: int):
    """A toy language: each sequence counts up by its own stride, modulo the vocabulary."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        start = rng.integers(0, cfg.vocab, (cfg.batch, 1))
        stride = rng.integers(1, 4, (cfg.batch, 1))
        yield ((start + stride * np.arange(cfg.seq + 1)) % cfg.vocab).astype(np.int32)


def train(strategy, steps: int, cfg: LMConfig = LMConfig()):
    # created in place: no device holds a whole sharded kernel
    state = strategy.init(lambda: create(cfg))
    step = strategy.step(train_step)
    losses = [
        float(step(state, tokens)) for tokens in strategy.distribute_dataset(batches(cfg, steps))
    ]
    return state[0], losses


def compare(runs, two_d, cfg: LMConfig) -> bool:
    """Prints each strategy's gap from one device; True if all agree and the layouts are as said."""
    from jax.sharding import PartitionSpec as P

    model, losses = runs["Strategy"]
    for path, layout in jax.tree_util.tree_flatten_with_path(
        two_d.state_spec(model, sources=True),
        is_leaf=lambda x: isinstance(x, spmd.LeafLayout),
    )[0]:
        name = jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")
        print(f"  {name:<12} {str(layout.spec):<24} from {layout.source}")

    oracle_model, oracle_losses = runs["OneDeviceStrategy"]
    ok = losses[-1] < 0.5 * losses[0]
    for name, (model, losses) in runs.items():
        loss_gap = float(np.max(np.abs(np.array(losses) - np.array(oracle_losses))))
        weight_gap = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(
                jax.tree.leaves(jax.device_get(nnx.state(model))),
                jax.tree.leaves(jax.device_get(nnx.state(oracle_model))),
                strict=True,
            )
        )
        print(
            f"{name:<24} largest difference from one device: loss {loss_gap:.1e}, weights {weight_gap:.1e}"
        )
        ok = ok and loss_gap < 1e-3 and weight_gap < 1e-3
    ps_w_in = runs["ParameterServerStrategy"][0].w_in[...].sharding.spec
    print(f"ParameterServerStrategy's partitioner splits w_in as {ps_w_in}")
    ok = ok and ps_w_in != P()
    wq = runs["Strategy"][0].attn["wq"][...]
    ok = ok and wq.sharding.spec == P(None, None, "model")
    return ok and wq.addressable_shards[0].data.shape == (cfg.layers, cfg.dim, cfg.dim // 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (even)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    spmd.initialize(local_device_count=args.devices)  # first thing, in every process

    from spmd.partitioners import MinSizePartitioner

    cfg = LMConfig()
    two_d = spmd.Strategy(
        mesh=spmd.make_mesh({"data": -1, "model": 2}),
        batch_axes=("data",),
        logical_axis_rules=LOGICAL_AXIS_RULES,
    )
    strategies = [
        spmd.OneDeviceStrategy(),  # the oracle
        spmd.MirroredStrategy(),
        spmd.ParameterServerStrategy(MinSizePartitioner(min_shard_bytes=16 << 10)),
        two_d,
    ]
    runs = {}
    for strategy in strategies:
        model, losses = train(strategy, args.steps, cfg)
        runs[strategy.name] = (model, losses)
        print(f"{strategy}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")
    return 0 if compare(runs, two_d, cfg) else 1


if __name__ == "__main__":
    sys.exit(main())
