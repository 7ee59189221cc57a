"""The roofline's matmul efficiency, calibrated on MaxText's published TPU training runs.

A TPU's matrix units do not run at their peak for a whole step: MaxText's
tuned dense decoders run at 55-72% of peak by its own count (MFU). The
roofline divides a step's FLOPs by `MATMUL_EFFICIENCY` x peak. Each point of
`MAXTEXT_RUNS` is a configuration MaxText publishes with its TFLOP/s per chip
(the READMEs of src/maxtext/configs/tpu/{v4,v5e,v5p}/ at MaxText commit
`MAXTEXT_COMMIT`, with the shell script beside each giving its model and
batch): its published step time is MaxText's FLOPs per device
(`calculate_tflops_training_per_device`: 6 x weights + causal attention, no
recomputation) over that rate. The roofline's estimate of the same step is the
FLOPs the program runs (`executed_flops`: the same products, plus what its
remat policy recomputes, as spmd counts a compiled step's) over the calibrated
rate. `MATMUL_EFFICIENCY` is the geometric mean of what each run implies, so
their estimates straddle the published times.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = [
    "MATMUL_EFFICIENCY",
    "MAXTEXT_COMMIT",
    "MAXTEXT_RUNS",
    "MaxTextRun",
    "calibration_note",
    "estimated_step",
    "executed_flops",
    "maxtext_flops",
    "published_step",
]

MAXTEXT_COMMIT = "e591f30cbbf217ed67ef71263ec0538239f9c3b8"  # AI-Hypercomputer/maxtext

# Peak bf16 FLOP/s of one chip (Cloud TPU's figures, as spmd._src.topologies.CHIPS has them).
_PEAK = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12}


class MaxTextRun(NamedTuple):
    """One published MaxText training configuration: a dense Llama-style decoder.

    Attributes:
      name: the model's name in MaxText's README ("32B").
      chip, target: the TPU generation and slice ("v5p", "v5p-128").
      chips: the chips of the slice (a device each: megacore on v4 and v5p).
      width, heads, head_dim, mlp, layers, vocab: the decoder's shape
        (`emb_dim`, `num_query_heads` (= kv heads), `head_dim`, `mlp_dim`,
        `num_decoder_layers`, `vocab_size`; SwiGLU MLP).
      batch, seq: `per_device_batch_size`, `max_target_length`.
      remat: `remat_policy`.
      tflops: the published TFLOP/s per chip.
      mfu: the published MFU.
      source: the README and script, under src/maxtext/configs/tpu/.
    """

    name: str
    chip: str
    target: str
    chips: int
    width: int
    heads: int
    head_dim: int
    mlp: int
    layers: int
    vocab: int
    batch: int
    seq: int
    remat: str
    tflops: float
    mfu: float
    source: str


def _scaled(scale: int) -> tuple[int, int, int, int]:
    """(width, heads, mlp, layers) of MaxText's `global_parameter_scale` (its base.yml: 2048,
    16, 7168, 16; `get_individual_scales` doubles heads and MLP, then width, then layers)."""
    base, rem = divmod(int(math.log2(scale)), 3)
    heads = base + int(rem > 0)
    return 2048 << (base + int(rem > 1)), 16 << heads, 7168 << heads, 16 << base


def _run(name, chip, target, chips, shape, batch, remat, tflops, mfu, source) -> MaxTextRun:
    width, heads, mlp, layers = shape
    return MaxTextRun(
        name, chip, target, chips, width, heads, 128, mlp, layers, 32000, batch, 2048, remat,
        tflops, mfu, source,
    )  # fmt: skip


MAXTEXT_RUNS: tuple[MaxTextRun, ...] = (
    _run("22B", "v4", "v4-128", 64, (6144, 24, 24576, 48), 13, "full", 156, 0.567, "v4/README.md, v4/22b.sh"),
    _run("52B", "v4", "v4-384", 192, (12288, 32, 49152, 32), 7, "full", 154, 0.560, "v4/README.md, v4/52b.sh"),
    _run("16B", "v5e", "v5e-256", 256, _scaled(16), 6, "full", 120, 0.6110, "v5e/README.md, v5e/16b.sh"),
    _run("32B", "v5e", "v5e-256", 256, _scaled(32), 4, "full", 132, 0.6686, "v5e/README.md, v5e/32b.sh"),
    _run("64B", "v5e", "v5e-256", 256, _scaled(64), 2, "full", 118, 0.5990, "v5e/README.md, v5e/64b.sh"),
    _run("128B", "v5e", "v5e-256", 256, _scaled(128), 1, "qkv_proj_offloaded", 110, 0.5606, "v5e/README.md, v5e/128b.sh"),
    _run("32B", "v5p", "v5p-128", 64, _scaled(32), 6, "minimal", 328, 0.7147, "v5p/README.md, v5p/32b.sh"),
    _run("64B", "v5p", "v5p-128", 64, _scaled(64), 3, "minimal", 323, 0.7031, "v5p/README.md, v5p/64b.sh"),
    _run("128B", "v5p", "v5p-256", 128, _scaled(128), 1, "minimal", 315, 0.6868, "v5p/README.md, v5p/128b.sh"),
)  # fmt: skip


def _per_token(run: MaxTextRun) -> dict[str, float]:
    """Forward FLOPs per token by part: q/k/v, the attention output, the MLP, attention
    itself (causal: half the scores), the logits."""
    qkv = run.heads * run.head_dim
    return {
        "qkv": 2 * run.width * 3 * qkv * run.layers,
        "out": 2 * qkv * run.width * run.layers,
        "mlp": 2 * 3 * run.width * run.mlp * run.layers,
        "attention": 2 * run.seq * qkv * run.layers,
        "logits": 2 * run.width * run.vocab,
    }


# What each remat policy recomputes in the backward pass (forward parts run twice).
_RECOMPUTED = {
    "none": (),
    "minimal": ("attention",),  # dots without batch dimensions are saved
    "save_qkv_proj": ("out", "mlp", "attention"),
    "qkv_proj_offloaded": ("out", "mlp", "attention"),
    "full": ("qkv", "out", "mlp", "attention"),
}


def maxtext_flops(run: MaxTextRun) -> float:
    """MaxText's FLOPs per device and step: 3 x the forward pass, no recomputation."""
    return 3 * sum(_per_token(run).values()) * run.batch * run.seq


def executed_flops(run: MaxTextRun) -> float:
    """The FLOPs a device runs per step: MaxText's, plus the forward parts its remat
    policy recomputes (as spmd counts a compiled step's matrix products)."""
    parts = _per_token(run)
    again = sum(parts[p] for p in _RECOMPUTED[run.remat])
    return maxtext_flops(run) + again * run.batch * run.seq


def published_step(run: MaxTextRun) -> float:
    """The step time MaxText's published TFLOP/s per chip implies, in seconds."""
    return maxtext_flops(run) / (run.tflops * 1e12)


def estimated_step(run: MaxTextRun, efficiency: float | None = None) -> float:
    """The roofline's compute time for the run's step at `efficiency` of peak, in seconds."""
    eff = MATMUL_EFFICIENCY if efficiency is None else efficiency
    return executed_flops(run) / (_PEAK[run.chip] * eff)


def _calibrated() -> float:
    """The efficiency whose estimates' ratios to the published times have a geometric mean of 1."""
    implied = [executed_flops(r) / published_step(r) / _PEAK[r.chip] for r in MAXTEXT_RUNS]
    return round(math.exp(sum(map(math.log, implied)) / len(implied)), 2)


MATMUL_EFFICIENCY = _calibrated()


def calibration_note() -> str:
    """What the roofline assumes, for a plan's output."""
    ratios = [estimated_step(r) / published_step(r) for r in MAXTEXT_RUNS]
    worst = max(abs(x - 1) for x in ratios)
    return (
        f"step (est.) assumes {MATMUL_EFFICIENCY:.0%} of peak matmul throughput, calibrated on "
        f"{len(MAXTEXT_RUNS)} published MaxText runs (v4, v5e, v5p), each within {worst:.0%}"
    )
