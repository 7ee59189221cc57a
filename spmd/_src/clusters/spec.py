"""What a cluster description says: the ClusterInfo, its checked fields, and TF_CONFIG."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from spmd._src.errors import ClusterError, message, received
from spmd._src.validate import integer

__all__ = ["ClusterInfo", "check_address", "parse_tf_config"]

# The environment `spmd launch` gives every process it starts (read here, written by launch.py).
ENV_COORDINATOR_ADDRESS = "SPMD_COORDINATOR_ADDRESS"  # "host:port" of process 0's coordinator
ENV_NUM_PROCESSES = "SPMD_NUM_PROCESSES"  # how many processes the job has
ENV_PROCESS_ID = "SPMD_PROCESS_ID"  # this process's index, 0 .. num_processes - 1
ENV_DEVICES_PER_PROCESS = "SPMD_DEVICES_PER_PROCESS"  # simulated CPU devices per process
ENV_RESTART_COUNT = "SPMD_RESTART_COUNT"  # 0 on the first attempt, then 1, 2, ...
# The TF_CONFIG `spmd launch` wrote for the program to read (its task index): while
# TF_CONFIG is still that text, the SPMD_* variables describe the cluster.
ENV_LAUNCH_TF_CONFIG = "SPMD_LAUNCH_TF_CONFIG"
ENV_HANG_TIMEOUT = "SPMD_HANG_TIMEOUT"  # seconds without a step before a process is hung
TF_CONFIG = "TF_CONFIG"

# The task types TF_CONFIG may name.
TASK_TYPES = ("chief", "worker", "evaluator", "ps")

MSG_PS_TASK = """\
{who}, but spmd runs no parameter server
processes: spmd.ParameterServerStrategy shards the variables over the workers' own
devices (ZeRO-3 / FSDP) and XLA gathers them where they are used.
{received}
To fix: start only the chief and worker tasks, each running the same script, and
drop the 'ps' job from TF_CONFIG:

    "cluster": {{"worker": ["host0:2222", "host1:2222"], "ps": ["host2:2222"]}}  # wrong
    "cluster": {{"worker": ["host0:2222", "host1:2222"]}}                        # right

A ClusterCoordinator loop ports as it is: spmd.ClusterCoordinator(strategy) runs
schedule / join / fetch in every process. For training that tolerates slow links
between groups of workers, as asynchronous parameter servers did, use
spmd.DiLoCo(islands=..., sync_every=...): islands that average every H steps
(docs/diloco.md).
"""
PS_TASK = "This process is a parameter server task"
PS_JOB = (
    "This {task} task's cluster lists parameter server tasks ('ps'), which its program\n"
    "expects to hold the variables"
)


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """What `spmd.initialize()` resolved about the job and this process.

    Attributes:
      process_index: this process's index in the training group, 0 .. process_count - 1.
      process_count: how many processes train together.
      task_type: the TF_CONFIG-style role: "chief", "worker" or "evaluator".
      task_index: the index of this process among the tasks of its type.
      is_chief: whether this process writes summaries and logs (process 0; an
        evaluator is the chief of its own one-process group, as in tf.distribute).
      coordinator_address: "host:port" of the coordination service (on process 0),
        or None with one process, or when JAX's own detection picks it.
      source: which resolver answered: "explicit", "TF_CONFIG", "spmd launch",
        a JAX cluster name such as "slurm", or "single process".
      local_device_count: the simulated CPU device count asked for, or None.
    """

    process_index: int
    process_count: int
    task_type: str
    task_index: int
    is_chief: bool
    coordinator_address: str | None
    source: str
    local_device_count: int | None = None

    def same_cluster(self, other: ClusterInfo) -> bool:
        """Whether two resolutions describe the same process of the same job."""
        keys = ("process_index", "process_count", "coordinator_address", "local_device_count")
        return all(getattr(self, k) == getattr(other, k) for k in keys)


def worker_info(index: int, count: int, coordinator: str | None, source: str) -> ClusterInfo:
    """The ClusterInfo of process `index` of `count` identical workers."""
    return ClusterInfo(index, count, "worker", index, index == 0, coordinator, source)


# ------------------------------------------------------------------ validation


def _is_address(address: Any) -> bool:
    """Whether `address` reads "host:port" with a port in 1..65535 ("[v6]:port" too)."""
    if not isinstance(address, str):
        return False
    host, _, port = address.rpartition(":")
    if host.startswith("["):
        host_ok = host.endswith("]") and len(host) > 2
    else:
        host_ok = bool(host) and ":" not in host
    host_ok = host_ok and not any(c.isspace() for c in host)
    return host_ok and port.isdigit() and 0 < int(port) < 65536


def check_address(address: Any, field: str) -> str:
    """Checks that `address` reads "host:port" (IPv6 hosts in brackets) and returns it.

    Args:
      address: the value to check.
      field: how to name it in the error, e.g. "TF_CONFIG['cluster']['worker'][1]".

    Raises:
      ClusterError: if it is not a string "host:port" with a port in 1..65535.
    """
    if _is_address(address):
        return address
    raise ClusterError(
        message(
            f'{field} must be an address "host:port" with a port in 1..65535.',
            received(**{field: address}),
            'write it as "host:port", e.g. "10.0.0.1:2222" or "[::1]:2222".',
        )
    )


def check_int(value: Any, field: str, low: int, high: int | None, fix: str) -> int:
    """Checks that `value` is an int in [low, high) (high None: unbounded) and returns it."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    return integer(value, field, low=low, high=high, fix=fix, error=ClusterError)


# ------------------------------------------------------------------ TF_CONFIG


def _tf_job(cluster_spec: Mapping[str, Any], job: str) -> list[str]:
    """Returns the checked address list of one TF_CONFIG job (empty if absent)."""
    field = f"{TF_CONFIG}['cluster']['{job}']"
    addresses = cluster_spec.get(job, [])
    if not isinstance(addresses, list):
        raise ClusterError(
            message(
                f"{field} must be a list of 'host:port' addresses.",
                received(**{field: addresses}),
                f'write it as a list, e.g. "{job}": ["host0:2222", "host1:2222"].',
            )
        )
    return [check_address(a, f"{field}[{i}]") for i, a in enumerate(addresses)]


def _tf_cluster(config: Any) -> dict[str, list[str]]:
    """Returns TF_CONFIG's `cluster` as {job: addresses}, checked."""
    spec = config.get("cluster") if isinstance(config, dict) else None
    if not isinstance(spec, dict) or not spec:
        raise ClusterError(
            message(
                f"{TF_CONFIG} must be a JSON object with a non-empty 'cluster' object.",
                received(**{f"{TF_CONFIG}['cluster']": spec}),
                'set e.g. TF_CONFIG=\'{"cluster": {"worker": ["host0:2222", "host1:2222"]}, '
                '"task": {"type": "worker", "index": 0}}\'.',
            )
        )
    unknown = sorted(set(spec) - set(TASK_TYPES))
    if unknown:
        raise ClusterError(
            message(
                f"{TF_CONFIG}['cluster'] may only name the jobs {list(TASK_TYPES)}.",
                received(**{f"{TF_CONFIG}['cluster'] jobs": unknown}),
                "rename the job (did you mean 'worker'?) or remove it.",
            )
        )
    jobs = {job: _tf_job(spec, job) for job in TASK_TYPES}
    for job in ("chief", "evaluator"):
        if len(jobs[job]) > 1:
            raise ClusterError(
                message(
                    f"{TF_CONFIG}['cluster']['{job}'] may hold at most one address.",
                    received(**{f"{TF_CONFIG}['cluster']['{job}']": jobs[job]}),
                    f"keep one {job}; list the other processes under 'worker'.",
                )
            )
    if not jobs["chief"] and not jobs["worker"]:
        raise ClusterError(
            message(
                f"{TF_CONFIG}['cluster'] must list at least one 'chief' or 'worker' address.",
                received(**{f"{TF_CONFIG}['cluster']": spec}),
                'add the training processes, e.g. "worker": ["host0:2222", "host1:2222"].',
            )
        )
    return jobs


def _tf_task(config: dict[str, Any], jobs: dict[str, list[str]]) -> tuple[str, int]:
    """Returns TF_CONFIG's (task type, task index), checked against the cluster."""
    task = config.get("task")
    if not isinstance(task, dict):
        raise ClusterError(
            message(
                f"{TF_CONFIG} must have a 'task' object naming this process's role.",
                received(**{f"{TF_CONFIG}['task']": task}),
                'add e.g. "task": {"type": "worker", "index": 0}, a different one per process.',
            )
        )
    task_type = task.get("type")
    if task_type not in TASK_TYPES:
        raise ClusterError(
            message(
                f"{TF_CONFIG}['task']['type'] must be one of {list(TASK_TYPES)}.",
                received(**{f"{TF_CONFIG}['task']['type']": task_type}),
                "set it to 'worker' (or 'chief' for the chief task).",
            )
        )
    if task_type == "ps":
        got = received(**{f"{TF_CONFIG}['task']['type']": "ps"})
        raise ClusterError(MSG_PS_TASK.format(who=PS_TASK, received=got))
    if jobs["ps"] and task_type != "evaluator":
        # Its program was written for parameter servers that hold the variables
        # (a coordinator's schedule, workers that read and update them): none will run.
        got = received(**{f"{TF_CONFIG}['cluster']['ps']": jobs["ps"]})
        raise ClusterError(MSG_PS_TASK.format(who=PS_JOB.format(task=task_type), received=got))
    count = len(jobs[task_type])
    if count == 0 and task_type == "evaluator":  # not part of the training cluster (TF allows it)
        fix = "number the evaluator 0 (there is at most one)."
        return task_type, check_int(
            task.get("index", 0), f"{TF_CONFIG}['task']['index']", 0, None, fix
        )
    if count == 0:
        raise ClusterError(
            message(
                f"{TF_CONFIG}['cluster'] must list a '{task_type}' job for this task's type.",
                received(**{f"{TF_CONFIG}['task']['type']": task_type}),
                f"add this process's address under {TF_CONFIG}['cluster']['{task_type}'].",
            )
        )
    field = f"{TF_CONFIG}['task']['index']"
    fix = f"number the '{task_type}' tasks 0 .. {count - 1}, in cluster order."
    if "index" not in task and count > 1:  # with one task of its type, 0 is the only index
        raise ClusterError(
            message(
                f"{field} must say which of the {count} '{task_type}' tasks this process is.",
                received(**{f"{TF_CONFIG}['task']": task}),
                f'add it, e.g. "task": {{"type": "{task_type}", "index": 1}}; {fix}',
            )
        )
    return task_type, check_int(task.get("index", 0), field, 0, count, fix)


def parse_tf_config(text: str) -> ClusterInfo:
    """Reads a TF_CONFIG JSON string into a ClusterInfo.

    The training group is the chief (if any) then the workers, in order; the chief
    task, or worker 0 without one, is process 0 and hosts the coordinator at its
    address. An evaluator is not part of the training group: it resolves to a
    one-process group of its own (no coordinator), the chief of itself, whether or
    not the cluster lists an 'evaluator' job (TF's RunConfig and Kubeflow's TFJob
    give it a cluster without one, as TF's own checks allow). A 'ps' task is an
    error: spmd shards variables over the workers, it has no ps processes; so is
    a chief or worker of a cluster that lists 'ps' tasks (its program expects
    parameter servers that will not exist), with the same pointers to
    `spmd.ClusterCoordinator` and `spmd.DiLoCo`. An evaluator of such a cluster
    reads checkpoints only, and resolves as above.

    Args:
      text: the JSON, e.g. '{"cluster": {"worker": ["h0:2222", "h1:2222"]},
        "task": {"type": "worker", "index": 1}}'.

    Returns:
      The ClusterInfo of the task the JSON describes, with source "TF_CONFIG".

    Raises:
      ClusterError: naming the field that is malformed.
    """
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterError(
            message(
                f"{TF_CONFIG} must be a JSON object ({e.msg} at position {e.pos}).",
                received(**{TF_CONFIG: text}),
                "quote keys and strings with double quotes, e.g. json.dumps(config).",
            )
        ) from None
    jobs = _tf_cluster(config)
    task_type, index = _tf_task(config, jobs)
    if task_type == "evaluator":
        return ClusterInfo(0, 1, "evaluator", index, True, None, TF_CONFIG)
    chiefs = len(jobs["chief"])
    coordinator = (jobs["chief"] + jobs["worker"])[0]
    process_index = index if task_type == "chief" else chiefs + index
    count = chiefs + len(jobs["worker"])
    coordinator = coordinator if count > 1 else None
    return ClusterInfo(
        process_index, count, task_type, index, process_index == 0, coordinator, TF_CONFIG
    )
