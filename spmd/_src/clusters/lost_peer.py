"""A peer lost without a launcher, as JAX's client reports it: spmd's error naming it, no abort.

When the coordination service finds a process gone (process 0, which hosts
it, killed, crashed, frozen or cut off; another process that missed its
heartbeats for `heartbeat_timeout`), JAX's client in every process calls its
error callback from a C++ thread. That callback cannot reach Python (it
throws std::bad_cast), so the C++ runtime calls `std::terminate`, which
aborts. A terminate handler installed here runs first, for that exception
only, and ends the process with spmd's error naming the process most likely
lost: process 0 if its service no longer answers, else the peer the hang
watch has not heard from for longest; else it says the service ended the
job. An exception of gloo's terminating the process (a collective broken
off by a peer's end: "terminate called after throwing an instance of
'gloo::EnforceNotMet'") is named the same way. Any other terminate goes to
the handler it replaced, as before. The main
thread's own errors from a lost service (a collective, a barrier) are
explained the same way by `spmd._src.clusters.distributed`.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import time
from collections.abc import Callable

from spmd._src.clusters.hang_watch import GONE

__all__ = ["ANSWER_TIMEOUT", "install", "lost", "reason"]

ANSWER_TIMEOUT = 2.0  # seconds process 0's service has to answer a connection
_RESETS = 5  # connections reset (a process ending) before its port is asked no more
_AFTER_RESET = 0.1  # seconds between them
_DYING = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)  # a reset connection
# An HTTP/2 client preface and an empty SETTINGS frame: a gRPC server answers with its
# own SETTINGS at once; a frozen process (SIGSTOP, a hung machine) does not.
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SET_TERMINATE = "_ZSt13set_terminatePFvvE"  # std::set_terminate(void (*)())
_IN_FLIGHT = "__cxa_current_exception_type"  # the std::type_info of the exception terminating
_CALLBACK_ERROR = b"St8bad_cast"  # what JAX's error callback throws (its mangled type name)
_GLOO = b"N4gloo"  # gloo's exceptions (EnforceNotMet, IoException): a collective broken off
_RUNTIMES = ("libstdc++.so.6", "libc++.1.dylib")  # the C++ runtime jaxlib uses
_HANDLER = ctypes.CFUNCTYPE(None)
_installed: list = []  # the handler, kept alive for as long as the C++ runtime may call it

# (culprit or None, reason): prints this process's last line and exits; never returns.
End = Callable[[int | None, str], None]
Quietest = Callable[[], "tuple[int, str] | None"]


def lost(address: str, timeout: float = ANSWER_TIMEOUT) -> str | None:
    """Why the coordination service at `address` ("host:port") does not answer; None if it does.

    A connection reset is a process that is dying (its sockets close as it
    ends, the listening one last): asked again, its port refuses.
    """
    for _ in range(_RESETS):
        try:
            return _ask(address, timeout)
        except _DYING:
            time.sleep(_AFTER_RESET)
    return "it resets every connection: process 0 was killed or crashed"


def _ask(address: str, timeout: float) -> str | None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
            s.sendall(_PREFACE)
            if s.recv(9):
                return None
            return "it closed the connection without a word"
    except ConnectionRefusedError:
        return "its port refuses connections: process 0 was killed or crashed"
    except _DYING:
        raise
    except (OSError, ValueError):
        return (
            f"no answer within {timeout:g} s: process 0 is frozen, or its machine or the "
            "network to it was lost"
        )


def reason(address: str, why: str) -> str:
    """The failure recorded for process 0, e.g. "gone: process 0, which hosts ... (why)"."""
    return (
        f"{GONE} process 0, which hosts the coordination service at {address}, is gone ({why}); "
        "see its own output for why"
    )


def culprit(address: str, index: int, quietest: Quietest) -> tuple[int | None, str]:
    """The process most likely lost, and why, when JAX's client reports a lost peer.

    Process 0 if its service does not answer (asked from the others only: it
    hosts the service), else the peer this process's hang watch has not heard
    from for longest, else None: the service's own log lines say who.
    """
    why = lost(address) if index != 0 else None
    if why is not None:
        return 0, reason(address, why)
    quiet = quietest()
    if quiet is not None:
        return quiet
    return None, (
        f"the coordination service at {address} reported a lost process (JAX's log lines "
        "above; process 0's output names it): a process that missed its heartbeats for "
        "heartbeat_timeout"
    )


def broken_collective(
    address: str, index: int, quietest: Quietest, error: str
) -> tuple[int | None, str]:
    """The process most likely at fault when a collective's error (gloo's, thrown on one of
    its threads, where nothing catches it) terminates this process: a peer that ended or
    broke off in the middle of it. Named as `culprit` names a lost peer; where no peer is
    known yet, the reason says so (the peer's own output, or the launcher, names it)."""
    found, why = culprit(address, index, quietest)
    if found is not None:
        return found, why
    return None, (
        f"a collective (gloo) broke off on this process ({error}): a peer ended or failed in "
        "the middle of it; its own output (or spmd launch's summary) says which and why"
    )


def _demangle(name: bytes) -> str:
    """A nested C++ type's name from its mangled form: b"N4gloo13EnforceNotMetE" ->
    "gloo::EnforceNotMet" (the mangled name where it is not of that form)."""
    text, parts, i = name.decode(errors="replace"), [], 1
    if not (text.startswith("N") and text.endswith("E")):
        return text
    while i < len(text) - 1:
        j = i
        while j < len(text) and text[j].isdigit():
            j += 1
        if j == i:
            return text
        size = int(text[i:j])
        parts.append(text[j : j + size])
        i = j + size
    return "::".join(parts)


def install(address: str, index: int, end: End, quietest: Quietest) -> bool:
    """Makes the C++ runtime's terminate call `end(*culprit(...))` first, for JAX's client
    (and `end(*broken_collective(...))` for a collective's error that nothing caught).

    Args:
      address: process 0's coordinator address, "host:port".
      index: this process's index.
      end: prints the reason as this process's last line and exits (never returns).
      quietest: the hang watch's peer silent longest, and why (or None).

    Returns:
      Whether the handler is installed (False where the C++ runtime is not found).
    """
    runtime = _runtime()
    if runtime is None:
        return False
    previous: list[int | None] = []

    def on_terminate() -> None:
        try:
            kind = _in_flight(runtime)
            if kind == _CALLBACK_ERROR:
                end(*culprit(address, index, quietest))
            if kind is not None and kind.startswith(_GLOO):
                end(*broken_collective(address, index, quietest, _demangle(kind)))
        except BaseException:  # noqa: BLE001 - the runtime's own handler still runs
            pass
        _call(previous[0])

    handler = _HANDLER(on_terminate)
    _installed.append(handler)
    previous.append(getattr(runtime, _SET_TERMINATE)(handler))
    return True


def _runtime() -> ctypes.CDLL | None:
    """The C++ runtime already loaded (jaxlib's), with its terminate functions typed; or None."""
    for name in _RUNTIMES:
        try:
            runtime = ctypes.CDLL(name)
            # getattr, not [...]: the library keeps the typed function for later calls
            set_terminate, in_flight = (
                getattr(runtime, _SET_TERMINATE),
                getattr(runtime, _IN_FLIGHT),
            )
        except (OSError, AttributeError):
            continue
        set_terminate.restype, set_terminate.argtypes = ctypes.c_void_p, [_HANDLER]
        in_flight.restype, in_flight.argtypes = ctypes.c_void_p, []
        return runtime
    return None


def _in_flight(runtime: ctypes.CDLL) -> bytes | None:
    """The mangled type name of the exception that is terminating the process, if any.

    A `std::type_info` holds its name's address after its vtable pointer (the
    Itanium C++ ABI, which Linux and macOS follow).
    """
    info = getattr(runtime, _IN_FLIGHT)()
    if not info:
        return None
    name = ctypes.c_char_p.from_address(info + ctypes.sizeof(ctypes.c_void_p)).value
    return name.lstrip(b"*") if name else None


def _call(handler: int | None) -> None:
    """The terminate handler that was installed before (it aborts), or abort."""
    sys.stderr.flush()
    if handler:
        _HANDLER(handler)()
    os.abort()
