"""Workers started from a warm interpreter (`spmd launch --preload`, SPMD_LAUNCH_PRELOAD):
each Python worker forked from a server that imported JAX, flax, optax and orbax once,
where a fresh interpreter would import them again (seconds of CPU per process, and per
restart). The server, and what a forked worker finds as a fresh interpreter would, are
spmd._src.clusters.preload_server's; this is the launcher's side.

`start()` forks a command where the server can run it as a fresh interpreter would:
`python SCRIPT|-c CODE|-m MODULE ARGS...` by this very interpreter, without options of
its own; else the launcher starts it fresh. A launch environment whose variables that
packages read when imported (`import_time_env`: JAX_*, PYTHON*, TZ, ...) differ gets a
server of its own. The worker answers as a subprocess.Popen does (pid, poll, wait,
returncode, stdout, stderr): it is the server's child, the server sends its exit status
over a socket of the worker's own and kills its process group when that socket closes
(the launcher died, or let the worker go). The server ends when its control socket
closes (the launcher died or ended), killing what it still runs, and every worker dies
with the server (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import locale
import math
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from spmd._src.clusters import preload_server
from spmd._src.clusters.preload_server import ENV_PRELOAD, SERVER_FILE

__all__ = [
    "DEFAULT_MODULES",
    "ENV_PRELOAD",
    "ForkedProcess",
    "close_servers",
    "cpu_seconds",
    "import_time_env",
    "start",
]

# SPMD_LAUNCH_PRELOAD: "1" preloads DEFAULT_MODULES; "a,b" those modules; "0" or "": off
DEFAULT_MODULES = ("numpy", "jax", "jax.numpy", "optax", "flax.nnx", "orbax.checkpoint")
# The environment variables that a preloaded package (or Python itself) reads when it is
# imported, and so must read the same in the server and in every worker forked from it.
_IMPORT_TIME_PREFIXES = (
    "JAX_", "XLA_", "FLAX_", "OPTAX", "ORBAX", "TENSORSTORE", "TF_", "TPU_", "LIBTPU",
    "CUDA", "NCCL", "NVIDIA", "ROCM", "HIP_", "OMP_", "OPENBLAS", "GOTO", "MKL_", "NPY_",
    "NUMPY", "ABSL", "GRPC", "PYTHON", "LD_", "MALLOC", "TCMALLOC", "LC_", "LANG", "TZ",
)  # fmt: skip
# ... and HOME, where Python's site finds the user's site-packages folder (~/.local/...)
# when the interpreter starts: a worker's modules come from its own HOME's, as fresh.
_IMPORT_TIME_NAMES = frozenset({"HOME"})
# ... except these, which a forked worker applies itself (or which no package reads).
# XLA_FLAGS is read when a backend starts, which no server does.
_PER_PROCESS = frozenset({"TF_CONFIG", "PYTHONPATH", "PYTHONUNBUFFERED", "XLA_FLAGS"})
_READY_TIMEOUT = 300.0  # seconds the server may take to import its modules
# Servers one launcher keeps (one per import-time environment): a new one beyond them
# replaces the least recently used that runs no worker.
_MAX_SERVERS = 4
# How the server runs preload_server.py: compiled under a name of its own (see there),
# without the working directory in sys.path.
_BOOT = (
    "import sys\n"
    "if not sys.flags.safe_path:\n"
    "    del sys.path[0]\n"
    "with open(sys.argv.pop(1), 'rb') as f:\n"
    "    source = f.read()\n"
    f"exec(compile(source, {SERVER_FILE!r}, 'exec'), {{'__name__': '__main__'}})\n"
)


def import_time_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of `env` that packages read when imported, sorted: a server serves
    the workers whose environment has the same."""
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if (k.startswith(_IMPORT_TIME_PREFIXES) or k in _IMPORT_TIME_NAMES)
            and k not in _PER_PROCESS
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
        # what communicate read from stdout and stderr, by their descriptors
        self._output: dict[int, list[bytes]] = {}
        self._fds = {name: f.fileno() for name, f in (("out", stdout), ("err", stderr)) if f}

    def poll(self) -> int | None:
        """The exit status if the worker ended (-N for signal N), else None."""
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the worker's end; subprocess.TimeoutExpired after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._read(left)
            if self.returncode is None and left == 0.0:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """(stdout, stderr) read to their ends, then the worker's exit awaited, as
        subprocess.Popen.communicate (without input: stdin is /dev/null): None for a
        stream that is not a pipe, text where the worker was started with `text`.
        subprocess.TimeoutExpired after `timeout` s; what was read is kept for the next
        call and given on the exception."""
        if input:
            raise ValueError(
                "A forked worker's stdin is /dev/null: communicate() sends it no input. "
                f"Received: input of {len(input)} items. Start the program fresh "
                "(subprocess.Popen with stdin=PIPE) to write to it."
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = {f.fileno(): f for f in (self.stdout, self.stderr) if f and not f.closed}
        for fd in streams:
            self._output.setdefault(fd, [])
        while streams:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(
                    self.args,
                    timeout,
                    output=self._collected(self.stdout, "out"),
                    stderr=self._collected(self.stderr, "err"),
                )
            for fd in _readable(list(streams), left):
                chunk = os.read(fd, 32768)
                if chunk:
                    self._output[fd].append(chunk)
                else:
                    streams.pop(fd).close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._collected(self.stdout, "out"), self._collected(self.stderr, "err")

    def _collected(self, stream: Any, name: str) -> Any:
        """What communicate read from `stream` (None if it is not a pipe)."""
        if stream is None:
            return None
        data = b"".join(self._output.get(self._fds[name], []))
        if isinstance(stream, io.TextIOWrapper):
            text = data.decode(stream.encoding, stream.errors)
            return text.replace("\r\n", "\n").replace("\r", "\n")
        return data

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
        """Reads the server's word on the worker ("exit N"), waiting up to `timeout` s
        (not holding the lock while it waits: another thread's poll or kill goes on)."""
        if self.returncode is not None:
            return
        try:
            ready = _readable([self._conn.fileno()], timeout)
        except (OSError, ValueError):  # closed by another thread that read the exit
            ready = [-1]
        if not ready:
            return
        with self._lock:
            if self.returncode is not None:
                return
            try:
                data = self._conn.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:  # another thread read it first
                return
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


class _Server:
    """One preload server, started from the launcher, and its control socket."""

    def __init__(self, modules: Sequence[str], env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        server_env = {k: v for k, v in env.items() if k not in _PER_PROCESS}
        server_env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _BOOT,
                os.path.abspath(preload_server.__file__),
                str(theirs.fileno()),
                ",".join(modules),
            ],
            env=server_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=[theirs.fileno()],
            start_new_session=True,  # neither the terminal's signals nor ours reach it
        )
        theirs.close()
        self.control = ours
        self.lock = threading.Lock()
        self.cpu_s = 0.0  # its CPU and its ended workers', as it said last
        self.workers: weakref.WeakSet[ForkedProcess] = weakref.WeakSet()
        self.pending = 0  # forks under way (counted under _servers_lock)
        # "ready", or "failed: ..." (an import failed): the launcher then starts fresh
        self.ready = _read_line(ours, _READY_TIMEOUT) == "ready"

    def fork(
        self, command: list[str], request: dict[str, Any], stdout: Any, stderr: Any, text: bool
    ) -> ForkedProcess | None:
        """The worker forked for `request`, or None where the server refuses it. `stdout`
        and `stderr` as subprocess.Popen takes them (PIPE, DEVNULL, None, a descriptor or
        a file; STDOUT for stderr, both checked by start); its stdin is /dev/null."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        null = os.open(os.devnull, os.O_RDONLY)
        out_r, out_w, out_closes = _stream(stdout, 1)
        if stderr == subprocess.STDOUT:
            err_r, err_w, err_closes = None, out_w, False
        else:
            err_r, err_w, err_closes = _stream(stderr, 2)
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
            os.close(null)
            for fd, closes in ((out_w, out_closes), (err_w, err_closes)):
                if closes:
                    os.close(fd)
            theirs.close()
        if not answer.startswith("pid "):
            ours.close()
            for fd in (out_r, err_r):
                if fd is not None:
                    os.close(fd)
            return None
        out, err = (_reader(fd, text) for fd in (out_r, err_r))
        worker = ForkedProcess(command, int(answer[4:]), self, ours, out, err)
        self.workers.add(worker)
        return worker

    def busy(self) -> bool:
        """Whether a worker forked from it may still run (one this process let go of,
        unwaited, counts as ended: the server killed it when its socket closed)."""
        return self.pending > 0 or any(worker.poll() is None for worker in list(self.workers))

    def close(self) -> None:
        self.control.close()  # the server kills what it forked and exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)


def _readable(fds: Sequence[int], timeout: float | None) -> list[int]:
    """Those of `fds` ready to read within `timeout` s (None: no limit), by poll(2):
    select(2) refuses descriptors above 1023."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    wait = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return [fd for fd, _ in poller.poll(wait)]


def _read_line(sock: socket.socket, timeout: float) -> str:
    """One line from `sock` (without its newline), "" on EOF or after `timeout` s."""
    data = b""
    deadline = time.monotonic() + timeout
    while not data.endswith(b"\n"):
        if not _readable([sock.fileno()], deadline - time.monotonic()):
            return ""
        chunk = sock.recv(1)
        if not chunk:
            return ""
        data += chunk
    return data[:-1].decode()


_servers: dict[tuple, _Server] = {}  # least recently used first
_servers_lock = threading.Lock()


def start(
    command: Sequence[str],
    env: Mapping[str, str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    stdout: Any = subprocess.PIPE,
    stderr: Any = subprocess.PIPE,
    text: bool = False,
) -> ForkedProcess | None:
    """`command` forked from a preload server, or None where it is to start as a fresh
    process: SPMD_LAUNCH_PRELOAD (in this process's environment) names no module, the
    command is not `python SCRIPT|-c CODE|-m MODULE ...` by this interpreter, or the
    server refused it (see preload_server._refusal) or could not start. Its stdin is
    /dev/null; `cwd`, `stdout`, `stderr` and `text` as subprocess.Popen takes them (by
    default pipes of bytes, as `spmd launch` runs a worker)."""
    _check_stream(stdout, "stdout")
    _check_stream(stderr, "stderr")
    modules = modules_from_env(os.environ.get(ENV_PRELOAD))
    command = [os.fsdecode(part) for part in command]  # str, bytes or paths, as Popen's
    env = {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}
    program = _program(command, env)
    if not modules or program is None:
        return None
    key = (modules, import_time_env(env))
    with _servers_lock:
        server = _servers.get(key)
        if server is not None and server.proc.poll() is not None:  # it died: a new one
            _servers.pop(key).close()
            server = None
        if server is None:
            if len(_servers) >= _MAX_SERVERS and not _close_an_idle_server():
                return None
            if not _servers:
                atexit.register(close_servers)
            server = _servers[key] = _Server(modules, env)
        _servers[key] = _servers.pop(key)  # the most recently used last
        server.pending += 1  # busy from now: no other start() closes it under this fork
    try:
        if not server.ready:
            return None
        where = os.path.abspath(os.fsdecode(cwd)) if cwd is not None else os.getcwd()
        request = {**program, "env": env, "cwd": where, "umask": _umask()}
        return server.fork(command, request, stdout, stderr, text)
    finally:
        with _servers_lock:
            server.pending -= 1


def _close_an_idle_server() -> bool:
    """Closes the least recently used server that runs no worker (reaped: its CPU time
    and its workers' then count in this process's RUSAGE_CHILDREN); False where every
    server runs one."""
    for key, server in _servers.items():
        if not server.busy():
            server.close()
            del _servers[key]
            return True
    return False


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


def _check_stream(spec: Any, name: str) -> None:
    """Refuses a `spec` of stdout or stderr that subprocess.Popen takes and a forked
    worker cannot (or nothing Popen takes), before anything is opened."""
    known = (subprocess.PIPE, subprocess.DEVNULL) + (
        (subprocess.STDOUT,) if name == "stderr" else ()
    )
    if spec is None or spec in known or (isinstance(spec, int) and spec >= 0):
        return
    if not isinstance(spec, int) and hasattr(spec, "fileno"):
        spec.fileno()  # io.UnsupportedOperation for a file without one, as Popen raises
        return
    raise ValueError(
        f"A forked worker's {name} is subprocess.PIPE, DEVNULL, None, a file descriptor or "
        f"a file{' (or STDOUT)' if name == 'stderr' else ''}. Received: {spec!r}."
    )


def _stream(spec: Any, inherited: int) -> tuple[int | None, int, bool]:
    """(the end this process reads or None, the descriptor the worker writes to, whether
    this process closes that one once sent) for a Popen-style `spec` of stdout or
    stderr (checked by _check_stream): PIPE, DEVNULL, None (this process's own
    `inherited`), a descriptor or a file."""
    if spec == subprocess.PIPE:
        read, write = os.pipe()
        return read, write, True
    if spec == subprocess.DEVNULL:
        return None, os.open(os.devnull, os.O_WRONLY), True
    if spec is None:
        return None, inherited, False
    if isinstance(spec, int):
        return None, spec, False
    return None, spec.fileno(), False


def _reader(fd: int | None, text: bool) -> Any:
    """The file this process reads a worker's pipe `fd` through, as Popen makes it."""
    if fd is None:
        return None
    raw = open(fd, "rb")  # noqa: SIM115
    return io.TextIOWrapper(raw, encoding=locale.getpreferredencoding(False)) if text else raw


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
