"""The roll call before the join: process 0 learns who came, and names who is missing or doubled.

JAX's coordination service says only "std::bad_cast" when a process never
joins or two join with one process id. So before `jax.distributed.initialize`
process 0 listens on the coordinator's own port (still free: the service is not
up yet) and every other process connects there and says its id, pid and host.
Process 0 answers each of them, once all came or `initialization_timeout`
passed: "ok", or which ids are missing, or which id came twice and from where.
Then it closes the port, and the service starts on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time

__all__ = ["Verdict", "answer", "call"]

_RETRY = 0.2  # seconds between a process's tries to reach process 0's roll call
_LINE = 512  # bytes of the longest line either side sends
_DRAIN = 5.0  # seconds process 0 waits for a peer to read its answer and hang up
_AFTER_TWICE = 2.0  # seconds the others still have to come once an id came twice


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What process 0 found.

    Attributes:
      missing: the process ids that did not come, sorted.
      twice: a process id two processes gave, or None.
      where: for `twice`, where each of them came from ("address (pid N, host H)").
      unreachable: (seen from a process other than 0) process 0 never answered.
    """

    missing: tuple[int, ...] = ()
    twice: int | None = None
    where: tuple[str, ...] = ()
    unreachable: bool = False

    @property
    def ok(self) -> bool:
        return not (self.missing or self.twice is not None or self.unreachable)

    def line(self) -> str:
        if self.twice is not None:
            return f"twice {self.twice} " + " | ".join(self.where)
        if self.missing:
            return "missing " + ",".join(map(str, self.missing))
        return "ok"

    @classmethod
    def parse(cls, line: str, index: int) -> Verdict:
        kind, _, rest = line.strip().partition(" ")
        if kind == "twice":
            twice, _, where = rest.partition(" ")
            return cls(twice=int(twice), where=tuple(where.split(" | ")))
        if kind == "missing":
            return cls(missing=tuple(int(i) for i in rest.split(",")))
        if kind == "ok":
            return cls()
        # Not process 0's roll call: the coordination service already runs there, so
        # process 0 moved on with a full roll, one that holds this process's id too.
        return cls(twice=index, where=(f"this process (pid {_me()})", "one that came first"))


def _me() -> str:
    return f"{os.getpid()} on {socket.gethostname()}"


def _readline(conn: socket.socket, deadline: float) -> str:
    """One line from `conn` (what came, at EOF), or "" once `deadline` passed."""
    data = b""
    while b"\n" not in data and len(data) < _LINE:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = conn.recv(_LINE)
        except OSError:
            return ""
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")


def _listen(bind: str) -> socket.socket:
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = socket.socket(family, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host if host != "localhost" else "127.0.0.1", int(port)))
    server.listen(128)
    return server


def answer(bind: str, count: int, timeout: float) -> Verdict:
    """On process 0: waits for processes 1 .. count-1 (or `timeout` s) and answers each.

    Args:
      bind: "host:port" to listen on (the coordinator's port; "[::]:port" for every interface).
      count: how many processes the job has.
      timeout: seconds to wait for all of them.
    """
    deadline = time.monotonic() + timeout
    came: dict[int, list[tuple[socket.socket, str]]] = {}
    with _listen(bind) as server:
        while len(came) < count - 1:
            server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, peer = server.accept()
            except OSError:  # the deadline passed
                break
            said = _readline(conn, time.monotonic() + _DRAIN).split()
            if len(said) < 1 or not said[0].isdigit() or not 0 < int(said[0]) < count:
                conn.close()  # not one of ours (a port scanner, a stray client)
                continue
            pid, host = (said[1:3] + ["?", "?"])[:2]
            came.setdefault(int(said[0]), []).append((conn, f"{peer[0]} (pid {pid} on {host})"))
            if len(came[int(said[0])]) > 1:  # a duplicate: the others have 2 s more to come
                deadline = min(deadline, time.monotonic() + _AFTER_TWICE)
    twice = next((i for i, v in sorted(came.items()) if len(v) > 1), None)
    verdict = Verdict(
        missing=tuple(i for i in range(1, count) if i not in came),
        twice=twice,
        where=tuple(where for _, where in came.get(twice, ())) if twice is not None else (),
    )
    _tell(verdict, [conn for v in came.values() for conn, _ in v])
    return verdict


def _tell(verdict: Verdict, conns: list[socket.socket]) -> None:
    """Sends the verdict to each peer, and waits (bounded) for each to hang up first."""
    line = (verdict.line() + "\n").encode()
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.sendall(line)
    deadline = time.monotonic() + _DRAIN
    for conn in conns:
        _readline(conn, deadline)  # EOF: the peer closed, so its side keeps the TIME_WAIT
        conn.close()


def call(address: str, index: int, timeout: float) -> Verdict:
    """On process `index` > 0: says who it is to process 0 at `address`; returns its verdict."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = socket.create_connection((host.strip("[]"), int(port)), timeout=1.0)
        except OSError:
            time.sleep(_RETRY)
            continue
        with conn:
            try:
                conn.sendall(f"{index} {os.getpid()} {socket.gethostname()}\n".encode())
            except OSError:
                time.sleep(_RETRY)
                continue
            line = _readline(conn, deadline + _DRAIN)
        if line:
            return Verdict.parse(line, index)
        time.sleep(_RETRY)  # process 0 hung up without a word: it may be a stale listener
    return Verdict(unreachable=True)
