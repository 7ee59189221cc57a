"""Process 0's death, seen by the others: spmd's error naming it, before JAX's client aborts.

Process 0 hosts the coordination service. When it dies (killed, crashed, its
machine lost, or frozen), JAX's client in every other process calls its
error callback from a C++ thread at once (a closed connection) or after
`heartbeat_timeout` (no answer); that callback cannot reach Python (it throws
std::bad_cast), so the C++ runtime calls `std::terminate`, which aborts. A
terminate handler installed here runs first: if process 0's service no longer
answers, it ends the process with spmd's message naming process 0 and its
address; otherwise it hands over to the handler it replaced (JAX's abort, as
before). The main thread's own errors from the lost service (a collective, a
barrier) are explained the same way by `spmd.clusters.distributed`.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
from collections.abc import Callable

from spmd.clusters.hang_watch import GONE

__all__ = ["ANSWER_TIMEOUT", "install", "lost", "reason"]

ANSWER_TIMEOUT = 2.0  # seconds process 0's service has to answer a connection
# An HTTP/2 client preface and an empty SETTINGS frame: a gRPC server answers with its
# own SETTINGS at once; a frozen process (SIGSTOP, a hung machine) does not.
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SET_TERMINATE = "_ZSt13set_terminatePFvvE"  # std::set_terminate(void (*)())
_RUNTIMES = ("libstdc++.so.6", "libc++.1.dylib")  # the C++ runtime jaxlib uses
_HANDLER = ctypes.CFUNCTYPE(None)
_installed: list = []  # the handler, kept alive for as long as the C++ runtime may call it


def lost(address: str, timeout: float = ANSWER_TIMEOUT) -> str | None:
    """Why the coordination service at `address` ("host:port") does not answer; None if it does."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
            s.sendall(_PREFACE)
            if s.recv(9):
                return None
            return "it closed the connection without a word"
    except ConnectionRefusedError:
        return "its port refuses connections: process 0 was killed or crashed"
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


def install(address: str, end: Callable[[str], None]) -> bool:
    """Makes the C++ runtime's terminate call `end(reason)` first when process 0 is gone.

    Args:
      address: process 0's coordinator address, "host:port".
      end: prints the reason as this process's last line and exits (never returns).

    Returns:
      Whether the handler is installed (False where the C++ runtime is not found).
    """
    set_terminate = _set_terminate()
    if set_terminate is None:
        return False
    previous: list[int | None] = []

    def on_terminate() -> None:
        try:
            why = lost(address)
            if why is not None:
                end(reason(address, why))
        except BaseException:  # noqa: BLE001 - the runtime's own handler still runs
            pass
        _call(previous[0])

    handler = _HANDLER(on_terminate)
    _installed.append(handler)
    previous.append(set_terminate(handler))
    return True


def _set_terminate() -> Callable | None:
    """`std::set_terminate` of the C++ runtime already loaded (jaxlib's), or None."""
    for name in _RUNTIMES:
        try:
            runtime = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        function = getattr(runtime, _SET_TERMINATE, None)
        if function is not None:
            function.restype = ctypes.c_void_p
            function.argtypes = [_HANDLER]
            return function
    return None


def _call(handler: int | None) -> None:
    """The terminate handler that was installed before (it aborts), or abort."""
    sys.stderr.flush()
    if handler:
        _HANDLER(handler)()
    os.abort()
