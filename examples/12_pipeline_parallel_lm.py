"""Pipeline x data parallel: examples/07's transformer LM with its layers split over stages.

The model is examples/07's, unchanged but for one line of `__call__`: the scan
over its stacked layers becomes `spmd.pipeline`, which splits the layers over
the mesh's `stage` axis and cuts the batch into microbatches that flow from
stage to stage. The model's own annotations place the layers: its weights name
their leading axis "layers", and the logical axis rule ("layers", "stage")
puts it on the stage axis; the batch goes over `data`. Two runs, GPipe
(each stage holds 2 of the 4 layers) and circular (2 repeats: stage 0 holds
layers 0 and 2, stage 1 layers 1 and 3), each against the same model with
the plain layer scan on one device; any difference is an error.

Run: python examples/12_pipeline_parallel_lm.py [--devices 8] [--steps 20]
"""

import argparse
import importlib.util
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import spmd


def lm_example():
    """examples/07 as a module (its file name starts with a digit)."""
    path = Path(__file__).with_name("07_sharded_transformer_lm.py")
    spec = importlib.util.spec_from_file_location("lm_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["lm_example"] = module
    spec.loader.exec_module(module)
    return module


lm = lm_example()

# The layers' leading axis on the stage axis; the rest replicated within a stage.
PIPELINE_RULES = [
    ("layers", "stage"),
    ("heads", None),
    ("mlp", None),
    ("embed", None),
    ("vocab", None),
]


class PipelinedLM(lm.TransformerLM):
    """examples/07's model with its layer scan run as a pipeline over `stage`."""

    microbatches, repeats = 4, 1

    def __call__(self, tokens):
        layers = {
            "attn": {w: v[...] for w, v in self.attn.items()},
            "mlp": {"w_in": self.w_in[...], "w_out": self.w_out[...]},
            "norm1": self.norm1[...],
            "norm2": self.norm2[...],
        }
        x = spmd.pipeline(
            lambda layer, x: lm.block(x, layer, self.heads, self.attention)[0],
            layers,
            self.embed[...][tokens],
            microbatches=self.microbatches,
            repeats=self.repeats,
        )
        return x @ self.unembed[...]


def train(strategy, steps, cfg, model_class):
    """Trains `model_class` from examples/07's seed; its losses and what explain says."""
    import optax

    def create():
        model = model_class(cfg, nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    state = strategy.init(create)
    step = strategy.step(lm.train_step)
    data = list(lm.batches(cfg, steps))
    pipelined = model_class is PipelinedLM
    pipelines = strategy.explain(step, state, data[0]).pipelines if pipelined else ()
    losses = [float(step(state, tokens)) for tokens in strategy.distribute_dataset(data)]
    return state[0], losses, pipelines


def compare(name, got, want) -> bool:
    """Prints the gap between a pipelined run and the one-device scan; True if it is float noise."""
    (model, losses, _), (oracle, oracle_losses, _) = got, want
    loss_gap = float(np.max(np.abs(np.array(losses) - np.array(oracle_losses))))
    weight_gap = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(jax.device_get(nnx.state(model, nnx.Param))),
            jax.tree.leaves(jax.device_get(nnx.state(oracle, nnx.Param))),
            strict=True,
        )
    )
    print(
        f"{name}: largest difference from one device: loss {loss_gap:.1e}, weights {weight_gap:.1e}"
    )
    return loss_gap < 1e-4 and weight_gap < 1e-4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (even)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    spmd.initialize(local_device_count=args.devices)  # first thing, in every process

    cfg = lm.LMConfig(layers=4, batch=16)
    oracle = train(spmd.OneDeviceStrategy(), args.steps, cfg, lm.TransformerLM)
    print(f"one device, layer scan: loss {oracle[1][0]:.3f} -> {oracle[1][-1]:.3f}")
    ok = oracle[1][-1] < 0.5 * oracle[1][0]
    stages = spmd.Strategy(
        mesh=spmd.make_mesh({"stage": 2, "data": -1}),
        batch_axes=("data",),
        logical_axis_rules=PIPELINE_RULES,
    )
    for repeats in (1, 2):
        PipelinedLM.repeats = repeats
        model, losses, pipelines = run = train(stages, args.steps, cfg, PipelinedLM)
        print(f"{stages}: {pipelines[0]}")
        print(
            f"  loss {losses[0]:.3f} -> {losses[-1]:.3f}; wq placed {model.attn['wq'][...].sharding.spec}"
        )
        ok = compare(f"  {repeats} repeat(s)", run, oracle) and ok
        ok = ok and model.attn["wq"][...].sharding.spec[0] == "stage"
    if not ok:
        print("FAILED: the pipelined runs differ from one device (or did not learn)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
