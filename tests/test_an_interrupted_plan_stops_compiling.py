"""A plan stopped mid-way (Ctrl-C, or a caller that stops reading) drops the compiles still
queued instead of running every one of them first."""

import threading

import pytest

from spmd._src import plan_compile


def test_stopping_a_plan_drops_the_queued_compiles(tmp_path):
    started = []
    release = threading.Event()

    def compile_fn(lowered):
        started.append(lowered)
        if lowered != 0:
            release.wait(2)  # a long compile, still running when the plan stops
        return RuntimeError("not compiled"), 0.0

    programs = [(i, f"key{i}") for i in range(8)]
    compiling = plan_compile.compile_programs(programs, 2, tmp_path, compile_fn=compile_fn)
    first, _, _ = next(compiling)
    compiling.close()  # what Ctrl-C in the caller's loop does
    release.set()
    assert first == 0
    assert len(started) <= 3  # program 0 and the two running when the plan stopped, no more
    assert list(tmp_path.iterdir()) == []  # errors are not cached; nothing half-written


def test_spmd_plan_interrupted_says_what_the_cache_holds_and_exits_130(
    tmp_path, monkeypatch, capsys
):
    from spmd._src import planning
    from spmd._src.cli import plan_command
    from spmd._src.cli.main import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def exit_now(code):  # os._exit would end the test process
        raise SystemExit(code)

    script = tmp_path / "train.py"
    script.write_text("def plan_inputs():\n    return (None, None, None)\n")
    monkeypatch.setattr(planning, "auto_strategy", interrupted)
    monkeypatch.setattr(plan_command.os, "_exit", exit_now)
    with pytest.raises(SystemExit) as info:
        main(["plan", "--cache-dir", str(tmp_path / "cache"), str(script)])
    assert info.value.code == 130
    assert "interrupted; the candidates compiled so far are in the cache" in capsys.readouterr().err
