"""How `spmd launch` shows its processes' output, and names the first failure."""

from __future__ import annotations

import collections
import re
import sys
import threading

from spmd._src.clusters.distributed import FOLLOWER
from spmd._src.clusters.hang_watch import WAITED
from spmd._src.clusters.launch_results import CONFIGURATION_EXIT_CODE, NOT_ARRIVED_LINE, GroupResult

__all__ = ["FOLLOWER_LINE", "Printer", "gloo_connected", "not_worth_restarting", "summary"]

# What a process that ends because a peer failed says last, naming the peer.
FOLLOWER_LINE = re.compile(rf"^spmd: {FOLLOWER} (\d+) failed")
# What a process the hang watch named as behind says last (its stack follows).
HUNG_LINE = re.compile(r"^spmd: process \d+ (hung: .*)")
# The pieces of gloo's "[Gloo] Rank N is connected to K peer ranks. Expected number of
# connected peer ranks is : K", which the threads of one process (one per device) write at
# once, so that their pieces interleave: "[Gloo] Rank [Gloo] Rank 0 is connected to ...".
_GLOO_PIECES = re.compile(
    r"\[Gloo\] Rank |is connected to|peer ranks\.|Expected number of connected peer ranks is :"
    r"|\d+|\s+"
)
_TRACEBACK = "Traceback (most recent call last):"
_KEPT_LINES = 200  # lines of each process's stderr kept for the failure summary


class Printer:
    """Writes the processes' lines prefixed with their index, one whole line at a time.

    Keeps the last lines of each process's stderr, to say at the end what
    failed first, and hides gloo's "[Gloo] Rank N is connected" lines unless
    `verbose`.
    """

    def __init__(self, verbose: bool = False) -> None:
        self._lock = threading.Lock()
        self._verbose = verbose
        self._stderr: dict[int, collections.deque[str]] = {}

    def __call__(self, index: int, stream: str, line: str) -> None:
        if stream == "stderr":
            kept = self._stderr.setdefault(index, collections.deque(maxlen=_KEPT_LINES))
            kept.append(line.rstrip("\n"))
        if not self._verbose and gloo_connected(line):
            return
        out = sys.stdout if stream == "stdout" else sys.stderr
        text = f"[{index}] {line}" if line.endswith("\n") else f"[{index}] {line}\n"
        with self._lock:
            out.write(text)
            out.flush()

    def exception(self, index: int) -> str | None:
        """The last Python exception process `index` printed ("Type: message"), if any."""
        lines = list(self._stderr.get(index, ()))
        starts = [i for i, line in enumerate(lines) if line.startswith(_TRACEBACK)]
        if not starts:
            return None
        after = lines[starts[-1] + 1 :]
        last = [line for line in after if line and not line[0].isspace()]
        return last[0] if last else None

    def follows(self, index: int) -> int | None:
        """The peer process `index` said it ended for ("spmd: ending: process K failed")."""
        found = [FOLLOWER_LINE.match(line) for line in self._stderr.get(index, ())]
        return next((int(m[1]) for m in found if m), None)

    def hung(self, index: int) -> str | None:
        """What process `index` said when it ended as hung ("hung: no progress ..."), if it did."""
        found = [HUNG_LINE.match(line) for line in self._stderr.get(index, ())]
        return next((m[1] for m in found if m), None)

    def forget(self) -> None:
        """Drops what was kept, before a restart."""
        self._stderr.clear()


def gloo_connected(line: str) -> bool:
    """Whether `line` is made of gloo's "is connected" lines, whole or in interleaved pieces."""
    return "is connected to" in line and not _GLOO_PIECES.sub("", line)


def summary(result: GroupResult, printer: Printer) -> str | None:
    """One paragraph on the first failure: process, exception type and message.

    A process that failed because others never reached a collective (its error
    starts "process(es) [K] did not reach ...") is not at fault: those are named.
    """
    if not result.failed:
        return None
    first = result.processes[result.failed[0]]
    who, index = first.describe(), first.process_index
    leader = printer.follows(index)  # every failed process ended for a peer (stopped since)
    if leader is not None:
        who, index = f"process {leader} (process {index} ended because it failed)", leader
    hang = printer.hung(index)
    if hang is not None:
        return (
            f"first failure: process {index}, alive but {hang.split('; its main thread')[0]}; "
            + (
                "its stack is above. The other processes waited for it and ended with it."
                if WAITED in hang
                else "each process named prints its stack above; the others ended with them."
            )
        )
    exception = printer.exception(index)
    what = f"raised {exception}" if exception else "printed no Python exception"
    absent = NOT_ARRIVED_LINE.search(exception or "")
    if absent is not None:
        hung = [int(k) for k in absent[1].split(",")]
        one = len(hung) == 1
        names = f"process {hung[0]}" if one else f"processes {hung}"
        return (
            f"first failure: {names}, alive but hung or slow (or never started): "
            f"{'it' if one else 'they'} never reached {absent[2]}, where process {index} "
            f"waited; process {index} then "
            f"{what}. Look at what {names} {'was' if one else 'were'} doing (the output above, "
            "py-spy dump)."
        )
    return (
        f"first failure: {who}; it {what}. The other processes' output "
        "after that (C++ check failures, collectives that lost a peer) follows from it."
    )


def not_worth_restarting(result: GroupResult, printer: Printer) -> str | None:
    """Why restarting the job cannot help, or None if it may.

    So when every process that failed on its own (not one that ended because a
    peer failed) raised spmd's ConfigurationError or BatchError
    (CONFIGURATION_EXIT_CODE): the same program at the same size raises it
    again. At another size it may not (a global batch that does not divide over
    these replicas may over others), which the message says rather than claim
    that no size can work.
    """
    own = [i for i in result.failed if printer.follows(i) is None]
    codes = {result.processes[i].returncode for i in own}
    if not own or codes != {CONFIGURATION_EXIT_CODE}:
        return None
    names = ", ".join(map(str, own))
    size = len(result.processes)
    return (
        f"not restarting: process {names} raised a configuration error (spmd's "
        f"ConfigurationError or BatchError, exit code {CONFIGURATION_EXIT_CODE}) at "
        f"{size} process{'es' if size != 1 else ''}, which a restart of the same program at "
        "this size raises again, so neither a restart nor a smaller job is tried; fix the "
        "program or its arguments (the error above says how). If it depends on the size (a "
        "global batch that does not divide over the replicas), launch again at a size where "
        "it divides."
    )
