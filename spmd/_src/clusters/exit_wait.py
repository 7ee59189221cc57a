"""The end of a program: a process waits for its peers to reach theirs, and fails only on a deadlock.

A process at the end of its program waits for nobody. A peer that still runs
its own code there (the chief exports the model, uploads it, writes a report)
is left to finish, bounded only by what the user set (`spmd launch --timeout`,
the scheduler's limit); the hang watch runs on meanwhile, so a peer killed or
frozen is still named. The wait fails, naming this process as the one that
ended early, only where a peer waits for it:

- a peer waits in a step call that this process never makes (its count of
  steps whose mesh spans several processes is past this one's final count):
  a collective that cannot finish, seen in two of its records in a row;
- a peer waits in JAX, with no step call, for `exit_timeout` seconds since
  this process reached its end: most likely a collective outside a step
  (`multihost_utils.process_allgather`, a sync) that this one never joins; a
  computation of the peer's own that runs that long is taken for one too.

The hang watch's records (`spmd._src.clusters.hang_watch`) tell all of this;
no collective and no barrier is entered before every process has ended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from spmd._src.clusters.hang_watch import Record

__all__ = ["ExitWait"]

_FIX = (
    "Every process must make the same collective calls (no `if is_chief: return` before "
    "a collective); work of one process alone (an export, an upload) may follow them, on "
    "arrays of its own (jax.device_get a replicated state first)."
)


@dataclasses.dataclass
class ExitWait:
    """One ended process's view of its peers, look after look.

    Attributes:
      index: this process's index.
      count: the process count.
      shared: this process's final count of steps spanning several processes.
      timeout: `exit_timeout`: seconds a peer may wait in JAX, with no step call,
        once this process ended.
    """

    index: int
    count: int
    shared: int
    timeout: float
    seen: dict[int, tuple[int, int, float]] = dataclasses.field(default_factory=dict)

    def look(self, now: float, records: Mapping[int, Record]) -> str | None:
        """Why this process must fail (a peer waits for it), or None: wait on.

        `records`: every process's last record; `seen` keeps, for each peer
        found waiting, (its record's seq, its shared step count, since when).
        """
        for index in range(self.count):
            r = records.get(index)
            if index == self.index or r is None or r.done or not r.waiting:
                self.seen.pop(index, None)
                continue
            seq, shared, since = self.seen.get(index, (r.seq, r.shared, now))
            if shared != r.shared:
                seq, since = r.seq, now
            self.seen[index] = (seq, r.shared, since)
            if r.shared > self.shared and seq != r.seq:
                return self._in_a_step(index, r)
            if r.shared == self.shared and now - since >= self.timeout:
                return self._in_jax(index, now - since)
        return None

    def done(self, records: Mapping[int, Record]) -> bool:
        """Whether every process has reached its end."""
        return all(records.get(i) is not None and records[i].done for i in range(self.count))

    def _in_a_step(self, peer: int, r: Record) -> str:
        return (
            f"process {self.index} reached the end of its program after {self.shared} step "
            f"call(s) spanning the processes, but process {peer} waits for it in a collective "
            f"of its step call {r.shared}, which this one never makes. " + _FIX
        )

    def _in_jax(self, peer: int, waited: float) -> str:
        return (
            f"process {self.index} reached the end of its program, and process {peer} has "
            f"waited in JAX since, {waited:.0f} s (exit_timeout={self.timeout:g} s), with no "
            "step call: most likely in a collective outside a step (process_allgather, a "
            "sync, a computation on arrays that span the processes) that this one never "
            "joins. " + _FIX
        )
