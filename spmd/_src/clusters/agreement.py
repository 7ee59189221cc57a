"""Every process posts a record; process 0 compares them and posts the verdict.

No device collective: the records go through the key-value store of JAX's
coordination service, so a check can run in a background thread beside the
steps and a missing process is named within a timeout rather than hanging the
next collective. Input pipelines check each batch this way
(`spmd._src.data.prefetch.HostCheck`), and a step each batch signature that differs
from its previous call's.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import jax

from spmd._src.errors import BatchError, message, received

__all__ = ["Agreement", "Stopped"]

_POLL_S = 0.1  # how often a waiting thread looks at its stop event
_PASSED_POLL_S = 1.0  # how often a waiting thread asks whether the awaited process went on
# A process other than 0 waits this much longer than the timeout for process 0's
# verdict, so that process 0's own timeout (naming the missing process) reaches it.
_VERDICT_GRACE = 5.0


class Stopped(Exception):
    """The waiting side was told to stop (its `stop` event was set)."""


class Agreement:
    """Checks, record by record, that every process posted one and that they match.

    Each process posts a one-line record per index to the store; process 0
    reads them all (one directory read when they are there), compares them and
    posts a verdict, which every other process reads: about 2N requests per
    record over N processes, not N^2. A missing record, a mismatch or another
    process's failure becomes a `BatchError` on every process.

    Subclasses say what the records mean: `compare`, `missing_message` and
    `failed_message`; and, where they can tell, that a process went on past an
    index without posting (`passed_message`), which ends the wait at once.
    """

    def __init__(
        self,
        client: Any,
        timeout: float,
        prefix: str,
        *,
        process: int | None = None,
        count: int | None = None,
    ):
        """An agreement under `prefix` (the same on every process) among `count` processes
        (JAX's by default), this one being `process`."""
        self._client = client
        self._timeout = timeout
        self._prefix = prefix
        self._process = jax.process_index() if process is None else process
        self._count = jax.process_count() if count is None else count

    # -- what the records mean: the subclass's -------------------------------

    def compare(self, records: list[dict], index: int) -> None:
        """Raises a `BatchError` unless every process's record for `index` agrees."""
        if len({json.dumps(r, sort_keys=True) for r in records}) > 1:
            raise BatchError(
                message(
                    "Every process posts the same record.",
                    received(index=index, per_process=dict(enumerate(records))),
                    "run the same program on every process.",
                )
            )

    def missing_message(self, process: int, index: int) -> str:
        """The error when `process` posted nothing for `index` within the timeout."""
        return message(
            f"Every process posts each record within {self._timeout:g} s.",
            received(missing_process=process, index=index),
            "run the same program on every process.",
        )

    def failed_message(self, index: int, failed: dict[int, str]) -> str:
        """The error when processes posted a failure for `index` instead of a record."""
        return message(
            "Every process produces each record.",
            received(index=index, failed=failed),
            "read the failing process's error above (each process reports its own).",
        )

    def passed_message(self, process: int, index: int) -> str | None:
        """The error when `process` has gone on past `index` without posting a record,
        so that it never will; None while that cannot be told (the default: it is not)."""
        return None

    # -- the exchange ---------------------------------------------------------

    def agree(self, index: int, record: dict, stop: threading.Event | None = None) -> None:
        """Posts this process's record for `index` and checks it against every process's.

        Args:
          index: the record's index, counted the same way on every process.
          record: a JSON-able dict; {"error": str} says this process failed.
          stop: set to stop waiting (raises `Stopped`).

        Raises:
          BatchError: the processes disagree, one failed, or one did not post
            within the timeout.
        """
        stop = stop or threading.Event()
        self.post(index, record)
        if self._process:
            verdict = self._get(f"{self._prefix}/{index}/verdict", 0, index, stop, _VERDICT_GRACE)
            if verdict:
                raise BatchError(verdict)
            return
        try:
            records = self._records(index, stop)
            if index:  # everyone posted `index`, so has read the verdict of `index - 1`
                self._client.key_value_delete(f"{self._prefix}/{index - 1}")
            failed = {p: r["error"] for p, r in enumerate(records) if "error" in r}
            if failed:
                raise BatchError(self.failed_message(index, failed))
            self.compare(records, index)
        except BatchError as error:
            self._verdict(index, str(error))
            raise
        self._verdict(index, "")

    def post(self, index: int, record: dict) -> None:
        """Posts this process's record for `index` without waiting for the others.

        A failure posted by process 0, which gives the verdicts, is the verdict.
        """
        self._client.key_value_set(f"{self._prefix}/{index}/{self._process}", json.dumps(record))
        if self._process == 0 and "error" in record:
            self._verdict(index, self.failed_message(index, {0: record["error"]}))

    def _verdict(self, index: int, error: str) -> None:
        """Process 0 posts the outcome of `index`: "" when every process agrees, else the error."""
        self._client.key_value_set(f"{self._prefix}/{index}/verdict", json.dumps(error))

    def _records(self, index: int, stop: threading.Event) -> list[dict]:
        """Every process's record for `index` (process 0): a directory read, then a
        blocking read of each record still missing, then the directory again."""
        key, records = f"{self._prefix}/{index}", {}
        while True:
            for name, value in self._client.key_value_dir_get(f"{key}/"):
                process = name.rsplit("/", 1)[-1]
                if process.isdigit():
                    records[int(process)] = json.loads(value)
            missing = next((p for p in range(self._count) if p not in records), None)
            if missing is None:
                return [records[p] for p in range(self._count)]
            records[missing] = self._get(f"{key}/{missing}", missing, index, stop)

    def _get(self, key: str, process: int, index: int, stop: threading.Event, grace: float = 0.0):
        start = time.monotonic()
        deadline, asked = start + self._timeout + grace, start
        while True:
            try:
                return json.loads(self._client.blocking_key_value_get(key, int(_POLL_S * 1000)))
            except Exception:  # the client raises on its timeout; poll again
                if stop.is_set():
                    raise Stopped() from None
                now = time.monotonic()
                if now > deadline:
                    raise BatchError(self.missing_message(process, index)) from None
            if now - asked >= _PASSED_POLL_S:
                asked = now
                passed = self.passed_message(process, index)
                if passed is not None:
                    raise BatchError(passed)
