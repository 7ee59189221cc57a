"""Whether a recorded run of the fast tier runs every spmd/ module within its CPU budget.

Run the fast tier, recorded, and check it (a few minutes):

    python tests/tiers.py

or check a run recorded before:

    SPMD_TEST_RECORD=/tmp/ran.json python -m pytest -q -m "not slow"
    python tests/tiers.py /tmp/ran.json

The record (written by tests/conftest.py) lists, per test, the spmd/ files
that had a function called and the CPU and wall seconds the test took, and the
whole run's. A module that defines a function or a class and has none called
by any recorded test is reported; so is a run over CPU_BUDGET_S seconds of CPU
time (all threads, children too; what counts on a shared 2-core machine). The
recorder's profile hook adds about a tenth to the CPU time, so a recorded run
within the budget is within it unrecorded too. The last line is the verdict;
the exit status is 1 when it is FAIL. Modules that only re-export names
(`spmd/callbacks.py`, ...) need no test.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SPMD = Path(__file__).resolve().parent.parent / "spmd"
CPU_BUDGET_S = 240.0  # the fast tier: at most 4 minutes of CPU on 2 cores
COSTLIEST = 15  # how many of the costliest tests to show
USAGE = (
    "usage: python tests/tiers.py [RECORD], where RECORD is written by "
    'SPMD_TEST_RECORD=RECORD python -m pytest -q -m "not slow" (without it, the fast '
    "tier runs here, recorded)"
)


@functools.cache
def runnable(root: Path = SPMD) -> list[str]:
    """The files of spmd/ (relative to it) that define a function or a class (read once)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if any(isinstance(node, kinds) for node in tree.body):
            found.append(path.relative_to(root).as_posix())
    return found


def unrun(tests: dict[str, dict], modules: list[str]) -> list[str]:
    """The modules no test of `tests` (a record's "tests") ran a function of."""
    ran = {name for test in tests.values() for name in test["ran"]}
    return [m for m in modules if m not in ran]


def costliest(tests: dict[str, dict], count: int = COSTLIEST) -> list[tuple[str, dict]]:
    """The `count` tests of `tests` that took the most CPU time, costliest first."""
    return sorted(tests.items(), key=lambda item: -item[1]["cpu_s"])[:count]


def verdict(missing: list[str], cpu_s: float, budget_s: float = CPU_BUDGET_S) -> str:
    """The verdict line: OK, or FAIL with each reason (modules unrun, CPU over budget)."""
    faults = []
    if missing:
        faults.append(f"{len(missing)} module(s) of spmd/ run by no test of this tier")
    if cpu_s > budget_s:
        faults.append(f"{cpu_s:.0f} s of CPU is over the budget of {budget_s:.0f} s")
    if faults:
        return "verdict: FAIL: " + "; ".join(faults)
    return (
        "verdict: OK: every module of spmd/ with code is run by a test of this tier, "
        f"in {cpu_s:.0f} s of CPU (budget {budget_s:.0f} s)"
    )


def report(record: dict, modules: list[str]) -> tuple[list[str], bool]:
    """The lines that `main` prints for `record`, and whether the verdict is OK."""
    tests, run = record["tests"], record["run"]
    missing = unrun(tests, modules)
    lines = [
        f"{len(tests)} tests recorded; {len(modules) - len(missing)} of {len(modules)} modules run"
    ]
    lines += [f"not run by any recorded test: spmd/{name}" for name in missing]
    lines.append(
        f"the run: {run['cpu_s']:.1f} s CPU, {run['wall_s']:.1f} s wall "
        f"(the tests alone: {sum(t['cpu_s'] for t in tests.values()):.1f} s CPU, "
        f"{sum(t['wall_s'] for t in tests.values()):.1f} s wall)"
    )
    lines.append(f"the {min(COSTLIEST, len(tests))} costliest tests (CPU s, wall s):")
    lines += [f"  {t['cpu_s']:7.1f} {t['wall_s']:7.1f}  {nodeid}" for nodeid, t in costliest(tests)]
    line = verdict(missing, run["cpu_s"])
    return lines + [line], line.startswith("verdict: OK")


def read(path: Path) -> dict | None:
    """The record at `path`, or None where there is none of the form conftest.py writes."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and {"run", "tests"} <= record.keys() else None


def record_run(path: Path) -> int:
    """Runs the fast tier with the recorder writing to `path`; pytest's exit status."""
    env = {**os.environ, "SPMD_TEST_RECORD": str(path)}
    command = [sys.executable, "-m", "pytest", "-q", "-m", "not slow"]
    return subprocess.run(command, cwd=SPMD.parent, env=env).returncode


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print(USAGE, file=sys.stderr)
        return 2
    if not argv:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "ran.json"
            status = record_run(path)
            record = read(path)
        if status != 0:
            print(f"the fast tier failed (pytest exit status {status})", file=sys.stderr)
    else:
        record = read(Path(argv[0]))
    if record is None:
        print(
            f"no record of a test run at {argv[0] if argv else 'the run'!r}; {USAGE}",
            file=sys.stderr,
        )
        return 2
    lines, ok = report(record, runnable())
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
