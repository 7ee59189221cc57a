"""Who is in the job and which process am I: cluster resolution and `initialize()`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any, Protocol

from spmd.clusters.distributed import EXIT_TIMEOUT, distributed_state, join
from spmd.clusters.gloo import check_interface, gloo_address, use_gloo_address
from spmd.clusters.jax_state import backends_started
from spmd.clusters.spec import (
    ENV_COORDINATOR_ADDRESS,
    ENV_DEVICES_PER_PROCESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    TF_CONFIG,
    ClusterInfo,
    check_address,
    check_int,
    parse_tf_config,
    worker_info,
)
from spmd.errors import ClusterError, InitializationError, message, received

__all__ = [
    "ClusterInfo",
    "cluster",
    "initialize",
    "parse_tf_config",
    "resolve",
]

# ------------------------------------------------------------------ resolvers


class Resolver(Protocol):
    """One place a cluster description can come from (STYLE guideline 10).

    `resolve()` tries the resolvers in a fixed order; the first present one answers.
    """

    @property
    def source(self) -> str:
        """The name ClusterInfo.source reports, e.g. "TF_CONFIG"."""
        ...

    def is_present(self) -> bool:
        """Whether this environment describes the cluster."""
        ...

    def resolve(self) -> ClusterInfo:
        """Reads the description; raises ClusterError naming a malformed field."""
        ...


def _group(
    count: Any, index: Any, coordinator: Any, names: Sequence[str], source: str
) -> ClusterInfo:
    """Checks (count, index, coordinator) given under `names` and builds the worker's info."""
    n_name, i_name, c_name = names
    fix = f"give {n_name} and {i_name} (and {c_name} with several processes), or none of them."
    count = check_int(count, n_name, 1, None, fix)
    index = 0 if index is None and count == 1 else index
    index = check_int(index, i_name, 0, count, f"number the processes 0 .. {count - 1}.")
    if coordinator is None and count > 1:
        raise ClusterError(
            message(
                f"{c_name} is needed with several processes: process 0 hosts the coordinator.",
                received(**{c_name: None, n_name: count}),
                f'set {c_name} to process 0\'s "host:port", e.g. "10.0.0.1:1234".',
            )
        )
    if coordinator is not None:
        coordinator = check_address(coordinator, c_name)
    return worker_info(index, count, coordinator if count > 1 else None, source)


@dataclasses.dataclass(frozen=True)
class ExplicitResolver:
    """The arguments of `initialize(coordinator_address, num_processes, process_id)`."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    source: str = "explicit"

    def is_present(self) -> bool:
        """Whether any of the three arguments was given."""
        values = (self.coordinator_address, self.num_processes, self.process_id)
        return any(v is not None for v in values)

    def resolve(self) -> ClusterInfo:
        """Checks the arguments together."""
        values = (self.num_processes, self.process_id, self.coordinator_address)
        names = ("num_processes", "process_id", "coordinator_address")
        return _group(*values, names, self.source)


class TfConfigResolver:
    """The TF_CONFIG environment variable (see `parse_tf_config`)."""

    source = TF_CONFIG

    def is_present(self) -> bool:
        """Whether TF_CONFIG is set to something other than blank or '{}'."""
        return os.environ.get(TF_CONFIG, "").strip() not in ("", "{}")

    def resolve(self) -> ClusterInfo:
        """Parses TF_CONFIG."""
        return parse_tf_config(os.environ[TF_CONFIG])


class LaunchResolver:
    """The environment `spmd launch` gives each process (SPMD_* variables)."""

    source = "spmd launch"
    names = (ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_COORDINATOR_ADDRESS)

    def is_present(self) -> bool:
        """Whether any of SPMD_NUM_PROCESSES, SPMD_PROCESS_ID, SPMD_COORDINATOR_ADDRESS is set."""
        return any(name in os.environ for name in self.names)

    def resolve(self) -> ClusterInfo:
        """Reads and checks the SPMD_* variables."""
        return _group(*(os.environ.get(name) for name in self.names), self.names, self.source)


class JaxResolver:
    """JAX's own cluster detection: Slurm, Open MPI, Kubernetes, Cloud TPU.

    `initialize()` then calls `jax.distributed.initialize()` without arguments and
    lets JAX pick the coordinator address.
    """

    def __init__(self) -> None:
        self._env: Any = None

    @property
    def source(self) -> str:
        """The detected environment's JAX name, e.g. "slurm"."""
        return (self._env.name or self._env.__name__) if self._env else "jax auto"

    def is_present(self) -> bool:
        """Whether one of JAX's (non opt-in) cluster environments is present."""
        try:
            from jax._src import clusters  # private: guarded, JAX may move it
        except ImportError:
            return False
        envs = getattr(clusters.ClusterEnv, "_cluster_types", [])
        present = (e for e in envs if not getattr(e, "opt_in_only_method", False))
        self._env = next((e for e in present if e.is_env_present()), None)
        return self._env is not None

    def resolve(self) -> ClusterInfo:
        """Asks the detected environment for the process count and index."""
        try:
            count, index = self._env.get_process_count(), self._env.get_process_id()
        except (KeyError, ValueError, RuntimeError) as e:
            raise ClusterError(
                message(
                    f"JAX detected a {self.source} cluster but could not read its process "
                    "count and index.",
                    received(error=str(e)),
                    "pass num_processes, process_id and coordinator_address to "
                    "spmd.initialize() instead.",
                )
            ) from e
        return worker_info(index, count, None, self.source)


class IndexedJobResolver:
    """A Kubernetes Indexed Job pod that no other resolver described: an error.

    Each pod would otherwise train alone as process 0 of 1, every one a chief:
    as many independent jobs as pods, silently. JAX's Kubernetes detection
    needs `jax[k8s]`; without it the pod must say how many processes there are.
    """

    source = "Kubernetes Indexed Job"
    names = ("JOB_COMPLETION_INDEX", "KUBERNETES_SERVICE_HOST")

    def is_present(self) -> bool:
        """Whether JOB_COMPLETION_INDEX, which Indexed Job pods get, is set."""
        return self.names[0] in os.environ

    def resolve(self) -> ClusterInfo:
        """Raises ClusterError naming the variables that would join the pods."""
        got = {name: os.environ.get(name) for name in self.names}
        raise ClusterError(
            message(
                "this is a pod of a Kubernetes Indexed Job, but nothing says how many "
                "processes the job has, so each pod would train alone as its chief.",
                received(**got),
                f"set {ENV_COORDINATOR_ADDRESS}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} in "
                "the pod template (docs/multihost.md, Kubernetes), or install jax[k8s] for "
                f"JAX's detection; for pods that train alone, set {ENV_NUM_PROCESSES}=1.",
            )
        )


class SingleProcessResolver:
    """No cluster anywhere: this process alone."""

    source = "single process"

    def is_present(self) -> bool:
        """Always: the last resort."""
        return True

    def resolve(self) -> ClusterInfo:
        """Process 0 of 1."""
        return worker_info(0, 1, None, self.source)


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
    resolvers: tuple[Resolver, ...] = (
        ExplicitResolver(coordinator_address, num_processes, process_id),
        TfConfigResolver(),
        LaunchResolver(),
        JaxResolver(),
        IndexedJobResolver(),
        SingleProcessResolver(),
    )
    info = next(r for r in resolvers if r.is_present()).resolve()
    return dataclasses.replace(info, local_device_count=_local_device_count(local_device_count))


# ------------------------------------------------------------------ initialize

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
    timeouts: tuple[int, int, int],
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
      exit_timeout: seconds a process that reached the end of its program waits
        for the others to reach theirs; then it fails, naming itself.
      interface: the network interface gloo uses, e.g. "eth0" (default:
        SPMD_GLOO_INTERFACE, else the local address that routes to the
        coordinator, never the hostname's address, which is often loopback).

    With several processes, a process that fails (an uncaught exception, or
    reaching its end alone) tells the others through the coordination
    service and each ends within about a second; a SIGTERM ends every process
    at once unless a checkpoint manager is waiting to save (see
    `spmd.preemption.PreemptionWatcher`).

    Returns:
      The ClusterInfo of this process.

    Raises:
      ClusterError: if the cluster description is malformed.
      ConfigurationError: if this machine has no network interface `interface`.
      InitializationError: if JAX's backends already started and something must
        change, if a second call resolves differently, or if joining fails (the
        coordinator's port is taken, two processes have the same process_id, or
        not every process joined within initialization_timeout), bounded by
        initialization_timeout; never an abort.

    Example:
      >>> import spmd
      >>> info = spmd.initialize()  # doctest: +SKIP
      >>> info.process_index, info.process_count  # doctest: +SKIP
      (0, 1)
    """
    global _INFO
    if cpu_collectives not in ("gloo", "mpi"):
        raise ClusterError(
            message(
                'cpu_collectives must be "gloo" or "mpi".',
                received(cpu_collectives=cpu_collectives),
                'leave it at "gloo" unless your job runs under an MPI launcher.',
            )
        )
    interface = check_interface(interface)
    args = (coordinator_address, num_processes, process_id, local_device_count)
    if _INFO is not None and all(a is None for a in args):
        return _INFO
    info = resolve(*args[:3], local_device_count=local_device_count)
    if _INFO is not None:
        if _INFO.same_cluster(info):
            return _INFO
        raise InitializationError(
            message(
                "spmd.initialize() was already called and resolved a different cluster.",
                received(first=_INFO, now=info),
                "call spmd.initialize() once, at the start of the program, with one description.",
            )
        )
    timeouts = (initialization_timeout, heartbeat_timeout, exit_timeout)
    _INFO = _set_up(info, cpu_collectives, timeouts, interface)
    return _INFO


def cluster() -> ClusterInfo:
    """Returns what `initialize()` resolved.

    Without a call to `initialize()`, describes what JAX knows (jax.distributed's
    process index and count, or this process alone) without starting any backend.
    """
    if _INFO is not None:
        return _INFO
    state = distributed_state()
    if state is not None:
        return worker_info(state[0], state[1], state[2], "jax.distributed")
    if backends_started():
        import jax

        return worker_info(jax.process_index(), jax.process_count(), None, "jax")
    return SingleProcessResolver().resolve()


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
