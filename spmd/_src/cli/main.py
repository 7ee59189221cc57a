"""The `spmd` command: `spmd launch`, `spmd env`, `spmd plan` (and `spmd demo`, registered elsewhere)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import spmd
from spmd._src.cli import plan_command
from spmd._src.cli.demo_command import add_subcommand, strategy_name
from spmd._src.cli.types import non_negative_int, positive_float, positive_int
from spmd._src.clusters.launch_results import EXIT_GRACE
from spmd._src.errors import SpmdError

__all__ = ["build_parser", "main"]

Subparsers = Any  # argparse's private _SubParsersAction


# ------------------------------------------------------------------ spmd launch


def _add_launch(subparsers: Subparsers) -> None:
    """Registers `spmd launch -n N [...] -- program args...`."""
    p = subparsers.add_parser(
        "launch",
        help="run a program as N local processes of one cluster",
        description=(
            "Run PROGRAM as N local processes that form one spmd cluster (127.0.0.1, a free "
            "port). Each line of output is prefixed with its process index. If a process "
            "fails, or exits with code 0 while the others run on past --exit-grace, the others "
            "are stopped; the group is restarted up to --max-restarts times. A process exiting "
            "with code 42 (preempted) restarts the group without using up --max-restarts; one "
            "exiting with code 78 (spmd's ConfigurationError or BatchError) ends the launch. "
            "A process that makes no step for --hang-timeout seconds while the others wait "
            "is named, with its stack; every process then exits with code 75 (retryable). "
            "Ctrl-C, SIGTERM and SIGHUP stop every process; so does SIGKILL of spmd launch."
        ),
        epilog="example: spmd launch -n 2 --devices-per-process 4 -- python train.py --epochs 3",
    )
    p.add_argument("-n", "--num-processes", type=positive_int, required=True, metavar="N")
    p.add_argument(
        "--devices-per-process",
        type=positive_int,
        metavar="K",
        help="simulated CPU devices per process (SPMD_DEVICES_PER_PROCESS)",
    )
    p.add_argument("--max-restarts", type=non_negative_int, default=0, metavar="R")
    p.add_argument("--max-preemptions", type=non_negative_int, default=10, metavar="P")
    p.add_argument(
        "--min-processes",
        type=positive_int,
        metavar="M",
        help="elastic: once --max-restarts are used up, relaunch on one process fewer, down "
        "to M, with --max-restarts again at each size (default: N, never fewer)",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        metavar="S",
        help="seconds for the whole launch, restarts included; then every process is stopped",
    )
    p.add_argument(
        "--hang-timeout",
        type=positive_float,
        metavar="S",
        help="seconds a process may go without a step before every process ends naming it "
        "and its stack, exit code 75 (default: the larger of 300 s and 10 times the slowest "
        "recent step)",
    )
    p.add_argument(
        "--exit-grace",
        type=positive_float,
        default=EXIT_GRACE,
        metavar="S",
        help="seconds the other processes have to end once one exits with code 0 "
        f"(default {EXIT_GRACE:g}); then the job fails",
    )
    p.add_argument(
        "--verbose", action="store_true", help='show gloo\'s "[Gloo] Rank N is connected" lines'
    )
    p.add_argument(
        "--preload",
        action="store_true",
        help="fork each Python worker from an interpreter that imported JAX, flax, optax and "
        "orbax once, rather than importing them again in each (SPMD_LAUNCH_PRELOAD=1; "
        "docs/multihost.md)",
    )
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- the program and its arguments")
    p.set_defaults(run=_run_launch, parser=p)


def _run_launch(args: argparse.Namespace) -> int:
    """Runs `spmd launch`."""
    from spmd._src.clusters.launch import launch

    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        args.parser.error("give the program to run after --, e.g. -- python train.py")
    if args.min_processes is not None and args.min_processes > args.num_processes:
        args.parser.error(
            f"argument --min-processes: must be at most -n/--num-processes "
            f"({args.num_processes}); received {args.min_processes}"
        )
    if args.preload:
        from spmd._src.clusters.preload import ENV_PRELOAD

        os.environ[ENV_PRELOAD] = "1"
    try:
        return launch(
            program,
            args.num_processes,
            args.devices_per_process,
            max_restarts=args.max_restarts,
            timeout=args.timeout,
            max_preemptions=args.max_preemptions,
            exit_grace=args.exit_grace,
            verbose=args.verbose,
            min_processes=args.min_processes,
            hang_timeout=args.hang_timeout,
        )
    except KeyboardInterrupt:
        print("spmd launch: interrupted; stopped every process.", file=sys.stderr)
        return 130


# ------------------------------------------------------------------ spmd env


def _add_env(subparsers: Subparsers) -> None:
    """Registers `spmd env [--devices N] [--strategy NAME ...]`."""
    p = subparsers.add_parser(
        "env",
        help="print what spmd.initialize() and each strategy would see",
        description=(
            "Initialize as a program would (TF_CONFIG, spmd launch's environment, Slurm, ...) "
            "and print the cluster, the devices and, for each named strategy, its mesh."
        ),
    )
    p.add_argument(
        "--devices", type=positive_int, metavar="N", help="simulated CPU devices for this process"
    )
    p.add_argument(
        "--strategy",
        type=strategy_name,
        action="append",
        metavar="NAME",
        help="only this strategy (repeatable); default: every named strategy",
    )
    p.set_defaults(run=_run_env, parser=p)


def _device_ids(devices: Sequence[Any]) -> str:
    """E.g. "cpu 0-7" or "cpu 0,2,5"."""
    ids = [d.id for d in devices]
    platform = devices[0].platform if devices else "?"
    contiguous = ids == list(range(ids[0], ids[0] + len(ids))) if ids else False
    span = f"{ids[0]}-{ids[-1]}" if contiguous and len(ids) > 1 else ",".join(map(str, ids))
    return f"{platform} {span}"


def _print_strategy(name: str) -> None:
    """Prints one strategy's mesh and devices, or why it cannot be built here."""
    from spmd._src.strategy import strategies

    try:
        s = strategies.by_name(name)
    except Exception as e:  # e.g. TPUStrategy without TPUs: say why, go on
        reason = str(e).replace("\n", "\n    ")
        print(f"  {name}: unavailable ({type(e).__name__})\n    {reason}")
        return
    print(
        f"  {name}: mesh {dict(s.mesh.shape)}, batch_axes {tuple(s.batch_axes)}, "
        f"num_replicas_in_sync {s.num_replicas_in_sync}, devices {_device_ids(s.mesh.devices.flat)}"
    )


def _run_env(args: argparse.Namespace) -> int:
    """Runs `spmd env`."""
    import dataclasses

    import jax

    from spmd._src.clusters.backend_check import check_backends_start
    from spmd._src.clusters.initialize import initialize
    from spmd._src.strategy import strategies

    check_backends_start()
    info = initialize(local_device_count=args.devices)
    print("cluster:")
    for field in dataclasses.fields(info):
        print(f"  {field.name}: {getattr(info, field.name)}")
    print("jax:")
    print(f"  backend: {jax.default_backend()}")
    print(f"  process: {jax.process_index()} of {jax.process_count()}")
    print(f"  local devices: {jax.local_device_count()} ({_device_ids(jax.local_devices())})")
    print(f"  global devices: {jax.device_count()} ({_device_ids(jax.devices())})")
    print("strategies:")
    for name in args.strategy or strategies.NAMES:
        _print_strategy(name)
    return 0


# ------------------------------------------------------------------ spmd demo


def _add_demo(subparsers: Subparsers) -> None:
    """Registers `spmd demo [...]`; the demo itself (and jax) is imported when it runs."""
    add_subcommand(subparsers, _run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    """Runs `spmd demo` (spmd/_src/cli/demo.py)."""
    from spmd._src.cli.demo import run

    return run(args)


# ------------------------------------------------------------------ main

# One function per subcommand, each adding its parser with `run=` (and `parser=`)
# defaults.
SUBCOMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    _add_demo,
    _add_launch,
    _add_env,
    plan_command.add_subcommand,
)


def build_parser() -> argparse.ArgumentParser:
    """The `spmd` argument parser, with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="spmd", description="JAX/XLA-native SPMD training: launch, inspect, demo."
    )
    parser.add_argument("--version", action="version", version=f"spmd {spmd.__version__}")
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `spmd` command line.

    Args:
      argv: the arguments after the program name (default: sys.argv[1:]).

    Returns:
      The exit code: 0 on success, 2 on a usage error, else the failure's code.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.subcommand is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.run(args)
    except SpmdError as e:
        print(f"spmd {args.subcommand}: error: {e}", file=sys.stderr)
        return 1
