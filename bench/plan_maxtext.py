"""A MaxText-shaped decoder compiled for the TPU slices MaxText's own configs name, no TPU needed.

    python -m bench.plan_maxtext v5p     # llama2-7b, v5p-512, per_device_batch_size=4, seq 4096
    python -m bench.plan_maxtext v5e     # llama2-7b, 2 x v5e-256, per_device_batch_size=4, seq 2048
    python -m bench.plan_maxtext small   # 8 such layers (1.9 B), v5e:2x2, seq 256: seconds
    python -m bench.plan_maxtext smoke   # small at seq 32 (python -m bench --quick)
    python -m bench.plan_maxtext 32b     # a 30 B decoder on v5p-128, FSDP 16 x TP 4: one compile
    python -m bench.plan_maxtext published [--quick]   # MaxText's published runs, below
    python -m bench --only plan_maxtext [--quick]   (the rows in docs/performance.md; quick: smoke)

`published` reruns MaxText's published TPU configurations
(`spmd._src.calibration.MAXTEXT_RUNS`: the model, slice, batch, remat policy
and layout of each README's row) through `spmd.auto_strategy` with MaxText's
layout, and prints a table: MaxText's verdict (it ran, at its published
TFLOP/s per chip), spmd's (the compiler's fit), and the estimated step beside
the published one. `--quick` plans one of them (v5p 32B) with one layer in
place of 32 and compares with the published rate applied to that layer.

The model is Llama 2's shape (MaxText's `model_name=llama2-7b`): vocabulary
32000, width 4096, 32 layers of 32 heads of 128, SwiGLU MLP of 11008, RMS
norms, untied embedding and head; float32 weights and AdamW moments, bfloat16
activations, layers scanned with rematerialisation (MaxText's `scan_layers`
and `remat_policy`). The state is abstract: nothing is ever allocated. The
run prints `spmd.auto_strategy`'s table for the layouts MaxText's configs use
(FSDP over every chip; data parallel over the slices) beside plain data
parallel, and checks:

- data parallel does not fit (7B float32 weights plus AdamW's two moments are
  80.9 GB before gradients, over a v5p's 95.74 GiB once gradients and
  activations join; far over a v5e's 15.75 GiB);
- FSDP over every chip fits, as MaxText runs it, and its per-chip state is the
  parameter count x 12 bytes / chips (the compiler's figure, checked against
  the published parameter count, 6.74 B).

Run it on an otherwise idle machine: each compile for 256 or 512 devices takes
minutes on two cores. `small` makes the same checks for eight of Llama 2's
layers (1.88 B parameters: 22.6 GB of state, over one v5e's HBM; 5.6 GB a chip
split over four) on a v5e:2x2, in seconds; `smoke` (the bench smoke test) the
same at sequence 32 rather than 256, about half the CPU to compile.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

import spmd
from spmd._src import calibration


@dataclass(frozen=True)
class Config:
    """A decoder's shape (MaxText's names in comments)."""

    vocab: int = 32000  # vocab_size
    width: int = 4096  # base_emb_dim
    heads: int = 32  # base_num_query_heads (= kv heads for llama2-7b)
    head_dim: int = 128  # head_dim
    mlp: int = 11008  # base_mlp_dim
    layers: int = 32  # base_num_decoder_layers
    seq: int = 4096  # max_target_length
    per_device_batch: int = 4  # per_device_batch_size
    remat: str = "minimal"  # remat_policy
    annotate: str = "maxtext"  # activations laid out by logical names, as MaxText's are

    def parameters(self) -> int:
        """Parameters: embedding, head, per layer q/k/v/o, gate/up/down and two norms, final norm."""
        per_layer = 4 * self.width * self.heads * self.head_dim + 3 * self.width * self.mlp
        return 2 * self.vocab * self.width + self.layers * (per_layer + 2 * self.width) + self.width


LLAMA2_7B = Config()

TARGETS = {
    # MaxText/configs/v5p/llama2_7b.sh: "4M token global batch size on 1 x v5p-512".
    "v5p": ("v5p-512", 1, LLAMA2_7B),
    # MaxText/configs/v5e/llama2_7b.sh: "any number of v5e-256 slices" (its AOT example: 2).
    "v5e": ("v5e-256", 2, Config(seq=2048, remat="save_qkv_proj")),
    # The same checks at a size that compiles in seconds.
    "small": ("v5e:2x2", 1, Config(layers=8, seq=256, per_device_batch=1)),
    # small at an eighth of its sequence (python -m bench --quick): the same parameters,
    # state and verdicts (data parallel's state alone is over HBM, so only FSDP compiles);
    # its compile and rank ~35 s of CPU on the machine of 2026-12-03, at seq 128 ~55.
    "smoke": ("v5e:2x2", 1, Config(layers=8, seq=32, per_device_batch=1)),
}


# A 32B-class decoder on v5p-128 in the layout of MaxText's 32B runs there (FSDP 16 x tensor 4,
# remat minimal, 6 sequences of 2048 a chip): 30.1 B parameters of this file's shape.
DECODER_32B = Config(width=7168, heads=56, mlp=19200, layers=48, seq=2048, per_device_batch=6)


def verdict_32b() -> dict:
    """Compiles the 32B decoder's one layout on v5p-128: the compiler's verdict and its cost.

    Its arguments and temporaries add up to more than a v5p's HBM, yet the
    compiler accepts the program: `auto_strategy` ranks it (docs/planning.md).
    """
    import resource

    topo = spmd.topology("v5p-128")
    c = DECODER_32B
    tokens = jax.ShapeDtypeStruct((c.per_device_batch * len(topo), c.seq + 1), jnp.int32)
    start, cpu = time.perf_counter(), time.process_time()
    _, plan = spmd.auto_strategy(create_fn(c), step_fn(c), (tokens,), topo, only="FSDP 16 x TP 4")
    e = plan.best.explanation
    print(e)
    return {
        "parameters": c.parameters(),
        "fits": e.fits,
        "upper_bound_bytes": e.peak_and_code_bytes,
        "hbm_capacity": e.hbm_capacity,
        "wall_s": round(time.perf_counter() - start, 1),
        "cpu_s": round(time.process_time() - cpu, 1),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def optimizer():
    """MaxText's default: AdamW."""
    return optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1)


def create_fn(config: Config):
    """The `create_fn` of the decoder: float32 parameters and AdamW's state."""

    def create(key):
        c = config
        keys = iter(jax.random.split(key, 12))

        def w(*shape):
            return jax.random.normal(next(keys), shape, jnp.float32) * 0.02

        qkv = c.heads * c.head_dim
        params = {
            "embed": w(c.vocab, c.width),
            "layers": {
                "q": w(c.layers, c.width, qkv),
                "k": w(c.layers, c.width, qkv),
                "v": w(c.layers, c.width, qkv),
                "o": w(c.layers, qkv, c.width),
                "gate": w(c.layers, c.width, c.mlp),
                "up": w(c.layers, c.width, c.mlp),
                "down": w(c.layers, c.mlp, c.width),
                "norm1": jnp.ones((c.layers, c.width)),
                "norm2": jnp.ones((c.layers, c.width)),
            },
            "final_norm": jnp.ones((c.width,)),
            "head": w(c.width, c.vocab),
        }
        return {"params": params, "opt": optimizer().init(params)}

    return create


def _norm(x, scale):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt((x32**2).mean(-1, keepdims=True) + 1e-6) * scale).astype(x.dtype)


QUERY_BLOCK = 512


BATCH, LENGTH, EMBED, HEADS, MLP, VOCAB = spmd.logical.ACTIVATIONS


def _constrain(x, names, annotate: str):
    """Lays out an activation: by MaxText's logical names under the strategy's rules
    ("maxtext"), by its batch alone with the other dimensions whole ("batch", as a
    constraint over the batch axes alone lays it out), or not at all ("none": the
    compiler chooses).
    """
    if annotate == "maxtext":
        return spmd.logical.constrain(x, names)
    if annotate == "batch":
        return spmd.logical.constrain(x, (BATCH,) + (None,) * (x.ndim - 1))
    return x


def _attention(q, k, v):
    """Causal attention a block of queries at a time, each block recomputed in the backward pass.

    MaxText runs a flash ("splash") attention kernel on TPU, which never holds
    the sequence x sequence scores; blocks of queries keep this model's
    memory of the same order (a block's scores, not the whole matrix).
    """
    b, s, h, d = q.shape
    block = min(QUERY_BLOCK, s)
    blocks = q.reshape(b, s // block, block, h, d).swapaxes(0, 1)

    @jax.checkpoint
    def one(args):
        qi, i = args
        scores = jnp.einsum("bqhd,bkhd->bhqk", qi, k) / jnp.sqrt(d).astype(q.dtype)
        causal = (i * block + jnp.arange(block))[:, None] >= jnp.arange(s)[None, :]
        scores = jnp.where(causal, scores.astype(jnp.float32), -1e30)
        attn = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", attn, v)

    out = jax.lax.map(one, (blocks, jnp.arange(s // block)))
    return out.swapaxes(0, 1).reshape(b, s, h, d)


# MaxText's remat policies as jax.checkpoint policies (its `remat_policy` names).
REMAT = {
    "none": jax.checkpoint_policies.everything_saveable,
    "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("qkv"),
    "full": jax.checkpoint_policies.nothing_saveable,
}


def step_fn(config: Config):
    """The train step: next-token cross entropy, AdamW."""
    c = config
    policy = REMAT[c.remat]
    residual = (BATCH, LENGTH, EMBED)

    def at(x, names):
        return _constrain(x, names, c.annotate)

    def layer(h, p):
        p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
        b, s, _ = h.shape
        x = _norm(h, p["norm1"])
        heads = (BATCH, LENGTH, HEADS, None)
        q = at(checkpoint_name(x @ p["q"], "qkv").reshape(b, s, c.heads, -1), heads)
        k = at(checkpoint_name(x @ p["k"], "qkv").reshape(b, s, c.heads, -1), heads)
        v = at(checkpoint_name(x @ p["v"], "qkv").reshape(b, s, c.heads, -1), heads)
        out = _attention(q, k, v).reshape(b, s, -1) @ p["o"]
        h = at(h + out, residual)
        x = _norm(h, p["norm2"])
        hidden = at(jax.nn.silu(x @ p["gate"]) * (x @ p["up"]), (BATCH, LENGTH, MLP))
        h = h + hidden @ p["down"]
        return at(h, residual), None

    def loss_fn(params, tokens):
        h = at(params["embed"].astype(jnp.bfloat16)[tokens[:, :-1]], residual)
        h, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy), h, params["layers"])
        h = _norm(h, params["final_norm"].astype(jnp.bfloat16))
        logits = at(h @ params["head"].astype(jnp.bfloat16), (BATCH, LENGTH, VOCAB))
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], tokens)
        updates, opt = optimizer().update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt}, {"loss": loss}

    return step


def plan(target: str) -> dict:
    """Compiles MaxText's layout and plain data parallel for a target; returns the checks."""
    name, slices, config = TARGETS[target]
    topo = spmd.topology(name, slices=slices)
    batch = config.per_device_batch * len(topo)
    tokens = jax.ShapeDtypeStruct((batch, config.seq + 1), jnp.int32)
    per_slice = len(topo) // slices
    start = time.perf_counter()
    _, table = spmd.auto_strategy(
        create_fn(config),
        step_fn(config),
        (tokens,),
        topo,
        only=["data parallel", f"FSDP over {per_slice}"],
    )
    seconds = time.perf_counter() - start
    print(table)
    fsdp = next(
        c
        for c in table.candidates
        if c.name.startswith(f"FSDP over {per_slice}") and "host memory" not in c.name
    )
    dp = next(c for c in table.candidates if c.name == "data parallel")
    n = config.parameters()
    expected_state = 12 * n / per_slice  # float32 weights and two AdamW moments, split per slice
    e = fsdp.explanation
    tokens_per_step = batch * config.seq
    model_flops = 6 * n * tokens_per_step  # the usual 6N per token (attention left out)
    result = {
        "target": f"{name} x {slices}" if slices > 1 else name,
        "seq": config.seq,
        "parameters": n,
        "compile_and_rank_s": round(seconds, 1),
        "data_parallel_fits": dp.dropped is None,
        "data_parallel_dropped": dp.dropped,
        "fsdp_fits": fsdp.dropped is None,
        "fsdp_state_bytes_per_chip": e.state_bytes if e else None,
        "expected_state_bytes_per_chip": expected_state,
        "fsdp_memory_bytes_per_chip": fsdp.memory_bytes,
        "hbm_capacity": e.hbm_capacity if e else None,
    }
    if fsdp.roofline is not None:
        step_s = fsdp.roofline.step_s
        result |= {
            "estimated_step_s": step_s,
            "bound": fsdp.roofline.bound,
            "implied_mfu": model_flops / len(topo) / step_s / topo.chip.peak_flops,
        }
    return result


# MaxText's weights under tensor parallelism (its annotations: the attention output's
# ("heads", "kv", "embed"), the MLP's wo ("mlp", "embed")): row-parallel, Megatron's pairing
# with the column-parallel q/k/v, gate and up that spmd's TP candidates make by default.
ROW_PARALLEL = [(r"params/layers/(o|down)", jax.sharding.PartitionSpec(None, "model", None))]

# MaxText's layout of each published run (its scripts' ici_fsdp_parallelism and
# ici_tensor_parallelism; -1 is every chip the other axes leave), as auto_strategy names it.
LAYOUTS = {
    ("22B", "v4-128"): "FSDP over 64",
    ("52B", "v4-384"): "FSDP over 192",
    ("16B", "v5e-256"): "FSDP over 256",
    ("32B", "v5e-256"): "FSDP over 256",
    ("64B", "v5e-256"): "FSDP over 256",
    ("32B", "v5p-128"): "FSDP 16 x TP 4",
    ("64B", "v5p-128"): "FSDP 16 x TP 4",
    ("128B", "v5p-256"): "FSDP 16 x TP 8",
}  # v5e 128B (FSDP 16 x TP 16, its qkv projections offloaded to host) is no candidate of spmd's


def published_config(run: calibration.MaxTextRun, layers: int | None = None) -> Config:
    """The decoder of a published MaxText run (optionally with fewer layers)."""
    return Config(
        vocab=run.vocab,
        width=run.width,
        heads=run.heads,
        head_dim=run.head_dim,
        mlp=run.mlp,
        layers=layers or run.layers,
        seq=run.seq,
        per_device_batch=run.batch,
        remat=run.remat,
    )


def published(run: calibration.MaxTextRun, layers: int | None = None) -> dict:
    """Plans one published run with MaxText's layout: spmd's verdict and estimate beside
    MaxText's (with `layers`, the published rate applied to that many layers)."""
    config = published_config(run, layers)
    scaled = run._replace(layers=config.layers)
    topo = spmd.topology(run.target)
    tokens = jax.ShapeDtypeStruct((run.batch * len(topo), run.seq + 1), jnp.int32)
    layout = LAYOUTS[(run.name, run.target)]
    start = time.perf_counter()
    try:
        _, table = spmd.auto_strategy(
            create_fn(config), step_fn(config), (tokens,), topo, only=[layout], rules=ROW_PARALLEL
        )
        candidate = next(c for c in table.candidates if c.name == layout)
        dropped = candidate.dropped
    except spmd.ConfigurationError as e:  # nothing fits: the table is in the message
        print(e)
        candidate, dropped = None, _reason(str(e), layout)
    seconds = time.perf_counter() - start
    fits = candidate is not None and dropped is None
    estimate = candidate.step_seconds if fits else None
    return {
        "model": run.name + (f" ({config.layers} of {run.layers} layers)" if layers else ""),
        "target": run.target,
        "layout": f"{layout}, remat {run.remat}",
        "published": f"runs: {run.tflops:g} TFLOP/s a chip ({run.mfu:.1%} MFU)",
        "spmd": "fits" if fits else dropped,
        "memory_gib": candidate.memory_bytes / 2**30
        if candidate and candidate.memory_bytes
        else None,
        "estimated_s": estimate,
        "published_s": calibration.published_step(scaled),
        "analytic_s": calibration.estimated_step(scaled),
        "compile_s": round(seconds, 1),
        "source": f"maxtext@{calibration.MAXTEXT_COMMIT[:8]}:src/maxtext/configs/tpu/{run.source}",
    }


def _reason(text: str, layout: str) -> str:
    """Why `layout` was dropped, read from the table in auto_strategy's error."""
    for line in text.splitlines():
        if line.strip().startswith(f"{layout} ("):
            return line.split("): ", 1)[1]
    return "dropped (see the table above)"


def published_rows(quick: bool = False) -> list[dict]:
    """The comparison for every published run (quick: v5p 32B, one layer)."""
    runs = [r for r in calibration.MAXTEXT_RUNS if (r.name, r.target) in LAYOUTS]
    if quick:
        return [published(next(r for r in runs if r.target == "v5p-128"), layers=1)]
    return [published(r) for r in runs]


def published_table(rows: list[dict]) -> str:
    """The comparison as a markdown table."""
    head = (
        "| model | target | layout | MaxText | spmd | memory/chip | step (est.) | "
        "step (published) | est. / published |\n| --- | --- | --- | --- | --- | --- | --- | "
        "--- | --- |"
    )
    lines = [head]
    for r in rows:
        est = r["estimated_s"]
        ratio = f"{est / r['published_s']:.2f}" if est else "-"
        memory = f"{r['memory_gib']:.2f} GiB" if r["memory_gib"] is not None else "-"
        lines.append(
            f"| {r['model']} | {r['target']} | {r['layout']} | {r['published']} | {r['spmd']} | "
            f"{memory} | {f'{est:.2f} s' if est else '-'} | {r['published_s']:.2f} s | {ratio} |"
        )
    return "\n".join(lines)


def passed(result: dict) -> bool:
    """Data parallel does not fit; FSDP does, with 12 bytes a parameter split over the chips."""
    return (
        not result["data_parallel_fits"]
        and result["fsdp_fits"]
        and abs(result["fsdp_state_bytes_per_chip"] / result["expected_state_bytes_per_chip"] - 1)
        < 0.01
    )


def main(quick: bool = False) -> list[dict]:
    """`python -m bench`'s rows: each target's checks (quick: smoke's), then the
    published runs' comparison (not in the quick mode, which stays a smoke test of
    minutes: `python -m bench.plan_maxtext published --quick` compiles one layer of
    one run, about 4 minutes of CPU here)."""
    rows = []
    for target in ["smoke"] if quick else ["v5p", "v5e"]:
        r = plan(target)
        rows.append(
            {
                "benchmark": "planning a MaxText-shaped decoder for a TPU slice (no TPU)",
                "target": r["target"],
                "parameters": f"{r['parameters'] / 1e9:.2f} B",
                "data parallel": "fits" if r["data_parallel_fits"] else "does not fit",
                "FSDP state/chip": f"{r['fsdp_state_bytes_per_chip'] / 2**30:.2f} GiB",
                "FSDP memory/chip": f"{r['fsdp_memory_bytes_per_chip'] / 2**30:.2f} GiB",
                "compile and rank (s)": r["compile_and_rank_s"],
                "checks": "pass" if passed(r) else "FAIL",
                "sequence": r["seq"],
            }
        )
    for r in [] if quick else published_rows():
        est = r["estimated_s"]
        rows.append(
            {
                "benchmark": "MaxText's published runs: verdict and step, spmd against MaxText",
                "model": r["model"],
                "target": r["target"],
                "layout": r["layout"],
                "MaxText": r["published"],
                "spmd": r["spmd"],
                "step (est.)": f"{est:.3f} s" if est else "-",
                "step (published)": f"{r['published_s']:.3f} s",
                "est. / published": f"{est / r['published_s']:.2f}" if est else "-",
                "compile (s)": r["compile_s"],
            }
        )
    return rows


def cli(argv: list[str]) -> int:
    if argv == ["32b"]:
        result = verdict_32b()
        print(json.dumps(result, indent=2))
        return 0 if result["fits"] else 1
    if argv and argv[0] == "published":
        rows = published_rows(quick="--quick" in argv)
        print(json.dumps(rows, indent=2, default=str))
        print(published_table(rows))
        return 0 if all(r["estimated_s"] for r in rows) else 1
    targets = argv or ["v5p"]
    results = [plan(t) for t in targets]
    print(json.dumps(results, indent=2, default=str))
    ok = all(passed(r) for r in results)
    print("checks:", "pass" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
