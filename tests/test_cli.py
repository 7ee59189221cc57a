"""Tests of the `spmd` command line: `spmd env`, usage errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmd.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """This environment without any cluster description, with spmd importable."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("SPMD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.timeout(60)
def test_env_prints_cluster_devices_and_strategies():
    proc = subprocess.run(
        [sys.executable, "-m", "spmd", "env", "--devices", "4"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for line in (
        "  process_index: 0",
        "  process_count: 1",
        "  is_chief: True",
        "  source: single process",
        "  local_device_count: 4",
        "  global devices: 4 (cpu 0-3)",
        "  mirrored: mesh {'replica': 4}, batch_axes ('replica',), num_replicas_in_sync 4, "
        "devices cpu 0-3",
    ):
        assert line + "\n" in out, out
    assert "  tpu: unavailable (" in out  # a constructor that raises: the reason, not a crash
    for name in (
        "default",
        "multi_worker_mirrored",
        "central_storage",
        "one_device",
        "parameter_server",
    ):
        assert f"  {name}: mesh " in out, out


def test_env_strategy_filter_and_malformed_tf_config_is_a_clean_error(monkeypatch, capsys):
    monkeypatch.setenv(
        "TF_CONFIG", '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 4}}'
    )
    assert cli.main(["env", "--strategy", "mirrored"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("spmd env: error: TF_CONFIG['task']['index'] must be")
    assert "Received: TF_CONFIG['task']['index']=4" in err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["frob"], "invalid choice: 'frob'"),
        (
            ["launch", "--", "python", "x.py"],
            "the following arguments are required: -n/--num-processes",
        ),
        (
            ["launch", "-n", "0", "--", "python"],
            "-n/--num-processes: must be an integer >= 1; received '0'",
        ),
        (["launch", "-n", "two", "--", "python"], "must be an integer >= 1; received 'two'"),
        (
            ["launch", "-n", "2", "--timeout", "0", "--", "x"],
            "--timeout: must be a number of seconds > 0",
        ),
        (
            ["launch", "-n", "2", "--max-restarts", "-1", "--", "x"],
            "--max-restarts: must be an integer >= 0",
        ),
        (["launch", "-n", "2", "--bogus", "--", "x"], "unrecognized arguments: --bogus"),
        (["launch", "-n", "2"], "give the program to run after --"),
        (["launch", "-n", "2", "--"], "give the program to run after --"),
        (["env", "--devices", "0"], "--devices: must be an integer >= 1"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, expected, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: spmd" in err and expected in err, err


def test_no_subcommand_prints_help(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "launch" in err and "env" in err


def test_launch_without_dashes_takes_the_rest_as_the_program():
    args = cli.build_parser().parse_args(["launch", "-n", "2", "python", "train.py", "--lr", "3"])
    assert args.program == ["python", "train.py", "--lr", "3"] and args.num_processes == 2
