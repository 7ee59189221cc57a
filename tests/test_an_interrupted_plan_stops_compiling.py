"""A plan stopped mid-way (Ctrl-C, or a caller that stops reading) drops the compiles still
queued instead of running every one of them first."""

import threading

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
