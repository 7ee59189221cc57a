"""A lost peer as JAX's client reports it (a std::bad_cast that terminates): who is named."""

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from commands import run_program

from spmd._src.clusters import lost_peer

ROOT = Path(__file__).resolve().parents[1]
# A process that installs the handler (as process INDEX, process 0 at ADDRESS, QUIET the
# peer its hang watch heard from least, or none), then terminates with a std::bad_cast in
# flight, as JAX's error callback does on a C++ thread, or a gloo::EnforceNotMet ("gloo": a
# type_info of that name made here, as gloo throws it on a collective's thread), or with
# none ("plain").
TERMINATE = """
import ctypes, os, sys
from spmd._src.clusters import lost_peer
address, index, quiet, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def end(culprit, reason):
    print("END", culprit, reason, flush=True)
    os._exit(75)
quietest = lambda: (int(quiet), "gone: it has published nothing for 9 s") if quiet else None
assert lost_peer.install(address, index, end, quietest)
cxx = ctypes.CDLL("libstdc++.so.6")
if kind == "plain":
    cxx._ZSt9terminatev()
allocate, throw = cxx.__cxa_allocate_exception, cxx.__cxa_throw
allocate.restype, allocate.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
throw.argtypes = [ctypes.c_void_p] * 3
error = allocate(ctypes.sizeof(ctypes.c_void_p))
if kind == "gloo":
    name = ctypes.create_string_buffer(b"N4gloo13EnforceNotMetE")
    info = (ctypes.c_void_p * 2)()
    vtable = ctypes.addressof(ctypes.c_char.in_dll(cxx, "_ZTVN10__cxxabiv117__class_type_infoE"))
    info[0], info[1] = vtable + 2 * ctypes.sizeof(ctypes.c_void_p), ctypes.addressof(name)
    throw(error, ctypes.addressof(info), None)
vtable = ctypes.addressof(ctypes.c_char.in_dll(cxx, "_ZTVSt8bad_cast"))
ctypes.c_void_p.from_address(error).value = vtable + 2 * ctypes.sizeof(ctypes.c_void_p)
throw(error, ctypes.addressof(ctypes.c_char.in_dll(cxx, "_ZTISt8bad_cast")), None)
"""
linux = pytest.mark.skipif(sys.platform != "linux", reason="the test calls libstdc++ directly")


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class Server:
    """A listening socket; with `answer`, each connection gets a few bytes back (as gRPC's
    SETTINGS), else none (a frozen process: the kernel accepts, nobody reads)."""

    def __init__(self, answer: bool) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.socket.getsockname()[1]}"
        if answer:
            threading.Thread(target=self._answer, daemon=True).start()

    def _answer(self) -> None:
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return
            with connection:
                connection.recv(64)
                connection.sendall(bytes(9))

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.socket.close()


def test_a_service_that_answers_is_not_lost():
    with Server(answer=True) as server:
        assert lost_peer.lost(server.address) is None


def test_a_closed_port_means_process_0_was_killed():
    assert "refuses connections: process 0 was killed" in lost_peer.lost(closed_port())


def test_a_port_that_accepts_but_never_answers_means_process_0_is_frozen_or_lost():
    with Server(answer=False) as server:
        why = lost_peer.lost(server.address, timeout=0.3)
    assert why.startswith("no answer within 0.3 s: process 0 is frozen"), why


def test_a_process_resetting_connections_as_it_dies_was_killed_not_frozen():
    """A SIGKILLed process closes its connections before its listening socket: a probe that
    got in resets, and asked again, the port refuses."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"

    def die() -> None:
        connection, _ = listener.accept()
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        connection.close()  # a reset
        listener.close()

    dying = threading.Thread(target=die)
    dying.start()
    why = lost_peer.lost(address, timeout=5)
    dying.join()
    assert why == "its port refuses connections: process 0 was killed or crashed", why


def test_process_0_gone_is_the_culprit_with_its_address():
    address = closed_port()
    culprit, why = lost_peer.culprit(address, 1, lambda: (2, "gone: quiet"))
    assert culprit == 0
    assert why.startswith(f"gone: process 0, which hosts the coordination service at {address}")


def test_with_process_0_answering_the_quietest_peer_is_the_culprit():
    with Server(answer=True) as server:
        assert lost_peer.culprit(server.address, 1, lambda: (2, "gone: quiet")) == (
            2,
            "gone: quiet",
        )


def test_process_0_never_blames_itself_and_without_a_quiet_peer_names_nobody():
    culprit, why = lost_peer.culprit(closed_port(), 0, lambda: None)
    assert culprit is None and "reported a lost process" in why, why


def terminate(address: str, index: int, quiet: str, kind: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    argv = [sys.executable, "-c", TERMINATE, address, str(index), quiet, kind]
    return run_program(argv, env, 60)


@linux
def test_jax_s_callback_error_with_process_0_gone_ends_naming_it():
    address = closed_port()
    done = terminate(address, 1, "", "bad_cast")
    assert done.returncode == 75, done.stderr[-2000:]
    expected = f"END 0 gone: process 0, which hosts the coordination service at {address}"
    assert done.stdout.startswith(expected), done.stdout
    assert "terminate called" not in done.stderr


@linux
def test_jax_s_callback_error_on_process_0_names_the_quietest_peer():
    done = terminate(closed_port(), 0, "2", "bad_cast")
    assert done.returncode == 75, done.stderr[-2000:]
    assert done.stdout.startswith("END 2 gone: it has published nothing"), done.stdout


@linux
def test_a_collective_s_error_that_nothing_caught_ends_naming_the_quietest_peer():
    """gloo throws on its own thread when a peer ends mid-collective; nothing catches it: no
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'" abort."""
    with Server(answer=True) as server:  # process 0's service answers: not lost
        done = terminate(server.address, 1, "2", "gloo")
    assert done.returncode == 75, done.stderr[-2000:]
    assert done.stdout.startswith("END 2 gone: it has published nothing"), done.stdout
    assert "terminate called" not in done.stderr


@linux
def test_a_collective_s_error_with_no_peer_known_says_what_broke():
    with Server(answer=True) as server:
        done = terminate(server.address, 1, "", "gloo")
    assert done.returncode == 75, done.stderr[-2000:]
    assert done.stdout.startswith(
        "END None a collective (gloo) broke off on this process (gloo::EnforceNotMet)"
    ), done.stdout
    assert "terminate called" not in done.stderr


@linux
def test_any_other_terminate_aborts_as_before():
    done = terminate(closed_port(), 1, "", "plain")
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-2000:])
    assert "END" not in done.stdout
