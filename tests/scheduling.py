"""The parallel run's scheduler: xdist's `loadgroup`, made to finish after a worker crashes.

pytest-xdist 3.8's `LoadScopeScheduling` (which `loadgroup` is) hangs the run once a
worker dies (pytest-dev/pytest-xdist#1323, #1327, #1378): it puts every unit the dead
worker ever ran back on the queue, finished ones too, and sends them out as empty
batches, which nothing ever reports done; and it hands a replacement worker a single
test, which a worker does not start before it knows the next one. The run then waits
until CI's limit, every worker idle. Here a crash costs the test it happened in (xdist
reports it failed, with the worker's last words) and nothing else: the dead worker's
unfinished tests go first in line, the one it died in is not run again, and a worker
always holds two tests or knows that no more are coming. Work sent to a worker that
died while the run was still reading its last reports (its channel closed) stays
assigned to it, and goes back in line when the run learns of the death.
"""

from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling

__all__ = ["CrashSafeLoadGroupScheduling"]


class CrashSafeLoadGroupScheduling(LoadGroupScheduling):
    """`--dist loadgroup` that survives a worker's crash (see the module's docstring)."""

    def __init__(self, config, log=None) -> None:
        super().__init__(config, log)
        self._gone: set = set()  # workers found dead when work was sent, not yet removed

    def schedule(self) -> None:
        """xdist's first distribution, in the collection's order (tests/conftest.py puts the
        long poles first). xdist would hand out the units with the most tests first
        (`loadscopereorder`, on by default): a module run whole on one worker before the
        single tests that start processes, the benchmarks' minutes-long smoke runs then
        last, alone at the run's end."""
        self.config.option.loadscopereorder = False
        super().schedule()

    def remove_node(self, node) -> str | None:
        self._gone.discard(node)
        workload = self.assigned_work.pop(node)
        unfinished = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
        if not unfinished:
            return None
        crashed = next(n for unit in unfinished.values() for n, done in unit.items() if not done)
        unfinished[self._split_scope(crashed)][crashed] = True  # reported failed by xdist
        for scope, unit in reversed(unfinished.items()):
            if not all(unit.values()):
                self.workqueue[scope] = unit
                self.workqueue.move_to_end(scope, last=False)
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _assign_work_unit(self, node) -> None:
        while self.workqueue:
            scope, unit = next(iter(self.workqueue.items()))
            if not all(unit.values()):
                try:
                    super()._assign_work_unit(node)
                except OSError:  # it died: the unit, assigned, goes back in `remove_node`
                    self._gone.add(node)
                return
            del self.workqueue[scope]  # nothing left to run in it

    def _reschedule(self, node) -> None:
        if node.shutting_down or node in self._gone:
            return
        if self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
            self._assign_work_unit(node)
        while (
            self.workqueue
            and node not in self._gone
            and self._pending_of(self.assigned_work[node]) < 2
        ):
            self._assign_work_unit(node)  # a worker starts a test once it knows the next
        if not self.workqueue and node not in self._gone:
            node.shutdown()  # it runs what it holds, the last with no next test
