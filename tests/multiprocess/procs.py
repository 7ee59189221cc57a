"""Helpers of the tests that start processes: a clean child environment, a command run without
root's DAC override (so mode bits hold), and process liveness by PID."""

import os
import shutil
import time

from commands import child_env

__all__ = ["alive", "child_env", "wait_gone", "without_dac_override"]


def without_dac_override(command: list[str]) -> list[str]:
    """`command` run so that the mode bits hold for it, also as root (setpriv drops root's
    DAC override capabilities, as the permission tests do)."""
    if os.geteuid() != 0:
        return command
    assert shutil.which("setpriv"), "needs setpriv (util-linux) to drop root's DAC override"
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", *command]


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
