"""The roll call before the join: process 0 learns who came, and names who is missing, doubled
or counting another job.

JAX's coordination service says only "std::bad_cast" when a process never
joins or two join with one process id, and nothing at all when two processes
were given different process counts (both join; one then believes in a job
size JAX does not have). So before `jax.distributed.initialize` process 0
listens on the coordinator's own port (still free: the service is not up yet)
and every other process connects there and says its id, pid, host, the
process count it was given and the coordinator address it was given.
Process 0 answers each of them, once all came or `initialization_timeout`
passed: "ok", or which processes disagree on the count, or which id came
twice and from where, or which ids are missing. Then it closes the port, and
the service starts on it.

Two processes given process_id 0 that start together can both be refused the
port at the same instant (the kernel marks each one listening before it checks
the other), and then neither has anyone to ask. `hold` retries after a random
pause, for a few seconds, until one listens and the other asks it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import socket
import time
from typing import Any

from spmd._src.clusters.launch_results import not_arrived
from spmd._src.errors import message, received

__all__ = ["Verdict", "answer", "ask", "call", "explain", "hold", "probe"]

_RETRY = 0.2  # seconds between a process's tries to reach process 0's roll call
_LINE = 512  # bytes of the longest line either side sends
_DRAIN = 5.0  # seconds process 0 waits for a peer to read its answer and hang up
_SETTINGS = 4  # the type of an HTTP/2 SETTINGS frame, a gRPC server's first frame
_KINDS = (b"ok", b"missing", b"twice", b"counts")  # how a verdict's line starts
_CONTEST = 3.0  # seconds a process 0 refused the port keeps asking, or trying to listen
_AFTER_TWICE = 2.0  # seconds the others still have to come once an id came twice (or a count
# disagreed): the verdict is known, and they hear it too if they come by then


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What process 0 found.

    Attributes:
      missing: the process ids that did not come, sorted.
      twice: a process id two processes gave, or None.
      where: for `twice`, where each of them came from ("address (pid N, host H)").
      unreachable: (seen from a process other than 0) process 0 never answered.
      counts: where the processes that came disagree on the process count, what
        each of them was given, as (process id, count, coordinator address),
        process 0 first; empty while they agree.
    """

    missing: tuple[int, ...] = ()
    twice: int | None = None
    where: tuple[str, ...] = ()
    unreachable: bool = False
    counts: tuple[tuple[int, int, str], ...] = ()

    @property
    def ok(self) -> bool:
        return not (self.missing or self.twice is not None or self.unreachable or self.counts)

    def line(self) -> str:
        if self.counts:
            return "counts " + " ".join(f"{i}:{n}:{a}" for i, n, a in self.counts)
        if self.twice is not None:
            return f"twice {self.twice} " + " | ".join(self.where)
        if self.missing:
            return "missing " + ",".join(map(str, self.missing))
        return "ok"

    @classmethod
    def parse(cls, line: str, index: int) -> Verdict:
        kind, _, rest = line.strip().partition(" ")
        if kind == "counts":
            said = [entry.split(":", 2) for entry in rest.split()]
            return cls(counts=tuple((int(i), int(n), a) for i, n, a in said))
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


def _readline(conn: socket.socket, deadline: float, raw: bool = False) -> Any:
    """One line from `conn` (what came, at EOF), or "" once `deadline` passed; with `raw`,
    the bytes."""
    data = b""
    while b"\n" not in data and len(data) < _LINE:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = conn.recv(_LINE)
        except OSError:
            return b"" if raw else ""
        if not chunk:
            break
        data += chunk
    line = data.split(b"\n", 1)[0]
    return line if raw else line.decode(errors="replace")


def _listen(bind: str) -> socket.socket:
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = socket.socket(family, socket.SOCK_STREAM)
    try:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host if host != "localhost" else "127.0.0.1", int(port)))
        server.listen(128)
    except OSError:
        server.close()  # a refused socket keeps no claim on the port
        raise
    return server


def _arrival(said: list[str], count: int) -> tuple[int, int, str] | None:
    """(process id, count it was given, coordinator it was given) from a peer's line, or None
    for a line of no process of a job (a port scanner, a stray client).

    A line without a count (an older spmd) must name an id 1 .. count-1; one with a
    count may name any id: a process of a job of another size, or a second process 0.
    """
    if not said or not said[0].isdigit():
        return None
    index = int(said[0])
    given = said[3] if len(said) > 3 and said[3].isdigit() else None
    if given is None:
        return (index, count, "") if 0 < index < count else None
    return index, int(given), said[4] if len(said) > 4 else ""


def answer(bind: str, count: int, timeout: float, coordinator: str = "") -> Verdict:
    """On process 0: waits for processes 1 .. count-1 (or `timeout` s) and answers each.

    Args:
      bind: "host:port" to listen on (the coordinator's port; "[::]:port" for every interface).
      count: how many processes the job has.
      timeout: seconds to wait for all of them.
      coordinator: the coordinator address process 0 was given, to show beside the
        others' where they disagree on the count.
    """
    deadline = time.monotonic() + timeout
    came: dict[int, list[tuple[socket.socket, str]]] = {}
    given: dict[int, tuple[int, str]] = {}  # what each process that came was given
    trouble = False  # a doubled id or another count: the others hear it if they come in time
    with _listen(bind) as server:
        while trouble or any(i not in came for i in range(1, count)):
            server.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, peer = server.accept()
            except OSError:  # the deadline passed
                break
            said = _readline(conn, time.monotonic() + _DRAIN).split()
            arrival = _arrival(said, count)
            if arrival is None:
                conn.close()
                continue
            index, its_count, its_coordinator = arrival
            pid, host = (said[1:3] + ["?", "?"])[:2]
            came.setdefault(index, []).append((conn, f"{peer[0]} (pid {pid} on {host})"))
            given.setdefault(index, (its_count, its_coordinator))
            if index == 0 or len(came[index]) > 1 or its_count != count:
                trouble, deadline = True, min(deadline, time.monotonic() + _AFTER_TWICE)
    verdict = _verdict(came, given, (bind, count, coordinator))
    _tell(verdict, [conn for v in came.values() for conn, _ in v])
    return verdict


def _verdict(
    came: dict[int, list[tuple[socket.socket, str]]],
    given: dict[int, tuple[int, str]],
    this: tuple[str, int, str],
) -> Verdict:
    """What process 0 (listening at `this` = (bind, count, coordinator)) found."""
    bind, count, coordinator = this
    counts = ()
    if any(n != count for n, _ in given.values()):
        counts = ((0, count, coordinator or "?"),) + tuple(
            (i, n, a or "?") for i, (n, a) in sorted(given.items())
        )
    twice = next((i for i, v in sorted(came.items()) if len(v) > 1 or i == 0), None)
    where = tuple(where for _, where in came.get(twice, ())) if twice is not None else ()
    if twice == 0:  # a second process 0: this one is the first
        where = (f"{bind} (pid {_me()}, listening first)", *where)
    return Verdict(
        missing=tuple(i for i in range(1, count) if i not in came),
        twice=twice,
        where=where,
        counts=counts,
    )


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


def _introduction(index: int, count: int, address: str) -> bytes:
    return f"{index} {os.getpid()} {socket.gethostname()} {count} {address}\n".encode()


def call(address: str, index: int, timeout: float, count: int = 0) -> Verdict:
    """On process `index` > 0: says who it is to process 0 at `address`, with the process
    count it was given; returns process 0's verdict."""
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
                conn.sendall(_introduction(index, count, address))
            except OSError:
                time.sleep(_RETRY)
                continue
            line = _readline(conn, deadline + _DRAIN)
        if line:
            return Verdict.parse(line, index)
        time.sleep(_RETRY)  # process 0 hung up without a word: it may be a stale listener
    return Verdict(unreachable=True)


def hold(binds: list[str], count: int, timeout: float, coordinator: str) -> Verdict | None:
    """On process 0: holds the roll call at the first of `binds` it can listen on (see
    `answer`), or, where another process holds the port, asks it (see `ask`).

    Returns:
      The verdict; None where the port stays taken by something that does not answer
      (another program), `_CONTEST` seconds after the first try.
    """
    deadline = time.monotonic() + _CONTEST
    while True:
        for bind in binds:
            with contextlib.suppress(OSError):
                return answer(bind, count, timeout, coordinator)
        verdict = probe(coordinator, count)
        if verdict is not None or time.monotonic() >= deadline:
            return verdict
        time.sleep(random.uniform(_RETRY / 4, _RETRY))  # apart: one of two refused wins next


def ask(address: str, count: int) -> Verdict | None:
    """`probe`, tried again for `_CONTEST` seconds while nothing answers: a process 0 that
    was refused the port at the same instant as this one listens a moment later."""
    return hold([], count, 0.0, address)  # nowhere to listen: only the asking, retried


def probe(address: str, count: int) -> Verdict | None:
    """On a process 0 that finds the coordinator's port taken: asks what holds it.

    Another process 0 of this job holding its roll call there answers with a
    verdict naming process_id 0 twice (and then fails too, as every process of
    a roll call with a doubled id does); one whose coordination service already
    runs there answers with an HTTP/2 SETTINGS frame (gRPC's first words), and
    the job runs on. None where nothing of spmd's or JAX's answers: another
    program holds the port.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + _AFTER_TWICE + 2 * _DRAIN
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0) as conn:
            conn.sendall(_introduction(0, count, address))
            line = _readline(conn, deadline, raw=True)
    except (OSError, ValueError):
        return None
    if len(line) >= 9 and line[3] == _SETTINGS:
        where = (
            f"this process (pid {_me()})",
            f"the one whose coordination service runs at {address}",
        )
        return Verdict(twice=0, where=where)
    kind = line.split(b" ", 1)[0]
    return Verdict.parse(line.decode(errors="replace"), 0) if kind in _KINDS else None


def explain(verdict: Verdict, coordinator: str, where: tuple[int, int], timeout: float) -> str:
    """The teaching message for a roll call that found someone missing, doubled, or counting
    another job size; `where` is (this process's id, the process count it was given)."""
    index, count = where
    got = received(coordinator_address=coordinator, process_id=index, num_processes=count)
    if verdict.counts:
        said = ", ".join(
            f"process {i} was given {n} (coordinator {a})" for i, n, a in verdict.counts
        )
        return message(
            "Every process of a job must be given the same process count; these processes "
            f"disagree on it: {said}.",
            got,
            "give every process the job's real size (SPMD_NUM_PROCESSES, num_processes=, "
            "TF_CONFIG's cluster, the scheduler's task count), or let spmd launch set it; "
            "check that each process's coordinator address is this job's.",
        )
    if verdict.twice is not None:
        return message(
            f"Each process must join with its own process_id, 0 .. {count - 1}; process_id "
            f"{verdict.twice} was given to more than one process (the same process_id twice): "
            f"{' and '.join(verdict.where)}.",
            got,
            "give every process a different index (SPMD_PROCESS_ID, TF_CONFIG's task index, or "
            "process_id=), or let spmd launch number them; check that the coordinator address "
            "is this job's. A process restarted alone cannot rejoin a running job: restart "
            "every process.",
        )
    missing = [0] if verdict.unreachable else list(verdict.missing)
    what = "spmd.initialize()" + (" (process 0 hosts the coordinator)" * verdict.unreachable)
    return message(
        f"{not_arrived(missing, what, timeout)}: all {count} processes (process ids 0 .. "
        f"{count - 1}, each once) must join within initialization_timeout={timeout:g} s.",
        got,
        f"start process(es) {missing} too (a process that crashed before spmd.initialize() says "
        "why in its own output); check that process 0's host:port is reachable from this "
        "machine, or raise initialization_timeout.",
    )
