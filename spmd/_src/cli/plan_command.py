"""`spmd plan`: rank a model's layouts for a target, from a function of the user's code.

The entry is `MODULE:FUNCTION`, `PATH.py:FUNCTION`, `PATH.py` (its function
`plan_inputs`), or `-- python PATH.py [ARGS...]` (the script imported with
those arguments in `sys.argv`, its `__main__` block not run). Options may
follow the entry; only words after `--` belong to the script. The function
returns the model's pieces; `spmd.auto_strategy` compiles the candidates.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spmd._src.cli.types import positive_int
from spmd._src.errors import ConfigurationError, message, received
from spmd._src.plan_cache import DEFAULT_CACHE_DIR

__all__ = ["DEFAULT_FUNCTION", "EntryRaised", "add_subcommand", "load_entry"]

DEFAULT_FUNCTION = "plan_inputs"  # what a script path alone names
_FIX = (
    "pass MODULE:FUNCTION or PATH.py:FUNCTION (e.g. train:plan_inputs or ./train.py:plan_inputs), "
    "PATH.py (its plan_inputs()), or -- python train.py ARGS...; the function returns "
    "dict(create_fn=..., step=..., batch=(jax.ShapeDtypeStruct(...),)), optionally with args, "
    "rules, logical_axis_rules and remat (step then builds the step: step(remat=name))."
)


class EntryRaised(ConfigurationError):
    """The user's module or function raised: `__cause__` is its exception, traceback and all."""


def _raised(what: str, entry: str, error: BaseException) -> EntryRaised:
    return EntryRaised(
        message(
            f"{what} raised {type(error).__name__}: {error}",
            received(entry=entry),
            "fix the error its traceback shows (the entry's own code), then run spmd plan again.",
        )
    )


def add_subcommand(subparsers: Any) -> None:
    """Registers `spmd plan [--target T] ENTRY`."""
    p = subparsers.add_parser(
        "plan",
        help="rank the layouts of a model's train step for a TPU slice (no TPU needed)",
        description=(
            "Import the entry's module (MODULE:FUNCTION, PATH.py:FUNCTION, PATH.py for its "
            f"{DEFAULT_FUNCTION}(), or -- python PATH.py ARGS... with ARGS in sys.argv; a "
            "script's __main__ block does not run) and call the function, which returns the "
            "model's pieces: a dict with create_fn, step and batch (and optionally args), or "
            "the tuple (create_fn, step, batch[, args]); batch holds jax.ShapeDtypeStructs of "
            "the global batch. Then compile every candidate layout for the target with the "
            "TPU compiler (the tpu-compile extra), drop those that do not fit and print the "
            "rest ranked by estimated step time (spmd.auto_strategy; docs/planning.md). "
            "Nothing is allocated or run."
        ),
        epilog="examples: spmd plan --target v5p-256 train:plan_inputs; "
        "spmd plan --target v5e-16 -- python train.py --config small",
    )
    p.add_argument(
        "--target",
        default="cpu",
        help='a Cloud TPU name ("v5p-256", "v5e:16x16", "v6e-64"), or "cpu" for this '
        "process's devices (default)",
    )
    p.add_argument(
        "--slices", type=positive_int, help="with a TPU target: how many slices (DCN); default 1"
    )
    p.add_argument(
        "--cpu-devices",
        type=positive_int,
        metavar="N",
        help="with --target cpu: simulate N CPU devices (jax_num_cpu_devices)",
    )
    p.add_argument(
        "--only", action="append", metavar="TEXT", help="keep the layouts whose names contain TEXT"
    )
    p.add_argument(
        "--jobs",
        type=positive_int,
        metavar="N",
        help="compile N candidates at once (default: one per core, as many as free memory holds)",
    )
    p.add_argument(
        "--cache-dir",
        default=str(DEFAULT_CACHE_DIR),
        metavar="DIR",
        help="keep each compiled program's figures here, keyed by the program and target, "
        f"so a second plan compiles only what changed (default {DEFAULT_CACHE_DIR})",
    )
    p.add_argument(
        "--json", action="store_true", help="print the plan as JSON (unknown figures null)"
    )
    p.add_argument(
        "entry",
        nargs=argparse.REMAINDER,
        metavar="ENTRY",
        help="MODULE:FUNCTION, PATH.py[:FUNCTION], or -- python PATH.py ARGS...",
    )
    p.set_defaults(run=run, parser=p)


def _entry_words(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The entry and the script's arguments; options after the entry are read as options."""
    words = list(args.entry)
    if words[:1] == ["--"]:
        words = words[1:]
        if words and Path(words[0]).name.startswith("python") and not words[0].endswith(".py"):
            words = words[1:]  # -- python train.py ARGS
        if not words:
            args.parser.error(f"give the model's entry point: {_FIX}")
        entry, argv = words[0], words[1:]
    elif not words:
        args.parser.error(f"give the model's entry point: {_FIX}")
    else:
        entry, rest = words[0], words[1:]
        cut = rest.index("--") if "--" in rest else len(rest)
        _options_after(args, entry, rest[:cut])
        argv = rest[cut + 1 :]
    if argv and not _script(entry):
        args.parser.error(
            f"only a script takes arguments (-- python train.py ARGS); received {words}"
        )
    return entry, argv


def _options_after(args: argparse.Namespace, entry: str, words: list[str]) -> None:
    """Reads spmd plan's options given after the entry into `args`; any other word is a usage
    error: a script's own arguments go after `--`."""
    if not words:
        return
    parsed, unknown = args.parser.parse_known_args(words, argparse.Namespace(**vars(args)))
    stray = unknown + list(parsed.entry)
    if stray:
        where = (
            f"A script's own arguments go after --: spmd plan {entry} -- {' '.join(stray)}"
            if _script(entry)
            else "A module entry takes no arguments: give its settings in the function."
        )
        args.parser.error(
            f"after the entry {entry}, only spmd plan's options are read; {stray} are not "
            f"among them. {where}"
        )
    for name, value in vars(parsed).items():
        if name != "entry":
            setattr(args, name, value)


def _check_options(args: argparse.Namespace) -> None:
    """Options that do nothing with this target are errors, not silently ignored."""
    cpu = args.target == "cpu"
    if cpu and args.slices is not None:
        args.parser.error(
            "--slices counts TPU slices: give it with a TPU --target (e.g. --target v5e-256 "
            f"--slices 2); received --target {args.target} --slices {args.slices}"
        )
    if not cpu and args.cpu_devices is not None:
        args.parser.error(
            "--cpu-devices simulates CPU devices for --target cpu; a TPU target's devices come "
            f"from its name; received --target {args.target} --cpu-devices {args.cpu_devices}"
        )


def run(args: argparse.Namespace) -> int:
    """Runs `spmd plan`."""
    _check_options(args)
    entry, argv = _entry_words(args)
    if args.cpu_devices:
        import jax

        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    from spmd._src.plan_compile import default_jobs
    from spmd._src.planning import auto_strategy

    try:
        create_fn, step, batch, create_args, layout = load_entry(entry, argv)
    except EntryRaised as e:
        print(f"spmd plan: error: {str(e).splitlines()[0]}", file=sys.stderr)
        _print_user_traceback(e.__cause__)
        return 1
    target = None if args.target == "cpu" else args.target
    try:
        _, plan = auto_strategy(
            create_fn,
            step,
            batch,
            target,
            args=create_args,
            slices=args.slices or 1,
            only=args.only,
            jobs=args.jobs or default_jobs(),
            cache_dir=args.cache_dir or None,
            progress=_progress(),
            **layout,
        )
    except KeyboardInterrupt:
        _exit_interrupted()
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan)
    return 0


def _exit_interrupted() -> None:
    """Ends the process now: the compiles still running in worker threads would hold a normal
    exit for minutes. The cache holds only whole entries (each written, then renamed)."""
    print(
        "spmd plan: interrupted; the candidates compiled so far are in the cache, and the "
        "next plan compiles only the rest.",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(130)


def _progress() -> Any:
    """A line to stderr per candidate as it is settled ("[3] FSDP over 16: compiled in ...")."""
    settled = [0]

    def line(candidate: Any, how: str) -> None:
        settled[0] += 1
        verdict = candidate.dropped or (
            f"fits, {candidate.step_seconds * 1e3:,.3f} ms a step (est.)"
        )
        print(f"[{settled[0]}] {candidate.name}: {how}; {verdict}", file=sys.stderr, flush=True)

    return line


def _print_user_traceback(error: BaseException) -> None:
    """The error's traceback from the user's code in: this module's and importlib's frames
    left out."""
    tb = error.__traceback__
    while tb is not None and _not_users(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb, file=sys.stderr)


def _not_users(filename: str) -> bool:
    return filename == __file__ or "importlib" in filename


def _script(entry: str) -> bool:
    return entry.partition(":")[0].endswith(".py") or entry.endswith(".py")


def load_entry(entry: str, argv: Sequence[str] = ()) -> tuple[Any, Any, Any, Any, dict]:
    """An entry point -> (create_fn, step, batch, args, layout) from what its function returns.

    Args:
      entry: `MODULE:FUNCTION` (imported with the current directory on
        `sys.path`), `PATH.py:FUNCTION`, or `PATH.py` (its `plan_inputs`).
      argv: a script's arguments, in `sys.argv` while it is imported.

    Returns:
      The function's dict's `create_fn`, `step`, `batch` and `args` (None if
      absent), and its `rules`, `logical_axis_rules` and `remat` where given (as
      a dict of `auto_strategy`'s keywords; with `remat`, the policies to try,
      `step` builds the step for each: `step(remat=name)`); or its tuple
      `(create_fn, step, batch[, args])` and an empty dict.

    Raises:
      ConfigurationError: the entry is none of those forms, its module or
        function is not found, or the function returns something else.
      EntryRaised: the module or the function raised (its `__cause__`).
    """
    where, _, function_name = entry.rpartition(":") if ":" in entry else (entry, "", "")
    if not function_name and _script(where):
        function_name = DEFAULT_FUNCTION
    if not where or not function_name.isidentifier():
        raise ConfigurationError(
            message(
                "The entry point is MODULE:FUNCTION, PATH.py[:FUNCTION] or -- python PATH.py.",
                received(entry=entry),
                _FIX,
            )
        )
    module = _load_script(where, argv) if _script(where) else _import(where, entry)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigurationError(
            message(
                f"{where} defines a function {function_name}().",
                received(entry=entry, found=function),
                _FIX,
            )
        )
    try:
        pieces = function()
    except Exception as e:
        raise _raised(f"{where}:{function_name}()", entry, e) from e
    return _pieces(entry, f"{where}:{function_name}", pieces)


def _import(module_name: str, entry: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):  # the module's own import
            raise _raised(f"importing {module_name}", entry, e) from e
        raise ConfigurationError(
            message("The entry point's module imports.", received(entry=entry, error=str(e)), _FIX)
        ) from e
    except Exception as e:
        raise _raised(f"importing {module_name}", entry, e) from e


def _load_script(path: str, argv: Sequence[str]) -> Any:
    """Imports a script by its path, `sys.argv` its own, its directory first on `sys.path`."""
    file = Path(path).resolve()
    if not file.is_file():
        raise ConfigurationError(
            message("The entry point's script exists.", received(script=path), _FIX)
        )
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    saved = sys.argv
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(file.parent))
    sys.modules[file.stem] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # SystemExit too: an argparse error in the script
        sys.modules.pop(file.stem, None)
        raise _raised(f"running {path}", path, e) from e
    finally:
        sys.argv = saved
    return module


_KEYS = ("create_fn", "step", "batch")  # what a plan function's dict must hold
_LAYOUT = ("rules", "logical_axis_rules", "remat")  # optional, given to auto_strategy as is


def _pieces(entry: str, called: str, pieces: Any) -> tuple[Any, Any, Any, Any, dict]:
    """The pieces `called` (the entry's module and function) returned."""
    if isinstance(pieces, dict) and set(_KEYS) <= set(pieces):
        unknown = set(pieces) - {*_KEYS, "args", *_LAYOUT}
        if unknown:
            raise ConfigurationError(
                message(
                    f"{called}() returns a dict of create_fn, step, batch and optionally args, "
                    "rules, logical_axis_rules and remat.",
                    received(entry=entry, unknown=sorted(map(str, unknown))),
                    _FIX,
                )
            )
        layout = {k: pieces[k] for k in _LAYOUT if k in pieces}
        return pieces["create_fn"], pieces["step"], pieces["batch"], pieces.get("args"), layout
    if isinstance(pieces, tuple) and len(pieces) in (3, 4):
        return (*pieces, *([None] if len(pieces) == 3 else []), {})
    what = {"returned": type(pieces).__name__}
    if isinstance(pieces, dict):
        what |= {
            "missing": [k for k in _KEYS if k not in pieces],
            "keys": [str(k) for k in pieces],
        }
    elif isinstance(pieces, tuple):
        what |= {"length": len(pieces)}
    raise ConfigurationError(
        message(
            f"{called}() returns dict(create_fn=..., step=..., batch=..., args=...) or the "
            "tuple (create_fn, step, batch[, args]).",
            received(entry=entry, **what),
            _FIX,
        )
    )
