"""`spmd demo`: the main job reaches its held-out accuracy on every path; bad input is a clear error."""

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from commands import program_env, run_spmd

from spmd._src.cli import main as cli

ACCURACY = re.compile(r"accuracy +(\d+\.\d)% on (\d+) held-out examples \(target 95%: met\)")


def run_demo(*args: str, timeout: int = 300) -> str:
    """Runs `python -m spmd demo ARGS` as a user would; returns its stdout."""
    proc = run_spmd("demo", *args, env=program_env(), timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def held_out_accuracy(out: str) -> float:
    match = ACCURACY.search(out)
    assert match, out
    return float(match.group(1))


def write_npz(path: Path, omit: str | None = None, size: int = 12) -> Path:
    """A tiny MNIST-shaped npz: ten classes of noisy stroke patterns, uint8 images."""
    templates = np.random.default_rng(0).random((10, size, size)) > 0.7
    arrays = {}
    for split, n, seed in (("train", 512, 1), ("test", 128, 2)):
        rng = np.random.default_rng(seed)
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = templates[y] * 150 + rng.integers(0, 100, (n, size, size))
        arrays[f"x_{split}"], arrays[f"y_{split}"] = x.astype(np.uint8), y
    np.savez(path, **{k: v for k, v in arrays.items() if k != omit})
    return path


# ------------------------------------------------------------------ training runs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_reaches_95_percent_on_held_out_digits_and_saves_a_checkpoint(tmp_path):
    out = run_demo("--fast", "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert held_out_accuracy(out) >= 95.0
    assert "scikit-learn's handwritten digits, 8x8: 1438 to train, 359 held out" in out
    for line in (
        "spmd demo: summary",
        "  strategy   MirroredStrategy (mesh replica=8)",
        "  devices    8 cpu in 1 process",
        "  replicas   8 in sync",
        "  steps      92 (4 epochs, global batch 64)",
    ):
        assert line + "\n" in out, out
    assert "epoch 1/4: " in out  # not a terminal: one line per epoch instead of a bar
    assert re.search(r"  time       \d+\.\d s", out)
    assert (tmp_path / "ckpt" / "92").is_dir(), out
    assert f"  checkpoint {tmp_path / 'ckpt' / '92'}" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_with_parameter_server_strategy():
    out = run_demo("--strategy", "parameter_server", "--fast")
    assert "  strategy   ParameterServerStrategy (mesh ps0=2, ps1=2, ps2=2)\n" in out
    assert held_out_accuracy(out) >= 95.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_trains_on_an_mnist_npz(tmp_path):
    path = write_npz(tmp_path / "mnist.npz")
    out = run_demo("--data", str(path), "--epochs", "3", "--devices", "4")
    assert f"{path}, 12x12: 512 to train, 128 held out" in out
    assert "  devices    4 cpu in 1 process\n" in out
    assert held_out_accuracy(out) >= 95.0
    assert ACCURACY.search(out).group(2) == "128"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_demo_as_two_worker_processes():
    out = run_demo("--processes", "2", "--fast")
    assert "spmd demo: 2 worker processes of 4 devices each, through spmd launch" in out
    assert "[0]   strategy   MultiWorkerMirroredStrategy (mesh host=2, replica=4)\n" in out
    assert "[0]   devices    8 cpu in 2 processes\n" in out
    assert held_out_accuracy(out) >= 95.0
    assert "[1]   strategy" not in out  # only the chief reports


# ------------------------------------------------------------------ bad input


def demo_error(capsys, *args: str) -> str:
    """Runs `spmd demo ARGS` in this process for an input it must refuse before any training."""
    assert cli.main(["demo", *args]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("spmd demo: error: "), captured.err
    return captured.err


def test_unknown_strategy_lists_the_names(capsys):
    err = demo_error(capsys, "--strategy", "mirorred")
    assert "--strategy is one of ['default', 'mirrored'" in err
    assert "Received: strategy='mirorred'" in err


def test_missing_scikit_learn_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # as if not installed
    err = demo_error(capsys)
    assert 'pip install "spmd[demo]"' in err
    assert "spmd demo --data mnist.npz" in err


def test_npz_missing_a_key_names_it(capsys, tmp_path):
    err = demo_error(capsys, "--data", str(write_npz(tmp_path / "m.npz", omit="y_test")))
    assert "the file has no 'y_test' array" in err
    assert "Received: missing=['y_test'], keys=['x_test', 'x_train', 'y_train']" in err


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "no such file"),
        (b"not a zip file", "not a readable .npz file"),
        ({"x_train": np.zeros((4, 8)), "y_train": np.zeros(4, np.int64)}, "x_train must hold"),
        ({"x_train": np.zeros((4, 8, 8)), "y_train": np.zeros(3, np.int64)}, "y_train must hold"),
    ],
    ids=["missing", "garbage", "x-shape", "y-length"],
)
def test_malformed_npz_is_a_clear_error(capsys, tmp_path, content, expected):
    path = tmp_path / "bad.npz"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, dict):
        test = {"x_test": np.zeros((2, 8, 8)), "y_test": np.zeros(2, np.int64)}
        np.savez(path, **content, **test)
    err = demo_error(capsys, "--data", str(path))
    assert f"--data {path}: {expected}" in err


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--processes", "2", "--strategy", "mirrored"], "the strategy must span them all"),
        (["--processes", "3"], "--devices is split evenly among the --processes"),
    ],
)
def test_bad_process_options_fail_before_launching(capsys, args, expected):
    assert expected in demo_error(capsys, *args)


@pytest.mark.parametrize("args", [["--devices", "0"], ["--epochs", "x"], ["--bogus"]])
def test_usage_errors_exit_2(capsys, args):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", *args])
    assert exit_info.value.code == 2
    assert "usage: spmd" in capsys.readouterr().err


@pytest.mark.slow
def test_error_from_the_command_line_exits_1():
    proc = run_spmd("demo", "--strategy", "nope", env=program_env(), timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("spmd demo: error: --strategy is one of"), proc.stderr
