"""Preemption: a notice on any process becomes one step at which every process saves and stops."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np
from jax.experimental import multihost_utils

from spmd._src.clusters import distributed
from spmd._src.clusters.jax_state import coordination_client, preemption_sync_manager
from spmd._src.clusters.launch_results import PREEMPTED_EXIT_CODE
from spmd._src.errors import ConfigurationError, message, received
from spmd._src.validate import positive_int

__all__ = ["MODES", "Preempted", "PreemptionWatcher", "check_options", "jax_service_available", "open_watchers"]

Mode = Literal["auto", "jax", "signal", "off"]
MODES: tuple[str, ...] = ("auto", "signal", "jax", "off")
_log = logging.getLogger("spmd.checkpoint")


class Preempted(SystemExit):
    """Raised by `CheckpointManager.save` once the preemption checkpoint is committed.

    A `SystemExit` with code `PREEMPTED_EXIT_CODE` (42): left uncaught, the
    program runs its `finally` blocks and exits with that code, which tells
    `spmd launch` to restart the group without using up `--max-restarts`.
    `except Exception` does not catch it.

    Attributes:
      step: the step every process saved before stopping.
      directory: where the checkpoint is.
    """

    def __init__(self, step: int, directory: str = ""):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.directory = directory

    def __str__(self) -> str:
        return (
            f"preempted: every process saved step {self.step} in {self.directory}; "
            f"exiting with code {PREEMPTED_EXIT_CODE}"
        )


def jax_service_available() -> bool:
    """Whether JAX's preemption sync manager runs here (jax.distributed, service enabled)."""
    return coordination_client() is not None and preemption_sync_manager() is not None


class PreemptionWatcher:
    """Answers, at every step, whether all processes agreed to save and stop here.

    Two mechanisms:

    - "signal" (what "auto" picks): a Python SIGTERM handler sets a flag; with
      several processes they all-gather their flags every `check_every` steps
      (a 4-byte collective), and the first step where any flag is up is the
      agreed step, the same on every process by construction.
    - "jax": JAX's preemption sync manager alone (it runs under
      `jax.distributed`): its own SIGTERM handler, the coordination service
      spreads the notice and picks the step (the largest any process has
      reached, plus one). No per-step collective, but each process learns the
      step asynchronously: under load we saw one process ask at the agreed step
      before it had learned it, pass it, and the job hang. Use it only with
      steps much longer than the coordination service's round trips.

    "off" never answers True and installs nothing.

    A SIGTERM always ends the process within a bounded time, even while its
    main thread is blocked in a collective (where no Python handler runs): if
    the save and exit have not happened `grace_period` seconds after it, a
    thread ends the process with code 143 ("signal" mode: the interpreter's
    wakeup fd; "jax" mode: JAX's notifier records the notice in the
    coordination service, where spmd's peer watch sees it). Without a
    watcher, under `spmd.initialize()`, SIGTERM ends the process at once.

    Args:
      mode: "auto", "signal", "jax" or "off".
      check_every: in "signal" mode with several processes, agree every this
        many steps (a notice waits at most this many steps).
      grace_period: seconds after SIGTERM within which the save and exit must
        happen; then the process ends anyway.

    Raises:
      ConfigurationError: an unknown mode, or "jax" where its service is not running.
    """

    def __init__(
        self,
        mode: Mode = "auto",
        check_every: int = 1,
        grace_period: float = distributed.SIGTERM_GRACE,
    ):
        self.mode, self.check_every = check_options(mode, check_every)
        self.grace_period = float(grace_period)
        self.step: int | None = None  # where the processes agreed to stop, once they have
        self._notice = threading.Event()
        self._routed = False
        if self.mode != "off":
            _ROUTE.open(self)

    def reached(self, step: int, notices: list[bool] | None = None) -> bool:
        """Whether `step` is the agreed preemption step. Call it at every step, on every process.

        Args:
          step: the step just done.
          notices: every process's `noticed()`, when the caller has already
            gathered them ("signal" mode then needs no collective of its own).
        """
        if self.step is not None:
            return step == self.step
        if self.mode == "off":
            return False
        if self.mode == "jax":
            hit = bool(multihost_utils.reached_preemption_sync_point(step))
        elif notices is not None:
            hit = any(notices) and (len(notices) == 1 or step % self.check_every == 0)
        else:
            hit = self._agree(step)
        if hit:
            self.step = step
            _log.warning("preemption: every process stops after saving step %d", step)
        return hit

    def noticed(self) -> bool:
        """Whether this process has had a preemption notice ("signal" mode)."""
        return self._notice.is_set()

    def close(self) -> None:
        """Stops watching; the last watcher open puts back the SIGTERM handler that was there
        before it, and SIGTERM ends the process again."""
        _ROUTE.close(self)

    def _noticed_sigterm(self) -> None:
        self._notice.set()

    def _agree(self, step: int) -> bool:
        if jax.process_count() == 1:
            return self._notice.is_set()
        if step % self.check_every:
            return False
        flags = multihost_utils.process_allgather(np.int32(self._notice.is_set()))
        return bool(np.any(flags))


class _SigtermRoute:
    """The process's one SIGTERM handler and watchdog, shared by every watcher open in it.

    Several checkpoint managers may be open at once (two writers, a Trainer's callback
    beside the user's own) and closed in any order: each watcher registers here, a SIGTERM
    reaches every one of them, and the handler that was there before the first is put back
    when the last closes. Watchers are held weakly: one dropped without `close()` stops
    being told and no longer keeps the process's end pending; a SIGTERM that finds none
    left is handled as the handler from before would have (by default: the process ends).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._open: weakref.WeakSet[PreemptionWatcher] = weakref.WeakSet()
        self._previous: Any = None
        self._installed = False
        self._watchdog: _SigtermWatchdog | None = None

    def open(self, watcher: PreemptionWatcher) -> None:
        with self._lock:
            self._open.add(watcher)
            distributed.expect_save(self._grace())
            if watcher.mode != "signal":
                return
            if threading.current_thread() is not threading.main_thread():
                _log.warning("preemption: not the main thread, so no SIGTERM handler was installed")
                return
            watcher._routed = True
            if not self._installed:
                self._previous = signal.signal(signal.SIGTERM, self._on_signal)
                self._installed = True
            if self._watchdog is None:
                self._watchdog = _SigtermWatchdog(self._signal_grace)

    def close(self, watcher: PreemptionWatcher) -> None:
        with self._lock:
            if watcher not in self._open:
                return
            self._open.discard(watcher)
            watcher._routed = False
            distributed.expect_save(self._grace())
            if self._installed and not self._routed():
                self._uninstall()

    def watching(self) -> list[PreemptionWatcher]:
        """The watchers open in this process."""
        with self._lock:
            return list(self._open)

    def _routed(self) -> list[PreemptionWatcher]:
        return [w for w in self._open if w._routed]

    def _grace(self) -> float | None:
        graces = [w.grace_period for w in self._open]
        return max(graces) if graces else None

    def _signal_grace(self) -> float | None:
        """The grace a SIGTERM gives the watchers open now; None where none is."""
        with self._lock:
            graces = [w.grace_period for w in self._routed()]
        return max(graces) if graces else None

    def _uninstall(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == self._on_signal:  # not someone's since
                previous = self._previous
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            self._installed, self._previous = False, None

    def _on_signal(self, signum: int, frame: Any) -> None:
        watchers = self._routed()
        if not watchers:  # every one was dropped unclosed: as if none had been installed
            previous = self._previous
            with self._lock:
                self._uninstall()
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.raise_signal(signum)
            return
        print(sigterm_line(max(w.grace_period for w in watchers)), file=sys.stderr, flush=True)
        for watcher in watchers:
            watcher._noticed_sigterm()


class _SigtermWatchdog:
    """Ends the process some seconds after a SIGTERM, even while the main thread is blocked.

    A Python signal handler runs only when the main thread runs Python, never
    while it waits in a collective; but the interpreter's C-level handler
    writes the signal number to the wakeup fd at once, and a thread reads it.
    Not installed where something else (e.g. asyncio) owns the wakeup fd.
    `grace()` says how long the watchers open at the SIGTERM have (None: none
    is open, the process is left alone).
    """

    def __init__(self, grace: Callable[[], float | None]) -> None:
        self._grace = grace
        self._closed = threading.Event()
        self._reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._writer = writer
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        if previous != -1:  # someone else's: put it back, go without
            signal.set_wakeup_fd(previous)
            self._closed.set()
            return
        threading.Thread(target=self._run, name="spmd-sigterm-watchdog", daemon=True).start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._reader.recv(64)
            except OSError:
                return
            if not data:
                return
            grace = self._grace() if signal.SIGTERM in data else None
            if grace is not None and not self._closed.wait(grace):
                _end_after_grace(grace)

    def close(self) -> None:
        """Stops watching; a SIGTERM no longer ends the process after the grace."""
        if not self._closed.is_set():
            with contextlib.suppress(ValueError):  # not the main thread: leave it
                signal.set_wakeup_fd(-1)
        self._closed.set()
        self._writer.close()
        self._reader.close()


_ROUTE = _SigtermRoute()


def open_watchers() -> list[PreemptionWatcher]:
    """The preemption watchers open in this process (each open checkpoint writer has one)."""
    return _ROUTE.watching()


def check_options(mode: str, check_every: int) -> tuple[str, int]:
    """The mode a watcher runs in ("auto" resolved) and its `check_every`, checked.

    Raises:
      ConfigurationError: an unknown mode, "jax" where its service is not running, or a
        `check_every` that is not a positive integer.
    """
    return _resolve_mode(mode), _positive(check_every, "preemption_check_steps")


def sigterm_line(grace: float) -> str:
    """What a process says when SIGTERM comes while a checkpoint manager is open: what will
    happen, which depends on whether the program makes its next save (a process stopped by a
    launcher after a peer failed, or blocked in a collective, never does)."""
    return (
        "spmd: SIGTERM caught (a preemption's notice, or a launcher stopping the job, as "
        "spmd launch does once a peer failed); at the next CheckpointManager.save() that "
        "every process "
        f"reaches, that step is saved and the process exits with code {PREEMPTED_EXIT_CODE}; "
        f"if no such save comes within {grace:g} s (grace_period), it ends with code 143, "
        "saving nothing."
    )


def _end_after_grace(grace: float) -> None:
    """Ends the process: SIGTERM came `grace` seconds ago and the save has not ended it.

    The other processes are told first, so that they end too rather than wait for it.
    """
    distributed.report_failure(f"SIGTERM {grace:g} s ago and no save ended it")
    print(
        f"spmd: SIGTERM {grace:g} s ago and no save ended the process; ending it (code 143).",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signal.SIGTERM)


def _resolve_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigurationError(
            message(
                f"preemption is one of {MODES}.",
                received(preemption=mode),
                'leave it at "auto" unless you need a specific mechanism.',
            )
        )
    if mode == "jax" and not jax_service_available():
        raise ConfigurationError(
            message(
                'preemption="jax" needs JAX\'s preemption sync manager, which runs only under '
                "jax.distributed with jax_enable_preemption_service on.",
                received(preemption=mode, process_count=jax.process_count()),
                'use preemption="auto" (a SIGTERM handler and a per-step agreement), or start '
                "the job with spmd.initialize() on several processes.",
            )
        )
    return "signal" if mode == "auto" else mode


def _positive(value: Any, name: str) -> int:
    return positive_int(value, name, fix=f"pass {name}=1.")
