"""The docs cover the public API, every public name has a docstring, the guide's code runs."""

import dataclasses
import functools
import inspect
import os
import re
import sys
import types
from pathlib import Path

import pytest
from commands import run_program

import spmd
import spmd.partitioners

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PUBLIC = {f"spmd.{name}": getattr(spmd, name) for name in spmd.__all__} | {
    f"spmd.partitioners.{name}": getattr(spmd.partitioners, name)
    for name in spmd.partitioners.__all__
}
SKIP_MARK = "<!-- docs: not run"  # put on the line before a ```python block the guide test skips


def _fenced_blocks(text: str) -> list[tuple[str, str, str]]:
    """(info string, body, the line before the fence) of each fenced code block."""
    pattern = re.compile(r"^([^\n]*)\n```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
    return [(m.group(2).strip(), m.group(3), m.group(1)) for m in pattern.finditer("\n" + text)]


@functools.cache
def _code_spans() -> frozenset[str]:
    """Every inline `code span` of docs/*.md, fenced blocks left out."""
    spans = set()
    for path in sorted(DOCS.glob("*.md")):
        text = re.sub(r"^```.*?^```[ \t]*$", "", path.read_text(), flags=re.M | re.S)
        spans.update(s.strip() for s in re.findall(r"`([^`\n]+)`", text))
    return frozenset(spans)


def _mentioned(name: str, prefixes: str) -> bool:
    """Whether a code span is `name`, optionally qualified, then perhaps `(...)` or ` -> ...`."""
    pattern = re.compile(rf"(?:(?:{prefixes})\.)?{re.escape(name)}(?:[(\s].*)?")
    return any(pattern.fullmatch(span) for span in _code_spans())


@pytest.mark.parametrize("qualname", sorted(PUBLIC))
def test_public_name_is_documented(qualname):
    name = qualname.rpartition(".")[2]
    assert _mentioned(name, r"spmd|spmd\.partitioners|partitioners"), (
        f"`{qualname}` is in __all__ but no docs/*.md mentions it in backticks; "
        "add it to docs/api.md."
    )


def _is_routine(member: object) -> bool:
    """Whether a class attribute is a method or a property (not a field or a constant)."""
    wrappers = (property, functools.cached_property, classmethod, staticmethod)
    return inspect.isfunction(member) or isinstance(member, wrappers)


def _routines(cls: type) -> list[str]:
    """The public methods and properties `cls` defines itself."""
    return [n for n, m in vars(cls).items() if not n.startswith("_") and _is_routine(m)]


def _members(cls: type) -> list[str]:
    """The public methods, properties and dataclass fields `cls` defines itself."""
    fields = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
    return sorted({n for n in fields if not n.startswith("_")} | set(_routines(cls)))


@pytest.mark.parametrize(
    "cls, member",
    [(cls, m) for cls in (spmd.Strategy, spmd.Step) for m in _members(cls)],
    ids=lambda x: x if isinstance(x, str) else x.__name__,
)
def test_strategy_and_step_members_are_documented(cls, member):
    owner = cls.__name__
    assert _mentioned(member, f"{owner}|{owner.lower()}"), (
        f"`{owner}.{member}` is public but no docs/*.md mentions it in backticks."
    )


def _own_doc(obj: object) -> str:
    """The docstring `obj` itself carries, not one generated or inherited."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, (property, functools.cached_property)):
        obj = obj.fget if isinstance(obj, property) else obj.func
    doc = (getattr(obj, "__doc__", None) or "").strip()
    generated = isinstance(obj, type) and dataclasses.is_dataclass(obj)
    if generated and doc.startswith(f"{obj.__name__}("):  # dataclass's signature stand-in
        return ""
    return doc


def _has_doc_by_nature(obj: object) -> bool:
    """Modules, classes and functions carry docstrings; plain constants cannot."""
    return isinstance(obj, (types.ModuleType, type)) or callable(obj)


@pytest.mark.parametrize(
    "qualname", sorted(name for name, obj in PUBLIC.items() if _has_doc_by_nature(obj))
)
def test_public_name_has_a_docstring(qualname):
    obj = PUBLIC[qualname]
    doc = _own_doc(obj)
    assert doc, f"{qualname} has no docstring"
    if isinstance(obj, types.ModuleType):
        assert len(doc.splitlines()) == 1, f"module {qualname} needs a one-line docstring"
    for name in _routines(obj) if isinstance(obj, type) else ():
        assert _own_doc(vars(obj)[name]), f"{qualname}.{name} has no docstring"


@pytest.mark.slow
def test_guide_examples_run(tmp_path):
    """Every ```python block of docs/guide.md, run in order in one fresh process."""
    blocks = [
        body
        for info, body, before in _fenced_blocks((DOCS / "guide.md").read_text())
        if info == "python" and not before.strip().startswith(SKIP_MARK)
    ]
    assert blocks, "docs/guide.md has no python examples"
    script = tmp_path / "guide.py"
    script.write_text("\n\n".join(blocks))
    # One process, whatever cluster the test session itself runs in.
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("SPMD_")}
    env["JAX_PLATFORMS"] = "cpu"
    result = run_program([sys.executable, str(script)], env, 300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
