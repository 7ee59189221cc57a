"""Tests of spmd._src.clusters: TF_CONFIG, explicit and launcher resolution, initialize()."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import spmd
from spmd._src.clusters.initialize import (
    ClusterInfo,
    parse_tf_config,
    resolve,
)
from spmd._src.errors import ClusterError

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multiprocess" / "psum_worker.py"
CLUSTER_VARS = (
    "TF_CONFIG",
    "SPMD_COORDINATOR_ADDRESS",
    "SPMD_NUM_PROCESSES",
    "SPMD_PROCESS_ID",
    "SPMD_DEVICES_PER_PROCESS",
    "SPMD_RESTART_COUNT",
    "SLURM_JOB_ID",
    "OMPI_MCA_orte_hnp_uri",
    "KUBERNETES_SERVICE_HOST",
)


def child_env(**extra: str) -> dict[str, str]:
    """This environment without any cluster description, spmd importable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, **extra}


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)


def tf_config(cluster, task_type="worker", index=0):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


# ------------------------------------------------------------------ TF_CONFIG


@pytest.mark.parametrize(
    "cluster, task_type, index, expected",
    [
        ({"worker": ["h0:1", "h1:2"]}, "worker", 0, (0, 2, True, "h0:1")),
        ({"worker": ["h0:1", "h1:2"]}, "worker", 1, (1, 2, False, "h0:1")),
        ({"chief": ["c:9"], "worker": ["h0:1", "h1:2"]}, "chief", 0, (0, 3, True, "c:9")),
        ({"chief": ["c:9"], "worker": ["h0:1", "h1:2"]}, "worker", 0, (1, 3, False, "c:9")),
        ({"chief": ["c:9"], "worker": ["h0:1", "h1:2"]}, "worker", 1, (2, 3, False, "c:9")),
        ({"worker": ["[::1]:1", "h1:2"]}, "worker", 1, (1, 2, False, "[::1]:1")),
        ({"worker": ["h0:1"]}, "worker", 0, (0, 1, True, None)),
    ],
)
def test_tf_config_training_group(cluster, task_type, index, expected):
    info = parse_tf_config(tf_config(cluster, task_type, index))
    got = (info.process_index, info.process_count, info.is_chief, info.coordinator_address)
    assert got == expected
    assert (info.task_type, info.task_index, info.source) == (task_type, index, "TF_CONFIG")


def test_tf_config_evaluator_is_its_own_group():
    info = parse_tf_config(tf_config({"worker": ["h0:1"], "evaluator": ["e:1"]}, "evaluator"))
    assert (info.process_index, info.process_count, info.task_type) == (0, 1, "evaluator")
    assert info.is_chief and info.coordinator_address is None


@pytest.mark.parametrize("index", [0, 1])
def test_tf_config_evaluator_whose_cluster_leaves_it_out_is_its_own_group(index):
    """TF's RunConfig ("evaluator is not part of training cluster") and Kubeflow's TFJob give
    the evaluator the training cluster only; TF's _validate_cluster_spec allows it."""
    training = {"chief": ["host0:2222"], "worker": ["host3:2222", "host4:2222"]}
    info = parse_tf_config(tf_config(training, "evaluator", index))
    assert (info.process_index, info.process_count, info.task_type) == (0, 1, "evaluator")
    assert (info.task_index, info.is_chief, info.coordinator_address) == (index, True, None)


T = "TF_CONFIG"
MALFORMED = {
    "not json": ("{cluster: 1}", T, "{cluster: 1}"),
    "missing cluster": ('{"task": {"type": "worker"}}', f"{T}['cluster']", None),
    "empty cluster": ('{"cluster": {}, "task": {}}', f"{T}['cluster']", {}),
    "missing task": ('{"cluster": {"worker": ["h:1"]}}', f"{T}['task']", None),
    "index out of range": (
        tf_config({"worker": ["h:1", "h:2"]}, index=2),
        f"{T}['task']['index']",
        2,
    ),
    "negative index": (tf_config({"worker": ["h:1"]}, index=-1), f"{T}['task']['index']", -1),
    "unknown task type": (
        tf_config({"worker": ["h:1"]}, "master"),
        f"{T}['task']['type']",
        "master",
    ),
    "ps task": (tf_config({"worker": ["h:1"], "ps": ["p:1"]}, "ps"), f"{T}['task']['type']", "ps"),
    "task type not in cluster": (
        tf_config({"worker": ["h:1"]}, "chief"),
        f"{T}['task']['type']",
        "chief",
    ),
    "no port": (tf_config({"worker": ["h:1", "h2"]}), f"{T}['cluster']['worker'][1]", "h2"),
    "port out of range": (
        tf_config({"worker": ["h:99999"]}),
        f"{T}['cluster']['worker'][0]",
        "h:99999",
    ),
    "empty host": (tf_config({"worker": [":80"]}), f"{T}['cluster']['worker'][0]", ":80"),
    "workers not a list": (tf_config({"worker": "h:1"}), f"{T}['cluster']['worker']", "h:1"),
    "two chiefs": (
        tf_config({"chief": ["a:1", "b:1"]}, "chief"),
        f"{T}['cluster']['chief']",
        ["a:1", "b:1"],
    ),
    "unknown job": (tf_config({"workers": ["h:1"]}), f"{T}['cluster'] jobs", ["workers"]),
}


@pytest.mark.parametrize("text, field, value", MALFORMED.values(), ids=MALFORMED.keys())
def test_tf_config_malformed_names_field_and_value(text, field, value):
    with pytest.raises(ClusterError) as e:
        parse_tf_config(text)
    assert f"Received: {field}={value!r}" in str(e.value)
    assert "To fix:" in str(e.value)


def test_tf_config_task_without_index_is_an_error_with_several_tasks():
    text = json.dumps({"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker"}})
    with pytest.raises(ClusterError) as e:
        parse_tf_config(text)
    assert "must say which of the 2 'worker' tasks" in str(e.value)
    assert "Received: TF_CONFIG['task']={'type': 'worker'}" in str(e.value)


def test_tf_config_task_without_index_is_the_only_task_of_its_type():
    text = json.dumps({"cluster": {"chief": ["c:1"], "worker": ["h:1"]}, "task": {"type": "chief"}})
    assert parse_tf_config(text).process_index == 0


def test_tf_config_ps_task_explains_sharded_variables():
    with pytest.raises(ClusterError, match="ParameterServerStrategy shards the variables"):
        parse_tf_config(tf_config({"worker": ["h:1"], "ps": ["p:1"]}, "ps"))


def test_tf_config_ps_task_points_at_the_coordinator_and_diloco():
    with pytest.raises(ClusterError) as caught:
        parse_tf_config(tf_config({"worker": ["h:1"], "ps": ["p:1"]}, "ps"))
    assert "spmd.ClusterCoordinator(strategy)" in str(caught.value)
    assert "spmd.DiLoCo(islands=..., sync_every=...)" in str(caught.value)


@pytest.mark.parametrize("task_type, index", [("worker", 1), ("chief", 0)])
def test_tf_config_training_task_of_a_cluster_with_ps_tasks_points_at_the_coordinator_and_diloco(
    task_type, index
):
    """Its program expects parameter servers to hold the variables: none will exist."""
    cluster = {"chief": ["c:1"], "worker": ["h:1", "h:2"], "ps": ["p:1", "p:2"]}
    with pytest.raises(ClusterError) as caught:
        parse_tf_config(tf_config(cluster, task_type, index))
    text = str(caught.value)
    assert "Received: TF_CONFIG['cluster']['ps']=['p:1', 'p:2']" in text
    assert "ParameterServerStrategy shards the variables" in text
    assert "spmd.ClusterCoordinator(strategy)" in text
    assert "spmd.DiLoCo(islands=..., sync_every=...)" in text


def test_tf_config_evaluator_of_a_cluster_with_ps_tasks_is_its_own_group():
    """A sidecar evaluator reads checkpoints only: the cluster's ps tasks are not its concern."""
    cluster = {"chief": ["c:1"], "worker": ["h:1"], "ps": ["p:1"], "evaluator": ["e:1"]}
    info = parse_tf_config(tf_config(cluster, "evaluator"))
    assert (info.process_index, info.process_count, info.task_type) == (0, 1, "evaluator")


# ------------------------------------------------------------------ resolution order


def test_no_cluster_is_single_process():
    assert resolve() == ClusterInfo(0, 1, "worker", 0, True, None, "single process")


def test_explicit_arguments_win_over_environment(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config({"worker": ["h0:1", "h1:2"]}, index=1))
    monkeypatch.setenv("SPMD_NUM_PROCESSES", "3")
    info = resolve("10.0.0.1:1234", 4, 3)
    assert (info.process_index, info.process_count, info.source) == (3, 4, "explicit")
    assert info.coordinator_address == "10.0.0.1:1234" and not info.is_chief


def test_tf_config_wins_over_launcher(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config({"worker": ["h0:1", "h1:2"]}, index=1))
    monkeypatch.setenv("SPMD_NUM_PROCESSES", "3")
    assert resolve().source == "TF_CONFIG"


def test_blank_tf_config_is_absent(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{}")
    assert resolve().source == "single process"


def test_launcher_environment(monkeypatch):
    monkeypatch.setenv("SPMD_COORDINATOR_ADDRESS", "127.0.0.1:5555")
    monkeypatch.setenv("SPMD_NUM_PROCESSES", "2")
    monkeypatch.setenv("SPMD_PROCESS_ID", "1")
    monkeypatch.setenv("SPMD_DEVICES_PER_PROCESS", "4")
    expected = ClusterInfo(1, 2, "worker", 1, False, "127.0.0.1:5555", "spmd launch", 4)
    assert resolve() == expected


@pytest.mark.parametrize(
    "env, field, value",
    [
        ({"SPMD_NUM_PROCESSES": "2", "SPMD_PROCESS_ID": "2"}, "SPMD_PROCESS_ID", 2),
        ({"SPMD_NUM_PROCESSES": "two", "SPMD_PROCESS_ID": "0"}, "SPMD_NUM_PROCESSES", "two"),
        ({"SPMD_NUM_PROCESSES": "2", "SPMD_PROCESS_ID": "0"}, "SPMD_COORDINATOR_ADDRESS", None),
        (
            {"SPMD_NUM_PROCESSES": "1", "SPMD_DEVICES_PER_PROCESS": "0"},
            "SPMD_DEVICES_PER_PROCESS",
            0,
        ),
    ],
)
def test_launcher_environment_malformed(monkeypatch, env, field, value):
    for name, v in env.items():
        monkeypatch.setenv(name, v)
    with pytest.raises(ClusterError, match="Received: .*" + field) as e:
        resolve()
    assert f"{field}={value!r}" in str(e.value)


@pytest.mark.parametrize(
    "kwargs, field, value",
    [
        ({"num_processes": 2, "process_id": 0}, "coordinator_address", None),
        ({"coordinator_address": "h:1"}, "num_processes", None),
        ({"num_processes": 2, "coordinator_address": "h:1"}, "process_id", None),
        ({"num_processes": 0, "process_id": 0}, "num_processes", 0),
        (
            {"num_processes": 2, "process_id": 0, "coordinator_address": "h"},
            "coordinator_address",
            "h",
        ),
        ({"local_device_count": -1}, "local_device_count", -1),
    ],
)
def test_explicit_arguments_malformed(kwargs, field, value):
    with pytest.raises(ClusterError) as e:
        resolve(**kwargs)
    assert f"{field}={value!r}" in str(e.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"heartbeat_timeout": 0}, "heartbeat_timeout=0"),  # every process dead at once: a hang
        ({"heartbeat_timeout": 0.5}, "heartbeat_timeout=0.5"),  # JAX's whole seconds: 0
        ({"heartbeat_timeout": -1}, "heartbeat_timeout=-1"),
        ({"initialization_timeout": -1}, "initialization_timeout=-1"),
        ({"initialization_timeout": "300"}, "initialization_timeout='300'"),
        ({"exit_timeout": -1}, "exit_timeout=-1"),
    ],
)
def test_initialize_s_timeouts_that_cannot_work_are_errors_before_joining(kwargs, field):
    with pytest.raises(ClusterError, match="To fix") as e:
        spmd.initialize(**kwargs)
    assert field in str(e.value)


def test_jax_detection_slurm(monkeypatch):
    slurm = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_NODELIST": "node[001-004]",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0",
    }
    for name, v in slurm.items():
        monkeypatch.setenv(name, v)
    info = resolve()
    assert (info.process_index, info.process_count, info.source) == (2, 4, "slurm")
    assert info.coordinator_address is None  # JAX picks it in jax.distributed.initialize()


def test_a_tf_config_evaluator_wins_over_slurms_variables(monkeypatch):
    """docs/multihost.md's Slurm evaluator step: srun sets SLURM_* for its one task (and the
    job's 3 nodes), and passes TF_CONFIG on; the task is the evaluator, a job of its own."""
    slurm = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_NODELIST": "n2",
        "SLURM_JOB_NODELIST": "n[0-2]",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    for name, v in slurm.items():
        monkeypatch.setenv(name, v)
    assert resolve().source == "slurm"  # without TF_CONFIG: a one-task Slurm step
    monkeypatch.setenv(
        "TF_CONFIG",
        '{"cluster": {"worker": ["n0:2222"], "evaluator": ["n2:2222"]}, '
        '"task": {"type": "evaluator"}}',  # the recipe's, without an index: the only evaluator
    )
    info = resolve()
    assert (info.task_type, info.task_index, info.source) == ("evaluator", 0, "TF_CONFIG")
    assert (info.process_index, info.process_count, info.is_chief) == (0, 1, True)
    assert info.coordinator_address is None  # no jax.distributed: it waits for no one


# ------------------------------------------------------------------ initialize, in fresh processes


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


SINGLE_PROCESS = """
import spmd, jax
info = spmd.initialize()
assert info.process_count == 1 and info.source == "single process", info
assert spmd.initialize() is info and spmd.cluster() is info
assert jax.process_count() == 1
assert spmd.initialize() is info  # after the backends started: nothing to change
try:
    spmd.initialize(num_processes=2, process_id=0, coordinator_address="127.0.0.1:1")
except spmd.InitializationError as e:
    assert "already called" in str(e), e
else:
    raise AssertionError("a conflicting second call must raise")
print("OK")
"""


@pytest.mark.slow
def test_initialize_single_process_is_a_noop_and_idempotent():
    proc = run_python(SINGLE_PROCESS)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"


EVALUATOR = """
import spmd, jax
info = spmd.initialize()
assert (info.task_type, info.process_count, info.coordinator_address) == ("evaluator", 1, None)
assert spmd.cluster() is info and info.is_chief
assert jax.process_count() == 1  # no jax.distributed: nothing waits for the workers
print("OK")
"""


@pytest.mark.slow
def test_a_tf_config_evaluator_is_a_one_process_job_even_under_the_launchers_variables():
    tf_config = json.dumps(
        {
            "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "evaluator": ["127.0.0.1:3"]},
            "task": {"type": "evaluator", "index": 0},
        }
    )
    launcher = {"SPMD_NUM_PROCESSES": "2", "SPMD_PROCESS_ID": "1"}
    proc = run_python(
        EVALUATOR, TF_CONFIG=tf_config, SPMD_COORDINATOR_ADDRESS="127.0.0.1:1", **launcher
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"


TOO_LATE = """
import spmd, jax
jax.devices()
for kwargs in ({"local_device_count": 3}, {}):
    try:
        spmd.initialize(**kwargs)
    except spmd.InitializationError as e:
        assert "before JAX starts its backends" in str(e) and "Received:" in str(e), e
        assert "call spmd.initialize() first thing" in str(e), e
        print("raised", list(kwargs))
    else:
        print("no error", list(kwargs))
"""


@pytest.mark.slow
def test_initialize_after_backend_start_is_an_error():
    launcher = {"SPMD_NUM_PROCESSES": "2", "SPMD_PROCESS_ID": "0"}
    proc = run_python(TOO_LATE, SPMD_COORDINATOR_ADDRESS="127.0.0.1:1", **launcher)
    assert proc.returncode == 0, proc.stderr
    # Both need a change: the first a CPU device count, the second jax.distributed.
    assert proc.stdout.split("\n")[:2] == ["raised ['local_device_count']", "raised []"]


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_processes_by_hand_with_tf_config_psum_over_gloo():
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "2"],
            env=child_env(TF_CONFIG=tf_config({"worker": workers}, "worker", i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, err
        result = json.loads(out.split("RESULT ", 1)[1])
        assert result["info"] == {
            "process_index": i,
            "process_count": 2,
            "task_type": "worker",
            "task_index": i,
            "is_chief": i == 0,
            "coordinator_address": workers[0],
            "source": "TF_CONFIG",
            "local_device_count": 2,
        }
        assert result["cluster_is_info"]
        assert (result["process_index"], result["process_count"]) == (i, 2)
        assert (result["device_count"], result["local_device_count"]) == (4, 2)
        assert result["psum"] == 1 + 1 + 2 + 2  # each device holds its process index + 1


# ------------------------------------------------------------------ misuse under spmd launch


@pytest.mark.parametrize(
    "task_type, index, expected",
    [("evaluator", 0, (0, 1, True)), ("worker", 1, (1, 2, False)), ("worker", 0, (0, 2, True))],
)
def test_cluster_before_initialize_is_the_tf_config_task(monkeypatch, task_type, index, expected):
    """TF's pattern: branch on the task type first (TFConfigClusterResolver().task_type), then
    start what the task needs; an evaluator branching on spmd.cluster() takes its branch."""
    import importlib

    import spmd

    monkeypatch.setattr(importlib.import_module("spmd._src.clusters.initialize"), "_INFO", None)
    cluster = {"worker": ["localhost:2222", "localhost:2223"], "evaluator": ["localhost:2224"]}
    monkeypatch.setenv("TF_CONFIG", tf_config(cluster, task_type, index))
    info = spmd.cluster()
    assert (info.task_type, info.task_index, info.source) == (task_type, index, "TF_CONFIG")
    assert (info.process_index, info.process_count, info.is_chief) == expected


@pytest.mark.cpu_mesh
@pytest.mark.parametrize("name", ["MirroredStrategy", "MultiWorkerMirroredStrategy"])
def test_a_strategy_under_spmd_launch_without_initialize_is_an_error(monkeypatch, name):
    import importlib

    import spmd
    from spmd._src.errors import InitializationError

    monkeypatch.setattr(importlib.import_module("spmd._src.clusters.initialize"), "_INFO", None)
    monkeypatch.setenv("SPMD_NUM_PROCESSES", "2")
    monkeypatch.setenv("SPMD_PROCESS_ID", "1")
    with pytest.raises(InitializationError, match=r"spmd.initialize\(\) was not called"):
        getattr(spmd, name)()
    monkeypatch.setenv("SPMD_NUM_PROCESSES", "1")  # one process: nothing to join
    assert getattr(spmd, name)().num_replicas_in_sync == 8


@pytest.mark.parametrize(
    "coordinator, bind",
    [
        ("127.0.0.1:1234", "127.0.0.1:1234"),
        ("localhost:1234", "localhost:1234"),
        ("[::1]:1234", "[::1]:1234"),
        ("192.0.2.7:1234", None),  # not an address of this machine (TEST-NET): every interface
        ("no-such-host.invalid:1234", None),
    ],
)
def test_coordinator_binds_only_where_it_is_reached(coordinator, bind, monkeypatch):
    from spmd._src.clusters.distributed import bind_address

    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    assert bind_address(coordinator) == bind
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "[::]:1")  # the user's choice wins
    assert bind_address(coordinator) is None


def test_a_local_address_binds_there():
    from spmd._src.clusters.distributed import bind_address

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this picks the outgoing interface
        ip = s.getsockname()[0]
    assert bind_address(f"{ip}:1234") == f"{ip}:1234"


@pytest.mark.parametrize("value", ["abc", "0", "-3"])
def test_an_invalid_simulated_device_count_in_xla_flags_names_the_flag(monkeypatch, value):
    """Checked before XLA reads it: XLA would print its usage text, or fail unnamed."""
    flags = f"--xla_cpu_use_thunk_runtime=true --xla_force_host_platform_device_count={value}"
    monkeypatch.setenv("XLA_FLAGS", flags)
    with pytest.raises(spmd.ConfigurationError) as caught:
        spmd.initialize()
    text = str(caught.value)
    assert "--xla_force_host_platform_device_count" in text and f"value='{value}'" in text
    assert "To fix: set e.g. XLA_FLAGS=--xla_force_host_platform_device_count=8" in text
