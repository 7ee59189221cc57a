"""docs/architecture.md's pointers hold: each file it names exists and defines the names beside it."""

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"

_PATH = r"`((?:spmd|tests|docs|bench|examples)/[\w./-]*)`"
_NAME = r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`"
# `path` (`name`, ...), `name` in `path` and `name` (`path`): a name the file defines.
POINTERS = [
    re.compile(_PATH + r"\s+\(" + _NAME),
    re.compile(_NAME + r"\s+in\s+" + _PATH),
    re.compile(_NAME + r"\s+\(" + _PATH + r"\)"),
]


def pointers(text: str) -> list[tuple[str, str]]:
    """(path, name) for each pointer of `text`."""
    found = set()
    for pattern in POINTERS:
        for match in pattern.finditer(text):
            first, second = match.groups()
            found.add((first, second) if "/" in first else (second, first))
    return sorted(found)


def paths(text: str) -> list[str]:
    """Every file or folder path `text` names in backticks."""
    return sorted(set(re.findall(_PATH, text)))


@functools.cache
def definitions(path: str) -> frozenset[str]:
    """The names `path` defines (def, class, assignment), classes' members as `Class.name`."""
    tree = ast.parse((ROOT / path).read_text())
    names = set()
    for node in ast.walk(tree):
        names |= _defined(node)
        if isinstance(node, ast.ClassDef):
            for member in ast.walk(node):
                if member is not node:
                    names |= {f"{node.name}.{name}" for name in _defined(member)}
    return frozenset(names)


def _defined(node: ast.AST) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    targets = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign | ast.AugAssign):
        targets = [node.target]
    names = set()
    for target in targets:
        for leaf in ast.walk(target):
            if isinstance(leaf, ast.Name):
                names.add(leaf.id)
            elif isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name):
                names.add(leaf.attr)  # self.x = ...
    return names


def _defines(names: frozenset[str], name: str) -> bool:
    """Whether `name` is among `names`; `instance.member` (`strategy.init`) where a
    class of the file defines `member`."""
    owner, _, member = name.rpartition(".")
    if not owner or owner[0].isupper():
        return name in names
    return any(n.endswith(f".{member}") for n in names)


def broken(text: str) -> list[str]:
    """What is wrong with `text`'s pointers: files that do not exist, names not defined."""
    wrong = [f"`{p}` does not exist" for p in paths(text) if not (ROOT / p).exists()]
    for path, name in pointers(text):
        if not path.endswith(".py") or not (ROOT / path).is_file():
            continue
        if not _defines(definitions(path), name):
            wrong.append(f"`{path}` does not define `{name}`")
    return wrong


def test_every_pointer_of_the_architecture_holds():
    assert broken(DOC.read_text()) == []


def test_the_architecture_points_at_names():
    found = pointers(DOC.read_text())
    assert ("spmd/_src/strategy/step.py", "Step.__call__") in found
    assert ("spmd/_src/placement.py", "put_rows") in found


@pytest.mark.parametrize(
    ("text", "wrong"),
    [
        (
            "`_place` in `spmd/_src/data/iterator.py` lays each leaf out",
            "`spmd/_src/data/iterator.py` does not define `_place`",
        ),
        (
            "| `spmd/_src/data/iterator.py` (`_place`), `spmd/_src/data/prefetch.py` |",
            "`spmd/_src/data/iterator.py` does not define `_place`",
        ),
        ("`Step._gone` (`spmd/_src/strategy/step.py`)", "does not define `Step._gone`"),
        ("`tests/test_gone.py`", "`tests/test_gone.py` does not exist"),
    ],
)
def test_a_stale_pointer_is_caught(text, wrong):
    assert any(wrong in line for line in broken(text)), broken(text)


def test_a_pointer_that_holds_is_not_flagged():
    text = "`CheckpointManager.save(step, state)` (`spmd/_src/checkpoint/manager.py`)"
    assert pointers(text) == [("spmd/_src/checkpoint/manager.py", "CheckpointManager.save")]
    assert broken(text) == []
