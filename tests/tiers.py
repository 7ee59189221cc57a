"""Which spmd/ modules a run of the tests leaves unrun: the fast tier must run every one.

Record a run, then check it:

    SPMD_TEST_RECORD=/tmp/ran.json python -m pytest -q -m "not slow"
    python tests/tiers.py /tmp/ran.json

The record (written by tests/conftest.py) lists, per test, the spmd/ files
that had a function called. A module that defines a function or a class and
has none called by any recorded test is reported, and the exit status is 1.
Modules that only re-export names (`spmd/callbacks.py`, ...) need no test.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

SPMD = Path(__file__).resolve().parent.parent / "spmd"


def runnable(root: Path = SPMD) -> list[str]:
    """The files of spmd/ (relative to it) that define a function or a class."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        if any(isinstance(node, kinds) for node in tree.body):
            found.append(path.relative_to(root).as_posix())
    return found


def unrun(record: dict[str, list[str]], modules: list[str]) -> list[str]:
    """The modules no test of `record` ran a function of."""
    ran = {name for names in record.values() for name in names}
    return [m for m in modules if m not in ran]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    record = json.loads(Path(argv[0]).read_text())
    modules = runnable()
    missing = unrun(record, modules)
    print(f"{len(record)} tests recorded; {len(modules) - len(missing)} of {len(modules)} modules run")
    for name in missing:
        print(f"not run by any recorded test: spmd/{name}")
    if missing:
        print(f"verdict: FAIL: {len(missing)} module(s) of spmd/ run by no test of this tier")
    else:
        print("verdict: OK: every module of spmd/ with code is run by a test of this tier")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
