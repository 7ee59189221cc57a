"""Workers started from a warm interpreter: a preload server imports JAX, flax, optax and
orbax once and forks each Python worker of `spmd launch` from it, where a fresh
interpreter would import them again (seconds of CPU per process, and per restart).

A forked worker runs as a fresh `python` would run it, as far as its program can tell:
its own argv, environment, working directory, umask, standard streams (numbered 0, 1 and
2), a session and process group of its own and its exit status; `__main__` is its script
(or `-c` code, or `-m` module) and sys.path is built as a fresh interpreter builds it.
Python's `random` and numpy's global generator are seeded anew. The heavy packages it
finds already imported are those a fresh interpreter would import: the server refuses
(and the worker starts as a fresh process) a command other than `python SCRIPT|-c
CODE|-m MODULE ARGS...` by this interpreter without options of its own, and a worker
whose sys.path would find one of the server's modules elsewhere. The variables those
packages read when imported (JAX_*, XLA_*, PYTHON*, ...: `import_time_env`) are the
server's: a worker whose environment says otherwise gets a server of its own. A program
that sets a JAX_* or FLAX_* variable itself before its first `import jax` (or flax, optax,
orbax) gets it applied at that import, as it would be at a fresh import; one that unsets
such a variable, or sets one that is no configuration option, gets an ImportError that
says so. The server has started no JAX backend (nor any thread of JAX's) when it forks.

The launcher's side, `start()`, answers as subprocess.Popen does (pid, poll, wait,
returncode, stdout, stderr). The worker is the server's child: the server sends its exit
status over a socket of the worker's own and kills its process group when that socket
closes (the launcher died, or let the worker go). The server dies with the launcher
(PR_SET_PDEATHSIG) and every worker with the server.

The server runs as `python preload.py FD MODULES` and imports only the standard library
and MODULES: it runs the worker's program whatever spmd the worker's sys.path finds.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import importlib.abc
import importlib.machinery
import io
import json
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DEFAULT_MODULES", "ENV_PRELOAD", "ForkedProcess", "import_time_env", "start"]

ENV_PRELOAD = "SPMD_LAUNCH_PRELOAD"  # "1": DEFAULT_MODULES; "a,b": those modules; "0" or "": off
DEFAULT_MODULES = ("numpy", "jax", "jax.numpy", "optax", "flax.nnx", "orbax.checkpoint")
# The environment variables that a preloaded package (or Python itself) reads when it is
# imported, and so must read the same in the server and in every worker forked from it.
_IMPORT_TIME_PREFIXES = (
    "JAX_", "XLA_", "FLAX_", "OPTAX", "ORBAX", "TENSORSTORE", "TF_", "TPU_", "LIBTPU",
    "CUDA", "NCCL", "NVIDIA", "ROCM", "HIP_", "OMP_", "OPENBLAS", "GOTO", "MKL_", "NPY_",
    "NUMPY", "ABSL", "GRPC", "PYTHON", "LD_", "MALLOC", "TCMALLOC", "LC_", "LANG",
)  # fmt: skip
# ... except these, which a forked worker applies itself (or which no package reads).
# XLA_FLAGS is read when a backend starts, which no server does.
_PER_PROCESS = frozenset({"TF_CONFIG", "PYTHONPATH", "PYTHONUNBUFFERED", "XLA_FLAGS"})
_CONFIG_PREFIXES = ("JAX_", "FLAX_")
# Preloaded packages that import none of the others: importing one first gives back only
# it (any other brings JAX with it, as a fresh import would).
_STANDALONE = frozenset({"numpy"})  # configuration options read from the environment
_READY_TIMEOUT = 300.0  # seconds the server may take to import its modules
_MAX_SERVERS = 4  # servers one launcher keeps (one per import-time environment)
_PR_SET_PDEATHSIG = 1
_PIDFDS = hasattr(os, "pidfd_open")  # a worker's end is an event to wait for (Linux 5.3+)
_POLL = 0.05  # seconds between looks at the workers without pidfds
# How the server runs this file: compiled under a name of its own, so that the frames
# below every worker's program are not spmd's (spmd tells its own frames by their file:
# the hang watch, errors naming the caller's line), and without the working directory
# in sys.path.
_SERVER_FILE = "<spmd preload server>"
_BOOT = (
    "import sys\n"
    "if not sys.flags.safe_path:\n"
    "    del sys.path[0]\n"
    "with open(sys.argv.pop(1), 'rb') as f:\n"
    "    source = f.read()\n"
    f"exec(compile(source, {_SERVER_FILE!r}, 'exec'), {{'__name__': '__main__'}})\n"
)


def import_time_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of `env` that packages read when imported, sorted: a server serves
    the workers whose environment has the same."""
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if k.startswith(_IMPORT_TIME_PREFIXES) and k not in _PER_PROCESS
        )
    )


def modules_from_env(value: str | None) -> tuple[str, ...]:
    """The modules SPMD_LAUNCH_PRELOAD names: none for "", "0" or unset, DEFAULT_MODULES
    for "1", else the comma-separated names."""
    value = (value or "").strip()
    if value in ("", "0"):
        return ()
    if value == "1":
        return DEFAULT_MODULES
    return tuple(name.strip() for name in value.split(",") if name.strip())


# ------------------------------------------------------------------ the launcher's side


class ForkedProcess:
    """A worker forked by a preload server, answering as a subprocess.Popen does."""

    def __init__(
        self, args: list[str], pid: int, server: _Server, conn: socket.socket, stdout, stderr
    ) -> None:
        self.args = args
        self._server = server
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = None
        self.stdout = stdout
        self.stderr = stderr
        self._conn = conn
        self._pending = b""
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        """The exit status if the worker ended (-N for signal N), else None."""
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the worker's end; subprocess.TimeoutExpired after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Sends `sig` to the worker unless it ended."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float | None) -> None:
        """Reads the server's word on the worker ("exit N"), waiting up to `timeout` s."""
        with self._lock:
            if self.returncode is not None:
                return
            ready, _, _ = _select([self._conn], timeout)
            if not ready:
                return
            data = self._conn.recv(4096)
            self._pending += data
            *lines, self._pending = self._pending.split(b"\n")
            for line in lines:
                kind, *values = line.decode().split()
                if kind == "exit":
                    self.returncode = int(values[0])
                    self._server.cpu_s = float(values[1])
            if not data and self.returncode is None:  # the server died, its workers with it
                self.returncode = -signal.SIGKILL
            if self.returncode is not None:
                self._conn.close()


def _select(socks: list[socket.socket], timeout: float | None) -> tuple[list, list, list]:
    import select

    return select.select(socks, [], [], timeout)


class _Server:
    """One preload server, started from the launcher, and its control socket."""

    def __init__(self, modules: Sequence[str], env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        server_env = {k: v for k, v in env.items() if k not in _PER_PROCESS}
        server_env.pop("PYTHONPATH", None)
        parent = os.getpid()

        def die_with_parent() -> None:
            _die_with(parent)

        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _BOOT,
                os.path.abspath(__file__),
                str(theirs.fileno()),
                ",".join(modules),
            ],
            env=server_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=[theirs.fileno()],
            start_new_session=True,  # neither the terminal's signals nor ours reach it
            preexec_fn=die_with_parent,  # noqa: PLW1509 (no locks taken in the child)
        )
        theirs.close()
        self.control = ours
        self.lock = threading.Lock()
        self.cpu_s = 0.0  # its CPU and its ended workers', as it said last
        self.failure = _read_line(ours, _READY_TIMEOUT)
        self.ready = self.failure == "ready"

    def fork(self, command: list[str], request: dict[str, Any]) -> ForkedProcess | None:
        """The worker forked for `request`, or None where the server refuses it."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            payload = json.dumps(request).encode()
            with self.lock:
                socket.send_fds(
                    self.control,
                    [struct.pack("!I", len(payload))],
                    [theirs.fileno(), null, out_w, err_w],
                )
                self.control.sendall(payload)
            answer = _read_line(ours, _READY_TIMEOUT)
        except OSError:
            answer = "fallback: the server is gone"
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
            theirs.close()
        if not answer.startswith("pid "):
            ours.close()
            os.close(out_r)
            os.close(err_r)
            return None
        return ForkedProcess(
            command, int(answer[4:]), self, ours, open(out_r, "rb"), open(err_r, "rb")
        )

    def close(self) -> None:
        self.control.close()  # the server kills what it forked and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)


def _read_line(sock: socket.socket, timeout: float) -> str:
    """One line from `sock` (without its newline), "" on EOF or after `timeout` s."""
    data = b""
    deadline = time.monotonic() + timeout
    while not data.endswith(b"\n"):
        ready, _, _ = _select([sock], max(0.0, deadline - time.monotonic()))
        if not ready:
            return ""
        chunk = sock.recv(1)
        if not chunk:
            return ""
        data += chunk
    return data[:-1].decode()


_servers: dict[tuple, _Server] = {}
_servers_lock = threading.Lock()


def start(command: Sequence[str], env: Mapping[str, str]) -> ForkedProcess | None:
    """`command` forked from a preload server, or None where it is to start as a fresh
    process: SPMD_LAUNCH_PRELOAD (in this process's environment) names no module, the
    command is not `python SCRIPT|-c CODE|-m MODULE ...` by this interpreter, or the
    server refused it (its sys.path would find a preloaded module elsewhere) or could
    not start. Its stdin is /dev/null, its stdout and stderr pipes, as `spmd launch` runs
    a worker."""
    modules = modules_from_env(os.environ.get(ENV_PRELOAD))
    command = list(command)
    program = _program(command, env)
    if not modules or program is None:
        return None
    key = (modules, import_time_env(env))
    with _servers_lock:
        server = _servers.get(key)
        if server is None:
            if len(_servers) >= _MAX_SERVERS:
                return None
            if not _servers:
                atexit.register(close_servers)
            server = _servers[key] = _Server(modules, env)
    if not server.ready:
        return None
    request = {**program, "env": dict(env), "cwd": os.getcwd(), "umask": _umask()}
    return server.fork(command, request)


def close_servers() -> None:
    """Stops every server this process started (and whatever they still run), and reaps
    it: its CPU time, and its workers', then counts in this process's RUSAGE_CHILDREN."""
    with _servers_lock:
        for server in _servers.values():
            server.close()
        _servers.clear()


def cpu_seconds() -> float:
    """The CPU time of this process's servers and of their ended workers, which its
    RUSAGE_CHILDREN leaves out until the servers end (`close_servers`)."""
    with _servers_lock:
        return sum(server.cpu_s for server in _servers.values())


def _program(command: list[str], env: Mapping[str, str]) -> dict[str, Any] | None:
    """What `command` runs ({"mode", "target", "args"}), where it is this interpreter
    without options of its own; else None."""
    import shutil

    if len(command) < 2:
        return None
    found = shutil.which(command[0], path=env.get("PATH", os.defpath))
    if found is None or not _is_this_interpreter(found):
        return None
    first, rest = command[1], command[2:]
    if first in ("-c", "-m"):
        if not rest:
            return None
        mode = "code" if first == "-c" else "module"
        return {"mode": mode, "target": rest[0], "args": rest[1:]}
    if first.startswith("-") or not os.path.isfile(first):
        return None  # an option of python's, or a file a fresh interpreter says is missing
    return {"mode": "script", "target": first, "args": rest}


def _is_this_interpreter(path: str) -> bool:
    """Whether `path` runs as sys.executable does (the same file, in the same folder:
    a virtual environment's python is its base interpreter in another folder)."""
    try:
        same = os.path.samefile(path, sys.executable)
    except OSError:
        return False
    here = os.path.dirname(os.path.abspath(sys.executable))
    return same and os.path.dirname(os.path.abspath(path)) == here


def _umask() -> int | None:
    """This process's umask, read without changing it (Linux), else None."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return None


def _die_with(parent: int) -> None:
    """Makes this process get SIGKILL when its parent dies (Linux), exiting at once if
    `parent` is already gone."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


# ------------------------------------------------------------------ the server


def _serve(control: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Forks a worker for each request until the control socket closes (then kills every
    worker still running and returns None). In a forked worker it returns the request
    and the worker's standard streams."""
    workers = _Workers(control)
    while True:
        for key, _ in workers.selector.select(timeout=None if _PIDFDS else _POLL):
            kind = key.data
            if kind is None:
                got = _receive(control)
                if got is None:  # the launcher is gone or done
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


def _tell(conn: socket.socket, line: str) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(f"{line}\n".encode())


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
    """Why the server cannot run `request` as a fresh interpreter would ("" if it can):
    the worker's own sys.path entries would find one of the imported modules elsewhere,
    or the server started a JAX backend."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is not None and getattr(bridge, "_backends", None):
        return "a JAX backend was started in the server"
    own = _own_path(request)
    for name in _imported_top_level():
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.machinery.PathFinder.find_spec(name, own)
            if spec is not None:
                return f"module {name!r} would come from {spec.origin}"
    return ""


def _imported_top_level() -> list[str]:
    """The top-level modules imported here that a sys.path entry could shadow."""
    return sorted(
        {
            name
            for name, module in list(sys.modules.items())
            if "." not in name and getattr(module, "__file__", None) and name != "__main__"
        }
    )


def _own_path(request: dict[str, Any]) -> list[str]:
    """The sys.path entries a fresh interpreter puts before the server's for `request`:
    the script's folder ('' for -c, the working directory for -m), then PYTHONPATH."""
    env, cwd = request["env"], request["cwd"]
    first: list[str] = []
    if not env.get("PYTHONSAFEPATH"):
        if request["mode"] == "script":
            target = os.path.join(cwd, request["target"])
            first = [os.path.dirname(os.path.realpath(target))]
        else:
            first = [cwd]
    extra = [os.path.join(cwd, p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    seen, out = set(), []
    for entry in first + [os.path.abspath(p) for p in extra]:
        if entry not in seen:
            seen.add(entry)
            out.append(entry)
    return out


# ------------------------------------------------------------------ the forked worker


def _become(request: dict[str, Any], fds: list[int], server_env: dict[str, str]) -> None:
    """Turns this forked process (in a session of its own, dying with the server) into
    the worker `request` describes, up to running its program."""
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    if request.get("umask") is not None:
        os.umask(request["umask"])
    os.chdir(request["cwd"])
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    own = _own_path(request)
    if request["mode"] == "code" and own and not env.get("PYTHONSAFEPATH"):
        own[0] = ""  # python -c puts '' first, the working directory as it changes
    sys.path[:0] = own
    _new_stdio(bool(env.get("PYTHONUNBUFFERED")))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh interpreter's legacy global generator
    _hide_until_imported(server_env)


def _new_stdio(unbuffered: bool) -> None:
    """sys.stdin, stdout and stderr on descriptors 0, 1 and 2, buffered as Python's own."""
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        open(0, "rb", closefd=False),  # noqa: SIM115 (sys.stdin, open for the process)
        encoding=encoding,
        errors=errors,
    )
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115
        stream = io.TextIOWrapper(
            raw,
            encoding=encoding,
            errors="backslashreplace" if name == "stderr" else errors,
            line_buffering=name == "stderr" and not unbuffered,
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


class _FirstImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Holds the preloaded packages (and their modules) back until the program imports
    one of them: then gives it back as it was, with the packages a fresh import of it
    would import (JAX with flax, optax or orbax: every one but numpy), applying the JAX_*
    and FLAX_* variables the program set meanwhile as a fresh import of JAX reads them."""

    def __init__(self, hidden: dict[str, types.ModuleType], server_env: dict[str, str]) -> None:
        self.hidden = hidden
        self.server_env = server_env
        self.specs = {name: getattr(m, "__spec__", None) for name, m in hidden.items()}

    def find_spec(self, name, path=None, target=None):  # noqa: ARG002 (the finder protocol)
        if name not in self.hidden:
            return None
        spec = importlib.machinery.ModuleSpec(name, self)
        original = self.specs[name]
        if original is not None:
            spec.submodule_search_locations = original.submodule_search_locations
        return spec

    def create_module(self, spec):
        module = self.hidden[spec.name]
        alone = spec.name.split(".")[0] in _STANDALONE  # imports none of the others
        released = [name for name in self.hidden if not alone or name.split(".")[0] in _STANDALONE]
        for name in released:
            sys.modules.setdefault(name, self.hidden.pop(name))
        if not self.hidden:
            sys.meta_path.remove(self)
        if _effects is not None and _effects.undone is not None:
            _effects.redo()
            _effects.undone = None
        if not alone:
            _apply_config(self.server_env)
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.specs[module.__name__]  # the module's own, not this finder's


def _hide_until_imported(server_env: dict[str, str]) -> None:
    """Takes the preloaded packages and their modules out of sys.modules until the
    program's first import of one of them (`_FirstImport`)."""
    roots = tuple({name.split(".")[0] for name in (*_preloaded, "jax", "flax")})
    hidden = {
        name: sys.modules.pop(name)
        for name in list(sys.modules)
        if name in roots or name.startswith(tuple(f"{r}." for r in roots))
    }
    if hidden:
        if _effects is not None:
            _effects.undo()
        sys.meta_path.insert(0, _FirstImport(hidden, server_env))


def _apply_config(server_env: dict[str, str]) -> None:
    """Sets the JAX and flax options whose variable the program changed since it started,
    as their packages read them when imported; an ImportError where that cannot be."""
    changed = sorted(
        name
        for name in set(server_env) | set(os.environ)
        if name.startswith(_CONFIG_PREFIXES) and server_env.get(name) != os.environ.get(name)
    )
    for variable in changed:
        option, value = variable.lower(), os.environ.get(variable)
        holder = _option(option)
        if holder is None:
            continue  # read when used (JAX_COORDINATOR_ADDRESS, ...), if at all: as it is now
        config, current = holder
        if value is None:
            raise ImportError(
                f"{variable} was unset by the program before its first import of "
                f"{', '.join(sorted(_preloaded))}, which this worker, started from a warm "
                f"interpreter ({ENV_PRELOAD}), had imported with {variable} set. Expected: "
                "configuration variables left as the program started with them, or set. "
                f"Fix: unset it in the launch's environment, or launch without {ENV_PRELOAD}."
            )
        config.update(option, _parse(variable, value, current))


def _option(name: str) -> tuple[Any, Any] | None:
    """(the config, the value) of JAX's or flax's option `name`, None if neither has it."""
    jax_config = getattr(sys.modules.get("jax"), "config", None)
    holders = getattr(jax_config, "_value_holders", {})
    if name in holders:
        return jax_config, holders[name].value
    flax_config = getattr(sys.modules.get("flax"), "config", None)
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
        raise ValueError(f"invalid truth value {value!r} for environment {variable!r}")
    if isinstance(current, int):
        return int(value)
    if isinstance(current, float):
        return float(value)
    return value


def _run(request: dict[str, Any]) -> int:
    """Runs the worker's program as `__main__`; its exit status as python's."""
    import builtins
    import runpy

    mode, target, args = request["mode"], request["target"], request["args"]
    sys.orig_argv = [
        sys.executable,
        *(["-c"] if mode == "code" else ["-m"] if mode == "module" else []),
        target,
        *args,
    ]
    if mode == "module":
        sys.argv = ["-m", *args]
        runpy._run_module_as_main(target, alter_argv=True)
        return 0
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    if mode == "script":
        path = os.path.abspath(target)
        with io.open_code(path) as f:
            source = f.read()
        main.__file__ = path
        main.__cached__ = None
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
        sys.argv = [target, *args]
    else:
        source, path = target, "<string>"
        main.__loader__ = importlib.machinery.BuiltinImporter
        sys.argv = ["-c", *args]
    sys.modules["__main__"] = main
    code = compile(source, path, "exec")
    try:
        exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 (printed as the interpreter prints it)
        e.__traceback__ = e.__traceback__.tb_next if e.__traceback__ else None  # not _run's
        sys.excepthook(type(e), e, e.__traceback__)
        return 1
    return 0


_preloaded: tuple[str, ...] = ()  # the modules the server imported


class _Effects:
    """What importing the preloaded modules did to the interpreter beyond sys.modules:
    warnings filters added, root logger handlers added (absl's first log calls
    logging.basicConfig()), the root logger's level, the recursion limit. A worker
    starts with them undone and gets them at its first import of a preloaded package,
    as a fresh interpreter does: a program's own logging.basicConfig(level=INFO) before
    `import orbax` configures the root logger, not a no-op."""

    def __init__(self, filters: list, handlers: list, level: int, recursion: int) -> None:
        self.filters = filters
        self.handlers = handlers
        self.level = level
        self.recursion = recursion
        self.undone: _Effects | None = None

    @classmethod
    def now(cls) -> _Effects:
        import logging
        import warnings

        root = logging.getLogger()
        return cls(list(warnings.filters), list(root.handlers), root.level, sys.getrecursionlimit())

    def since(self) -> _Effects:
        """What changed from `self` to now (the state before, to undo it, kept)."""
        now = _Effects.now()
        added = _Effects(
            [f for f in now.filters if f not in self.filters],
            [h for h in now.handlers if h not in self.handlers],
            now.level,
            now.recursion,
        )
        added.undone = self
        return added

    def undo(self) -> None:
        import logging
        import warnings

        before = self.undone
        warnings.filters[:] = [f for f in warnings.filters if f not in self.filters]
        warnings._filters_mutated()
        root = logging.getLogger()
        for handler in self.handlers:
            root.removeHandler(handler)
        root.setLevel(before.level)
        sys.setrecursionlimit(before.recursion)

    def redo(self) -> None:
        import logging
        import warnings

        before = self.undone
        warnings.filters[:0] = self.filters
        warnings._filters_mutated()
        root = logging.getLogger()
        if self.handlers and not root.handlers:
            if all(_is_basic(h) for h in self.handlers):
                logging.basicConfig()  # on this worker's sys.stderr, as the import did
            else:
                for handler in self.handlers:
                    root.addHandler(handler)
        if root.level == before.level:
            root.setLevel(self.level)
        if sys.getrecursionlimit() == before.recursion:
            sys.setrecursionlimit(self.recursion)


_effects: _Effects | None = None


def _is_basic(handler: Any) -> bool:
    """Whether `handler` is the one logging.basicConfig() adds (stderr, BASIC_FORMAT)."""
    import logging

    formatter = handler.formatter
    return type(handler) is logging.StreamHandler and getattr(formatter, "_fmt", None) == (
        logging.BASIC_FORMAT
    )


def _main(argv: list[str]) -> int:
    """The server: imports the modules, says "ready", then serves; in a forked worker,
    runs the worker's program."""
    global _preloaded, _effects
    control = socket.socket(fileno=int(argv[0]))
    before = _Effects.now()
    try:
        for name in argv[1].split(","):
            importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 (reported to the launcher, which starts fresh)
        _tell(control, f"failed: {type(e).__name__}: {e}".replace("\n", " "))
        return 1
    _preloaded, _effects = tuple(argv[1].split(",")), before.since()
    server_env = dict(os.environ)
    _tell(control, "ready")
    job = _serve(control)
    if job is None:
        return 0
    request, fds = job
    _become(request, fds, server_env)
    return _run(request)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
