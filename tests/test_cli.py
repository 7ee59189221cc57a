"""Tests of the `spmd` command line: `spmd env`, usage errors."""

import importlib
import os
import subprocess
import sys

import pytest
from commands import ROOT, child_env, run_spmd

from spmd._src.cli import main as cli


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_env_prints_cluster_devices_and_strategies():
    proc = run_spmd("env", "--devices", "4", timeout=60)
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
    # As in a fresh process: an earlier test's spmd.initialize() is not this one's.
    monkeypatch.setattr(importlib.import_module("spmd._src.clusters.initialize"), "_INFO", None)
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
        (
            ["launch", "-n", "2", "--min-processes", "3", "--", "x"],
            "--min-processes: must be at most -n/--num-processes (2); received 3",
        ),
        (["env", "--strategy", "mirored"], "--strategy: must be one of default, mirrored,"),
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


# ------------------------------------------------------------------ a quick command line

_NO_JAX = """
import sys
from spmd._src.cli import main as cli
parser = cli.build_parser()
for argv in ({argvs}):
    try:
        parser.parse_args(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
heavy = sorted(m for m in ("jax", "jaxlib", "flax", "optax", "orbax", "numpy") if m in sys.modules)
print("heavy:", heavy)
"""


@pytest.mark.timeout(60)
def test_help_and_version_import_no_jax():
    """`spmd --help`, `spmd launch --help`, `spmd demo --help`, `spmd --version` build the
    parser and print without importing jax (what kept `spmd --help` over a second)."""
    argvs = '["--help"], ["launch", "--help"], ["demo", "--help"], ["env", "--help"], ["--version"]'
    proc = subprocess.run(
        [sys.executable, "-c", _NO_JAX.format(argvs=argvs)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "heavy: []" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_import_spmd_alone_imports_no_jax_and_names_resolve_on_use():
    code = (
        "import sys, spmd\n"
        "assert 'jax' not in sys.modules, 'import spmd imported jax'\n"
        "assert spmd.MirroredStrategy.__name__ == 'MirroredStrategy'\n"
        "assert 'jax' in sys.modules\n"
        "print(sorted(set(spmd.__all__) - set(dir(spmd))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_version(capsys):
    import spmd

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"spmd {spmd.__version__}"


@pytest.mark.parametrize(
    "requested, replicas, batch",
    [(30, 8, 32), (32, 8, 32), (None, 8, 64), (None, 3, 66), (1, 4, 4)],
)
def test_demo_batch_size_rounds_up_to_the_replicas_as_its_help_says(requested, replicas, batch):
    from spmd._src.cli.demo_command import global_batch

    assert global_batch(requested, replicas) == batch


def test_demo_help_says_the_batch_is_rounded(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "the global batch (default 64); rounded up to a multiple of the replicas" in help_text


def test_strategy_names_are_read_as_by_name_reads_them():
    from spmd._src.cli.demo_command import strategy_name

    args = cli.build_parser().parse_args(["env", "--strategy", "MirroredStrategy"])
    assert args.strategy == ["mirrored"]
    assert strategy_name("parameter-server-strategy") == "parameter_server"


def test_demo_strategy_names_are_the_strategies_names():
    from spmd._src.cli.demo_command import STRATEGY_NAMES
    from spmd._src.strategy import strategies

    assert STRATEGY_NAMES == strategies.NAMES


def test_a_nested_error_prints_real_newlines_once(monkeypatch, capsys):
    from spmd._src.errors import ConfigurationError, message, received

    inner = message("inner expected.", received(x=2), "fix the inner thing.")

    def failing(args):
        raise ConfigurationError(message("outer expected.", received(error=inner), "fix it."))

    monkeypatch.setattr(cli, "_run_env", failing)
    assert cli.main(["env"]) == 1
    err = capsys.readouterr().err
    assert "\\n" not in err, err
    assert err.count("inner expected.") == 1 and err.count("spmd env: error:") == 1, err
    assert err.splitlines() == [
        "spmd env: error: outer expected.",
        "Received: error=",
        "    inner expected.",
        "    Received: x=2",
        "    To fix: fix the inner thing.",
        "To fix: fix it.",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("JAX_PLATFORMS", "tpu", "JAX_PLATFORMS=tpu names the platforms JAX must start"),
        ("XLA_FLAGS", "--xla_bogus_flag=1", "unknown='--xla_bogus_flag=1'"),
        *(
            ("XLA_FLAGS", f"--xla_force_host_platform_device_count={v}", f"value='{v}'")
            for v in ("abc", "0")
        ),
        (
            "XLA_FLAGS",
            "--xla_cpu_enable_fast_math=maybe",
            "flag='--xla_cpu_enable_fast_math', value='maybe'",
        ),
    ],
)
def test_spmd_env_with_a_backend_that_cannot_start_prints_one_clear_message(variable, value, named):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(ROOT)
    env[variable] = value
    done = run_spmd("env", env=env, timeout=300)
    assert done.returncode == 1
    assert done.stderr.startswith("spmd env: error: "), done.stderr[-3000:]
    assert done.stderr.count("spmd env: error:") == 1 and named in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "To fix: " in done.stderr
    assert len(done.stderr.splitlines()) == 3, done.stderr  # expected, received, fix
    assert done.stdout == ""
