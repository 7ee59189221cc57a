"""The package layout: the public names `import spmd` gives stay exactly these."""

import ast
import functools
import importlib
import os
import pickle
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import spmd

SPMD = Path(spmd.__file__).resolve().parent

PUBLIC = [
    "ArgumentTypeError",
    "AutoShardPolicy",
    "BatchError",
    "CentralStorageStrategy",
    "CheckpointError",
    "CheckpointManager",
    "ClusterCoordinator",
    "ClusterError",
    "ClusterInfo",
    "Collective",
    "CommunicationImplementation",
    "CommunicationOptions",
    "ConfigurationError",
    "ContextError",
    "DiLoCo",
    "DistributedDataset",
    "DistributedIterator",
    "Explanation",
    "FileDataset",
    "InitializationError",
    "InputContext",
    "InputOptions",
    "LaunchError",
    "LayoutConflictWarning",
    "LeafLayout",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NonFiniteLossError",
    "NumpyDataset",
    "OneDeviceStrategy",
    "OutOfRangeError",
    "PaddedBatch",
    "ParameterServerStrategy",
    "PerReplica",
    "PipelineSchedule",
    "Plan",
    "Preempted",
    "ReduceOp",
    "RemoteValue",
    "ReplicaContext",
    "Roofline",
    "ScopeError",
    "SidecarEvaluator",
    "SpmdError",
    "Step",
    "Strategy",
    "TPUStrategy",
    "Topology",
    "Traffic",
    "Trainer",
    "attention",
    "auto_strategy",
    "callbacks",
    "cluster",
    "compute_average_loss",
    "get_replica_context",
    "get_strategy",
    "grain_shard_options",
    "has_strategy",
    "in_cross_replica_context",
    "initialize",
    "logical",
    "losses",
    "make_mesh",
    "partitioners",
    "pipeline",
    "restart_count",
    "scale_regularization_loss",
    "testing",
    "topology",
]


def test_the_public_names_are_pinned():
    assert spmd.__all__ == PUBLIC
    missing = [name for name in PUBLIC if getattr(spmd, name, None) is None]
    assert not missing, missing


def test_the_public_modules_keep_their_names():
    """The modules the docs name: `spmd.callbacks`, `spmd.losses`, `spmd.partitioners`,
    `spmd.logical`, `spmd.testing`; everything else lives under spmd._src."""
    assert spmd.callbacks.BackupAndRestore.__module__ == "spmd._src.trainer.callbacks"
    assert spmd.losses.Metric.__module__ == "spmd._src.trainer.losses"
    assert spmd.partitioners.MinSizePartitioner.__name__ == "MinSizePartitioner"
    assert spmd.logical.REST == importlib.import_module("spmd._src.logical").REST
    assert callable(spmd.testing.run_processes)
    public = {"__init__", "__main__", "callbacks", "logical", "losses", "partitioners", "testing"}
    top = {p.stem for p in SPMD.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert top == public | {"_src"}, top ^ (public | {"_src"})


def test_cluster_is_the_function_not_the_package():
    """The cluster family is `spmd._src.clusters`, so `spmd.cluster` stays the public function."""
    importlib.import_module("spmd._src.clusters.initialize")
    assert callable(spmd.cluster) and spmd.cluster.__module__ == "spmd._src.clusters.initialize"


def _modules() -> dict[str, Path]:
    """Every module of spmd/ by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(SPMD.rglob("*.py")):
        parts = path.relative_to(SPMD.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """The import statements that run at some point: in functions too, under
    `if TYPE_CHECKING:` not. Also the imports that are not statements: a call
    `importlib.import_module("spmd.x")` or `__import__("spmd.x")` with a literal name,
    and `spmd.X` read off the lazy root (it imports `spmd._WHERE[X]`). A name computed at
    run time (`import_module(name)`, as spmd/__init__.py does) cannot be seen; spmd/
    has none besides the root's `__getattr__`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking_only(node):
            yield from (n for child in node.orelse for n in _imports_of(child))
            continue
        yield from _imports_of(node)


def _imports_of(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)) or _imported_name(node):
        yield node
    else:
        yield from _imports(node)


def _imported_name(node: ast.AST) -> str | None:
    """The module a call `import_module("spmd.x")` / `__import__("spmd.x")` imports, or the
    module `spmd.X` (X a public name or a submodule) imports; else None."""
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        text = node.args[0].value
        if called in ("import_module", "__import__") and isinstance(text, str):
            return text if text.split(".")[0] == "spmd" else None
    root = isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "spmd"
    if root and not node.attr.startswith("_"):
        return spmd._WHERE.get(node.attr, f"spmd.{node.attr}")
    return None


def _targets(name: str, node: ast.AST, modules: dict) -> set[str]:
    """The spmd modules an import statement (or call, or `spmd.X`) of module `name` runs."""
    if (dynamic := _imported_name(node)) is not None:
        bases = [dynamic]
    elif isinstance(node, ast.Import):
        bases = [alias.name for alias in node.names]
    else:
        package = name if modules[name].name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = node.module or ""
        base = f"{package}.{base}".strip(".") if node.level else base
        bases = [base] + [f"{base}.{alias.name}" for alias in node.names]
    found = set()
    for base in bases:
        parts = base.split(".")
        # importing a.b.c runs a, a.b and a.b.c; the packages around `name` itself don't count
        for i in range(1, len(parts) + 1):
            target = ".".join(parts[:i])
            if target in modules and not name.startswith(target + ".") and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: set().union(
            *(_targets(name, n, modules) for n in _imports(ast.parse(path.read_text())))
        )
        for name, path in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph (as a path that returns to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_sees_imports_in_functions_and_skips_type_checking():
    code = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import spmd.b\ndef f():\n    from spmd import c\n"
    modules = {"spmd.a": Path("a.py"), "spmd.b": Path("b.py"), "spmd.c": Path("c.py")}
    found = set().union(*(_targets("spmd.a", n, modules) for n in _imports(ast.parse(code))))
    assert found == {"spmd.c"}
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_cycle_finder_sees_relative_dynamic_and_lazy_root_imports():
    """`from . import x`, `import spmd.a.c as c`, `importlib.import_module("spmd.x")`,
    `__import__`, and `spmd.Trainer` read off the lazy root are arrows too."""
    modules = {
        name: Path(f"{name.replace('.', '/')}.py")
        for name in ("spmd", "spmd.a", "spmd.a.b", "spmd.a.c", "spmd.x", "spmd._src.trainer")
    }
    modules["spmd._src.trainer.trainer"] = Path("spmd/_src/trainer/trainer.py")
    cases = {
        "from . import c\n": {"spmd.a.c"},
        "from .. import x\n": {"spmd.x"},
        "import spmd.a.c as c\n": {"spmd.a.c"},
        "import importlib\ndef f():\n    return importlib.import_module('spmd.x')\n": {"spmd.x"},
        "from importlib import import_module\nimport_module('spmd.a.c')\n": {"spmd.a.c"},
        "__import__('spmd.x')\n": {"spmd.x"},
        "import importlib\nimportlib.import_module('numpy')\n": set(),
        "import spmd\ndef f():\n    return spmd.Trainer\n": {
            "spmd._src.trainer",
            "spmd._src.trainer.trainer",
        },
        "import spmd\nv = spmd.__version__\n": set(),
    }
    for code, expected in cases.items():
        nodes = _imports(ast.parse(code))
        found = set().union(*(_targets("spmd.a.b", n, modules) for n in nodes))
        assert found == expected, (code, found)


@pytest.mark.slow
def test_no_import_cycle_inside_spmd():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# ------------------------------------------------------------------ the lazy root


def _type_checking_names() -> dict[str, str]:
    """The names spmd/__init__.py imports under `if TYPE_CHECKING:` (what IDEs and type
    checkers see), each with the module it comes from."""
    tree = ast.parse((SPMD / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and _type_checking_only(n))
    found = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"re-export as itself: {ast.unparse(node)}"
            is_module = node.module == "spmd"  # `from spmd import callbacks as callbacks`
            found[alias.name] = f"spmd.{alias.name}" if is_module else node.module
    return found


def test_all_where_and_type_checking_imports_agree():
    """`__all__` (what `from spmd import *` gives), `_WHERE` (what `spmd.X` imports) and the
    TYPE_CHECKING imports (what an IDE sees) name the same things from the same modules."""
    assert set(spmd.__all__) == set(spmd._WHERE), set(spmd.__all__) ^ set(spmd._WHERE)
    assert _type_checking_names() == spmd._WHERE
    assert sorted(spmd.__all__) == sorted(set(spmd.__all__)), "a name twice in __all__"


def test_the_type_checking_imports_are_written_from_where():
    """`python -m spmd._src.exports` writes them from `_WHERE`; a stale block fails here."""
    exports = importlib.import_module("spmd._src.exports")
    text = exports.INIT.read_text()
    assert exports.render(text, spmd._WHERE) == text, "run: python -m spmd._src.exports"
    assert spmd.__all__ == sorted(spmd._WHERE)


def test_every_public_name_lives_where_the_map_says():
    for name, module in spmd._WHERE.items():
        value = getattr(spmd, name)
        if module == f"spmd.{name}":
            assert value is importlib.import_module(module), name
        else:
            assert value is getattr(importlib.import_module(module), name), name
            # the module that defines it, not one that re-exports it; an exception
            # class is named by its public path, as tracebacks print it
            shown = "spmd" if isinstance(value, type) and issubclass(value, Exception) else module
            assert getattr(value, "__module__", module) == shown, (name, value.__module__)


def test_a_traceback_names_an_error_by_its_public_path():
    error = spmd.BatchError("no")
    assert f"{type(error).__module__}.{type(error).__qualname__}" == "spmd.BatchError"
    assert pickle.loads(pickle.dumps(spmd.NonFiniteLossError("x"))).args == ("x",)
    text = "".join(traceback.format_exception_only(spmd.ContextError("here")))
    assert text.startswith("spmd.ContextError: here")


_FRESH = """
import pickle, sys
import spmd
from spmd import *
import jax
jax.config.update("jax_num_cpu_devices", 8)  # after import spmd, before first use: as examples do
assert sorted(n for n in dir() if n in spmd.__all__) == sorted(spmd.__all__)
assert MirroredStrategy().num_replicas_in_sync == 8 == jax.device_count()
assert hasattr(spmd, "Trainer") and not hasattr(spmd, "Trainerr")
assert not hasattr(spmd, "x.y") and not hasattr(spmd, "cli.main") and not hasattr(spmd, "_WHERE_")
try:
    spmd.MirroredStrategyy
except AttributeError as e:
    assert "MirroredStrategyy" in str(e)
assert "MirroredStrategy" in dir(spmd)  # what the interpreter's "Did you mean" reads
sys.stdout.buffer.write(pickle.dumps(spmd.InputOptions(prefetch=3, check_contents=False)))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_lazy_root_in_a_fresh_process():
    """`from spmd import *`, `hasattr`, a typo, `jax.config.update` after `import spmd`, and a
    pickled public value read back by another fresh process that only imports pickle."""
    env = {**os.environ, "PYTHONPATH": str(SPMD.parent), "JAX_PLATFORMS": "cpu"}
    run = functools.partial(subprocess.run, capture_output=True, env=env, timeout=120)
    made = run([sys.executable, "-c", _FRESH])
    assert made.returncode == 0, made.stderr.decode()[-3000:]
    read = "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read()))"
    back = run([sys.executable, "-c", read], input=made.stdout)
    assert back.returncode == 0, back.stderr.decode()[-3000:]
    assert "prefetch=3" in back.stdout.decode() and "check_contents=False" in back.stdout.decode()


# ------------------------------------------------------------------ names the repository gives

ROOT = SPMD.parent
_DOTTED = re.compile(r"(?<![\w./-])spmd(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"(?<![\w./-])spmd/[\w/]+\.py\b")
_PLACEHOLDERS = {"spmd.X"}  # spmd/__init__.py's docstring: "`spmd.X` works as usual"
# Logger names (logging.getLogger): public names of spmd's logs, not modules.
_LOGGERS = {"spmd.checkpoint", "spmd.data", "spmd.evaluator", "spmd.strategy", "spmd.trainer"}


def _resolves(dotted: str) -> bool:
    """Whether `spmd.a.b.c` is an attribute chain or a module path that exists."""
    parts = dotted.split(".")
    value = spmd
    for i, part in enumerate(parts[1:], start=2):
        if hasattr(value, part):
            value = getattr(value, part)
            continue
        try:
            value = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            return False
    return True


def _texts() -> list[Path]:
    """The docs, examples, tests, bench and spmd/ itself (this file names made-up modules)."""
    found = [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")]
    for folder in ("examples", "tests", "bench", "spmd"):
        found += sorted((ROOT / folder).rglob("*.py"))
    return [path for path in found if path.resolve() != Path(__file__).resolve()]


def test_every_spmd_module_and_file_the_repository_names_exists():
    """`spmd.cluster_gloo`, `spmd/prefetch.py`: names of modules the layout moved, left in a
    doc, a docstring or a test's subprocess code, fail here rather than at a user's."""
    stale = set()
    for path in _texts():
        text = path.read_text()
        where = path.relative_to(ROOT).as_posix()
        stale |= {
            (where, m)
            for m in set(_DOTTED.findall(text)) - _PLACEHOLDERS - _LOGGERS
            if not _resolves(m)
        }
        stale |= {(where, m) for m in set(_PATH.findall(text)) if not (ROOT / m).exists()}
    assert not stale, sorted(stale)
