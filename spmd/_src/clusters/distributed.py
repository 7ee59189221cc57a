"""jax.distributed, bounded: join with errors instead of aborts, and end when a peer is gone."""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import ipaddress
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from spmd._src.clusters import hang_watch, lost_peer, roll_call
from spmd._src.clusters.configuration_exit import printing_hook
from spmd._src.clusters.exit_wait import ExitWait
from spmd._src.clusters.jax_state import global_state
from spmd._src.clusters.launch_results import (
    CONFIGURATION_EXIT_CODE,
    FOLLOWER,
    HANG_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
)
from spmd._src.clusters.resolvers.jax_detect import detected_join
from spmd._src.errors import BatchError, ConfigurationError, InitializationError, message, received

__all__ = [
    "EXIT_TIMEOUT",
    "PEER_POLL",
    "SIGTERM_GRACE",
    "bind_address",
    "distributed_state",
    "expect_save",
    "join",
    "report_failure",
    "sigterm_received",
]

PEER_POLL = 0.5  # seconds between a process's looks at the coordination service for failed peers
EXIT_TIMEOUT = 30  # seconds a peer may wait in JAX, no step call, for a process at its end
SIGTERM_GRACE = 120.0  # seconds after SIGTERM for a process with a save to make; then it ends
_FAILED = "spmd/failed/"  # key prefix: a process that fails says so here, once, before exiting
_NOTICE = "RECEIVED_PREEMPTION_NOTICE"  # JAX's key, set when any process gets SIGTERM
_EXIT_CODE_PEER = 1  # how a process ends because a peer failed
_REASON_CHARS = 4000  # of a hang's reason, which carries the stuck process's stack
# How a process that ends because a peer failed starts its last line ("spmd: ending:
# process K failed ..."): `spmd launch` reads it, never to name it as the first failure.
_EXIT_CODE_SIGTERM = 128 + 15
# What a collective says when a peer's end closed its connections (gloo, NCCL), or when
# it connects to a peer that already ended (gloo's first collective across islands, a
# DiLoCo sync after a peer died: "connect ...: Connection refused"): an uncaught error
# saying so is that peer's failure, which the watches name.
_PEER_CLOSED = re.compile(
    r"closed by peer|reset by peer|Broken pipe|Socket closed|remote process exited"
    r"|Connection refused",
    re.I,
)
# Held by the thread that ends this process, from its decision on: any other thread that
# would end it too (or print an error) waits for that end instead.
_ENDING = threading.RLock()

_state: dict[str, Any] = {
    "process": None,
    "count": None,
    "watch": None,  # this process's hang watch
    "sigterm_at": None,  # when the peer watch saw the SIGTERM notice
    "coordinator": None,  # process 0's "host:port"
    "exiting": False,
    "ending": False,  # some thread holds _ENDING: this process is ending
    "peer_wait": 0.0,  # seconds an error from a closed connection waits for the peer's name
    "save_grace": None,
    "sigterm": False,
    "exit_code": None,
}


# ------------------------------------------------------------------ what JAX knows


def distributed_state() -> tuple[int, int, str | None] | None:
    """(process_id, num_processes, coordinator) if jax.distributed is initialized."""
    state = global_state()
    if state is None or state.client is None:
        return None
    return state.process_id, state.num_processes, state.coordinator_address


# ------------------------------------------------------------------ where the coordinator listens


def _local_ip(ip: str) -> bool:
    """Whether `ip` belongs to this machine (a socket can bind to it)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


def bind_address(coordinator: str) -> str | None:
    """Where process 0's coordinator listens: only the address the others are given.

    A loopback coordinator ("127.0.0.1:1234", "localhost:1234") listens on
    loopback only; one at an address of this machine listens there; otherwise
    (a name or address that reaches this machine through NAT or a service)
    None: JAX's default, every interface. JAX_COORDINATOR_BIND_ADDRESS, if set,
    wins (None).
    """
    if os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return None
    host, _, port = coordinator.rpartition(":")
    host = host.strip("[]")
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        return None
    loopback = all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in ips)
    if not loopback and (len(ips) != 1 or not _local_ip(next(iter(ips)))):
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_port_free(coordinator: str, bind: str | None, count: int) -> None:
    """On process 0: the coordinator's port must be free, else InitializationError.

    Where another process 0 of this job holds it (its roll call, or its
    coordination service), the error names process_id 0 given twice.
    """
    host, _, port = (bind or f"[::]:{coordinator.rpartition(':')[2]}").rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        try:
            s.bind((host if host != "localhost" else "127.0.0.1", int(port)))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # not ours to judge: JAX reports it
            verdict = roll_call.ask(coordinator, count)
            if verdict is not None and not verdict.ok:
                raise InitializationError(
                    roll_call.explain(verdict, coordinator, (0, count), 0)
                ) from None
            raise InitializationError(
                message(
                    f"Process 0 hosts the coordination service on port {port}, so that port "
                    "must be free on this machine.",
                    received(coordinator_address=coordinator, error=str(e)),
                    f"stop the program that listens on it (`ss -ltnp | grep :{port}`; it may be "
                    "another process of this job given process_id 0 too), or give every process "
                    "another port (spmd launch picks a free one itself).",
                )
            ) from None


# ------------------------------------------------------------------ joining


@contextlib.contextmanager
def _connect_errors_raise() -> Iterator[None]:
    """JAX's client aborts the process when connecting fails; with a callback it raises.

    The callback JAX calls on a fatal coordination error replaces its default,
    which is to abort (SIGABRT with a C++ stack). While connecting, the error
    then comes back as an exception from `connect()`. Later, a fatal error
    (process 0's service lost, a peer's missed heartbeats) reaches the callback
    on a C++ thread, where it cannot be called (it throws std::bad_cast) and the
    C++ runtime terminates the process: `lost_peer` names the lost process first.
    """
    try:
        from jax._src.lib import _jax  # private: guarded, JAX may move it
    except ImportError:
        yield
        return
    original = getattr(_jax, "get_distributed_runtime_client", None)
    if original is None:
        yield
        return
    _jax.get_distributed_runtime_client = functools.partial(
        original, missed_heartbeat_callback=lambda *_: None
    )
    try:
        yield
    finally:
        _jax.get_distributed_runtime_client = original


def _explain(
    error: Exception, elapsed: float, where: tuple[str | None, int, int], timeout: int
) -> str:
    """The teaching message for a failed join, naming the field most likely at fault.

    JAX's error text says little here (often just "std::bad_cast", from its
    error callback), so the time it took tells a rejection from a timeout: an
    unreachable coordinator or a missing peer is retried until the deadline;
    a process turned away (its index taken) hears so before it.
    """
    coordinator, index, count = where
    got = received(
        coordinator_address=coordinator,
        process_id=index,
        num_processes=count,
        seconds=round(elapsed, 1),
        error=str(error)[:200],
    )
    if elapsed < 0.9 * timeout:
        return message(
            f"Each process must join with its own process_id, 0 .. {count - 1}; the "
            f"coordination service turned process {index} away at once, which happens when "
            "another process already joined with the same process_id.",
            got,
            "give every process a different index (SPMD_PROCESS_ID, TF_CONFIG's task index, or "
            "process_id=), or let spmd launch number them; check that the coordinator address "
            "is this job's.",
        )
    return message(
        f"All {count} processes must join the coordination service within "
        f"initialization_timeout={timeout} s.",
        got,
        f"start every process of the job (process ids 0 .. {count - 1}, each once), check that "
        "process 0's host:port is reachable from this machine, or raise initialization_timeout.",
    )


def join(
    coordinator: str | None,
    count: int,
    index: int,
    init_timeout: int,
    heartbeat_timeout: int,
    exit_timeout: int = EXIT_TIMEOUT,
    hang_timeout: float | None = None,
) -> None:
    """Calls jax.distributed.initialize, raising InitializationError instead of aborting.

    With a coordinator address it binds the coordinator there only (see
    `bind_address`). Without one, JAX's cluster detection (Slurm, Open MPI,
    Cloud TPU) finds the address, asked first here (`detected_join`), and the
    coordinator listens where JAX's would (every interface, or
    JAX_COORDINATOR_BIND_ADDRESS). Process 0 checks that the port is free;
    the roll call names a process missing or doubled. Then it starts the peer
    watch (`report_failure`), the hang watch (`hang_watch`: a process that
    stops stepping for `hang_timeout` s, None: the default rule, is named),
    the bounded exit, and spmd's SIGTERM handling. Where JAX's detection finds
    no address, JAX's join reports it.
    """
    import jax

    kwargs: dict[str, Any] = {
        "initialization_timeout": int(init_timeout),
        "heartbeat_timeout_seconds": int(heartbeat_timeout),
    }
    bind = None if coordinator is None else bind_address(coordinator)
    if coordinator is None and (found := detected_join(count, index, init_timeout)):
        coordinator, local = found
        if local is not None:
            kwargs["local_device_ids"] = local
    if coordinator is not None:
        if index == 0:
            _check_port_free(coordinator, bind, count)
        _roll_call(coordinator, bind, (index, count), init_timeout)
        kwargs.update(
            coordinator_address=coordinator,
            num_processes=count,
            process_id=index,
            cluster_detection_method="deactivate",
            coordinator_bind_address=bind,
        )
    start = time.monotonic()
    try:
        with _connect_errors_raise():
            jax.distributed.initialize(**kwargs)
    except Exception as e:
        _shutdown_quietly()
        elapsed = time.monotonic() - start
        raise InitializationError(
            _explain(e, elapsed, (coordinator, index, count), init_timeout)
        ) from e
    _state["process"], _state["count"] = index, count
    _state["coordinator"] = coordinator or global_state().coordinator_address
    _state["peer_wait"] = float(heartbeat_timeout)
    _exit_promptly_on_errors()
    _record_sys_exit()
    atexit.register(_agree_to_exit, exit_timeout)
    threading.Thread(target=_watch_peers, name="spmd-peer-watch", daemon=True).start()
    _state["watch"] = hang_watch.start(
        _client(), (index, count), (hang_timeout, heartbeat_timeout), _end_for, _exiting
    )
    if _state["coordinator"]:
        lost_peer.install(_state["coordinator"], index, _end_as_lost, _state["watch"].quietest)


def _exiting() -> bool:
    return bool(_state["exiting"])


def _end_for(culprit: int, reason: str, text: str) -> None:
    """Records `reason` as process `culprit`'s failure, for every peer to read, and ends.

    The hang watch calls it: on the process that is behind (it names itself),
    or on the first to see a peer fall silent (it speaks for that peer). Its
    peers' watches then end them naming `culprit`, with HANG_EXIT_CODE.
    """
    _claim_end()
    client = _client()
    with contextlib.suppress(Exception):
        client.key_value_set(f"{_FAILED}{culprit}", reason[:_REASON_CHARS], allow_overwrite=True)
    if culprit != _state["process"]:
        _end_following(culprit, reason)
    time.sleep(2.5 * PEER_POLL)  # the peers read it and end first: no collective fails on them
    _end(HANG_EXIT_CODE, text)


def _end_as_lost(culprit: int | None, reason: str) -> None:
    """Ends this process for a lost peer that JAX's client reported, naming it where known.

    Process 0 records the failure for the others and keeps its service up a
    few seconds first: the others ask whether it answers, and must not take
    its own end for the loss. A process with no culprit of its own names the
    one process 0 recorded, if it can still read it.
    """
    _claim_end()
    if culprit is None:
        culprit, reason = _recorded_failure() or (None, reason)
    if _state["process"] == 0:
        if culprit is not None:
            with contextlib.suppress(Exception):
                _client().key_value_set(f"{_FAILED}{culprit}", reason, allow_overwrite=True)
        time.sleep(lost_peer.ANSWER_TIMEOUT + 1)
    if culprit is None:
        _end(HANG_EXIT_CODE, f"{reason}; ending this process.")
    _end(HANG_EXIT_CODE, f"{FOLLOWER} {culprit} failed ({reason}); ending this one too.")


def _recorded_failure() -> tuple[int, str] | None:
    """The first failure some process recorded, if the service can still be read."""
    with contextlib.suppress(Exception):
        for key, why in _failed_peers(_client()):
            return int(key.rsplit("/", 1)[1]), why
    return None


def _end_if_coordinator_lost() -> None:
    """On a process other than 0, after an error: ends naming process 0 if its service is gone.

    A collective or a barrier whose peer (process 0) died fails on the main
    thread too; the error to report is process 0's, not this one's.
    """
    address = _state["coordinator"]
    if _state["process"] in (0, None) or not address:
        return
    why = lost_peer.lost(address)
    if why is not None:
        _end_as_lost(0, lost_peer.reason(address, why))


def _roll_call(coordinator: str, bind: str | None, where: tuple[int, int], timeout: float) -> None:
    """Before the join: raises naming the processes missing, the id given twice, or the
    processes that disagree on the process count.

    See `spmd._src.clusters.roll_call`. Process 0 that cannot listen at the
    coordinator's address fails here (the service could not listen there either).
    """
    index, count = where
    if index == 0:
        port = coordinator.rpartition(":")[2]
        bind = bind or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")  # where JAX will listen
        binds = [bind] if bind else [f"[::]:{port}", f"0.0.0.0:{port}"]  # no IPv6: v4
        verdict = roll_call.hold(binds, count, timeout, coordinator)
        if verdict is None:
            raise InitializationError(
                message(
                    "Process 0 hosts the coordination service, so it must be able to listen "
                    "at the coordinator's address.",
                    received(coordinator_address=coordinator, listen_at=bind or f"*:{port}"),
                    "give process 0's own host:port as the coordinator address, or set "
                    "JAX_COORDINATOR_BIND_ADDRESS to an address of this machine.",
                )
            )
    else:
        verdict = roll_call.call(coordinator, index, timeout, count)
    if not verdict.ok:
        raise InitializationError(roll_call.explain(verdict, coordinator, where, timeout))


def _shutdown_quietly() -> None:
    """Leaves jax.distributed's half-built state so that exiting does not crash."""
    state = global_state()
    if state is None:
        return
    for part in ("preemption_sync_manager", "client", "service"):
        with contextlib.suppress(Exception):
            if getattr(state, part, None) is not None:
                getattr(state, part).shutdown()
        setattr(state, part, None)


# ------------------------------------------------------------------ ending, bounded


def _client() -> Any:
    state = global_state()
    return None if state is None else state.client


def _claim_end() -> None:
    """Makes this thread the one that ends this process: one that ends it too (a watch, the
    excepthook, JAX's client reporting a lost peer) waits here for that end, saying nothing."""
    _ENDING.acquire()
    _state["ending"] = True


def _end(code: int, text: str) -> None:
    """Prints `text` and ends this process at once, without waiting for anyone."""
    _claim_end()
    with contextlib.suppress(Exception):
        print(f"spmd: {text}", file=sys.stderr, flush=True)
        sys.stdout.flush()
    os._exit(code)


def _end_following(culprit: int | str, reason: str) -> None:
    """Ends this process because process `culprit` failed for `reason` (what it recorded)."""
    _claim_end()
    _linger_if_host()
    stalled = reason.startswith((hang_watch.HUNG, hang_watch.GONE))
    code = HANG_EXIT_CODE if stalled else _EXIT_CODE_PEER
    if _configuration_error(reason):  # the peer's restart would raise it again: so would ours
        code = CONFIGURATION_EXIT_CODE
    own = ""
    if reason.startswith(hang_watch.HUNG):  # named with it: this one's stack too
        with contextlib.suppress(Exception):
            own = hang_watch.named_stack(_client(), _state["process"])
    _end(code, f"{FOLLOWER} {culprit} failed ({reason}); ending this one too.{own}")


def _configuration_error(reason: str) -> bool:
    """Whether a peer's recorded failure ("BatchError: ...") is spmd's ConfigurationError or
    BatchError (a subclass too), which ends a process with CONFIGURATION_EXIT_CODE."""
    name, found = reason.split(":", 1)[0], set()
    kinds = [ConfigurationError, BatchError]
    while kinds:
        kind = kinds.pop()
        found.add(kind.__name__)
        kinds.extend(kind.__subclasses__())
    return name in found


def _end_if_a_peer_caused(error: BaseException) -> None:
    """Before an uncaught error is reported: ends naming the peer whose end caused it, if any.

    A collective fails on this process when a peer ends (named hung, failed,
    killed): its error ("Gloo AllGather failed: ... Connection closed by
    peer") is the peer's failure, not this process's. A failure a peer
    recorded, or process 0's service gone, is named at once; an error that
    says a connection closed waits, up to `heartbeat_timeout`, for the
    watches to name the peer (or to end this process themselves). Returns
    when no peer is to blame: the error is this process's own.
    """
    if _client() is None or _state["process"] is None:
        return
    wait = _state["peer_wait"] if _PEER_CLOSED.search(str(error)) else 0.0
    deadline = time.monotonic() + wait
    while True:
        if _state["ending"]:
            _claim_end()  # another thread ends this process: wait for it
        recorded = _recorded_failure()
        if recorded is not None:
            _end_following(*recorded)
        _end_if_coordinator_lost()
        if time.monotonic() >= deadline:
            return
        time.sleep(PEER_POLL)


def report_failure(reason: str) -> None:
    """Tells the other processes, through the coordination service, that this one fails.

    Each of them ends within about PEER_POLL seconds instead of waiting for a
    heartbeat timeout. Bounded and silent if the service is gone.
    """
    client, index = _client(), _state["process"]
    if client is None or index is None:
        return
    with contextlib.suppress(Exception):
        client.key_value_set(f"{_FAILED}{index}", reason[:500], allow_overwrite=True)
        _linger_if_host()


def _linger_if_host() -> None:
    """On process 0, which hosts the coordination service, waits for the peers to poll.

    The service ends with process 0; a peer that has not yet read what ends it
    (a failure, a SIGTERM notice) would then abort on the lost service instead
    of ending cleanly. Two and a half polls let every peer read it first.
    """
    if _state["process"] == 0:
        time.sleep(2.5 * PEER_POLL)


def _exit_promptly_on_errors() -> None:
    """An uncaught exception ends this process at once, telling its peers first.

    Otherwise the failing process waits in jax.distributed's shutdown barrier
    while the others wait in a collective for it. The traceback is printed
    first, unless a peer's end caused the error (`_end_if_a_peer_caused`):
    then the process ends naming that peer, as its watches would; `SystemExit` (e.g. a preemption's code 42) exits normally. spmd's
    ConfigurationError and BatchError exit with CONFIGURATION_EXIT_CODE: a
    restart would raise them again, and `spmd launch` does not restart for them.
    """
    previous = printing_hook(sys.excepthook)  # this hook decides the exit code itself

    def hook(kind, value, traceback):
        _end_if_a_peer_caused(value)
        _claim_end()  # from here on the watches wait: the traceback prints whole
        previous(kind, value, traceback)
        report_failure(f"{kind.__name__}: {value}")
        deterministic = issubclass(kind, (ConfigurationError, BatchError))
        code = CONFIGURATION_EXIT_CODE if deterministic else 1
        _end(code, f"process {_state['process']} failed; its peers were told to stop.")

    sys.excepthook = hook


def _exit_status(status: object) -> int:
    """The exit code `sys.exit(status)` gives: 0 for None, the int, else 1."""
    if status is None:
        return 0
    return status if isinstance(status, int) else 1


def _record_sys_exit() -> None:
    """`sys.exit(N)` on the main thread records N, for `_agree_to_exit` to act on.

    A SystemExit reaches neither the excepthook nor, with its code, the atexit
    handlers, so `sys.exit` itself is wrapped. Limits: `raise SystemExit(N)`
    is not seen (it exits through the exit barrier, as a code 0 would), and a
    `sys.exit(N)` whose SystemExit is caught still counts if the program then
    ends without calling `sys.exit` again.
    """
    original = sys.exit
    if getattr(original, "spmd_records_exit", False):
        return

    def exit(status: object = None) -> None:  # noqa: A001 (it replaces sys.exit)
        if threading.current_thread() is threading.main_thread():
            _state["exit_code"] = _exit_status(status)
        original(status)

    exit.spmd_records_exit = True  # type: ignore[attr-defined]
    sys.exit = exit


def _end_on_exit_code(index: int | None) -> None:
    """A process that called sys.exit(N), N not 0 nor 42, ends at once with N, telling its peers.

    Waiting in the exit barrier would keep it until the others time out
    there, while they wait in a collective for it. Code 42 (a preemption)
    goes through the barrier: every process exits with it at one agreed step.
    """
    code = _state.get("exit_code") or 0
    if code in (0, PREEMPTED_EXIT_CODE):
        return
    report_failure(f"exited with code {code}")
    _end(code, f"process {index} exited with code {code}; its peers were told to stop.")


def _agree_to_exit(timeout: int) -> None:
    """At exit: wait for every process to reach its end too, failing only on a deadlock.

    A peer still running its own code (a chief's export) is left to finish;
    one that waits for this process in a collective it never joins (e.g.
    after `if is_chief: return`) makes it fail, naming itself, and its peers
    end with it (`spmd._src.clusters.exit_wait`). Peers that fail, fall silent, or
    get SIGTERM meanwhile end it as they would have before.
    """
    _state["exiting"] = True
    client, index, watch = _client(), _state["process"], _state["watch"]
    if client is None:
        return
    _end_on_exit_code(index)
    if watch is not None:
        watch.wake()  # its record says done now, not at the next interval
        _wait_for_peers(client, ExitWait(index, _state["count"], hang_watch.SHARED[0], timeout))
    try:
        client.wait_at_barrier("spmd_exit", int(timeout * 1000))
    except Exception:
        _end_if_coordinator_lost()
        report_failure(f"process {index} reached the end of its program alone")
        _end(
            1,
            f"process {index} reached the end of its program, but the other processes did not "
            f"within {timeout} s: they are probably waiting for this one in a collective. "
            "Every process must run the same steps (no `if is_chief: return` before a "
            "collective); only side effects such as printing may depend on the process.",
        )
    if watch is not None:
        watch.stop()


def _wait_for_peers(client: Any, wait: ExitWait) -> None:
    """Polls the peers' records until every process has ended; ends this process where one
    waits for it (a deadlock), where one failed, or on an unanswered SIGTERM."""
    while True:
        _look_at_peers(client)
        try:
            records = hang_watch.records(client)
        except Exception:
            _end_if_coordinator_lost()
            return  # the barrier reports it
        if wait.done(records):
            return
        why = wait.look(time.monotonic(), records)
        if why is not None:
            report_failure(f"process {wait.index} reached the end of its program early")
            _end(1, why)
        time.sleep(PEER_POLL)


def expect_save(grace: float | None) -> None:
    """Says that a SIGTERM should be followed by a save (`grace` s at most), or not (None)."""
    _state["save_grace"] = grace


def sigterm_received() -> bool:
    """Whether some process of the job got SIGTERM (seen by the peer watch)."""
    return bool(_state["sigterm"])


def _failed_peers(client: Any) -> list[tuple[str, str]]:
    """The (key, reason) of every process that reported a failure."""
    return [
        (k, v) for k, v in client.key_value_dir_get(_FAILED) if k != f"{_FAILED}{_state['process']}"
    ]


def _notice(client: Any) -> bool:
    """Whether some process got SIGTERM (JAX's preemption notifier recorded it)."""
    try:
        client.key_value_try_get(_NOTICE)
    except Exception:
        return False
    return True


def _watch_peers() -> None:
    """Ends this process when a peer failed, or a SIGTERM has gone unanswered too long.

    Runs in a daemon thread, so it works while the main thread is blocked in
    a collective, where no Python signal handler can run; at this process's
    end, `_agree_to_exit` looks in its place.
    """
    while not _state["exiting"]:
        time.sleep(PEER_POLL)
        client = _client()
        if client is None or _state["exiting"]:
            return
        _look_at_peers(client)


def _look_at_peers(client: Any) -> None:
    """One look: ends this process if a peer failed, or a SIGTERM went unanswered too long."""
    with contextlib.suppress(Exception):
        failed = _failed_peers(client)
        if failed:
            key, reason = failed[0]
            _end_following(key.rsplit("/", 1)[1], reason)
    if _state["sigterm_at"] is None and _notice(client):
        _state["sigterm_at"], _state["sigterm"] = time.monotonic(), True
    sigterm_at = _state["sigterm_at"]
    if sigterm_at is not None:
        grace = _state["save_grace"]
        if grace is None or time.monotonic() - sigterm_at > grace:
            after = "" if grace is None else f" and {grace:g} s without the save ending it"
            _claim_end()
            _linger_if_host()
            _end(_EXIT_CODE_SIGTERM, f"SIGTERM{after}; ending the process.")
