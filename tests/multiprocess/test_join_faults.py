"""jax.distributed under spmd: joins fail with errors, peers end together, SIGTERM ends, bounded.

Real processes over loopback, started here with explicit SPMD_* variables, or
with the variables Slurm's `srun` sets (JAX's own detection then finds the
coordinator), so that a test can give two processes the same index or leave one
out; every wait is bounded, and every process is killed at the end whatever
happened.
"""

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from commands import start_program

from spmd._src.clusters.launch import free_port
from spmd._src.clusters.launch_results import HANG_EXIT_CODE
from spmd.testing import run_processes
from tests.bounds import bound

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
WORKER = HERE / "fault_worker.py"
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def clean_env() -> dict[str, str]:
    """This environment without any cluster description, with spmd importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "TF_CONFIG" and not k.startswith(("SPMD_", "SLURM_", "JAX_COORDINATOR"))
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, "PYTHONUNBUFFERED": "1"}


def env_for(index: int, count: int, address: str) -> dict[str, str]:
    """Process `index` of `count` as `spmd launch` describes it (SPMD_* variables)."""
    return {
        **clean_env(),
        "SPMD_NUM_PROCESSES": str(count),
        "SPMD_PROCESS_ID": str(index),
        "SPMD_COORDINATOR_ADDRESS": address,
    }


def slurm_env(index: int, count: int, address: str) -> dict[str, str]:
    """Process `index` of `count` as `srun` describes it, on a one-node allocation whose
    node is `address`'s host; JAX's Slurm detection finds the coordinator there (its port
    from JAX_COORDINATOR_PORT, as a batch script may set it)."""
    host, _, port = address.rpartition(":")
    return {
        **clean_env(),
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": host,
        "SLURM_NTASKS": str(count),
        "SLURM_PROCID": str(index),
        "SLURM_LOCALID": str(index),
        "JAX_COORDINATOR_PORT": port,
    }


Env = Callable[[int, int, str], dict[str, str]]
DESCRIPTIONS = [pytest.param(env_for, id="SPMD_vars"), pytest.param(slurm_env, id="Slurm")]


class Group:
    """Processes of fault_worker.py with the given indices; always killed on exit."""

    def __init__(
        self,
        scenario: str,
        indices: list[int],
        count: int | list[int],
        address: str = "",
        env: Env = env_for,
    ) -> None:
        """`count` is every process's process count, or each one's (a list beside `indices`)."""
        address = address or f"127.0.0.1:{free_port()}"
        self.address = address
        counts = count if isinstance(count, list) else [count] * len(indices)
        self.procs = [
            start_program(
                [sys.executable, str(WORKER), scenario],
                env(i, n, address),
                stderr=subprocess.STDOUT,
            )
            for i, n in zip(indices, counts, strict=True)
        ]
        self.start = time.monotonic()

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)

    def wait_for(self, text: str, seconds: float = 30.0) -> None:
        """Reads each process's output until it prints `text` (bounded)."""
        deadline = time.monotonic() + bound(seconds)
        for p in self.procs:
            os.set_blocking(p.stdout.fileno(), True)
            while time.monotonic() < deadline:
                line = p.stdout.readline()
                assert line, f"process ended before printing {text!r}"
                if text in line:
                    break

    def finish(self, seconds: float) -> list[tuple[int, str]]:
        """(returncode, output) of each process; fails the test if one runs past `seconds`
        (with the run's headroom)."""
        seconds, results = bound(seconds), []
        for p in self.procs:
            left = max(0.1, seconds - (time.monotonic() - self.start))
            out, _ = p.communicate(timeout=left)
            results.append((p.returncode, out))
        return results


def assert_spmd_message_only(out: str) -> None:
    """A process ended for a lost peer says so in spmd's words: no Python traceback, no
    collective's own error, no C++ abort."""
    for raw in ("Traceback", "Gloo", "bad_cast", "Check failure"):
        assert raw not in out, out[-3000:]


def init_error(output: str) -> str:
    [line] = [line for line in output.splitlines() if line.startswith("INIT_ERROR")]
    return line


def test_coordinator_port_in_use_is_an_initialization_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with Group("join", [0, 1], 2, address) as group:
            (code0, out0), (code1, out1) = group.finish(seconds=60)
    assert code0 == 3, out0[-2000:]
    assert "must be free" in init_error(out0) and address in init_error(out0)
    assert code1 == 3, out1[-2000:]  # nobody to join: an error after the timeout, no abort
    assert "within initialization_timeout=8 s" in init_error(out1)


def test_two_processes_with_one_index_are_an_initialization_error():
    with Group("join", [0, 1, 1], 3) as group:
        results = group.finish(seconds=70)
    assert [code for code, _ in results] == [3, 3, 3], [out[-1500:] for _, out in results]
    messages = [init_error(out) for _, out in results]
    assert any("same process_id" in m for m in messages), messages
    assert all("Traceback" not in out and "Check failure" not in out for _, out in results)


def test_a_peer_that_never_starts_is_an_initialization_error():
    with Group("join", [0], 2) as group:
        [(code, out)] = group.finish(seconds=50)
    assert code == 3, out[-2000:]
    assert "process ids 0 .. 1" in init_error(out)


def test_the_coordinator_listens_on_loopback_only():
    results = run_processes([sys.executable, str(WORKER), "listen"], 2, timeout=150)
    [line] = [line for line in results[0].stdout.splitlines() if line.startswith("LISTEN")]
    addresses = [decode(a) for a in line.split()[1:]]
    assert addresses and all(a.is_loopback for a in addresses), addresses


def decode(entry: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it ("tcp:0100007F"), v4-mapped ones unmapped."""
    table, hexed = entry.split(":")
    raw = bytes.fromhex(hexed)
    if table == "tcp":
        return ipaddress.IPv4Address(raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # each 32-bit word is LE
    address = ipaddress.IPv6Address(words)
    return address.ipv4_mapped or address


def test_a_raising_peer_ends_the_survivor_within_seconds():
    """Without a launcher: the survivor is told by the coordination service, not a heartbeat."""
    with Group("raise", [0, 1], 2) as group:
        (code0, out0), (code1, out1) = group.finish(seconds=60)
        elapsed = time.monotonic() - group.start
    assert code1 == 1 and "RuntimeError: process 1 broke" in out1
    assert code0 == 1, out0[-2000:]
    assert "process 1 failed (RuntimeError: process 1 broke); ending this one too." in out0
    assert elapsed < bound(30)  # joining takes a few seconds; the heartbeat would take 100


def test_a_process_that_ends_while_its_peer_waits_for_it_in_a_step_fails_naming_itself():
    """Process 0 leaves after 2 steps; process 1 waits for it in its third step's collective:
    a deadlock, seen at once from the records (not after exit_timeout), and process 0 is
    named as the one that ended early."""
    with Group("early", [0, 1], 2) as group:
        group.wait_for("READY")
        ready = time.monotonic()
        (code0, out0), (code1, out1) = group.finish(seconds=60)
        elapsed = time.monotonic() - ready
    assert code0 == 1, out0[-2000:]
    assert (
        "process 0 reached the end of its program after 2 step call(s) spanning the processes, "
        "but process 1 waits for it in a collective of its step call 3" in out0
    ), out0[-2000:]
    assert code1 == 1 and "process 0 failed" in out1, out1[-2000:]
    assert "END" not in out1.split()
    assert elapsed < bound(15), elapsed


def test_a_process_that_ends_while_its_peer_waits_in_a_collective_outside_a_step_fails():
    """Process 1 calls process_allgather after process 0 ended: it waits in JAX with no step
    call; after exit_timeout (2 s) process 0 fails naming itself."""
    with Group("gather", [0, 1], 2) as group:
        (code0, out0), (code1, out1) = group.finish(seconds=60)
    assert code0 == 1, out0[-2000:]
    assert "process 0 reached the end of its program, and process 1 has waited in JAX" in out0
    assert code1 == 1 and "process 0 failed" in out1, out1[-2000:]


def test_the_chief_s_own_work_after_training_is_left_to_finish():
    """Process 0 exports for 8 s after the last step, past exit_timeout (2 s) and
    hang_timeout (2 s): process 1, at its end, waits for it, and both exit 0."""
    with Group("export", [0, 1], 2) as group:
        (code0, out0), (code1, out1) = group.finish(seconds=60)
    assert (code0, code1) == (0, 0), (out0[-2000:], out1[-2000:])
    assert "EXPORTED" in out0 and "END" in out0.split() and "END" in out1.split()
    assert "hung" not in out0 + out1 and "reached the end" not in out0 + out1


def test_sigterm_without_a_save_ends_processes_blocked_in_cpp_at_once():
    """JAX's notifier swallows SIGTERM; spmd's peer watch sees its notice and ends every process."""
    with Group("block", [0, 1], 2) as group:
        group.wait_for("READY")
        sent = time.monotonic()
        group.procs[1].send_signal(signal.SIGTERM)
        (code0, out0), (code1, out1) = group.finish(seconds=sent - group.start + 20)
        elapsed = time.monotonic() - sent
    assert (code0, code1) == (143, 143), (out0[-1500:], out1[-1500:])
    assert "BLOCK ENDED" not in out0 + out1
    assert elapsed < bound(4), elapsed


def test_sigterm_with_a_save_to_make_ends_a_blocked_process_after_the_grace():
    """A PreemptionWatcher gives the save 2 s; the blocked process never saves, so it ends."""
    with Group("block_save", [0, 1], 2) as group:
        group.wait_for("READY")
        sent = time.monotonic()
        group.procs[1].send_signal(signal.SIGTERM)
        (code0, out0), (code1, out1) = group.finish(seconds=sent - group.start + 20)
        elapsed = time.monotonic() - sent
    assert code1 == 143, out1[-1500:]
    assert "SIGTERM 2 s ago and no save ended the process" in out1
    assert code0 == 1 and "process 1 failed (SIGTERM 2 s ago" in out0, out0[-1500:]
    assert 1.5 < elapsed < 6, elapsed


@pytest.mark.parametrize("when", ["at once", "later"])
def test_a_peer_killed_without_a_launcher_is_named_by_the_survivor(when):
    """kill -9 of process 1: process 0 ends with spmd's error naming it, not JAX's abort."""
    killed = 1
    with Group("dead", [0, 1], 2) as group:
        group.wait_for("READY")
        time.sleep(0 if when == "at once" else 3)  # before or after its first records
        group.procs[killed].kill()
        sent = time.monotonic()
        [(code, out)] = [r for i, r in enumerate(group.finish(seconds=90)) if i != killed]
        elapsed = time.monotonic() - sent
    assert code == HANG_EXIT_CODE, (elapsed, out[-2000:])
    assert f"spmd: ending: process {killed} failed (gone: " in out, out[-2000:]
    assert_spmd_message_only(out)
    assert elapsed < 10, elapsed  # before the heartbeat timeout (10 s) would abort it: not scaled


def test_a_peer_killed_while_the_survivor_waits_for_it_in_a_collective_is_named():
    """kill -9 of process 1 while process 0 waits for it in a step: the collective fails on
    process 0 at once (its connection closed); process 0 ends naming process 1, not itself."""
    with Group("collective1", [0, 1], 2) as group:
        group.wait_for("READY")
        time.sleep(1)  # process 0 is in the step's collective
        group.procs[1].kill()
        sent = time.monotonic()
        [(code, out)] = group.finish(seconds=90)[:1]
        elapsed = time.monotonic() - sent
    assert code == HANG_EXIT_CODE, (elapsed, out[-2000:])
    [line] = [line for line in out.splitlines() if line.startswith("spmd: ")]
    assert line.startswith("spmd: ending: process 1 failed (gone: "), line
    assert_spmd_message_only(out)
    assert elapsed < 10, elapsed  # before the heartbeat timeout (10 s): not scaled


@pytest.mark.parametrize(
    "scenario",
    [
        "dead",  # process 1 waits in a coordination-service barrier (C++, no GIL)
        "collective",  # process 1 waits for process 0 in a step's collective
        "idle",  # process 1 sleeps between steps, in Python
    ],
)
def test_process_0_killed_without_a_launcher_is_named_with_its_address(scenario):
    """kill -9 of process 0, which hosts the coordination service: JAX's client in process 1
    ends it from C++ at once; spmd's message naming process 0 and its address comes first."""
    with Group(scenario, [0, 1], 2) as group:
        group.wait_for("READY")
        time.sleep(1)  # process 1 is in its wait
        group.procs[0].kill()
        sent = time.monotonic()
        [(code, out)] = group.finish(seconds=90)[1:]
        elapsed = time.monotonic() - sent
    assert code == HANG_EXIT_CODE, (elapsed, out[-2000:])
    [line] = [line for line in out.splitlines() if line.startswith("spmd: ending: process 0")]
    assert line.startswith(
        f"spmd: ending: process 0 failed (gone: process 0, which hosts the coordination "
        f"service at {group.address}, is gone (its port refuses connections: process 0 was "
        "killed or crashed)"
    ), line
    assert_spmd_message_only(out)
    assert elapsed < 10, elapsed  # at once, never after the heartbeat timeout (10 s): not scaled


def test_process_0_frozen_without_a_launcher_is_named_after_the_heartbeat_timeout():
    """SIGSTOP of process 0: its service no longer answers; process 1 ends naming it when
    JAX's client gives up (heartbeat_timeout=10), with spmd's message, not JAX's abort."""
    with Group("idle", [0, 1], 2) as group:
        group.wait_for("READY")
        group.procs[0].send_signal(signal.SIGSTOP)
        sent = time.monotonic()
        try:
            out = group.procs[1].communicate(timeout=60)[0]
        finally:
            group.procs[0].send_signal(signal.SIGCONT)
        code, elapsed = group.procs[1].returncode, time.monotonic() - sent
    assert code == HANG_EXIT_CODE, (elapsed, out[-2000:])
    assert (
        f"spmd: ending: process 0 failed (gone: process 0, which hosts the coordination service "
        f"at {group.address}, is gone (no answer within 2 s: process 0 is frozen" in out
    ), out[-2000:]
    assert_spmd_message_only(out)
    assert elapsed < bound(30), elapsed  # the heartbeat timeout (10 s), then the 2 s probe


def test_a_job_that_jax_detects_joins_at_the_address_it_detects_and_trains():
    with Group("train", [0, 1], 2, env=slurm_env) as group:
        results = group.finish(seconds=60)
    for code, out in results:
        assert code == 0, out[-2000:]
        assert "STEP 2 1.0" in out and "END" in out.split(), out[-2000:]


@pytest.mark.parametrize("env", DESCRIPTIONS)
def test_a_missing_process_is_named_on_every_process_that_joined(env):
    with Group("join", [0, 2], 3, env=env) as group:
        results = group.finish(seconds=50)
        elapsed = time.monotonic() - group.start
    assert [code for code, _ in results] == [3, 3], [out[-1500:] for _, out in results]
    for _, out in results:
        assert "process(es) [1] did not reach spmd.initialize() within 8 s" in init_error(out)
        assert "Traceback" not in out and "bad_cast" not in out
    assert elapsed < bound(30), elapsed  # initialization_timeout=8


@pytest.mark.parametrize("env", DESCRIPTIONS)
def test_a_process_id_given_twice_is_named_with_both_processes(env):
    with Group("join", [0, 1, 1], 3, env=env) as group:
        results = group.finish(seconds=50)
    assert [code for code, _ in results] == [3, 3, 3], [out[-1500:] for _, out in results]
    pids = [p.pid for p in group.procs[1:]]
    for _, out in results:
        line = init_error(out)
        assert "process_id 1 was given to more than one process" in line, line
        assert all(f"127.0.0.1 (pid {pid} on " in line for pid in pids), (pids, line)


@pytest.mark.parametrize("env", DESCRIPTIONS)
def test_process_0_never_starting_is_named_on_the_others(env):
    with Group("join", [1, 2], 3, env=env) as group:
        results = group.finish(seconds=50)
        elapsed = time.monotonic() - group.start
    assert [code for code, _ in results] == [3, 3], [out[-1500:] for _, out in results]
    for _, out in results:
        line = init_error(out)
        assert "process(es) [0] did not reach spmd.initialize() (process 0 hosts the " in line, line
        assert "Traceback" not in out and "bad_cast" not in out
    assert elapsed < bound(30), elapsed  # initialization_timeout=8


@pytest.mark.parametrize("counts", [[2, 3], [3, 2]], ids=["1_counts_more", "0_counts_more"])
def test_processes_given_different_process_counts_are_named_on_every_process(counts):
    """Process 0 given 2 and process 1 given 3 would both join (JAX's service counts
    process 0's 2) and process 1 would believe in 3 processes: every process fails instead,
    naming each one's count, within seconds rather than after initialization_timeout."""
    with Group("join", [0, 1], counts) as group:
        results = group.finish(seconds=50)
        elapsed = time.monotonic() - group.start
    assert [code for code, _ in results] == [3, 3], [out[-1500:] for _, out in results]
    for _, out in results:
        line = init_error(out)
        assert "these processes disagree on it" in line, line
        assert f"process 0 was given {counts[0]} (coordinator {group.address})" in line, line
        assert f"process 1 was given {counts[1]} (coordinator {group.address})" in line, line
        assert "did not reach" not in line and "Traceback" not in out
    assert elapsed < bound(8) + 10, elapsed  # the verdict comes once process 1 came: no timeout


def test_a_second_process_0_is_named_as_a_process_id_given_twice():
    """Two processes given process_id 0 on one host: the second finds the port taken by the
    first's roll call, and both name process_id 0 given twice (not a taken port)."""
    with Group("join", [0, 0], 2) as group:
        results = group.finish(seconds=50)
        elapsed = time.monotonic() - group.start
    assert [code for code, _ in results] == [3, 3], [out[-1500:] for _, out in results]
    for _, out in results:
        line = init_error(out)
        assert "process_id 0 was given to more than one process" in line, line
        assert "must be free" not in line
    assert elapsed < bound(8) + 10, elapsed  # 2 s after the second came, not initialization_timeout


def test_a_late_second_process_0_is_refused_and_the_job_runs():
    """A process given process_id 0 after the job joined finds the port taken by process 0's
    coordination service: it names process_id 0 given twice, and the job runs on."""
    with Group("block", [0, 1], 2) as group:
        group.wait_for("READY")
        late = Group("join", [0], 2, group.address)
        with late:
            [(code, out)] = late.finish(seconds=40)
        assert all(p.poll() is None for p in group.procs)
    assert code == 3, out[-2000:]
    line = init_error(out)
    assert "process_id 0 was given to more than one process" in line, line
    assert f"the one whose coordination service runs at {group.address}" in line, line


def test_a_late_second_process_with_a_taken_id_is_refused_and_the_job_runs():
    """Process 0 moved on with a full roll; a process that comes later with id 1 is told so."""
    with Group("block", [0, 1], 2) as group:
        group.wait_for("READY")
        late = Group("join", [1], 2, group.address)
        with late:
            [(code, out)] = late.finish(seconds=40)
        assert all(p.poll() is None for p in group.procs)  # the job itself runs on
    assert code == 3, out[-2000:]
    assert "process_id 1 was given to more than one process" in init_error(out)


def test_the_launcher_names_a_process_that_never_joins_not_process_0():
    code = (
        "import os, time, spmd\n"
        "if os.environ['SPMD_PROCESS_ID'] == '1': time.sleep(60)\n"
        "spmd.initialize(initialization_timeout=5)\n"
    )
    argv = [sys.executable, "-m", "spmd", "launch", "-n", "2", "--", sys.executable, "-c", code]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPMD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "spmd launch: first failure: process 1, alive but hung or slow" in done.stderr, (
        done.stderr[-3000:]
    )
