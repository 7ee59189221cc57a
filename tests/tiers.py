"""Whether a recorded test run is within the loop's budgets: the whole suite's wall time, the
fast tier's CPU time and each of its tests' CPU time, and every spmd/ module run.

Run the whole suite (in parallel, as the README's command does), recorded, and check it:

    python tests/tiers.py

or only the fast tier (a few minutes; the suite's wall time is then not judged):

    python tests/tiers.py --fast

or check a run recorded before:

    SPMD_TEST_RECORD=/tmp/ran.json python -m pytest -q
    python tests/tiers.py /tmp/ran.json

The record (written by tests/conftest.py) lists, per test, the spmd/ files that
had a function called, the CPU and wall seconds the test took and whether it is
slow, and the whole run's. The fast tier is the tests not marked slow. Each
budget is for a 2-core machine: the suite in SUITE_WALL_BUDGET_S of wall time;
the fast tier in TIER_CPU_BUDGET_S of CPU time (all threads, children too:
what counts on a shared machine), no test of it over TEST_CPU_BUDGET_S; and no
module that defines a function or a method left unrun by the fast tier (modules
that only re-export names, `spmd/callbacks.py`, ... need no test). The
recorder's profile hook, on the fast tier's tests only, adds about an eighth to
their CPU time, so a recorded run within the budgets is within them unrecorded too. The record also holds the
machine's speed (tests/reference_workload.py, timed before the tests start), and the
report states the run's CPU time in reference workloads: the figure to compare runs
on different machines by (the budgets stay in seconds). The last line is the
verdict; the exit status is 1 when it is FAIL.
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
SUITE_WALL_BUDGET_S = 900.0  # the whole suite: 15 minutes of wall time on 2 cores
TIER_CPU_BUDGET_S = 240.0  # the fast tier's tests: at most 4 minutes of CPU
TEST_CPU_BUDGET_S = 5.0  # one test of the fast tier
COSTLIEST = 15  # how many of the costliest tests to show
USAGE = (
    "usage: python tests/tiers.py [--fast | RECORD], where RECORD is written by "
    "SPMD_TEST_RECORD=RECORD python -m pytest -q (without it, the whole suite runs here, "
    "recorded; with --fast, only the fast tier)"
)


@functools.cache
def runnable(root: Path = SPMD) -> list[str]:
    """The files of spmd/ (relative to it) that define a function or a method (read once):
    code a test can run. A module of records only (a NamedTuple of fields) has none."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
        if any(isinstance(node, kinds) for node in ast.walk(tree)):
            found.append(path.relative_to(root).as_posix())
    return found


def fast(tests: dict[str, dict]) -> dict[str, dict]:
    """The tests of a record's "tests" that are in the fast tier (not marked slow)."""
    return {name: test for name, test in tests.items() if not test.get("slow", False)}


def unrun(tests: dict[str, dict], modules: list[str]) -> list[str]:
    """The modules no test of `tests` (a record's "tests") ran a function of."""
    ran = {name for test in tests.values() for name in test["ran"]}
    return [m for m in modules if m not in ran]


def costliest(tests: dict[str, dict], count: int = COSTLIEST) -> list[tuple[str, dict]]:
    """The `count` tests of `tests` that took the most CPU time, costliest first."""
    return sorted(tests.items(), key=lambda item: -item[1]["cpu_s"])[:count]


def over(tests: dict[str, dict], budget_s: float = TEST_CPU_BUDGET_S) -> list[str]:
    """The tests of `tests` that took more than `budget_s` of CPU time, costliest first."""
    return [name for name, test in costliest(tests, len(tests)) if test["cpu_s"] > budget_s]


def verdict(
    missing: list[str],
    cpu_s: float,
    budget_s: float = TIER_CPU_BUDGET_S,
    costly: list[str] = (),
    wall_s: float | None = None,
) -> str:
    """The verdict line: OK, or FAIL with each reason (modules unrun, the tier's CPU over
    budget, tests over theirs, the suite's wall time over budget; None: not measured)."""
    faults = []
    if missing:
        faults.append(f"{len(missing)} module(s) of spmd/ run by no test of the fast tier")
    if cpu_s > budget_s:
        faults.append(f"{cpu_s:.0f} s of CPU is over the fast tier's budget of {budget_s:.0f} s")
    if costly:
        faults.append(
            f"{len(costly)} test(s) of the fast tier over {TEST_CPU_BUDGET_S:g} s of CPU "
            "(make them cheaper or mark them slow)"
        )
    if wall_s is not None and wall_s > SUITE_WALL_BUDGET_S:
        faults.append(
            f"the suite's {_minutes(wall_s)} of wall time is over its budget of "
            f"{_minutes(SUITE_WALL_BUDGET_S)}"
        )
    if faults:
        return "verdict: FAIL: " + "; ".join(faults)
    suite = "" if wall_s is None else f"; the suite in {_minutes(wall_s)} of wall time"
    return (
        "verdict: OK: every module of spmd/ with code is run by a test of the fast tier, "
        f"in {cpu_s:.0f} s of CPU (budget {budget_s:.0f} s), no test of it over "
        f"{TEST_CPU_BUDGET_S:g} s{suite}"
    )


def report(record: dict, modules: list[str]) -> tuple[list[str], bool]:
    """The lines that `main` prints for `record`, and whether the verdict is OK.

    A record of the fast tier alone is judged on the run's CPU time; a record of the
    whole suite on its fast tests' CPU time and the run's wall time.
    """
    tests, run = record["tests"], record["run"]
    tier = fast(tests)
    whole = len(tier) < len(tests)
    missing, costly = unrun(tier, modules), over(tier)
    workers = run.get("workers") or 1
    lines = [
        f"{len(tests)} tests recorded, {len(tier)} of them in the fast tier; "
        f"{len(modules) - len(missing)} of {len(modules)} modules run by the fast tier",
        f"the run: {run['cpu_s']:.1f} s CPU, {run['wall_s']:.1f} s wall "
        f"({_minutes(run['wall_s'])}, {workers} worker(s))",
    ]
    lines += [f"not run by any test of the fast tier: spmd/{name}" for name in missing]
    tier_cpu = sum(t["cpu_s"] for t in tier.values())
    lines += _machine(run, tier_cpu if whole else None)
    lines.append(
        f"the fast tier's tests: {tier_cpu:.1f} s CPU, "
        f"{sum(t['wall_s'] for t in tier.values()):.1f} s wall"
    )
    lines += [
        f"over {TEST_CPU_BUDGET_S:g} s of CPU in the fast tier: {name} "
        f"({tier[name]['cpu_s']:.1f} s)"
        for name in costly
    ]
    lines.append(f"the {min(COSTLIEST, len(tests))} costliest tests (CPU s, wall s):")
    lines += [f"  {t['cpu_s']:7.1f} {t['wall_s']:7.1f}  {nodeid}" for nodeid, t in costliest(tests)]
    cpu_s = tier_cpu if whole else run["cpu_s"]
    line = verdict(missing, cpu_s, costly=costly, wall_s=run["wall_s"] if whole else None)
    return lines + [line], line.startswith("verdict: OK")


def _machine(run: dict, tier_cpu: float | None) -> list[str]:
    """The line on the machine's speed, where the record has it: the run's CPU (and the
    fast tier's, for a whole suite) in reference workloads (tests/reference_workload.py),
    which compare between machines, where seconds do not."""
    reference = run.get("reference_cpu_s")
    if not reference:
        return []
    tier = "" if tier_cpu is None else f", its fast tier's {tier_cpu / reference:.0f}"
    return [
        f"the machine: the reference workload took {reference:.2f} s of CPU; the run's CPU "
        f"is {run['cpu_s'] / reference:.0f} workloads{tier} (compare runs on other machines "
        "by these)"
    ]


def read(path: Path) -> dict | None:
    """The record at `path`, or None where there is none of the form conftest.py writes."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and {"run", "tests"} <= record.keys() else None


def record_run(path: Path, tier_only: bool = False) -> int:
    """Runs the whole suite (or the fast tier) with the recorder writing to `path`; pytest's
    exit status."""
    env = {**os.environ, "SPMD_TEST_RECORD": str(path)}
    command = [sys.executable, "-m", "pytest", "-q", *(["-m", "not slow"] if tier_only else [])]
    return subprocess.run(command, cwd=SPMD.parent, env=env).returncode


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0].startswith("-") and argv[0] != "--fast"):
        print(USAGE, file=sys.stderr)
        return 2
    if not argv or argv[0] == "--fast":
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "ran.json"
            status = record_run(path, tier_only=bool(argv))
            record = read(path)
        if status != 0:
            print(f"the run failed (pytest exit status {status})", file=sys.stderr)
    else:
        status, record = 0, read(Path(argv[0]))
    if record is None:
        where = argv[0] if argv and argv[0] != "--fast" else "the run"
        print(f"no record of a test run at {where!r}; {USAGE}", file=sys.stderr)
        return 2
    lines, ok = report(record, runnable())
    print("\n".join(lines))
    return 0 if ok and status == 0 else 1


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
