"""The keeper of `spmd launch`: stops every worker's process group when the launcher dies.

The kernel's kill-on-parent-death (PR_SET_PDEATHSIG) reaches only the
launcher's direct children; a worker's own children (a data loader, the
`python` under `bash -c '...'`) would outlive a SIGKILL of the launcher. So
the launcher starts this small program in a session of its own, holding the
read end of a pipe, and writes the process group of each worker it starts
into it, one number a line. When the pipe closes without the line "done"
(the launcher died, however), the keeper sends SIGTERM to every group,
SIGKILL after the grace to those still alive, and exits.

It runs as `python -I -S launch_keeper.py GRACE` and imports only the standard
library, so that it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable

__all__: list[str] = []

_POLL = 0.05  # seconds between looks at the groups
_DONE = "done"  # the launcher ended normally and stopped the groups itself


def group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a member that is not a zombie.

    On Linux /proc is read, since a zombie (which a container's PID 1 may never
    reap) still counts for `killpg(pgid, 0)`; elsewhere that is the answer.
    """
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def signal_groups(pgids: Iterable[int], sig: int) -> None:
    """Sends `sig` to every group; a group that is gone (ESRCH) is no error."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def stop_groups(pgids: Iterable[int], grace: float) -> None:
    """SIGTERM to every group, then SIGKILL to the groups still alive after `grace` s."""
    pgids = list(pgids)
    signal_groups(pgids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(group_alive(g) for g in pgids):
        time.sleep(_POLL)
    signal_groups([g for g in pgids if group_alive(g)], signal.SIGKILL)


class Keeper:
    """The launcher's end of the keeper: start it, tell it each group, release it."""

    def __init__(self, grace: float) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), repr(float(grace))],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # neither the terminal's signals nor ours reach it
            text=True,
        )

    def watch(self, pgid: int) -> None:
        """Adds a worker's process group to those stopped if the launcher dies."""
        with contextlib.suppress(OSError):  # the keeper is gone: PDEATHSIG still holds
            self._proc.stdin.write(f"{pgid}\n")
            self._proc.stdin.flush()

    def release(self) -> None:
        """The launcher stopped the groups itself: the keeper exits without a signal."""
        with contextlib.suppress(OSError):
            self._proc.stdin.write(f"{_DONE}\n")
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _main(grace: float) -> None:
    """Reads process groups until the pipe closes; stops them unless told "done"."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    pgids: list[int] = []
    for line in sys.stdin:
        if line.strip() == _DONE:
            return
        with contextlib.suppress(ValueError):
            pgids.append(int(line))
    stop_groups(pgids, grace)


if __name__ == "__main__":
    _main(float(sys.argv[1]))
