"""`spmd demo`'s options and registration, without jax: `spmd --help` stays quick.

The demo itself (spmd/_src/cli/demo.py) imports jax, flax and optax; it is imported when
`spmd demo` runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from spmd._src.cli.types import positive_int
from spmd._src.clusters.spec import ENV_DEVICES_PER_PROCESS

__all__ = ["STRATEGY_NAMES", "add_arguments", "add_subcommand", "global_batch", "strategy_name"]

DEFAULT_DEVICES = 8  # simulated CPU devices of a one-process run
GLOBAL_BATCH = 64  # rounded up to a multiple of the replicas
TARGET_ACCURACY = 0.95  # on the held-out examples
# Epochs by data set: (default, --fast). The digits pass the target after 2 or 3.
EPOCHS = {"digits": (8, 4), "npz": (3, 1)}
# The names `spmd._src.strategy.strategies.by_name` takes (tests/test_cli.py checks they agree).
STRATEGY_NAMES = (
    "default",
    "mirrored",
    "multi_worker_mirrored",
    "tpu",
    "central_storage",
    "one_device",
    "parameter_server",
)


def strategy_name(text: str) -> str:
    """argparse type of `spmd env --strategy`: a name `by_name` takes, checked without jax.

    "MirroredStrategy" and "mirrored-strategy" give "mirrored", as `by_name` reads them.
    """
    key = text.lower().replace("-", "_").removesuffix("_strategy").removesuffix("strategy")
    if key not in STRATEGY_NAMES:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(STRATEGY_NAMES)}; received {text!r}"
        )
    return key


def global_batch(requested: int | None, replicas: int) -> int:
    """The demo's global batch: `requested` (default GLOBAL_BATCH) rounded up to a
    multiple of `replicas`, so that every replica gets the same number of examples."""
    return math.ceil((requested or GLOBAL_BATCH) / replicas) * replicas


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options."""
    parser.add_argument(
        "--strategy",
        metavar="NAME",
        help=f"one of {', '.join(STRATEGY_NAMES)} (default: mirrored, "
        "multi_worker_mirrored with several processes)",
    )
    parser.add_argument(
        "--devices",
        type=positive_int,
        metavar="N",
        help=f"simulated CPU devices (default {DEFAULT_DEVICES}), split among --processes; "
        f"under spmd launch, {ENV_DEVICES_PER_PROCESS} by default",
    )
    parser.add_argument(
        "--epochs",
        type=positive_int,
        metavar="E",
        help=f"default {EPOCHS['digits'][0]} on the digits, {EPOCHS['npz'][0]} on an .npz",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        metavar="B",
        help=f"the global batch (default {GLOBAL_BATCH}); rounded up to a multiple of the replicas",
    )
    parser.add_argument(
        "--processes",
        type=positive_int,
        metavar="P",
        help="run as P local worker processes through spmd launch, the devices split among them",
    )
    parser.add_argument("--data", metavar="FILE.npz", help="train on an MNIST .npz instead")
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="save the trained state there (spmd.CheckpointManager)",
    )
    parser.add_argument(
        "--fast",
        action="store_true",
        help=f"{EPOCHS['digits'][1]} epochs on the digits, {EPOCHS['npz'][1]} on an .npz (for CI)",
    )


def add_subcommand(subparsers: Any, run: Callable[[argparse.Namespace], int]) -> None:
    """Registers `spmd demo` with the `spmd` command; `run` runs it (spmd._src.cli.main imports
    the demo, and jax, only then)."""
    p = subparsers.add_parser(
        "demo",
        help="train the tutorial CNN on handwritten digits over 8 simulated devices",
        description=(
            "Train the multi-worker tutorial's CNN on scikit-learn's handwritten digits (or an "
            "MNIST .npz) with a strategy, over simulated CPU devices, and check the held-out "
            f"accuracy reaches {TARGET_ACCURACY:.0%}."
        ),
        epilog="example: spmd demo --strategy parameter_server --processes 2",
    )
    add_arguments(p)
    p.set_defaults(run=run, parser=p)
