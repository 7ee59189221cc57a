"""Helpers of the multi-process tests: a clean child environment and process liveness by PID."""

import time

from commands import child_env

__all__ = ["alive", "child_env", "wait_gone"]


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    """Waits up to `seconds` for every pid to end; returns those still alive."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
