"""Process 0's coordination service, looked at from another process: gone or answering."""

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from spmd.clusters import coordinator_loss

ROOT = Path(__file__).resolve().parents[1]
# A process that installs the handler for ADDRESS, then terminates as JAX's client does.
TERMINATE = """
import ctypes, os, sys
from spmd.clusters import coordinator_loss
def end(reason):
    print("END", reason, flush=True)
    os._exit(75)
assert coordinator_loss.install(sys.argv[1], end)
ctypes.CDLL("libstdc++.so.6")._ZSt9terminatev()
"""


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
        assert coordinator_loss.lost(server.address) is None


def test_a_closed_port_means_process_0_was_killed():
    assert "refuses connections: process 0 was killed" in coordinator_loss.lost(closed_port())


def test_a_port_that_accepts_but_never_answers_means_process_0_is_frozen_or_lost():
    with Server(answer=False) as server:
        why = coordinator_loss.lost(server.address, timeout=0.3)
    assert why.startswith("no answer within 0.3 s: process 0 is frozen"), why


def test_the_reason_names_process_0_and_its_address():
    text = coordinator_loss.reason("10.0.0.7:1234", "why")
    assert text.startswith("gone: process 0, which hosts the coordination service at 10.0.0.7:1234")


def terminate(address: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, "-c", TERMINATE, address]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(sys.platform != "linux", reason="the test calls libstdc++ directly")
def test_a_terminate_with_process_0_gone_ends_with_spmd_s_message():
    address = closed_port()
    done = terminate(address)
    assert done.returncode == 75, done.stderr[-2000:]
    assert done.stdout.startswith(
        f"END gone: process 0, which hosts the coordination service at {address}"
    )


@pytest.mark.skipif(sys.platform != "linux", reason="the test calls libstdc++ directly")
def test_a_terminate_with_process_0_answering_aborts_as_before():
    with Server(answer=True) as server:
        done = terminate(server.address)
    assert done.returncode == -signal.SIGABRT, (done.returncode, done.stderr[-2000:])
    assert "END" not in done.stdout
