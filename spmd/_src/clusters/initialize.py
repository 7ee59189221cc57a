"""Who is in the job and which process am I: cluster resolution and `initialize()`."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from spmd._src.clusters.backend_check import check_device_count
from spmd._src.clusters.configuration_exit import exit_78_on_configuration_errors
from spmd._src.clusters.distributed import EXIT_TIMEOUT, distributed_state, join
from spmd._src.clusters.gloo import check_interface, gloo_address, use_gloo_address
from spmd._src.clusters.hang_watch import check_hang_timeout
from spmd._src.clusters.jax_state import backends_started
from spmd._src.clusters.resolvers.base import Resolver
from spmd._src.clusters.resolvers.explicit import ExplicitResolver
from spmd._src.clusters.resolvers.indexed_job import IndexedJobResolver
from spmd._src.clusters.resolvers.jax_detect import JaxResolver
from spmd._src.clusters.resolvers.single import SingleProcessResolver
from spmd._src.clusters.resolvers.spmd_launch import LaunchResolver
from spmd._src.clusters.resolvers.tf_config import TfConfigResolver
from spmd._src.clusters.spec import (
    ENV_DEVICES_PER_PROCESS,
    ENV_HANG_TIMEOUT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ClusterInfo,
    check_int,
    parse_tf_config,
    worker_info,
)
from spmd._src.clusters.tpu_backend import skip_without_chips
from spmd._src.errors import ClusterError, InitializationError, message, received
from spmd._src.validate import non_negative_number, positive_int

__all__ = [
    "ClusterInfo",
    "cluster",
    "initialize",
    "parse_tf_config",
    "resolve",
]

# After the explicit arguments, the resolvers `resolve()` asks, in order; the first
# present one answers. A new environment is one file in spmd/_src/clusters/resolvers/ and
# one entry here.
RESOLVERS: tuple[type, ...] = (
    TfConfigResolver,
    LaunchResolver,
    JaxResolver,
    IndexedJobResolver,
    SingleProcessResolver,
)

MSG_TOO_LATE = """\
spmd.initialize() must run before JAX starts its backends, and here they have
already started (something called jax.devices(), created an array or ran a
computation) while initialize() still had to change how they start.
{received}
To fix: call spmd.initialize() first thing, before any other JAX call:

    import jax, spmd
    x = jax.numpy.ones(3)     # wrong: this starts the backends
    spmd.initialize()

    import jax, spmd
    spmd.initialize()         # right
    x = jax.numpy.ones(3)
"""
_INFO: ClusterInfo | None = None  # what initialize() resolved in this process
MSG_NOT_INITIALIZED = """\
This process was started by `spmd launch` as process {index} of {count}, but
spmd.initialize() was not called, so it would train alone as process 0 of 1 and
every process would claim to be the chief: {count} independent jobs instead of one.
{received}
To fix: call spmd.initialize() first thing, before building a strategy:

    import spmd
    strategy = spmd.MultiWorkerMirroredStrategy()   # wrong: never joined the others

    import spmd
    spmd.initialize()                               # right
    strategy = spmd.MultiWorkerMirroredStrategy()
"""


def _local_device_count(value: int | None) -> int | None:
    """The simulated CPU device count: the argument, else SPMD_DEVICES_PER_PROCESS."""
    fix = "give a positive number of devices per process, e.g. 4."
    if value is not None:
        return check_int(value, "local_device_count", 1, None, fix)
    if os.environ.get(ENV_DEVICES_PER_PROCESS):
        return check_int(os.environ[ENV_DEVICES_PER_PROCESS], ENV_DEVICES_PER_PROCESS, 1, None, fix)
    return None


def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
) -> ClusterInfo:
    """Works out the cluster without touching JAX: what `initialize()` would use.

    Order: explicit arguments; TF_CONFIG; `spmd launch`'s SPMD_* variables; JAX's
    detection (Slurm, Open MPI, Kubernetes, Cloud TPU); else a single process,
    except in a Kubernetes Indexed Job pod (JOB_COMPLETION_INDEX set), which is
    an error: each pod would train alone.

    Args:
      coordinator_address: process 0's "host:port".
      num_processes: how many processes train together.
      process_id: this process's index.
      local_device_count: simulated CPU devices for this process (default:
        SPMD_DEVICES_PER_PROCESS, else JAX's own count).

    Returns:
      The ClusterInfo of this process.

    Raises:
      ClusterError: if the description that answers is malformed, or in an
        Indexed Job pod that nothing else describes.
    """
    explicit = ExplicitResolver(coordinator_address, num_processes, process_id)
    resolvers: tuple[Resolver, ...] = (explicit, *(make() for make in RESOLVERS))
    info = next(r for r in resolvers if r.is_present()).resolve()
    return dataclasses.replace(info, local_device_count=_local_device_count(local_device_count))


# ------------------------------------------------------------------ initialize


def _cpu_devices_match(count: int) -> bool:
    """Whether JAX already gives (or will give) `count` CPU devices."""
    import jax

    if not backends_started():
        return jax.config.jax_num_cpu_devices == count
    try:
        return len(jax.local_devices(backend="cpu")) == count
    except RuntimeError:
        return False


def _adopt_distributed(info: ClusterInfo) -> ClusterInfo:
    """Checks `info` against a jax.distributed someone already initialized."""
    state = distributed_state()
    if state is None:
        return info
    index, count, coordinator = state
    if info.source == SingleProcessResolver.source:
        adopted = worker_info(index, count, coordinator, "jax.distributed")
        return dataclasses.replace(adopted, local_device_count=info.local_device_count)
    if (info.process_index, info.process_count) != (index, count):
        raise InitializationError(
            message(
                f"jax.distributed is already initialized as process {index} of {count}, "
                f"which disagrees with what spmd resolved from {info.source}.",
                received(process_index=info.process_index, process_count=info.process_count),
                "call spmd.initialize() instead of jax.distributed.initialize(), not both.",
            )
        )
    return dataclasses.replace(info, coordinator_address=coordinator or info.coordinator_address)


def _use_gloo(interface: str | None) -> None:
    """After joining: gloo listens on `interface`, else where the coordinator is reached."""
    if interface is not None:
        use_gloo_address(None, interface)
        return
    state = distributed_state()
    if state is not None and state[2]:
        use_gloo_address(gloo_address(state[2]), None)


def _set_up(
    info: ClusterInfo,
    cpu_collectives: str,
    timeouts: tuple[int, int, int, float | None],
    interface: str | None = None,
) -> ClusterInfo:
    """Applies `info` to JAX: CPU device count, CPU collectives, jax.distributed."""
    import jax

    count = info.local_device_count
    set_devices = count is not None and not _cpu_devices_match(count)
    joining = info.process_count > 1 and distributed_state() is None
    pending = [f"set jax_num_cpu_devices={count}"] if set_devices else []
    pending += [f"start jax.distributed for {info.process_count} processes"] if joining else []
    if pending and backends_started():
        got = received(pending=pending, source=info.source)
        raise InitializationError(MSG_TOO_LATE.format(received=got))
    if set_devices:
        jax.config.update("jax_num_cpu_devices", count)
    if joining:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
        join(info.coordinator_address, info.process_count, info.process_index, *timeouts)
        if cpu_collectives == "gloo":
            _use_gloo(interface)
    return _adopt_distributed(info)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    cpu_collectives: str = "gloo",
    initialization_timeout: int = 300,
    heartbeat_timeout: int = 100,
    exit_timeout: int = EXIT_TIMEOUT,
    interface: str | None = None,
    hang_timeout: float | None = None,
) -> ClusterInfo:
    """Joins this process to its cluster; call it first thing, in every process.

    Resolves the cluster (see `resolve`). With several processes it selects the CPU
    collectives (gloo, or MPI) and calls `jax.distributed.initialize`; with a
    `local_device_count` (or SPMD_DEVICES_PER_PROCESS) it sets the simulated CPU
    device count, which only the CPU backend uses. One process with no cluster is a
    no-op that records the ClusterInfo. Calling it again with no arguments, or
    arguments resolving to the same cluster, returns the same ClusterInfo.

    Args:
      coordinator_address: process 0's "host:port"; with the two next ones,
        overrides every environment.
      num_processes: how many processes train together.
      process_id: this process's index, 0 .. num_processes - 1.
      local_device_count: simulated CPU devices for this process.
      cpu_collectives: cross-process collectives on CPU: "gloo" or "mpi".
      initialization_timeout: seconds to wait for every process to join.
      heartbeat_timeout: seconds without heartbeats after which a process is dead
        (and its peers end): the bound for a peer killed without a word.
      exit_timeout: a process that reached the end of its program waits for the
        others to reach theirs (a peer running its own code, a chief's export, is
        left to finish); it fails, naming itself, where a peer waits for it in a
        step it never makes, or waits in JAX with no step call for this many
        seconds (most likely a collective outside a step it never joins).
      interface: the network interface gloo uses, e.g. "eth0" (default:
        SPMD_GLOO_INTERFACE, else the local address that routes to the
        coordinator, never the hostname's address, which is often loopback).
      hang_timeout: seconds a process may go without a step before every
        process ends naming it, and before its first step, seconds its peers
        may wait for it in theirs (default: SPMD_HANG_TIMEOUT, else the larger
        of 300 s and 10x the slowest recent step, 300 s before any step; see
        docs/multihost.md).

    With several processes, a process that fails (an uncaught exception, or
    reaching its end while a peer waits for it) tells the others through the coordination
    service and each ends within about a second; a SIGTERM ends every process
    at once unless a checkpoint manager is waiting to save (see
    docs/checkpoints.md, preemption).

    Returns:
      The ClusterInfo of this process.

    Raises:
      ClusterError: if the cluster description is malformed.
      ConfigurationError: if this machine has no network interface `interface`.
      InitializationError: if JAX's backends already started and something must
        change, if a second call resolves differently, or if joining fails (the
        coordinator's port is taken, two processes have the same process_id, the
        processes were given different process counts, or not every process
        joined within initialization_timeout), bounded by
        initialization_timeout; never an abort.

    Example:
      >>> import spmd
      >>> info = spmd.initialize()  # doctest: +SKIP
      >>> info.process_index, info.process_count  # doctest: +SKIP
      (0, 1)
    """
    global _INFO
    if LaunchResolver().is_present():  # a malformed SPMD_* variable exits 78, as a launch expects
        exit_78_on_configuration_errors()
    check_device_count(os.environ.get("XLA_FLAGS", ""))  # before XLA reads it, and aborts
    skip_without_chips()  # libtpu is not started (nor heard) on a host with no TPU chip
    _check_cpu_collectives(cpu_collectives)
    interface = check_interface(interface)
    timeouts = (
        positive_int(initialization_timeout, "initialization_timeout", error=ClusterError),
        positive_int(
            heartbeat_timeout,
            "heartbeat_timeout",
            fix="pass whole seconds >= 1, e.g. heartbeat_timeout=100 (JAX's coordination "
            "service counts its heartbeats in whole seconds; below 1 every process would "
            "look dead at once).",
            error=ClusterError,
        ),
        non_negative_number(exit_timeout, "exit_timeout", error=ClusterError),
        _hang(hang_timeout),
    )
    args = (coordinator_address, num_processes, process_id, local_device_count)
    if _INFO is not None and all(a is None for a in args):
        return _INFO
    info = resolve(*args[:3], local_device_count=local_device_count)
    if _INFO is not None:
        return _same_as_before(_INFO, info)
    _INFO = _set_up(info, cpu_collectives, timeouts, interface)
    return _INFO


def _check_cpu_collectives(cpu_collectives: Any) -> None:
    if cpu_collectives not in ("gloo", "mpi"):
        raise ClusterError(
            message(
                'cpu_collectives must be "gloo" or "mpi".',
                received(cpu_collectives=cpu_collectives),
                'leave it at "gloo" unless your job runs under an MPI launcher.',
            )
        )


def _same_as_before(first: ClusterInfo, now: ClusterInfo) -> ClusterInfo:
    """A second `initialize()` returns the first's ClusterInfo if it resolves the same cluster."""
    if first.same_cluster(now):
        return first
    raise InitializationError(
        message(
            "spmd.initialize() was already called and resolved a different cluster.",
            received(first=first, now=now),
            "call spmd.initialize() once, at the start of the program, with one description.",
        )
    )


def _hang(hang_timeout: Any) -> Any:
    """`hang_timeout` checked; None takes SPMD_HANG_TIMEOUT where it is set."""
    if hang_timeout is None and os.environ.get(ENV_HANG_TIMEOUT):
        return check_hang_timeout(os.environ[ENV_HANG_TIMEOUT], ENV_HANG_TIMEOUT)
    return check_hang_timeout(hang_timeout)


def cluster() -> ClusterInfo:
    """Returns what `initialize()` resolved.

    Without a call to `initialize()`, and without starting any backend or joining
    anything: jax.distributed's process index and count if someone initialized it;
    else the task TF_CONFIG describes (its type, index and training group, as TF's
    TFConfigClusterResolver reads it, so a program can branch on `task_type` before
    it initializes: the evaluator is a one-process job of its own); else what JAX
    knows (this process alone).

    Raises:
      ClusterError: TF_CONFIG is set and malformed.
    """
    if _INFO is not None:
        return _INFO
    state = distributed_state()
    if state is not None:
        return worker_info(state[0], state[1], state[2], "jax.distributed")
    if TfConfigResolver().is_present():
        return TfConfigResolver().resolve()
    if backends_started():
        import jax

        return worker_info(jax.process_index(), jax.process_count(), None, "jax")
    return SingleProcessResolver().resolve()


def check_initialized_under_launcher() -> None:
    """Raises if `spmd launch` started this process and `initialize()` was not called.

    The strategies call it when they are built.

    Raises:
      InitializationError: naming spmd.initialize().
    """
    if _INFO is not None or distributed_state() is not None:
        return
    count = os.environ.get(ENV_NUM_PROCESSES, "")
    if not count.strip().isdigit() or int(count) <= 1:
        return
    index = os.environ.get(ENV_PROCESS_ID, "?")
    got = received(**{ENV_NUM_PROCESSES: count, ENV_PROCESS_ID: index})
    raise InitializationError(MSG_NOT_INITIALIZED.format(index=index, count=count, received=got))
