"""Preemption notices exchanged between a writer's processes: one barrier a step, nothing kept.

A SIGTERM reaches some processes, not all; every process must still stop at
the same step. At a step where they look (every `preemption_check_steps`),
a process that had a notice posts it (once, with the step at which it posts)
before the barrier of that step; after the barrier each reads the notices
posted: the same set on every process, since each was posted before its
poster reached the barrier, and one posted later (at a later step) names a
later step. A step costs each process the barrier and one listing of the
notices (empty while there are none): its reply does not grow with the
process count, and no key is set per step. A notice's key is deleted when its
writer closes.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax

from spmd._src.clusters.jax_state import coordination_client
from spmd._src.errors import CheckpointError, message, received

__all__ = ["NoticeBoard"]

_boards = itertools.count()  # the writers opened by this process, in order: alike on every one


class NoticeBoard:
    """One writer's preemption notices, exchanged at the steps where its processes look."""

    def __init__(self, timeout: float):
        """A board whose barrier waits at most `timeout` seconds for every process."""
        self._key = f"spmd/_src/checkpoint/notices/{next(_boards)}"
        self._timeout = timeout
        self._posted = False

    def exchange(self, step: int, noticed: bool) -> list[bool]:
        """Every process's notice as of `step` (this one's is `noticed`); every process calls
        it at the same steps.

        Raises:
          CheckpointError: not every process reached `step` within the timeout.
        """
        if jax.process_count() == 1:
            return [noticed]
        client, me = coordination_client(), jax.process_index()
        if noticed and not self._posted:
            client.key_value_set(f"{self._key}/{me}", str(step))
            self._posted = True
        try:
            client.wait_at_barrier(self._key, max(1, int(self._timeout * 1000)))
        except Exception as error:  # the client's error for a barrier that timed out or failed
            raise _not_all(step, self._timeout, error) from error
        flags = [False] * jax.process_count()
        for key, posted_at in client.key_value_dir_get(f"{self._key}/"):
            flags[int(key.rsplit("/", 1)[1])] = int(posted_at) <= step
        return flags

    def close(self) -> None:
        """Deletes this process's notice, if it posted one (every process read it: they
        saved the step it stopped them at together)."""
        if self._posted and (client := coordination_client()) is not None:
            client.key_value_delete(f"{self._key}/{jax.process_index()}")
            self._posted = False


def _not_all(step: int, timeout: float, error: Any) -> CheckpointError:
    return CheckpointError(
        message(
            f"Every process calls CheckpointManager.save(step={step}) within {timeout:g} s of "
            "the others (it is a collective: they look for preemption notices together).",
            received(step=step, coordination_timeout=timeout, error=str(error).splitlines()[0]),
            "call save on every process at every step with the same step numbers (never under "
            "`if is_chief:`); if some processes are only slow, raise coordination_timeout.",
        )
    )
