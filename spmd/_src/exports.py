"""Writes `spmd/__init__.py`'s TYPE_CHECKING imports from its `_WHERE`, the one list of the
public API (what an IDE or a type checker reads; `spmd.X` imports lazily from `_WHERE`).

    python -m spmd._src.exports          # rewrites the block
    python -m spmd._src.exports --check  # exits 1 if the block is stale

tests/test_layout.py runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

INIT = Path(__file__).resolve().parent.parent / "__init__.py"
BEGIN = "if TYPE_CHECKING:  # generated from _WHERE by `python -m spmd._src.exports`; do not edit\n"
END = "# fmt: on\n"
LINE = 100  # ruff's line length (pyproject.toml)


def block(where: dict[str, str]) -> str:
    """The TYPE_CHECKING block for `where` (public name -> module), as ruff sorts and wraps it."""
    lines = [BEGIN]
    imports = sorted(
        ("spmd", name) if module == f"spmd.{name}" else (module, name)
        for name, module in where.items()
    )
    for module, name in imports:
        line = f"    from {module} import {name} as {name}\n"
        if len(line) > LINE + 1:
            line = f"    from {module} import (\n        {name} as {name},\n    )\n"
        lines.append(line)
    return "".join(lines)


def render(text: str, where: dict[str, str]) -> str:
    """`text` (spmd/__init__.py) with its TYPE_CHECKING block written from `where`."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{INIT} needs the line {BEGIN.strip()!r} and, after it, {END.strip()!r}")
    return f"{head}{block(where)}{end}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the block is stale")
    args = parser.parse_args(argv)
    import spmd

    text = INIT.read_text()
    new = render(text, spmd._WHERE)
    if args.check:
        if new != text:
            print(f"{INIT} is stale: run python -m spmd._src.exports", file=sys.stderr)
            return 1
        return 0
    INIT.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
