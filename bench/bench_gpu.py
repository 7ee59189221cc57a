"""The benchmarks of issue 15 on one accelerator: step overhead, MFU, CentralStorage.

Run: python -m bench.bench_gpu [--quick] [--output docs/performance-gpu.md] [--only NAMES]
     [--lm-dim 2048 --lm-layers 16 --lm-seq 1024 --lm-batch 16] [--profile DIR]

Runs on the default backend's first device (one GPU; the CPU with --quick for a
smoke run). Sections: overhead (the step against the hand-written jax.jit
floor), spe (steps_per_execution), feed (the fed paths), mfu (examples/07's
transformer LM in bf16: model FLOPs per step over step time and peak), central
(CentralStorageStrategy's state in pinned_host memory against OneDeviceStrategy).
Every section runs apart: one that fails prints its traceback and leaves a row
saying so.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import bench_feed, bench_step, common  # noqa: E402

SECTIONS = ("overhead", "spe", "feed", "mfu", "central", "sweep")
# Dense bf16 peak FLOP/s by device kind (NVIDIA datasheets, without sparsity).
PEAKS = (("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12))
FULL_LM = dict(vocab=32768, dim=2048, heads=16, mlp=8192, layers=16, seq=1024, batch=16)
MID_LM = dict(vocab=32768, dim=1024, heads=8, mlp=4096, layers=8, seq=1024, batch=8)
QUICK_LM = dict(vocab=256, dim=64, heads=4, mlp=256, layers=2, seq=64, batch=4)
# Models of 1.3-1.9 B parameters for the MFU sweep (cuDNN attention, remat keeping matmul outputs).
SWEEP_LMS = (
    dict(vocab=32768, dim=2048, heads=16, mlp=8192, layers=24, seq=1024, batch=32),
    dict(vocab=32768, dim=3072, heads=24, mlp=12288, layers=16, seq=1024, batch=32),
    dict(vocab=32768, dim=4096, heads=32, mlp=16384, layers=8, seq=2048, batch=16),
)
QUICK_SWEEP = (QUICK_LM,)  # one model: the best of one is the one the fit runs


def example():
    """examples/07 as a module (its file name starts with a digit)."""
    if "lm_example" not in sys.modules:
        path = ROOT / "examples" / "07_sharded_transformer_lm.py"
        spec = importlib.util.spec_from_file_location("lm_example", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["lm_example"] = module
        spec.loader.exec_module(module)
    return sys.modules["lm_example"]


def device_label() -> str:
    import jax

    return f"1x {jax.devices()[0].device_kind}"


def peak_flops() -> float | None:
    import jax

    kind = jax.devices()[0].device_kind
    return next((peak for name, peak in PEAKS if name in kind), None)


def memory(key: str) -> str:
    import jax

    stats = jax.devices()[0].memory_stats()
    return f"{stats[key] / 2**30:.2f} GiB" if stats and key in stats else "n/a"


# -- a. step overhead, b. steps_per_execution, c. fed paths, on one device


def overhead(args) -> list[dict]:
    import jax
    import numpy as np

    import spmd

    big = 128 if args.quick else 1024
    rows = []
    for model, size in (("cnn", 64), ("cnn", big), ("tiny", 64), ("mlp", 64), ("mlp", big)):
        if model == "mlp":
            rng = np.random.default_rng(0)
            x = rng.normal(size=(size, 1024)).astype(np.float32)
            y = rng.integers(0, 1024, size=size).astype(np.int32)
        else:
            x, y = common.batch(model, size)
        floor = bench_step._floor_runner(model, x, y, jax.devices()[:1])
        ours = bench_step._spmd_runner(spmd.OneDeviceStrategy(), model, x, y)
        steps = (3 if model != "tiny" else 30) if args.quick else (50 if model != "tiny" else 500)
        times = common.timeit(
            {"floor": floor, "spmd": ours}, steps=steps, repeats=2 if args.quick else 7
        )
        rows.append(
            {
                "benchmark": "step overhead (1 device)",
                "case": f"{model}, batch {size}, OneDeviceStrategy",
                "device": device_label(),
                "floor": common.fmt_time(times["floor"]),
                "spmd": common.fmt_time(times["spmd"]),
                "ratio": common.ratio(times["spmd"], times["floor"]),
            }
        )
    return rows


def spe(args) -> list[dict]:
    import jax

    import spmd

    rows = bench_step.steps_per_execution(
        args.quick, spmd.OneDeviceStrategy(), "OneDeviceStrategy", jax.devices()[:1]
    )
    for row in rows:
        row["benchmark"] = "steps_per_execution (1 device)"
        row["device"] = device_label()
    return rows


def feed(args) -> list[dict]:
    import jax

    import spmd

    rows = bench_feed.fed_rows(spmd.OneDeviceStrategy(), jax.devices()[:1], args.quick)
    for row in rows:
        row["benchmark"] = "fed paths, tiny model (1 device)"
        row["device"] = device_label()
    return rows


# -- d. MFU of the example's transformer LM in bf16


def lm_config(args, base: dict):
    sizes = dict(QUICK_LM if args.quick else base)
    for name in ("dim", "heads", "mlp", "layers", "seq", "batch", "vocab"):
        value = getattr(args, f"lm_{name}", None)
        if value is not None:
            sizes[name] = value
    return example().LMConfig(
        **sizes,
        attention=getattr(args, "lm_attention", None),
        remat=getattr(args, "lm_remat", False),
    )


def lm_pure(cfg, lr: float = 1e-4):
    """(create, step) of the example's LM as a pytree state: f32 master weights and adam,
    the forward and backward in bf16."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    lm, tx = example(), optax.adam(lr)
    graph = {}  # the module's structure, from the first create (init/abstract_state trace it)

    def create():
        graph["def"], params = nnx.split(lm.TransformerLM(cfg, nnx.Rngs(0)), nnx.Param)
        return {"params": params, "opt": tx.init(params)}

    def step(state, tokens):
        def loss_fn(params):
            half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
            logits = nnx.merge(graph["def"], half)(tokens[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    return create, step


def model_flops(cfg, tokens) -> float:
    """The model's FLOPs per step, as `explain` counts them (`Explanation.matmul_flops`), for
    the model as written: attention as einsums (a cuDNN kernel's arithmetic is invisible to
    the count) and no recomputation (remat's extra work is not the model's). Only traced."""
    import spmd
    from spmd._src.flops import matmul_flops

    plain = dataclasses.replace(cfg, attention="xla", remat=False)
    create, step_fn = lm_pure(plain)
    strategy = spmd.OneDeviceStrategy()
    traced, _ = strategy.step(step_fn).trace(strategy.abstract_state(create), tokens)
    return matmul_flops(traced.jaxpr)


def analytic_flops(cfg) -> tuple[float, int]:
    """PaLM's model FLOPs per step (Chowdhery et al. 2022, app. B): 6 N T + 12 L d s T, with N
    the matmul parameters (not the embedding lookup) and T the tokens; attention counted whole
    (no causal halving). Returns (flops, N)."""
    n = cfg.layers * (4 * cfg.dim**2 + 2 * cfg.dim * cfg.mlp) + cfg.dim * cfg.vocab
    tokens = cfg.batch * cfg.seq
    return 6 * n * tokens + 12 * cfg.layers * cfg.dim * cfg.seq * tokens, n


def lm_memory_estimate(cfg) -> float:
    """A rough bytes estimate: f32 params + adam (12 B/param) + f32 grads + bf16 copy, and bf16
    activations kept for the backward (~(10 d + 2 mlp + 2 h s) per token per layer) and logits."""
    params = cfg.layers * (4 * cfg.dim**2 + 2 * cfg.dim * cfg.mlp) + 2 * cfg.dim * cfg.vocab
    tokens = cfg.batch * cfg.seq
    acts = cfg.layers * tokens * (10 * cfg.dim + 2 * cfg.mlp + 2 * cfg.heads * cfg.seq) * 2
    return params * 18 + acts + tokens * cfg.vocab * 10


def matmul_ceiling(quick: bool) -> tuple[float, int]:
    """Measured bf16 FLOP/s of one n x n x n jnp.dot (median of 10 after warm-up)."""
    import jax
    import jax.numpy as jnp

    n = 1024 if quick else 8192
    a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in jax.random.split(jax.random.key(1)))
    dot = jax.jit(jnp.dot)
    for _ in range(3):
        dot(a, b).block_until_ready()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        dot(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times), n


def _is_oom(error: BaseException) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def mfu(args) -> list[dict]:
    """The example's LM at `args`' size; halves the batch (and says so) if it runs out of memory."""
    cfg, notes = lm_config(args, FULL_LM), []
    while True:
        try:
            return _mfu_rows(args, cfg, notes)
        except Exception as error:  # noqa: BLE001 - only memory errors retry
            if not _is_oom(error) or cfg.batch == 1:
                raise
            traceback.print_exc()
            notes.append(f"batch {cfg.batch} ran out of memory")
            cfg = dataclasses.replace(cfg, batch=cfg.batch // 2)
            gc.collect()


def _time_fit(cfg, steps: int, quick: bool) -> float:
    """Seconds per step of Trainer.fit (bf16 mixed precision) over `steps` batches, after a
    warm-up fit of 2 batches."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import spmd

    lm, strategy = example(), spmd.OneDeviceStrategy()
    with strategy.context():  # the model's annotations need a mesh
        model = lm.TransformerLM(cfg, nnx.Rngs(0))
    trainer = spmd.Trainer(
        model,
        optax.adam(1e-4),
        "sparse_categorical_crossentropy",
        strategy=strategy,
        mixed_precision="bfloat16",
    )
    tokens = np.concatenate(list(lm.batches(cfg, steps)))
    x, y = tokens[:, :-1], tokens[:, 1:]
    warm = 2 * cfg.batch
    trainer.fit((x[:warm], y[:warm]), batch_size=cfg.batch, verbose=0, shuffle=False)
    jax.block_until_ready(trainer.state)
    start = time.perf_counter()
    trainer.fit((x, y), batch_size=cfg.batch, verbose=0, shuffle=False)
    jax.block_until_ready(trainer.state)
    seconds = (time.perf_counter() - start) / steps
    del trainer
    gc.collect()
    return seconds


def _time_step(strategy, step_fn, state, tokens, steps: int):
    import jax

    step = strategy.step(step_fn)
    for _ in range(2):
        state, loss = step(state, tokens)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, loss = step(state, tokens)
    jax.block_until_ready(state)
    return (time.perf_counter() - start) / steps, state


def _mfu_rows(args, cfg, notes) -> list[dict]:
    import spmd

    steps = 2 if args.quick else 10
    ceiling, n = matmul_ceiling(args.quick)
    peak = peak_flops()
    analytic, params = analytic_flops(cfg)
    strategy = spmd.OneDeviceStrategy()
    create, step_fn = lm_pure(cfg)
    tokens = strategy.distribute_batch(next(example().batches(cfg, 1)))
    report = strategy.explain(step_fn, strategy.abstract_state(create), tokens)
    model = model_flops(cfg, tokens)
    state = strategy.init(create)
    step_s, state = _time_step(strategy, step_fn, state, tokens, steps)
    attention = "cuDNN fused" if "cudnn" in report.hlo.lower() and "fmha" in report.hlo else "XLA"
    if args.profile:
        _profile(args.profile, strategy, step_fn, state, tokens, report)
    del state
    gc.collect()
    fit_s = _time_fit(cfg, steps, args.quick)
    base = {
        "benchmark": "MFU, examples/07 transformer LM, bf16",
        "device": device_label(),
        "config": ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(cfg).items()),
        "params": f"{params / 1e6:.1f} M matmul",
    }
    rows = []
    for path, seconds in (
        ("hand-written bf16 step (strategy.step)", step_s),
        ("Trainer.fit", fit_s),
    ):
        row = {**base, "path": path, "step": f"{seconds * 1e3:.1f} ms"}
        achieved = model / seconds
        row["model FLOPs"] = f"{model:.4e}"
        row["MFU"] = f"{achieved / peak:.1%}" if peak else "peak unknown"
        row["of the matmul ceiling"] = f"{achieved / ceiling:.1%}"
        row["analytic FLOPs"] = f"{analytic:.4e}"
        row["executed matmul FLOPs"] = f"{report.matmul_flops:.4e}"
        row["XLA's estimate"] = f"{report.flops:.3e}"
        rows.append(row)
    rows.append(
        {
            **base,
            "path": f"matmul ceiling: bf16 {n}x{n}x{n} jnp.dot",
            "step": f"{ceiling / 1e12:.1f} TFLOP/s",
            "MFU": f"{ceiling / peak:.1%} of peak" if peak else "peak unknown",
        }
    )
    rows.append(
        {
            **base,
            "path": "notes",
            "step": f"attention kernel: {attention}; peak "
            + (f"{peak / 1e12:.1f} TFLOP/s" if peak else "unknown")
            + f"; explain peak bytes {report.peak_bytes / 2**30:.2f} GiB"
            + f"; estimate {lm_memory_estimate(cfg) / 2**30:.1f} GiB; device peak in use "
            + memory("peak_bytes_in_use")
            + "".join(f"; {note}" for note in notes),
        }
    )
    return rows


def _profile(directory, strategy, step_fn, state, tokens, report) -> None:
    """A jax.profiler trace of 3 steps under `directory`, and the step's HLO beside it."""
    import jax

    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / "step.hlo.txt").write_text(report.hlo)
    step = strategy.step(step_fn)
    with jax.profiler.trace(directory):
        for _ in range(3):
            state, _ = step(state, tokens)
        jax.block_until_ready(state)
    print(f"profile: a trace under {directory}, the step's HLO in {directory}/step.hlo.txt")
    try:
        print(kernel_table(directory, steps=3), flush=True)
    except Exception:  # noqa: BLE001 - the table is a reading aid; the trace stays
        traceback.print_exc()


KINDS = (  # kernel name fragments -> what the kernel does
    ("attention", ("fmha", "flash", "sdpa", "attention", "softmax", "dot_do_o")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "matmul", "wgmma", "dot")),
    ("copy", ("memcpy", "memset", "copy")),
)


def kernel_table(directory, steps: int) -> str:
    """The device's kernels in the newest trace under `directory`: time per step by kernel
    name (top 25) and by kind (matmul, attention, other), from jax.profiler's ProfileData."""
    from collections import Counter

    from jax.profiler import ProfileData

    path = max(Path(directory).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    data = ProfileData.from_file(str(path))
    per_kernel: Counter = Counter()
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for event in line.events:
                per_kernel[event.name] += event.duration_ns / 1e6 / steps
    total = sum(per_kernel.values())
    if not total:
        return "device kernels: none in the trace (no GPU plane)"
    kinds: Counter = Counter()
    for name, ms in per_kernel.items():
        low = name.lower()
        kind = next((k for k, parts in KINDS if any(p in low for p in parts)), "other")
        kinds[kind] += ms
    lines = [f"device kernels, ms per step (busy {total:.1f} ms):"]
    lines += [f"  {kind:<10} {ms:8.2f} ms  {ms / total:6.1%}" for kind, ms in kinds.most_common()]
    lines += [f"  {ms:8.3f} ms  {name[:110]}" for name, ms in per_kernel.most_common(25)]
    return "\n".join(lines)


# -- e. CentralStorageStrategy: state in pinned_host memory, one process per measurement (see
# _apart)


def _apart(args) -> bool:
    """Whether each measurement of `central` and `sweep` runs in a fresh process of its own,
    so that the device's peak memory is that measurement's alone (and a model that runs
    out of memory ends its process, not the run). The quick run on a device that reports
    no memory (the CPU) measures in this process: there is no peak to keep apart, and a
    process start with its compiles costs more than the rows (six fewer on the CPU)."""
    import jax

    return not args.quick or jax.devices()[0].memory_stats() is not None


def central(args) -> list[dict]:
    import jax

    kinds = [m.kind for m in jax.devices()[0].addressable_memories()]
    rows = []
    for model in ("mlp", "lm"):
        results = {}
        for strategy in ("OneDeviceStrategy", "CentralStorageStrategy"):
            results[strategy] = (
                _central_subprocess(args, model, strategy)
                if _apart(args)
                else central_worker(model, strategy, args.quick)
            )
        base = results["OneDeviceStrategy"]["step_s"]
        for strategy, r in results.items():
            rows.append(
                {
                    "benchmark": "CentralStorageStrategy (1 device)",
                    "case": f"{r['case']}, {strategy}",
                    "device": device_label(),
                    "step": common.fmt_time(r["times"]),
                    "ratio": f"{r['step_s'] / base:.3f}x",
                    "state/device (explain)": f"{r['state_bytes'] / 2**20:.1f} MiB",
                    "state/host (explain)": f"{r['state_host_bytes'] / 2**20:.1f} MiB",
                    "in use after init": r["after_init"],
                    "peak in use": r["peak"],
                    "memories": ", ".join(kinds),
                }
            )
    return rows


def _central_subprocess(args, model: str, strategy: str) -> dict:
    command = [sys.executable, "-m", "bench.bench_gpu", "--central-worker", model, strategy]
    command += ["--quick"] if args.quick else []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(
            f"{' '.join(command)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    return json.loads(lines[-1])


def central_worker(model: str, strategy_name: str, quick: bool) -> dict:
    """One strategy and model in a fresh process, so that peak memory is this run's alone."""
    import jax
    import numpy as np

    import spmd

    strategy = getattr(spmd, strategy_name)()
    if model == "mlp":
        size = 64 if quick else 1024
        rng = np.random.default_rng(0)
        x = rng.normal(size=(size, 1024)).astype(np.float32)
        y = rng.integers(0, 1024, size=size).astype(np.int32)
        step_fn, data = common.make_train_step(bench_step._big_apply), (x, y)
        create, case = (
            (lambda: bench_step._big_init(jax.random.key(0))),
            f"4x1024 MLP, batch {size}",
        )
    else:
        cfg = example().LMConfig(**(QUICK_LM if quick else MID_LM))
        create, step_fn = lm_pure(cfg)
        data = (next(example().batches(cfg, 1)),)
        case = f"LM dim {cfg.dim} layers {cfg.layers} seq {cfg.seq} batch {cfg.batch}, bf16"
    report = strategy.explain(step_fn, strategy.abstract_state(create), *data)
    state = strategy.init(create)
    jax.block_until_ready(state)
    after_init = memory("bytes_in_use")
    data = strategy.distribute_batch(data)
    step = strategy.step(step_fn)
    box = [state]

    def run(steps):
        for _ in range(steps):
            box[0], _ = step(box[0], *data)
        jax.block_until_ready(box[0])

    times = common.timeit({"step": run}, steps=2 if quick else 10, repeats=2 if quick else 5)
    return {
        "case": case,
        "times": times["step"],
        "step_s": times["step"]["median"],
        "state_bytes": report.state_bytes,
        "state_host_bytes": report.state_host_bytes,
        "after_init": after_init,
        "peak": memory("peak_bytes_in_use"),
    }


# -- f. sweep: MFU of >1 B-parameter LMs, hand-written jax.jit against strategy.step, and the
# compiler's memory figure against the device's measured peak; one process per model (see _apart)


def sweep(args) -> list[dict]:
    """Each of SWEEP_LMS in its own process (a model that does not fit says so; see
    `_apart`); then Trainer.fit and `explain` on the one with the best MFU."""
    rows, results = [], []
    lms = json.loads(args.sweep_lms) if args.sweep_lms else SWEEP_LMS
    for sizes in QUICK_SWEEP if args.quick else lms:
        try:
            result = _worker(args, "--sweep-worker", sizes)
        except Exception as error:  # noqa: BLE001 - one model that fails must not lose the rest
            rows.append(
                {
                    "benchmark": "MFU sweep",
                    "config": str(sizes),
                    "path": "FAILED",
                    "step": f"{type(error).__name__}: {error}"[-300:],
                }
            )
            continue
        results.append(result)
        rows += result["rows"]
    if results:
        best = max(results, key=lambda r: r["mfu"])
        try:
            rows += _worker(args, "--fit-worker", best["sizes"])["rows"]
        except Exception as error:  # noqa: BLE001
            rows.append(
                {
                    "benchmark": "MFU sweep",
                    "path": "Trainer.fit FAILED",
                    "step": f"{type(error).__name__}: {error}"[-300:],
                }
            )
    return rows


def _worker(args, flag: str, sizes: dict) -> dict:
    """The sweep's or the fit's worker (`flag`) on the model of `sizes`: in a process of
    its own, or, where `_apart` says, in this one."""
    if _apart(args):
        return _worker_subprocess(flag, json.dumps(sizes), args.quick)
    return {"--sweep-worker": sweep_worker, "--fit-worker": fit_worker}[flag](sizes, args.quick)


def _worker_subprocess(flag: str, sizes: str, quick: bool) -> dict:
    command = [sys.executable, "-m", "bench.bench_gpu", flag, sizes] + (
        ["--quick"] if quick else []
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    sys.stderr.write(result.stderr[-2000:])
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(
            f"{flag} {sizes} failed:\n{result.stdout[-1500:]}{result.stderr[-1500:]}"
        )
    return json.loads(lines[-1])


def _sweep_cfg(sizes: dict, quick: bool):
    return example().LMConfig(**sizes, attention=None if quick else "cudnn", remat=True)


def _base_row(cfg) -> dict:
    _, params = analytic_flops(cfg)
    return {
        "benchmark": "MFU sweep",
        "device": device_label(),
        "config": f"dim {cfg.dim}, heads {cfg.heads}, mlp {cfg.mlp}, layers {cfg.layers}, "
        f"seq {cfg.seq}, batch {cfg.batch}",
        "params": f"{params / 1e9:.2f} B matmul",
    }


def _timed(run, state, tokens, steps: int) -> tuple[float, list[float], object]:
    import jax

    for _ in range(2):
        state, loss = run(state, tokens)
    jax.block_until_ready(state)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, loss = run(state, tokens)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, state


def sweep_worker(sizes: dict, quick: bool) -> dict:
    """One LM: a hand-written `jax.jit` step (donating the state) and `strategy.step`, timed
    in turn; MFU from PaLM's model FLOPs; the compiled program's memory against the peak."""
    import jax

    import spmd

    cfg = _sweep_cfg(sizes, quick)
    steps = 2 if quick else 8
    peak, (flops, _) = peak_flops(), analytic_flops(cfg)
    strategy = spmd.OneDeviceStrategy()
    create, step_fn = lm_pure(cfg)
    tokens = jax.device_put(next(example().batches(cfg, 1)), jax.devices()[0])
    state = strategy.init(create)
    compiled = jax.jit(step_fn, donate_argnums=0).lower(state, tokens).compile()
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    estimate = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes
    )
    jit_s, jit_times, state = _timed(compiled, state, tokens, steps)
    measured_peak = jax.devices()[0].memory_stats() or {}
    measured_peak = measured_peak.get("peak_bytes_in_use", 0)
    spmd_s, spmd_times, state = _timed(strategy.step(step_fn), state, tokens, steps)
    rows = []
    for path, seconds, times in (
        ("hand-written jax.jit step", jit_s, jit_times),
        ("strategy.step", spmd_s, spmd_times),
    ):
        rows.append(
            {
                **_base_row(cfg),
                "path": path,
                "step": common.fmt_time({"median": seconds, "min": min(times), "max": max(times)}),
                "MFU": f"{flops / seconds / peak:.1%}" if peak else "peak unknown",
                "vs jax.jit": f"{seconds / jit_s:.3f}x",
            }
        )
    rows.append(
        {
            **_base_row(cfg),
            "path": "memory",
            "step": f"compiler {estimate / 2**30:.2f} GiB (args {mem.argument_size_in_bytes / 2**30:.2f}, "
            f"temps {mem.temp_size_in_bytes / 2**30:.2f}); device peak {measured_peak / 2**30:.2f} GiB; "
            f"XLA flops {float(cost.get('flops', 0)):.3e}, bytes accessed "
            f"{float(cost.get('bytes accessed', 0)):.3e}",
        }
    )
    return {
        "sizes": sizes,
        "mfu": flops / spmd_s / (peak or 1.0),
        "rows": rows,
        "jit_s": jit_s,
        "spmd_s": spmd_s,
        "estimate_bytes": estimate,
        "peak_bytes": measured_peak,
        "flops": flops,
        "xla_flops": float(cost.get("flops", 0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0)),
    }


def fit_worker(sizes: dict, quick: bool) -> dict:
    """Trainer.fit's step time and `explain`'s memory for one LM of the sweep."""
    import jax

    import spmd

    cfg = _sweep_cfg(sizes, quick)
    peak, (flops, _) = peak_flops(), analytic_flops(cfg)
    strategy = spmd.OneDeviceStrategy()
    create, step_fn = lm_pure(cfg)
    tokens = strategy.distribute_batch(next(example().batches(cfg, 1)))
    report = strategy.explain(step_fn, strategy.abstract_state(create), tokens)
    fit_s = _time_fit(cfg, 2 if quick else 8, quick)
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "rows": [
            {
                **_base_row(cfg),
                "path": "Trainer.fit (mixed_precision='bfloat16')",
                "step": f"{fit_s * 1e3:.1f} ms",
                "MFU": f"{flops / fit_s / peak:.1%}" if peak else "peak unknown",
                "vs jax.jit": "",
            },
            {
                **_base_row(cfg),
                "path": "explain",
                "step": f"peak {report.peak_bytes / 2**30:.2f} GiB, state {report.state_bytes / 2**30:.2f} GiB;"
                f" Trainer's device peak {stats.get('peak_bytes_in_use', 0) / 2**30:.2f} GiB",
            },
        ]
    }


# -- the page


def header() -> list[str]:
    import jax
    import jaxlib

    device = jax.devices()[0]
    return [
        "# Performance on one accelerator",
        "",
        f"Written by `python -m bench.bench_gpu {' '.join(sys.argv[1:])}` on "
        f"{datetime.date.today().isoformat()}: device {device.device_kind} "
        f"(platform {device.platform}, {jax.device_count()} device(s)), jax {jax.__version__}, "
        f"jaxlib {jaxlib.__version__}. Times are medians (min–max); ratios against the "
        "hand-written `jax.jit` floor (or the baseline named) in the same run.",
        "",
    ]


def run_sections(args) -> tuple[list[str], bool]:
    """Every section asked for, each apart; (markdown lines, whether all ran)."""
    functions = {
        "overhead": overhead,
        "spe": spe,
        "feed": feed,
        "mfu": mfu,
        "central": central,
        "sweep": sweep,
    }
    lines, ok = header(), True
    print("\n".join(lines), flush=True)
    for name in args.only or SECTIONS:
        start = time.perf_counter()
        try:
            rows = functions[name](args)
        except Exception as error:  # noqa: BLE001 - one failed section must not lose the rest
            traceback.print_exc()
            ok = False
            rows = [
                {
                    "benchmark": name,
                    "case": "FAILED",
                    "error": f"{type(error).__name__}: {error}"[:300],
                }
            ]
        title = rows[0]["benchmark"] if rows else name
        columns = [c for c in dict.fromkeys(k for r in rows for k in r) if c != "benchmark"]
        text = [
            f"## {title}",
            "",
            common.table(rows, columns),
            "",
            f"({time.perf_counter() - start:.0f} s)",
            "",
        ]
        print("\n".join(text), flush=True)
        lines += text
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_gpu", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="few steps and a tiny LM (CPU smoke)")
    parser.add_argument("--output", default=str(ROOT / "docs" / "performance-gpu.md"))
    parser.add_argument("--only", nargs="*", choices=SECTIONS, default=None)
    for name in ("dim", "heads", "mlp", "layers", "seq", "batch", "vocab"):
        parser.add_argument(f"--lm-{name}", type=int, default=None, help="the MFU LM's size")
    parser.add_argument(
        "--lm-attention",
        default=None,
        choices=("xla", "cudnn"),
        help="the LM's attention kernel (default: JAX's choice)",
    )
    parser.add_argument(
        "--lm-remat",
        action="store_true",
        help="the LM recomputes each layer's elementwise work in the backward",
    )
    parser.add_argument("--profile", default=None, help="a directory for a jax.profiler trace")
    parser.add_argument("--central-worker", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sweep-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fit-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--sweep-lms", default=None, help="the sweep's LM sizes, a JSON list of dicts"
    )
    args = parser.parse_args(argv)
    if args.quick:  # the smoke run: its processes compile a program once between them
        common.share_compilations()
    for flag, worker in ((args.sweep_worker, sweep_worker), (args.fit_worker, fit_worker)):
        if flag:
            print(json.dumps(worker(json.loads(flag), args.quick)), flush=True)
            return 0
    if args.central_worker:
        print(json.dumps(central_worker(*args.central_worker, args.quick)), flush=True)
        return 0
    lines, ok = run_sections(args)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("\n".join(lines))
    print(f"wrote {args.output}" + ("" if ok else " (some sections FAILED)"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
