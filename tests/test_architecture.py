"""docs/architecture.md stays true: its picture is the code's, the paths it names exist."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
PATH = re.compile(r"(?<![\w/.-])((?:spmd|tests)/[\w./-]*[\w/])")


def _graph():
    spec = importlib.util.spec_from_file_location(
        "architecture_graph", ROOT / "docs" / "architecture_graph.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 2 s of CPU: over the fast tier's share (tests/tiers.py)
def test_the_picture_is_drawn_from_the_current_code():
    graph = _graph()
    text = graph.DOC.read_text()
    assert graph.render(text) == text, (
        "docs/architecture.md's picture differs from spmd/'s imports: "
        "run `python docs/architecture_graph.py` and commit the result."
    )
    assert graph.main(["--check"]) == 0


@pytest.mark.slow  # 1 s of CPU: over the fast tier's share (tests/tiers.py)
def test_a_stale_picture_is_caught():
    graph = _graph()
    text = graph.DOC.read_text()
    stale = text.replace("    strategy --> rules\n", "")
    assert stale != text
    assert graph.render(stale) == text


def test_the_picture_reads_imports_as_they_run():
    """Imports in functions count, `TYPE_CHECKING` ones don't, `spmd._src.errors` is left out."""
    edges = _graph().edges()
    assert (
        "strategy",
        "data",
    ) in edges  # spmd/_src/strategy/base.py imports spmd._src.data.dataset
    assert ("cli", "trainer") in edges  # spmd/_src/cli/demo.py
    assert ("data", "strategy") not in edges  # only for type hints
    assert not [e for e in edges if "errors" in e]


def _mentioned_paths() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for path in PATH.findall(doc.read_text()):
            found.append((doc.name, path))
    return sorted(set(found))


def test_the_docs_name_paths():
    names = {path for _, path in _mentioned_paths()}
    assert "spmd/_src/strategy/step.py" in names and "spmd/_src/clusters/initialize.py" in names


@pytest.mark.parametrize(("doc", "path"), _mentioned_paths())
def test_every_path_the_docs_name_exists(doc, path):
    assert (ROOT / path).exists(), f"{doc} names {path}, which does not exist"
