"""Preemption: a notice on any process becomes one step at which every process saves and stops."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
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

__all__ = [
    "MODES",
    "Preempted",
    "PreemptionWatcher",
    "check_options",
    "jax_service_available",
    "open_watchers",
]

Mode = Literal["auto", "jax", "signal", "off"]
MODES: tuple[str, ...] = ("auto", "signal", "jax", "off")
_log = logging.getLogger("spmd.checkpoint")
_LOOK_S = 0.5  # how often the watchdog looks whether the writers saved, after a SIGTERM
_NO_WRITER_WAIT_S = 2.0  # a SIGTERM with no writer open: the main thread's time to end it


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
        self._answered = False  # whether it saved the step agreed after a notice
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

    def answered(self) -> None:
        """Says that the step agreed after the notice is saved: the watchdog no longer
        ends the process on this watcher's account (the program stops when it chooses)."""
        self._answered = True

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

    Several checkpoint writers may be open at once and closed in any order, from any
    thread: each watcher registers here and a SIGTERM reaches every one of them. The
    handler that was in place when the route installed its own comes back when the last
    closes (one installed meanwhile by the program is left where it is, and taken as the
    one to put back if the route installs its own again). Only the main thread installs
    or removes anything: a close elsewhere leaves the handler and the watchdog in place,
    acting as if no writer were open, until the main thread next opens or closes one.
    Watchers are held weakly: one dropped without `close()` stops being told once
    collected. A SIGTERM that finds no writer open is handled as the handler from before
    would have (by default the process ends; the watchdog ends it even while the main
    thread is blocked in a collective).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._open: dict[int, weakref.ref[PreemptionWatcher]] = {}
        self._previous: Any = None  # the handler the route's replaced, while it is installed
        self._installed = False
        self._watchdog: _SigtermWatchdog | None = None

    def open(self, watcher: PreemptionWatcher) -> None:
        with self._lock:
            self._check_mix(watcher.mode)
            key = id(watcher)  # registered before the handler: a SIGTERM then reaches it
            self._open[key] = weakref.ref(watcher, lambda ref, key=key: self._collected(key, ref))
            try:
                if watcher.mode == "signal":
                    self._install()
            except BaseException:
                del self._open[key]
                raise
            finally:
                distributed.expect_save(self._grace())

    def close(self, watcher: PreemptionWatcher) -> None:
        with self._lock:
            if self._open.pop(id(watcher), None) is None:
                return
            distributed.expect_save(self._grace())
            if not self._routed():
                self._uninstall()

    def watching(self) -> list[PreemptionWatcher]:
        """The watchers open in this process."""
        with self._lock:
            return [w for ref in self._open.values() if (w := ref()) is not None]

    def _check_mix(self, mode: str) -> None:
        """JAX's preemption service catches SIGTERM in C++; spmd's handler would replace it."""
        modes = {w.mode for w in self.watching()}
        other = {"signal": "jax", "jax": "signal"}.get(mode)
        if other in modes:
            raise ConfigurationError(
                message(
                    'Every writer of a process uses one SIGTERM mechanism: "jax" (JAX\'s '
                    'preemption service, whose handler is C++) or "signal" (spmd\'s Python '
                    "handler, which would replace JAX's).",
                    received(preemption=mode, already_open=other),
                    f'open this writer with preemption="{other}" too (or "off"), or close the '
                    "other first.",
                )
            )

    def _collected(self, key: int, ref: weakref.ref) -> None:
        """A watcher dropped without `close()` was collected (any thread, any time)."""
        with self._lock:
            if self._open.get(key) is ref:
                del self._open[key]
            try:  # noqa: SIM105 (contextlib itself may be gone by then)
                distributed.expect_save(self._grace())
            except Exception:  # at the interpreter's exit, when this module's names are gone
                pass

    def _routed(self) -> list[PreemptionWatcher]:
        """The open watchers a SIGTERM reaches: those in "signal" mode."""
        return [w for w in self.watching() if w.mode == "signal"]

    def _grace(self) -> float | None:
        graces = [w.grace_period for w in self.watching()]
        return max(graces) if graces else None

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            if not self._installed:
                _log.warning(
                    "preemption: a writer opened outside the main thread, where no SIGTERM "
                    "handler can be installed: until one opens in the main thread, SIGTERM "
                    "does what it did before"
                )
            return
        made = None
        if self._watchdog is None:
            made = self._watchdog = _SigtermWatchdog(self._after_sigterm)
        current = signal.getsignal(signal.SIGTERM)
        if self._installed and current == self._on_signal:
            return
        try:
            signal.signal(signal.SIGTERM, self._on_signal)
        except BaseException:
            if made is not None:
                made.close()
                self._watchdog = None
            raise
        self._previous, self._installed = current, True  # the program's own, if it set one

    def _uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # left in place: the next open or close in the main thread finishes it
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        if self._installed and signal.getsignal(signal.SIGTERM) == self._on_signal:
            previous = self._previous
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            self._previous, self._installed = None, False
        # else the program's handler is in place now: kept, and `_previous` with it, so
        # that the route's handler, if put back, still forwards to the one from before

    def _on_signal(self, signum: int, frame: Any) -> None:
        with self._lock:
            watchers = self._routed()
            previous = self._previous
            if not watchers:  # none left open (dropped unclosed): as if none had been
                self._uninstall()
        if not watchers:
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.raise_signal(signum)  # the default: the process ends
            return
        print(sigterm_line(max(w.grace_period for w in watchers)), file=sys.stderr, flush=True)
        for watcher in watchers:
            watcher._noticed_sigterm()

    def _after_sigterm(self, closed: threading.Event) -> None:
        """The watchdog's answer to a SIGTERM: end the process once the writers open have
        had their grace without saving; or, with none open and SIGTERM's default action,
        end it when the main thread cannot (blocked in C, e.g. in a collective)."""
        started = time.monotonic()
        while True:
            with self._lock:
                routed = self._routed()
                previous = self._previous
            waiting = [w for w in routed if not w._answered]
            if routed and not waiting:
                return  # each writer saved its preemption step: stopping is the program's
            if not routed:
                if previous in (None, signal.SIG_DFL) and not closed.wait(_NO_WRITER_WAIT_S):
                    _end_after_sigterm(
                        "SIGTERM with no checkpoint writer open, and the main thread blocked"
                    )
                return
            grace = max(w.grace_period for w in waiting)
            left = grace - (time.monotonic() - started)
            if left <= 0:
                _end_after_sigterm(f"SIGTERM {grace:g} s ago and no save ended the process")
            if closed.wait(min(left, _LOOK_S)):
                return


class _SigtermWatchdog:
    """Acts on a SIGTERM even while the main thread is blocked (`act(closed)` does).

    A Python signal handler runs only when the main thread runs Python, never
    while it waits in a collective; but the interpreter's C-level handler
    writes the signal number to the wakeup fd at once, and a thread reads it.
    Not installed where something else (e.g. asyncio) owns the wakeup fd.
    Made and closed in the main thread only (the wakeup fd is the main thread's).
    """

    def __init__(self, act: Callable[[threading.Event], None]) -> None:
        self._act = act
        self._closed = threading.Event()
        self._reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._writer = writer
        self._owned = False
        try:
            previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except BaseException:
            self._closed.set()
            self._close_sockets()
            raise
        if previous != -1:  # someone else's: put it back, go without
            signal.set_wakeup_fd(previous)
            self._closed.set()
            return
        self._owned = True
        threading.Thread(target=self._run, name="spmd-sigterm-watchdog", daemon=True).start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self._act(self._closed)

    def close(self) -> None:
        """Stops watching (main thread only); the wakeup fd goes back to none, unless
        someone else set their own since."""
        if self._owned:
            previous = signal.set_wakeup_fd(-1)
            if previous not in (-1, self._writer.fileno()):
                signal.set_wakeup_fd(previous)  # someone else's since: theirs stays
            self._owned = False
        self._closed.set()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._writer.close()
        self._reader.close()


_ROUTE = _SigtermRoute()


def open_watchers() -> list[PreemptionWatcher]:
    """The preemption watchers open in this process (each open checkpoint writer has one)."""
    return _ROUTE.watching()


def check_options(mode: str, check_every: int) -> tuple[str, int]:
    """The mode a watcher runs in ("auto" resolved) and its `check_every`, checked.

    Raises:
      ConfigurationError: an unknown mode, "jax" where its service is not running, a
        mode that would mix with the other mechanism in this process (see
        `_SigtermRoute`), or a `check_every` that is not a positive integer.
    """
    resolved = _resolve_mode(mode)
    _ROUTE._check_mix(resolved)
    return resolved, _positive(check_every, "preemption_check_steps")


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


def _end_after_sigterm(why: str) -> None:
    """Ends the process with code 143 because of a SIGTERM, for the reason `why`.

    The other processes are told first, so that they end too rather than wait for it.
    """
    distributed.report_failure(why)
    print(f"spmd: {why}; ending the process (code 143).", file=sys.stderr, flush=True)
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
