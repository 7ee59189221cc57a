"""Two processes given process_id 0 that contend for the coordinator's port both learn of it.

The kernel can refuse the port to both at the same instant (each is marked
listening before it checks the other), and then neither has anyone to ask: each
must try again, apart, until one holds the roll call and the other asks it. A
port held by a program that does not answer is still named so, within seconds.
These run the roll call in threads over loopback; the processes' own run is in
tests/multiprocess/test_join_faults.py.
"""

import os
import socket
import threading
import time

from spmd._src.clusters import roll_call
from spmd._src.clusters.launch import free_port


def refused_for(seconds: float, port: int) -> threading.Thread:
    """Holds `port` without answering (a listener that accepts nothing, as a refused
    contender's moment looks from outside), then lets it go; returns the holding thread."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()

    def release() -> None:
        time.sleep(seconds)
        holder.close()

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


def test_a_process_0_refused_at_first_holds_the_roll_call_once_the_port_is_free():
    port = free_port()
    address = f"127.0.0.1:{port}"
    refused_for(0.3, port)
    # A connection to the holder before it closes is reset: hold must neither take that
    # for a verdict nor give up while the port is merely busy for a moment.
    got: dict[str, roll_call.Verdict | None] = {}
    peer = threading.Thread(target=lambda: got.update(one=roll_call.call(address, 1, 10.0, 2)))
    peer.start()
    verdict = roll_call.hold([address], 2, 10.0, address)
    peer.join(timeout=20)
    assert verdict is not None and verdict.ok, verdict
    assert got["one"] is not None and got["one"].ok, got


def test_a_second_process_0_asks_the_one_that_listens_a_moment_later():
    port = free_port()
    address = f"127.0.0.1:{port}"
    first: dict[str, roll_call.Verdict | None] = {}

    def listen_late() -> None:
        time.sleep(0.4)  # refused at the same instant as the other, it listens on its retry
        first["verdict"] = roll_call.answer(address, 2, 10.0, address)

    thread = threading.Thread(target=listen_late)
    thread.start()
    second = roll_call.ask(address, 2)
    thread.join(timeout=20)
    assert second is not None and second.twice == 0, second
    assert first["verdict"] is not None and first["verdict"].twice == 0, first
    said = roll_call.explain(second, address, (0, 2), 8.0)
    assert "process_id 0 was given to more than one process" in said, said
    assert "listening first" in said and f"pid {os.getpid()} on " in said, said


def test_two_processes_0_refused_together_both_name_process_id_0_twice():
    """The race itself, made certain: both start while the port is held, so both are
    refused and find nobody to ask; they retry apart, one listens, the other asks it."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    refused_for(0.3, port)
    verdicts: list[roll_call.Verdict | None] = []
    threads = [
        threading.Thread(target=lambda: verdicts.append(roll_call.hold([address], 2, 8.0, address)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(verdicts) == 2 and all(v is not None and v.twice == 0 for v in verdicts), verdicts


def test_a_port_held_by_a_program_that_does_not_answer_is_named_within_seconds(monkeypatch):
    monkeypatch.setattr(roll_call, "_AFTER_TWICE", 0.2)
    monkeypatch.setattr(roll_call, "_DRAIN", 0.2)
    monkeypatch.setattr(roll_call, "_CONTEST", 1.0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        start = time.monotonic()
        assert roll_call.hold([address], 2, 8.0, address) is None
        assert roll_call.ask(address, 2) is None
    assert time.monotonic() - start < 2 * (roll_call._CONTEST + 1.0)


def test_asking_a_port_where_nobody_listens_ends_within_the_contest(monkeypatch):
    monkeypatch.setattr(roll_call, "_CONTEST", 0.5)
    address = f"127.0.0.1:{free_port()}"  # free a moment ago: every connection is refused
    start = time.monotonic()
    assert roll_call.ask(address, 2) is None
    assert 0.5 <= time.monotonic() - start < 3.0
