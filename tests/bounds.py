"""Time bounds of the tests that wait for processes, with the headroom a parallel run needs.

A bound is written for one test running alone on an idle 2-core machine. When the
suite runs in parallel (pytest-xdist: PYTEST_XDIST_WORKER_COUNT workers sharing the
cores) every process a test starts gets a share of the cores, so each bounded wait
is given `headroom()` times its seconds: what it proves (the wait ends, the fault is
named, nothing hangs) is unchanged. SPMD_TEST_HEADROOM sets the factor.
"""

from __future__ import annotations

import os

__all__ = ["bound", "headroom"]


def headroom() -> float:
    """The factor every bounded wait of a test is given: 1 alone; under xdist, the cores a
    test was written for (2) over those each worker has, e.g. 3 for 3 workers on 2 cores."""
    asked = os.environ.get("SPMD_TEST_HEADROOM")
    if asked:
        return max(1.0, float(asked))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1.0, 2 * workers / len(os.sched_getaffinity(0)))


def bound(seconds: float) -> float:
    """`seconds`, a wait's bound on an idle machine, with this run's headroom."""
    return seconds * headroom()
