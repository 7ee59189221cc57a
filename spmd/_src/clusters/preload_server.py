"""The preload server of `spmd launch --preload` (spmd._src.clusters.preload starts it):
imports the heavy packages once, then forks a worker for each request and runs the
worker's program in it as a fresh interpreter would.

It runs as `python -c BOOT preload_server.py FD MODULES` (see preload.py), compiled
under the name `<spmd preload server>`: spmd tells its own frames by their file (the
hang watch, errors naming the caller's line), and the frames below a worker's program
are not spmd's. It imports only the standard library and MODULES, not spmd: a worker
runs whatever spmd its own sys.path finds.

What a worker finds as a fresh interpreter would:

- its argv, environment, working directory, umask, standard streams (0, 1, 2, buffered
  as Python's own), a session and process group of its own, its exit status (an
  uncaught error prints its traceback, from the program's frames on, and exits 1; an
  uncaught KeyboardInterrupt ends it by SIGINT);
- `__main__` a module of its own (its script, `-c` code or `-m` module), sys.path
  built as a fresh interpreter builds it;
- the modules the server imported for MODULES (and the ones they imported), held back
  until the program imports them (`_HeldBack`): importing one of MODULES gives back it
  and the ones imported before it, with what importing them did to the interpreter
  (warnings filters, root logging handlers, the root level, the recursion limit:
  `_Effects`); JAX_* and FLAX_* variables the program set meanwhile applied as a fresh
  import of JAX reads them. A module its sys.path now finds elsewhere is an ImportError.
- `random` and numpy's global generator seeded anew, `tempfile`'s folder unset.

The server refuses (and the worker starts fresh) a worker whose own sys.path entries
(its script's folder, PYTHONPATH) would find one of the server's modules elsewhere or
hold a sitecustomize or usercustomize, and a script that is a zip archive or bytecode.
What differs still, and cannot be undone in a running interpreter: the hash seed of
str (one per server, not per worker), absl flags the packages defined, numpy's dtypes
that ml_dtypes registered, exit handlers the packages registered (they run at exit as
they would after the import), the frames below the program's in a stack, the memory,
and what the imports made being frozen out of the garbage collector's reach (gc.freeze,
as Python advises before a fork: `gc.get_freeze_count()` is not 0, and gc.get_objects()
and gc.get_referrers() do not list those objects; the program's own objects are
collected as usual).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import os
import resource
import selectors
import signal
import socket
import struct
import sys
import threading
import types
import zipfile
from typing import Any

__all__: list[str] = []

ENV_PRELOAD = "SPMD_LAUNCH_PRELOAD"
SERVER_FILE = "<spmd preload server>"  # the name this file's code runs under
_CONFIG_PREFIXES = ("JAX_", "FLAX_")  # configuration options read from the environment
_PR_SET_PDEATHSIG = 1
_PIDFDS = hasattr(os, "pidfd_open")  # a worker's end is an event to wait for (Linux 5.3+)
_POLL = 0.05  # seconds between looks at the workers without pidfds
_CUSTOMIZE = ("sitecustomize", "usercustomize")  # what site imports from sys.path at start


def _die_with(parent: int) -> None:
    """Makes this process get SIGKILL when its parent dies (Linux), exiting at once if
    `parent` is already gone. (The signal comes when the thread that forked this one
    ends: only a process that forks from one long-lived thread may rely on it.)"""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _tell(conn: socket.socket, line: str) -> None:
    """Sends one line; a launcher that is gone is no error."""
    with contextlib.suppress(OSError):
        conn.sendall(f"{line}\n".encode())


# ------------------------------------------------------------------ serving


def _serve(control: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Forks a worker for each request until the control socket closes (then kills every
    worker still running and returns None: the launcher is gone or done). In a forked
    worker it returns the request and the worker's standard streams."""
    workers = _Workers(control)
    while True:
        for key, _ in workers.selector.select(timeout=None if _PIDFDS else _POLL):
            kind = key.data
            if kind is None:
                got = _receive(control)
                if got is None:
                    workers.kill_all()
                    return None
                job = workers.fork(*got)
                if job is not None:
                    return job
            elif kind[0] == "conn":  # the launcher let the worker go (or died): kill it
                if not _recv_quietly(key.fileobj):
                    workers.selector.unregister(key.fileobj)
                    _kill_group(kind[1])
            else:
                workers.reap(kind[1])
        if not _PIDFDS:
            for pid in list(workers.running):
                workers.reap(pid, block=False)


class _Workers:
    """The server's workers: each one's socket to the launcher and its pidfd, watched."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ, None)
        self.running: dict[int, tuple[socket.socket, int | None]] = {}

    def fork(self, request: dict[str, Any], fds: list[int]) -> tuple | None:
        """Forks the worker of `request` (fds: its socket, stdin, stdout, stderr). In the
        worker: (request, its streams); in the server: None, the launcher told its pid
        (or told to start it fresh)."""
        conn = socket.socket(fileno=fds[0])
        refusal = _refusal(request)
        if refusal:
            _tell(conn, f"fallback: {refusal}")
            conn.close()
            for fd in fds[1:]:
                os.close(fd)
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        server, (settled, settle) = os.getpid(), os.pipe()
        pid = os.fork()
        if pid == 0:
            os.setsid()  # its own session and process group, as a launched worker
            _die_with(server)
            os.write(settle, b"1")
            self._close_all(settled, settle, conn)
            return request, fds[1:]
        os.close(settle)
        os.read(settled, 1)  # its process group exists: the launcher may signal it now
        for fd in (settled, *fds[1:]):
            os.close(fd)
        pidfd = os.pidfd_open(pid) if _PIDFDS else None
        self.running[pid] = (conn, pidfd)
        _tell(conn, f"pid {pid}")
        self.selector.register(conn, selectors.EVENT_READ, ("conn", pid))
        if pidfd is not None:
            self.selector.register(pidfd, selectors.EVENT_READ, ("exit", pid))
        return None

    def reap(self, pid: int, block: bool = True) -> None:
        """Collects worker `pid`'s exit status and sends it to the launcher, with the CPU
        time of this server and of its ended workers."""
        done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
        if done == 0:
            return
        conn, pidfd = self.running.pop(pid)
        mine = resource.getrusage(resource.RUSAGE_SELF)
        theirs = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = mine.ru_utime + mine.ru_stime + theirs.ru_utime + theirs.ru_stime
        _tell(conn, f"exit {os.waitstatus_to_exitcode(status)} {cpu!r}")
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        conn.close()
        if pidfd is not None:
            self.selector.unregister(pidfd)
            os.close(pidfd)

    def kill_all(self) -> None:
        for pid in self.running:
            _kill_group(pid)

    def _close_all(self, *fds: int | socket.socket) -> None:
        """In a forked worker: closes what is the server's."""
        for fd in fds:
            if isinstance(fd, socket.socket):
                fd.close()
            else:
                os.close(fd)
        self.selector.close()
        self.control.close()
        for sock, pidfd in self.running.values():
            sock.close()
            if pidfd is not None:
                os.close(pidfd)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _recv_quietly(sock: socket.socket) -> bytes:
    try:
        return sock.recv(4096)
    except OSError:
        return b""


def _receive(control: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One request and its file descriptors; None when the control socket closed."""
    try:
        head, fds, _, _ = socket.recv_fds(control, 4, 4)
    except OSError:
        return None
    if len(head) < 4:
        for fd in fds:
            os.close(fd)
        return None
    (size,) = struct.unpack("!I", head)
    payload = b""
    while len(payload) < size:
        chunk = control.recv(size - len(payload))
        if not chunk:
            return None
        payload += chunk
    return json.loads(payload), fds


def _refusal(request: dict[str, Any]) -> str:
    """Why the server cannot run `request` as a fresh interpreter would ("" if it can)."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is not None and getattr(bridge, "_backends", None):
        return "a JAX backend was started in the server"
    if request["mode"] == "script":
        path = os.path.join(request["cwd"], request["target"])
        if _is_bytecode(path) or zipfile.is_zipfile(path):
            return f"{path} is not Python source (a zip archive or bytecode)"
    own = _own_path(request)
    for name in (*_imported_top_level(), *_CUSTOMIZE):
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.machinery.PathFinder.find_spec(name, own)
            imported = getattr(sys.modules.get(name), "__spec__", None)
            if spec is not None and not (imported and _same_place(spec, imported)):
                where = spec.origin or list(spec.submodule_search_locations or [])
                return f"module {name!r} would come from {where}"
    return ""


def _is_bytecode(path: str) -> bool:
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return f.read(4) == importlib.util.MAGIC_NUMBER[:4]
    return False


def _imported_top_level() -> list[str]:
    """The top-level modules imported here that a sys.path entry could shadow: those
    of a file or a folder (namespace packages too), not those built in."""
    return sorted(
        {
            name
            for name, module in list(sys.modules.items())
            if "." not in name
            and name != "__main__"
            and (getattr(module, "__file__", None) or hasattr(module, "__path__"))
        }
    )


def _own_path(request: dict[str, Any]) -> list[str]:
    """The sys.path entries a fresh interpreter puts before the server's for `request`:
    the script's folder (the working directory for -c and -m), then PYTHONPATH."""
    env, cwd = request["env"], request["cwd"]
    first: list[str] = []
    if not env.get("PYTHONSAFEPATH"):
        if request["mode"] == "script":
            target = os.path.join(cwd, request["target"])
            first = [os.path.dirname(os.path.realpath(target))]
        else:
            first = [cwd]
    # An empty entry is the working directory; an empty PYTHONPATH, none.
    pythonpath = env.get("PYTHONPATH", "")
    extra = [os.path.join(cwd, p) for p in pythonpath.split(os.pathsep)] if pythonpath else []
    seen, out = set(), []
    for entry in first + [os.path.abspath(p) for p in extra]:
        if entry not in seen:
            seen.add(entry)
            out.append(entry)
    return out


# ------------------------------------------------------------------ what the imports did


class _Effects:
    """What importing one module did to the interpreter beyond sys.modules: warnings
    filters added, root logger handlers added (absl's first log calls
    logging.basicConfig()), the root logger's level, the recursion limit, each as it
    was before and after, and the environment variables it set (JAX's import sets
    TPU_SKIP_MDS_QUERY on a host without TPU chips: without it, libtpu asks a cloud
    metadata server for minutes)."""

    def __init__(self) -> None:
        import logging
        import warnings

        # The server's logging and warnings modules: a worker holds `logging` back, and
        # an `import logging` here then would load a second one.
        self.logging, self.warnings = logging, warnings
        root = logging.getLogger()
        self.filters, self.handlers = list(warnings.filters), list(root.handlers)
        self.level, self.recursion = root.level, sys.getrecursionlimit()
        self.env = dict(os.environ)
        self.before: _Effects | None = None

    def since(self) -> _Effects:
        """What changed from `self` (the state then) to now."""
        now = _Effects()
        now.filters = [f for f in now.filters if f not in self.filters]
        now.handlers = [h for h in now.handlers if h not in self.handlers]
        # name -> (value before the import or None, value after or None)
        now.env = {
            k: (self.env.get(k), now.env.get(k))
            for k in self.env.keys() | now.env.keys()
            if self.env.get(k) != now.env.get(k)
        }
        now.before = self
        return now

    def undo(self) -> None:
        """Takes this import's effects back (a worker starts without them)."""
        logging, warnings = self.logging, self.warnings
        warnings.filters[:] = [f for f in warnings.filters if f not in self.filters]
        warnings._filters_mutated()
        root = logging.getLogger()
        for handler in self.handlers:
            root.removeHandler(handler)
        root.setLevel(self.before.level)
        sys.setrecursionlimit(self.before.recursion)

    def redo(self) -> None:
        """Does them again, as importing the module in a fresh interpreter would now."""
        logging, warnings = self.logging, self.warnings
        warnings.filters[:0] = self.filters
        warnings._filters_mutated()
        root = logging.getLogger()
        if self.handlers and not root.handlers:
            if all(_is_basic(h, logging) for h in self.handlers):
                logging.basicConfig()  # on this worker's sys.stderr, as the import did
            else:
                for handler in self.handlers:
                    root.addHandler(handler)
        if root.level == self.before.level:
            root.setLevel(self.level)
        if sys.getrecursionlimit() == self.before.recursion:
            sys.setrecursionlimit(self.recursion)
        for name, (before, after) in self.env.items():  # where the program left them be
            if os.environ.get(name) == before:
                if after is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = after


def _is_basic(handler: Any, logging: Any) -> bool:
    """Whether `handler` is the one logging.basicConfig() adds (stderr, BASIC_FORMAT)."""
    fmt = getattr(handler.formatter, "_fmt", None)
    return type(handler) is logging.StreamHandler and fmt == logging.BASIC_FORMAT


class _Step:
    """A package of MODULES, imported (with its modules of MODULES: jax and jax.numpy
    are one step): its own top-level name, the top-level modules first imported with
    it, and what importing it did."""

    def __init__(self, own: str) -> None:
        self.own = own
        self.roots: list[str] = []
        self.effects: list[_Effects] = []
        self.done = False  # whether the worker has it back


def _preload(modules: list[str]) -> tuple[list[_Step], Any]:
    """Imports `modules` in order, noting what each brought; and tempfile's folder before."""
    import tempfile

    seen = {name.split(".")[0] for name in sys.modules}
    steps: dict[str, _Step] = {}
    for name in modules:
        before = _Effects()
        importlib.import_module(name)
        own = name.split(".")[0]
        step = steps.setdefault(own, _Step(own))
        step.roots += sorted({m.split(".")[0] for m in list(sys.modules)} - seen)
        step.effects.append(before.since())
        seen.update(step.roots)
    return list(steps.values()), tempfile.tempdir


# ------------------------------------------------------------------ the forked worker


def _become(request: dict[str, Any], fds: list[int], held: _HeldBack, tempdir: Any) -> None:
    """Turns this forked process (in a session of its own, dying with the server) into
    the worker `request` describes, up to running its program."""
    import tempfile

    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    if request.get("umask") is not None:
        os.umask(request["umask"])
    os.chdir(request["cwd"])
    env = dict(request["env"])
    if "LC_CTYPE" in os.environ and "LC_CTYPE" not in env:
        # Python's own C locale coercion (PEP 538) in the server, started with the
        # launch's locale variables: a fresh interpreter would set it too.
        env["LC_CTYPE"] = os.environ["LC_CTYPE"]
    os.environ.clear()
    os.environ.update(env)
    own = _own_path(request)
    if request["mode"] == "code" and own and not env.get("PYTHONSAFEPATH"):
        own[0] = ""  # python -c puts '' first: the working directory, as it changes
    sys.path[:0] = own
    _new_stdio(bool(env.get("PYTHONUNBUFFERED")))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh interpreter's legacy global generator
    tempfile.tempdir = tempdir  # read from TMPDIR again when first asked for
    held.hold()


def _new_stdio(unbuffered: bool) -> None:
    """sys.stdin, stdout and stderr on descriptors 0, 1 and 2, made as Python makes them
    (Python/pylifecycle.c, create_stdio)."""
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        mode, raw_only = ("r", False) if fd == 0 else ("w", unbuffered)
        buffer = open(fd, f"{mode}b", buffering=0 if raw_only else -1, closefd=False)  # noqa: SIM115
        (buffer if raw_only else buffer.raw).name = f"<{name}>"
        stream = io.TextIOWrapper(
            buffer,
            encoding=encoding,
            errors="backslashreplace" if name == "stderr" else errors,
            newline="\n",
            line_buffering=not unbuffered and (fd == 2 or os.isatty(fd)),
            write_through=unbuffered,
        )
        stream.mode = mode
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


class _HeldBack(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The modules the server imported (new top-level ones, with their submodules), out
    of sys.modules until the program imports them, as a fresh interpreter would import
    them then: one of MODULES gives back it and every step before it (their modules,
    their effects; JAX's and flax's variables applied), any other only itself. Where the
    program's sys.path now finds one elsewhere, the import is an ImportError."""

    def __init__(self, steps: list[_Step], server_env: dict[str, str]) -> None:
        self.steps, self.server_env = steps, server_env
        self.hidden: dict[str, dict[str, types.ModuleType]] = {}  # root: its modules
        self.specs: dict[str, Any] = {}  # each module's own spec
        self.step_of = {root: k for k, step in enumerate(steps) for root in step.roots}
        # Imports in several threads of the program give modules back one at a time.
        self.lock = threading.RLock()

    def hold(self) -> None:
        """Takes the modules out of sys.modules (and their effects back)."""
        for name in list(sys.modules):
            root = name.split(".")[0]
            if root in self.step_of:
                self.hidden.setdefault(root, {})[name] = module = sys.modules.pop(name)
                self.specs[name] = getattr(module, "__spec__", None)
        for step in reversed(self.steps):
            for effects in reversed(step.effects):
                effects.undo()
        sys.meta_path.insert(0, self)

    def find_spec(self, name, path=None, target=None):  # noqa: ARG002 (the finder protocol)
        module = self.hidden.get(name.split(".")[0], {}).get(name)
        if module is None:
            return None
        original = self.specs.get(name)
        spec = importlib.machinery.ModuleSpec(
            name,
            self,
            origin=getattr(original, "origin", None),
            is_package=hasattr(module, "__path__"),
        )
        if original is not None:
            spec.submodule_search_locations = original.submodule_search_locations
            spec.has_location = original.has_location
            spec.cached = original.cached
        return spec

    def create_module(self, spec):
        with self.lock:
            return self._give_back(spec)

    def _give_back(self, spec):
        root = spec.name.split(".")[0]
        if spec.name not in self.hidden.get(root, {}):  # another thread gave it back
            return sys.modules[spec.name]
        module = self.hidden[root][spec.name]
        k = self.step_of[root]
        whole = root == self.steps[k].own  # one of MODULES: the steps up to it
        steps = [s for s in self.steps[: k + 1] if not s.done] if whole else []
        roots = [r for s in steps for r in s.roots if r in self.hidden] if whole else [root]
        for name in roots:
            self._check_found_here(name)
        config = _changed_config(self.server_env, self._module) if whole else []
        for name in roots:
            for key, held in self.hidden.pop(name).items():
                sys.modules.setdefault(key, held)
        for step in steps:
            step.done = True
            for effects in step.effects:
                effects.redo()
        for config_object, option, value in config:
            config_object.update(option, value)
        if not self.hidden:
            sys.meta_path.remove(self)
        return module

    def exec_module(self, module) -> None:
        """Imported already: only its own __spec__ back (the import set this finder's)."""
        module.__spec__ = self.specs.get(module.__name__, module.__spec__)

    def _module(self, name: str) -> Any:
        return self.hidden.get(name.split(".")[0], {}).get(name) or sys.modules.get(name)

    def _check_found_here(self, root: str) -> None:
        """An ImportError where the program's sys.path now finds `root` elsewhere, or, under
        a namespace package (whose portions sys.path gives), one of its held-back modules."""
        found = None
        for finder in sys.meta_path:  # as a fresh import would look: frozen, built in, path
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            with contextlib.suppress(ImportError, ValueError):
                found = finder.find_spec(root, None)
            if found is not None:
                break
        if found is None:
            return
        self._check_same(root, found)
        fresh = {root: found}
        for name in sorted(self.hidden.get(root, {}), key=lambda n: n.count(".")):
            parent = fresh.get(name.rpartition(".")[0])
            if parent is None or parent.has_location or not parent.submodule_search_locations:
                continue  # not under a namespace package: found in its package's own folder
            fresh[name] = _find_under_namespace(name, list(parent.submodule_search_locations))
            if fresh[name] is not None and fresh[name].has_location:  # a file: its own
                self._check_same(name, fresh[name])  # (a namespace's portions: its modules)

    def _check_same(self, name: str, found: Any) -> None:
        original = self.specs.get(name)
        if _same_place(found, original):
            return
        where = found.origin or list(found.submodule_search_locations or [])
        had = _location(original)[0] or _location(original)[1]
        raise ImportError(
            f"Module {name!r} would be imported from {where} by this program's sys.path, "
            f"but this worker, started from a warm interpreter ({ENV_PRELOAD}), has it "
            f"imported from {had} already. Expected: the packages the "
            "launch's interpreter imports. Fix: put that folder in PYTHONPATH of the launch "
            f"instead of in sys.path, or launch without {ENV_PRELOAD}.",
            name=name,
        )


def _find_under_namespace(name: str, locations: list[str]) -> Any:
    """The spec a fresh import finds for `name` in its namespace package's `locations`:
    a module or regular package (PathFinder's), else a namespace package of its own, whose
    portions are the folders of that name (which PathFinder cannot build while the parent
    is held back: it reads the parent's path from sys.modules); None if none."""
    with contextlib.suppress(ImportError, ValueError, KeyError):
        return importlib.machinery.PathFinder.find_spec(name, locations)
    child = name.rpartition(".")[2]
    portions = [os.path.join(p, child) for p in locations if os.path.isdir(os.path.join(p, child))]
    if not portions:
        return None
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = portions
    return spec


def _same_place(found: Any, original: Any) -> bool:
    """Whether a fresh import would find the module where the server imported it: the same
    file (a package's __init__.py, whose __path__ the package may have grown since, as
    TensorFlow's does), or a namespace package's same folders."""
    origin = getattr(found, "origin", None)
    if origin is not None and found.has_location:
        return origin == getattr(original, "origin", None)
    return _location(found) == _location(original)


def _location(spec: Any) -> tuple[str | None, list[str]]:
    """Where a module spec says its module is: its file, its package's folders."""
    origin = getattr(spec, "origin", None)
    return origin, list(getattr(spec, "submodule_search_locations", None) or [])


def _changed_config(server_env: dict[str, str], find: Any) -> list[tuple[Any, str, Any]]:
    """(config, option, value) for each JAX or flax option whose variable the program
    changed since it started, read as the package reads it when imported; an
    ImportError, before anything is given back, where that cannot be."""
    changed = sorted(
        name
        for name in set(server_env) | set(os.environ)
        if name.startswith(_CONFIG_PREFIXES) and server_env.get(name) != os.environ.get(name)
    )
    updates = []
    for variable in changed:
        option, value = variable.lower(), os.environ.get(variable)
        holder = _option(option, find)
        if holder is None:
            continue  # read when used (JAX_COORDINATOR_ADDRESS, ...), if at all: as it is now
        config, current = holder
        if value is None:
            raise ImportError(
                f"{variable} was unset by the program before its first import of the "
                f"packages this worker, started from a warm interpreter ({ENV_PRELOAD}), "
                f"had imported with {variable} set. Expected: configuration variables left "
                "as the program started with them, or set. Fix: unset it in the launch's "
                f"environment, or launch without {ENV_PRELOAD}."
            )
        updates.append((config, option, _parse(variable, value, current)))
    return updates


def _option(name: str, find: Any) -> tuple[Any, Any] | None:
    """(the config, the value) of JAX's or flax's option `name`, None if neither has it."""
    jax_config = getattr(find("jax"), "config", None)
    holders = getattr(jax_config, "_value_holders", {})
    if name in holders:
        return jax_config, holders[name].value
    flax_config = getattr(find("flax"), "config", None)
    values = getattr(flax_config, "_values", {})
    if name in values:
        return flax_config, values[name]
    return None


def _parse(variable: str, value: str, current: Any) -> Any:
    """`value` read as the option's package reads its variable: a truth value, a number
    or the text itself."""
    if isinstance(current, bool):
        lowered = value.lower()
        if lowered in ("y", "yes", "t", "true", "on", "1"):
            return True
        if lowered in ("n", "no", "f", "false", "off", "0"):
            return False
        raise ImportError(f"invalid truth value {value!r} for environment {variable!r}")
    if isinstance(current, int):
        return int(value)
    if isinstance(current, float):
        return float(value)
    return value


# ------------------------------------------------------------------ running the program


def _run(request: dict[str, Any]) -> int:
    """Runs the worker's program as `__main__`; its exit status as python's."""
    import builtins

    mode, target, args = request["mode"], request["target"], request["args"]
    flag = {"code": ["-c"], "module": ["-m"]}.get(mode, [])
    sys.orig_argv = [sys.executable, *flag, target, *args]
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    main.__annotations__ = {}
    sys.modules["__main__"] = main
    try:
        if mode == "module":
            import runpy  # as python -m does

            sys.argv = ["-m", *args]
            runpy._run_module_as_main(target, alter_argv=True)
            return 0
        if mode == "script":
            path = os.path.join(request["cwd"], target)  # as given, not normalized
            with io.open_code(path) as f:
                source = f.read()
            main.__file__, main.__cached__ = path, None
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
            sys.argv = [target, *args]
        else:
            source, path = target, "<string>"
            main.__loader__ = importlib.machinery.BuiltinImporter
            sys.argv = ["-c", *args]
        try:
            code = compile(source, path, "exec")
        except SyntaxError as e:
            e.__traceback__ = None  # python prints no traceback for its program's syntax
            raise
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 (printed as the interpreter prints it)
        if e.__traceback__ is not None:
            e.__traceback__ = e.__traceback__.tb_next  # from the program's frame on
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, e.__traceback__
        sys.excepthook(type(e), e, e.__traceback__)
        if isinstance(e, KeyboardInterrupt):
            _exit_by_sigint()
        return 1
    return 0


def _exit_by_sigint() -> None:
    """Ends as python ends on an uncaught KeyboardInterrupt: exit handlers run, streams
    flushed, then killed by SIGINT (exit status -2, 130 in a shell)."""
    import atexit

    atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(130)


def main(argv: list[str]) -> int:
    """The server: imports the modules, says "ready", then serves; in a forked worker,
    runs the worker's program."""
    control = socket.socket(fileno=int(argv[0]))
    try:
        steps, tempdir = _preload(argv[1].split(","))
    except BaseException as e:  # noqa: BLE001 (reported to the launcher, which starts fresh)
        _tell(control, f"failed: {type(e).__name__}: {e}".replace("\n", " "))
        return 1
    server_env = dict(os.environ)
    # What the imports made lives as long as the server, and in every worker: out of the
    # garbage collector's reach (gc.freeze), a worker's collections, and the last one at
    # its exit, do not walk it, nor write to its pages (which a fork shares until written:
    # each worker copied them at exit, about 0.45 s of CPU with JAX, flax and orbax).
    gc.collect()
    gc.freeze()
    _tell(control, "ready")
    job = _serve(control)
    if job is None:
        return 0
    request, fds = job
    _become(request, fds, _HeldBack(steps, server_env), tempdir)
    return _run(request)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
