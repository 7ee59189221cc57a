"""Tests of spmd._src.clusters.launch and spmd.testing: real local processes, loopback only, bounded."""

import json
import re
import sys
import time
from pathlib import Path

import pytest
from commands import child_env, run_program

from spmd._src.cli import main as cli
from spmd._src.clusters.launch import PREEMPTED_EXIT_CODE, TIMEOUT_EXIT_CODE, launch, process_env
from spmd._src.clusters.resolvers.tf_config import TfConfigResolver
from spmd._src.errors import ConfigurationError, LaunchError
from spmd.testing import run_processes

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multiprocess" / "psum_worker.py"
PY = sys.executable

pytestmark = pytest.mark.timeout(120)


@pytest.mark.multiprocess
def test_cli_launch_two_processes_psum_and_prefixed_output():
    argv = ["-m", "spmd", "launch", "-n", "2", "--devices-per-process", "2", "--timeout", "90"]
    proc = run_program([PY, *argv, "--", PY, str(WORKER)], child_env(), 100, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line]
    assert all(re.match(r"\[[01]\] ", line) for line in lines), lines
    for i in range(2):
        [line] = [line for line in lines if line.startswith(f"[{i}] RESULT ")]
        result = json.loads(line.split("RESULT ", 1)[1])
        assert result["info"]["source"] == "spmd launch"
        assert result["info"]["process_index"] == result["process_index"] == i
        assert result["process_count"] == 2 and result["device_count"] == 4
        assert result["psum"] == 6.0


BLOCKS_UNLESS_STOPPED = """
import os, sys, time
if os.environ["SPMD_PROCESS_ID"] == "1":
    print("process 1 fails", flush=True)
    sys.exit(3)
time.sleep(120)  # process 0 would hang forever
"""


@pytest.mark.multiprocess
def test_failure_stops_the_group_quickly_and_names_the_process(capsys):
    start = time.monotonic()
    code = cli.main(["launch", "-n", "2", "--", PY, "-c", BLOCKS_UNLESS_STOPPED])
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert code == 3
    assert elapsed < 15
    assert "[1] process 1 fails" in out
    assert "spmd launch: process 1 exited with code 3; stopped the other processes." in err


IGNORES_SIGTERM = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.environ["SPMD_PROCESS_ID"] == "0":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


@pytest.mark.multiprocess
def test_signal_reported_and_sigterm_ignorers_killed(capsys):
    start = time.monotonic()
    code = launch([PY, "-c", IGNORES_SIGTERM], 2, grace_period=1.0)
    assert time.monotonic() - start < 15
    assert code == 128 + 9
    assert "process 0 was killed by SIGKILL" in capsys.readouterr().err


FAILS_ON_FIRST_ATTEMPT = """
import os, sys
attempt, index = os.environ["SPMD_RESTART_COUNT"], os.environ["SPMD_PROCESS_ID"]
print("attempt", attempt, "at", os.environ["SPMD_COORDINATOR_ADDRESS"])
sys.exit(5 if attempt == "0" and index == "0" else 0)
"""


@pytest.mark.multiprocess
def test_max_restarts_restarts_the_group_on_a_new_port(capsys):
    code = cli.main(
        ["launch", "-n", "2", "--max-restarts", "1", "--", PY, "-c", FAILS_ON_FIRST_ATTEMPT]
    )
    out, err = capsys.readouterr()
    assert code == 0
    assert "process 0 exited with code 5" in err
    assert "restarting all 2 processes (restart 1 of 1)" in err
    # Process 0 prints before failing; process 1 may be stopped before it prints.
    seen = set(re.findall(r"\[0\] attempt (\d) at (\S+)", out))
    assert {attempt for attempt, _ in seen} == {"0", "1"}
    assert len({address for _, address in seen}) == 2  # a fresh port per attempt


@pytest.mark.multiprocess
def test_without_restarts_a_failure_is_final(capsys):
    code = launch([PY, "-c", FAILS_ON_FIRST_ATTEMPT], 2)
    assert code == 5
    assert "giving up: no restarts left (max_restarts=0)" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_preemption_restarts_without_using_max_restarts(capsys):
    preempted = FAILS_ON_FIRST_ATTEMPT.replace("5 if", f"{PREEMPTED_EXIT_CODE} if")
    code = launch([PY, "-c", preempted], 2, max_restarts=0)
    err = capsys.readouterr().err
    assert code == 0
    assert f"process 0 was preempted (exit code {PREEMPTED_EXIT_CODE})" in err
    assert "restarting all 2 processes (preemption 1 of 10)" in err


@pytest.mark.multiprocess
def test_timeout_stops_every_process(capsys):
    start = time.monotonic()
    code = launch([PY, "-c", "import time; time.sleep(120)"], 2, timeout=1.0)
    assert time.monotonic() - start < 10
    assert code == TIMEOUT_EXIT_CODE
    assert "timed out after 1 s" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_processes": 0}, "num_processes"),
        ({"devices_per_process": 0}, "devices_per_process"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"command": []}, "command"),
        ({"command": ["/nonexistent/program"]}, "command"),
    ],
)
def test_launch_arguments_checked(kwargs, name):
    args = {"command": [PY, "-c", "pass"], "num_processes": 2, **kwargs}
    with pytest.raises(ConfigurationError, match=f"Received: {name}="):
        launch(**args)


def test_process_env_contract():
    base = {"TF_CONFIG": "{}", "SPMD_DEVICES_PER_PROCESS": "9", "HOME": "/h"}
    env = process_env(base, 1, 2, "127.0.0.1:9", None, 3)
    assert "TF_CONFIG" not in env and "SPMD_DEVICES_PER_PROCESS" not in env
    assert env["HOME"] == "/h" and env["PYTHONUNBUFFERED"] == "1"
    assert {k: v for k, v in env.items() if k.startswith("SPMD_")} == {
        "SPMD_COORDINATOR_ADDRESS": "127.0.0.1:9",
        "SPMD_NUM_PROCESSES": "2",
        "SPMD_PROCESS_ID": "1",
        "SPMD_RESTART_COUNT": "3",
    }
    assert process_env(base, 0, 2, "h:1", 4, 0)["SPMD_DEVICES_PER_PROCESS"] == "4"


def test_each_launched_process_gets_a_tf_config_with_its_task_index(monkeypatch):
    base = {"TF_CONFIG": '{"cluster": {"worker": ["other:1"]}}', "HOME": "/h"}
    workers = ["127.0.0.1:9", "127.0.0.1:10"]
    env = process_env(base, 1, 2, "127.0.0.1:9", None, 0, workers)
    assert json.loads(env["TF_CONFIG"]) == {
        "cluster": {"worker": workers},
        "task": {"type": "worker", "index": 1},
    }
    # spmd resolves from SPMD_* while TF_CONFIG is the launcher's; one the program sets wins
    for name in ("TF_CONFIG", "SPMD_LAUNCH_TF_CONFIG", *(k for k in env if k.startswith("SPMD_"))):
        monkeypatch.setenv(name, env[name])
    assert not TfConfigResolver().is_present()
    monkeypatch.setenv(
        "TF_CONFIG",
        '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"index": 1, "type": "worker"}}',
    )
    assert TfConfigResolver().is_present()


@pytest.mark.multiprocess
def test_a_launched_tf_script_reads_its_task_index_from_tf_config():
    code = (
        "import json, os, spmd; spmd.initialize(); c = json.loads(os.environ['TF_CONFIG']); "
        "print('task', c['task']['index'], len(c['cluster']['worker']), "
        "spmd.cluster().process_index, spmd.cluster().source)"
    )
    results = run_processes(code, 2, devices_per_process=1, timeout=120)
    lines = [next(x for x in r.stdout.splitlines() if x.startswith("task")) for r in results]
    assert lines == ["task 0 2 0 spmd launch", "task 1 2 1 spmd launch"]


@pytest.mark.multiprocess
def test_run_processes_captures_each_process():
    code = "import os, sys; i = os.environ['SPMD_PROCESS_ID']; print('out', i); print('err', i, file=sys.stderr)"
    results = run_processes(code, 3, devices_per_process=2, timeout=30)
    assert [r.process_index for r in results] == [0, 1, 2]
    assert [(r.returncode, r.stdout, r.stderr) for r in results] == [
        (0, f"out {i}\n", f"err {i}\n") for i in range(3)
    ]


@pytest.mark.multiprocess
def test_run_processes_check_quotes_the_failed_stderr():
    code = "import os, sys, time\nif os.environ['SPMD_PROCESS_ID'] == '1': sys.exit('boom')\ntime.sleep(60)"
    with pytest.raises(LaunchError, match=r"process 1 exited with code 1(.|\n)*boom"):
        run_processes(code, 2, timeout=30)
    results = run_processes(code, 2, timeout=30, check=False)
    assert results[1].returncode == 1 and results[0].returncode < 0  # 0 was stopped


RAISES_WHILE_PEER_WAITS = """
import spmd
spmd.initialize()
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
multihost_utils.sync_global_devices("joined")
if jax.process_index() == 1:
    raise RuntimeError("process 1 broke")
multihost_utils.sync_global_devices("never reached by process 1")  # process 0 waits here
"""


@pytest.mark.multiprocess
def test_an_exception_in_one_jax_process_ends_the_group_promptly(capsys):
    """Without spmd's hook the raising process would sit in jax.distributed's shutdown barrier."""
    start = time.monotonic()
    code = launch(
        [PY, "-c", RAISES_WHILE_PEER_WAITS], 2, devices_per_process=1, env=child_env(), timeout=100
    )
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert code == 1 and elapsed < 60, (code, elapsed)
    assert "RuntimeError: process 1 broke" in out + err
    assert "process 1 exited with code 1" in err


def test_a_malformed_restart_count_names_the_variable(monkeypatch):
    from spmd._src.clusters.launch import restart_count

    monkeypatch.setenv("SPMD_RESTART_COUNT", "abc")
    with pytest.raises(ConfigurationError, match="SPMD_RESTART_COUNT=.abc."):
        restart_count()
    monkeypatch.setenv("SPMD_RESTART_COUNT", "2")
    assert restart_count() == 2


def test_a_launched_process_ended_by_a_configuration_error_is_marked_for_code_78(
    monkeypatch, capsys
):
    """The hook spmd.initialize installs under spmd launch: the traceback prints as before,
    and the error's kind is kept for the exit handler (which exits 78); other errors are not."""
    import sys

    from spmd._src.clusters import configuration_exit

    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda *error: printed.append(error[0]))
    monkeypatch.setattr(configuration_exit, "_RAISED", [])
    monkeypatch.setattr(configuration_exit.atexit, "register", lambda fn: None)
    configuration_exit.exit_78_on_configuration_errors()
    hook = sys.excepthook
    configuration_exit.exit_78_on_configuration_errors()  # once: not wrapped twice
    assert sys.excepthook is hook and configuration_exit.printing_hook(hook) is not hook
    hook(RuntimeError, RuntimeError("other"), None)
    assert configuration_exit._RAISED == []
    hook(ConfigurationError, ConfigurationError("SPMD_HANG_TIMEOUT='abc'"), None)
    assert printed == [RuntimeError, ConfigurationError]
    raised = configuration_exit._RAISED
    assert raised == [ConfigurationError], raised
