"""The hang watch: each process publishes its step count; one that stops advancing is named.

A step pays one list-item increment (`STEPS[0] += 1` in `Step.__call__`, and in
`strategy.run` called outside a trace: a pmap port's step; a step whose mesh
spans several processes counts in `SHARED` too). A daemon thread of each
process samples that count and, every few seconds, publishes it in the
coordination service's key-value store with how long it has not moved and
whether the process waits in JAX or spmd (for a peer, in a collective) or runs
its own code (a JAX callback of its included: the runtime calls it from its
own thread while the main thread waits). Process 0 reads every record; when
some process has not advanced for its hang timeout, process 0 names the ones
someone waits for: of the processes not at their end, those with the lowest
step, the ones among them running their own code if some wait, else all of
them (nothing tells them apart, and each prints its stack), and only where
some peer waits for them or none has ended (a process at the end of its
program waits for nobody: a peer running its own code then, a chief's export,
is left to finish). Before its second step a process counts as stalled only
while it waits inside one of spmd's calls (its first step, a checkpoint's
restore) for that long: a process stuck before its first step (a loader's
first batch, a hung read) is named once its peers have waited for it, never a
job whose processes all work (load data, restore) for long. Time in JAX's
tracing, lowering and compilation is progress. A named process ends itself,
printing its main thread's stack and its other threads' innermost frames,
and tells the others, who end naming it. A peer whose record stops changing
(killed without a word, its machine lost, or its Python threads frozen) is
named by process 0 (process 0 itself by the first other process to notice),
before the coordination service's heartbeat timeout would abort everyone.
Each interval costs the service N writes, 2N reads and one directory read,
not N² reads. The watch runs on at a process's end, until its exit is agreed
(`spmd._src.clusters.exit_wait`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from spmd._src.errors import ConfigurationError, message, received

__all__ = [
    "HUNG",
    "MIN_HANG_TIMEOUT",
    "SHARED",
    "STEPS",
    "TIE",
    "WAITED",
    "Record",
    "Verdict",
    "behind",
    "check_hang_timeout",
    "named_stack",
    "progress",
    "records",
    "returned_from",
    "start",
]

STEPS = [0]  # steps taken here: Step and IslandStep calls, strategy.run calls (untraced)
SHARED = [0]  # of those, the calls of steps whose mesh spans several processes
MIN_HANG_TIMEOUT = 300.0  # the default hang timeout's floor, seconds
SLOW_STEP_FACTOR = 10  # the default hang timeout: this many times the slowest recent step
HUNG = "hung:"  # how a hang's failure reason starts (the peers exit with HANG_EXIT_CODE)
GONE = "gone:"  # how the reason given for a process that stopped publishing starts
_KEY = "spmd/progress/"  # key prefix: each process's Record, as JSON
_VERDICT = "spmd/behind"  # the process that process 0 found behind, which then ends itself
RUNNING = threading.Event()  # set once this process's hang watch has started
_ARMED_AT = 2  # from the second step on, any time without a step is a stall
_STACK_FRAMES = 12  # innermost frames of the main thread's stack that are shown
_OTHER_FRAMES = 3  # innermost frames shown of each other thread
_WATCHES = ("spmd-hang-watch", "spmd-peer-watch")  # threads that are not the program's
_STDLIB = os.path.join(os.path.dirname(os.path.abspath(threading.__file__)), "")
_SPMD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
# Modules whose frames wait for a computation or for peers: JAX, and Orbax's barriers.
_WAITS = ("jax", "jaxlib", "orbax.checkpoint._src.multihost.multihost")
# Where, under jax/_src, JAX traces, lowers and compiles: progress, however long it takes.
_COMPILES = ("compiler.py", "interpreters/mlir.py", "interpreters/partial_eval.py")
# Where, under jax/_src, JAX calls a program's callback (pure_callback, io_callback,
# debug.callback): from a runtime thread, while the main thread waits for the computation.
_CALLBACKS = ("callback.py", "debugging.py")
# How a verdict that names processes nothing tells apart says so.
TIE = "nothing tells which of them the others wait for"
WAITED = "while its peers waited for it"


def _waiting_in() -> tuple[str, ...]:
    """Where a thread's innermost frame is when it waits for a computation or for its
    peers (JAX, Orbax's barriers, and spmd: its step, its checkpoints' and input
    pipeline's agreements across processes) rather than running the program's own code."""
    modules = [m for m in map(sys.modules.get, _WAITS) if m is not None]
    return (_SPMD, *(os.path.join(os.path.dirname(m.__file__), "") for m in modules))


def _compiling_in() -> tuple[str, ...]:
    jax = sys.modules.get("jax")
    if jax is None:
        return ()
    return tuple(os.path.join(os.path.dirname(jax.__file__), "_src", p) for p in _COMPILES)


@dataclasses.dataclass(frozen=True)
class Record:
    """What one process publishes about its progress.

    Attributes:
      seq: how many times it published (a record that stops changing is a dead publisher).
      step: its steps so far (Step calls, and strategy.run calls outside a trace).
      stalled: seconds since its step count last moved.
      limit: its hang timeout, seconds.
      armed: whether its second step came (from then on any stall counts).
      waiting: whether its main thread waits in JAX (or spmd's step) rather than in its own code.
      done: whether it reached the end of its program (it no longer steps).
      waited: seconds its main thread has waited inside one of spmd's calls (a step, a
        restore), without a step call since and compilation aside: before its second
        step, only this counts.
      in_spmd: whether its main thread was inside one of spmd's calls; a process out of
        them has returned from its last step call (`returned_from`).
      shared: its calls of steps whose mesh spans several processes (`SHARED`).
      callback: whether a thread of it ran the program's code inside a JAX callback while
        its main thread waited for the computation (then `waiting` is False: it is the
        program's code that the computation, and so its peers, wait for).
    """

    seq: int
    step: int
    stalled: float
    limit: float
    armed: bool
    waiting: bool
    done: bool = False
    waited: float = 0.0
    in_spmd: bool = True
    shared: int = 0
    callback: bool = False


@dataclasses.dataclass(frozen=True)
class _Activity:
    """What a process's main thread does, as one look at its stack tells."""

    waiting: bool  # waits in JAX, Orbax's barriers or spmd (for a computation or its peers)
    compiling: bool  # JAX traces, lowers or compiles
    in_spmd: bool  # inside a call of spmd's (a step, a checkpoint's restore, Trainer.fit)
    callback: bool = False  # waits in JAX while a callback of its runs the program's code


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whom process 0 names, and why: what every process reads alike.

    Attributes:
      named: the processes named, sorted.
      steps: each named process's step count when it was named (a process that
        advanced since is no longer named).
      why: how their peers stood, e.g. "while its peers waited for it".
    """

    named: tuple[int, ...]
    steps: tuple[int, ...]
    why: str

    def names(self, index: int, step: int) -> bool:
        """Whether process `index`, now at `step`, is named."""
        return any(i == index and s == step for i, s in zip(self.named, self.steps, strict=True))

    def value(self) -> str:
        return json.dumps({"named": self.named, "steps": self.steps, "why": self.why})

    @classmethod
    def read(cls, client: Any) -> Verdict | None:
        """The verdict published last, or None."""
        try:
            said = json.loads(client.key_value_try_get(_VERDICT))
            return cls(tuple(said["named"]), tuple(said["steps"]), said["why"])
        except Exception:  # none yet, an older form, or the service is gone
            return None


def behind(records: Mapping[int, Record]) -> Verdict | None:
    """The processes the job waits for, once some process has not advanced for its limit.

    Of the processes not done, those with the lowest step; of them, the ones
    not waiting in JAX (the others wait for them in a collective) if some do
    wait, else all of them: what every process reads alike from the records.
    They are named only where someone waits for them (a process at a higher
    step that waits, or has ended there; one at their step that waits) or,
    while no process has ended, where every process runs its own code (a pause
    of the whole job, named as such); never where they all wait for a process
    that ended at a lower step (its end-of-program wait names it). None while
    no process is past its limit (an armed one stalled for it, one not yet
    armed waited in spmd's calls for it), while a named one has not been
    stalled for half of its own, or while it is not armed and waits itself
    (before the first steps, a process in JAX is not the one its peers wait for).
    """
    live = {i: r for i, r in records.items() if not r.done}
    if not any((r.stalled if r.armed else r.waited) >= r.limit for r in live.values()):
        return None
    lowest = min(r.step for r in live.values())
    group = {i: r for i, r in live.items() if r.step == lowest}
    own = [i for i, r in group.items() if not r.waiting]
    ahead = any(r.step > lowest and (r.waiting or r.done) for r in records.values())
    if own:
        named, why = own, _why(ahead or len(own) < len(group), records, own)
        if why is None:
            return None  # a peer ended and nobody waits: left to finish
    elif any(r.done and r.step < lowest for r in records.values()):
        return None  # they wait for a process that ended first: spmd._src.clusters.exit_wait
    else:
        named, why = sorted(group), WAITED if len(group) == 1 else f"each waiting in JAX: {TIE}"
    if not all(
        records[i].stalled >= records[i].limit / 2 and (records[i].armed or not records[i].waiting)
        for i in named
    ):
        return None
    named = sorted(named)
    return Verdict(tuple(named), tuple(records[i].step for i in named), why)


def _why(waited: bool, records: Mapping[int, Record], own: list[int]) -> str | None:
    """How the peers of processes in their own code stood: they waited, or none did (then
    None once some process has ended: nobody waits for the others)."""
    if waited:
        return WAITED
    if any(r.done for r in records.values()):
        return None
    if len(own) == len(records):
        return "while every process ran its own code, none waiting for another"
    return "while its peers ran their own code too"


def progress(client: Any, index: int) -> Record | None:
    """Process `index`'s last published Record; None before its first (or without a watch)."""
    try:
        return Record(**json.loads(client.key_value_try_get(f"{_KEY}{index}")))
    except Exception:  # not published (yet), or the service is gone
        return None


def returned_from(record: Record, step: int) -> bool:
    """Whether the process whose record this is had returned from its Step call number
    `step` (`STEPS` counted in that call) when it published it.

    True once it made a later step call, or reached the end of its program, or
    has made `step` calls and its main thread is out of spmd's calls: each
    call counts itself first, inside spmd. Like the watch itself, this takes
    the main thread to be the one that calls the steps.
    """
    return record.step > step or (record.step == step and (record.done or not record.in_spmd))


def check_hang_timeout(value: float | None, name: str = "hang_timeout") -> float | None:
    """`value` as seconds (None: the default rule).

    Raises:
      ConfigurationError: it is not a positive number.
    """
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not seconds > 0:
        raise ConfigurationError(
            message(
                f"{name} is the seconds a process may go without a step before the job ends "
                "naming it: a positive number, or None for the default (the larger of 300 s "
                "and 10 times the slowest recent step).",
                received(**{name: value}),
                f"set e.g. {name}=600, or unset it."
                if name.isupper()  # read from the environment
                else "pass e.g. hang_timeout=600 (spmd launch --hang-timeout 600), or leave it out.",
            )
        )
    return seconds


def _steps(count: int) -> str:
    return f"{count} step" + ("s" if count != 1 else "")


def _when(count: int) -> str:
    """E.g. "after 4 steps", or "before its first step"."""
    return f"after {_steps(count)}" if count else "before its first step"


def _no_progress(r: Record, why: str, also: tuple[int, ...] = ()) -> str:
    """The start of a hang's reason, e.g. "hung: no progress for 300 s after 4 steps
    (hang_timeout=300 s) while its peers waited for it"; `also`: the others named with it."""
    with_it = f", as did process(es) {list(also)}," if also else ""
    callback = (
        " (a JAX callback of its ran the program's code while its main thread waited for the "
        "computation)"
        if r.callback
        else ""
    )
    return (
        f"{HUNG} no progress for {r.stalled:.0f} s {_when(r.step)} (hang_timeout={r.limit:g} s)"
        f"{with_it} {why}{callback}"
    )


def _unanswered(r: Record, why: str, silence: float) -> str:
    """The reason given for a named process that did not answer: what its last record said,
    and how old that record is (a process holding the GIL publishes nothing)."""
    last = (
        f"; its last record, {silence:.0f} s old, counted {_steps(r.step)}" if silence >= 1 else ""
    )
    return (
        f"{HUNG} no progress for {r.stalled:.0f} s (hang_timeout={r.limit:g} s) {why}{last}; "
        "named, it did not answer (its Python threads did not run: a C extension holding the "
        "GIL, or frozen; no stack)"
    )


@functools.lru_cache(maxsize=4096)
def _path(filename: str) -> str:
    return os.path.abspath(filename)


def _kind(frame: Any) -> str:
    """Where a thread's innermost frame is: "jax" (waiting for a computation, so in a
    collective for its peers), "idle" (the standard library: waiting on a lock, a
    queue, another thread) or "own" (the program's code, a C call from it included)."""
    path = _path(frame.f_code.co_filename)
    if path.startswith(_waiting_in()):
        return "jax"
    if path.startswith(_STDLIB) and "-packages" not in path:
        return "idle"
    return "own"


def _helpers_kind() -> str:
    """For a main thread that waits on another thread: "own" if one of the others runs
    the program's code (a loader stuck in its source), "jax" if one waits in JAX,
    else "own" (they wait on I/O or on threads of C++ code, such as a checkpoint's reads)."""
    frames = sys._current_frames()
    main = threading.main_thread()
    kinds = {
        _kind(frames[t.ident])
        for t in threading.enumerate()
        if t is not main and t.ident in frames and t.name not in _WATCHES
    }
    return "jax" if "jax" in kinds and "own" not in kinds else "own"


def _callback_running() -> bool:
    """Whether a thread other than the main one runs the program's code inside a JAX
    callback: a frame of JAX's callback machinery with one of the program's (or the
    standard library's) inside it. The runtime calls callbacks from threads of its own,
    which `threading` does not list, so every thread's frames are looked at."""
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    entries = tuple(os.path.join(os.path.dirname(jax.__file__), "_src", c) for c in _CALLBACKS)
    jaxes = tuple(p for p in _waiting_in() if p != _SPMD)
    skip = {threading.main_thread().ident} | {
        t.ident for t in threading.enumerate() if t.name in _WATCHES
    }
    for ident, frame in sys._current_frames().items():
        own = False
        while frame is not None and ident not in skip:
            path = _path(frame.f_code.co_filename)
            if path.startswith(entries):
                if own:
                    return True
                break
            own = own or not path.startswith(jaxes)
            frame = frame.f_back
    return False


def _activity() -> _Activity:
    """One look at the main thread's stack (no source lines read: it runs every interval).

    It waits when its main thread does, or when its main thread waits on
    another thread (a prefetching loader's queue) and that thread waits in JAX;
    not while a thread of it runs the program's code in a JAX callback.
    """
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return _Activity(False, False, False)
    kind = _kind(frame)
    if kind == "idle":
        kind = _helpers_kind()
    compiles, compiling, in_spmd = _compiling_in(), False, False
    outer = frame
    while outer is not None:
        path = _path(outer.f_code.co_filename)
        compiling = compiling or path.startswith(compiles)
        in_spmd = in_spmd or path.startswith(_SPMD)
        outer = outer.f_back
    waiting = kind == "jax" and not compiling
    callback = waiting and _callback_running()
    return _Activity(waiting and not callback, compiling, in_spmd, callback)


def _main_stack() -> str:
    """The main thread's innermost frames, formatted."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return ""
    return "".join(traceback.format_stack(frame)[-_STACK_FRAMES:]).rstrip()


def _other_stacks() -> str:
    """The innermost frames of this process's other threads (a loader's, a JAX callback's
    on a runtime thread that `threading` does not list), spmd's own left out."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in frames.items():
        name = names.get(ident, "a JAX runtime thread (a callback)")
        if ident == threading.main_thread().ident or name in _WATCHES:
            continue
        lines = "".join(traceback.format_stack(frame)[-_OTHER_FRAMES:]).rstrip()
        parts.append(f"\nthread {name!r}:\n{lines}")
    return "".join(parts)


def _stacks() -> str:
    return (_main_stack() or "(no Python stack)") + _other_stacks()


def named_stack(client: Any, index: int) -> str:
    """For a process that ends following a peer named hung: its own stacks, if process 0
    named it too (processes nothing tells apart are all named, and each shows its stack);
    else ""."""
    verdict = Verdict.read(client)
    if verdict is None or not verdict.names(index, STEPS[0]):
        return ""
    return f"\nprocess {index} was named with it ({verdict.why}); its main thread:\n{_stacks()}"


def records(client: Any) -> dict[int, Record]:
    """Every process's last published Record (those not yet published left out).

    Raises:
      Exception: the coordination service's, where it cannot be read.
    """
    found = {}
    for key, value in client.key_value_dir_get(_KEY):
        found[int(key.rsplit("/", 1)[1])] = Record(**json.loads(value))
    return found


@dataclasses.dataclass
class _Watch:
    """One process's view: its own progress, and when each peer's record last changed."""

    index: int
    count: int
    hang_timeout: float | None
    stale_after: float
    interval: float
    client: Any
    end: Callable[[int, str, str], None]  # (culprit, reason, text): tell the others, then exit
    seq: int = 0
    seen: int = 0
    moved_at: float = dataclasses.field(default_factory=time.monotonic)
    waits_since: float | None = None  # since when its main thread waits in spmd's calls
    steps: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=32)
    )
    peers: dict = dataclasses.field(default_factory=dict)  # index -> (seq, local time it changed)
    last: dict = dataclasses.field(default_factory=dict)  # index -> its last Record read
    named: tuple[tuple[int, ...], float] | None = None  # (process 0) those named, and when
    woken: threading.Event = dataclasses.field(default_factory=threading.Event)
    stopped: threading.Event = dataclasses.field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def limit(self) -> float:
        if self.hang_timeout is not None:
            return self.hang_timeout
        return max(MIN_HANG_TIMEOUT, SLOW_STEP_FACTOR * max(self.steps, default=0.0))

    def sample(self, now: float, done: bool) -> Record:
        """This process's Record now; notes how long the steps since the last sample took.

        A look that finds it tracing or compiling counts as progress; one that
        finds it waiting in spmd's calls adds to how long it has waited, which
        any other look, or a step call, starts again.
        """
        count, act = STEPS[0], _activity()
        if count != self.seen:
            if self.seen >= _ARMED_AT:
                self.steps.append((now - self.moved_at) / (count - self.seen))
            self.seen, self.moved_at, self.waits_since = count, now, None
        elif act.compiling:
            self.moved_at = now
        if not (act.waiting and act.in_spmd):
            self.waits_since = None
        elif self.waits_since is None:
            self.waits_since = now
        self.seq += 1
        stalled, limit = now - self.moved_at, self.limit()
        waited = 0.0 if self.waits_since is None else round(now - self.waits_since, 2)
        armed = count >= _ARMED_AT
        return Record(
            self.seq,
            count,
            round(stalled, 2),
            limit,
            armed,
            act.waiting,
            done,
            waited,
            act.in_spmd,
            SHARED[0],
            act.callback,
        )

    def publish(self, record: Record) -> None:
        value = json.dumps(dataclasses.asdict(record))
        self.client.key_value_set(f"{_KEY}{self.index}", value, allow_overwrite=True)

    def read(self, now: float, only: int | None = None) -> dict[int, Record]:
        """Every published record (or process `only`'s); a peer's that stopped changing
        counts its silence as stall."""
        records = {}
        if only is None:
            items = self.client.key_value_dir_get(_KEY)
        else:
            items = [(f"{_KEY}{only}", self.client.key_value_try_get(f"{_KEY}{only}"))]
        for key, value in items:
            index = int(key.rsplit("/", 1)[1])
            record = Record(**json.loads(value))
            seq, changed = self.peers.get(index, (None, now))
            if seq != record.seq:
                changed = now
            self.peers[index], self.last[index] = (record.seq, changed), record
            silent = now - changed if index != self.index else 0.0
            records[index] = dataclasses.replace(record, stalled=record.stalled + silent)
        expected = range(self.count) if only is None else (only,)
        for index in set(expected) - set(records):  # killed before its first record
            self.peers.setdefault(index, (None, now))
            records[index] = Record(0, 0, now - self.peers[index][1], math.inf, False, False)
        return records

    def silent(self, now: float, records: Mapping[int, Record]) -> int | None:
        """A peer whose record has not changed for `stale_after` seconds (and is not done)."""
        for index, (_, changed) in sorted(self.peers.items()):
            peer = index != self.index and not records[index].done
            if peer and now - changed >= self.stale_after:
                return index
        return None

    def judge(self, now: float, records: Mapping[int, Record]) -> None:
        """On process 0: ends a silent peer's job, or names the processes behind.

        Those named are told through the verdict key and end themselves with
        their stacks; one that does not within `stale_after` is ended for.
        """
        self.end_if_silent(now, records)
        verdict = behind(records)
        if verdict is None:
            self.named = None
            return
        if self.named is None or self.named[0] != verdict.named:
            self.client.key_value_set(_VERDICT, verdict.value(), allow_overwrite=True)
            self.named = (verdict.named, now)
        if self.index in verdict.named:
            self.end_hung(records[self.index], verdict)
        elif now - self.named[1] >= self.stale_after:
            culprit = verdict.named[0]
            silence = now - self.peers.get(culprit, (None, now))[1]
            self.end(culprit, _unanswered(records[culprit], verdict.why, silence), "")

    def follow(self, now: float, own: Record) -> None:
        """On the other processes: ends this one if process 0 named it, or fell silent."""
        verdict = Verdict.read(self.client)
        if verdict is not None and verdict.names(self.index, own.step):
            self.end_hung(own, verdict)
        self.end_if_silent(now, self.read(now, only=0))

    def end_if_silent(self, now: float, records: Mapping[int, Record]) -> None:
        gone = self.silent(now, records)
        if gone is not None:
            reason = _gone(now - self.peers[gone][1], records[gone].step)
            self.end(gone, reason, f"process {gone} is gone: {reason[len(GONE) + 1 :]}.")

    def quietest(self) -> tuple[int, str] | None:
        """The peer silent longest (not done), and why, once silent for two intervals.

        What a lost peer reported by JAX's client (which ends this process)
        most likely is: process 0 reads every record, the others process 0's.
        """
        now = time.monotonic()
        quiet = [
            (changed, index)
            for index, (_, changed) in self.peers.items()
            if index != self.index and not getattr(self.last.get(index), "done", False)
        ]
        if not quiet or now - min(quiet)[0] < 2 * self.interval:
            return None
        changed, index = min(quiet)
        return index, _gone(now - changed, getattr(self.last.get(index), "step", 0))

    def end_hung(self, r: Record, verdict: Verdict) -> None:
        """Ends this process as one behind, with its stacks."""
        also = tuple(i for i in verdict.named if i != self.index)
        reason = f"{_no_progress(r, verdict.why, also)}; its main thread:\n{_stacks()}"
        self.end(self.index, reason, f"process {self.index} {reason}")

    def tick(self, now: float, done: bool) -> None:
        """One interval's work: publish this process's record, then judge (on process 0),
        or follow process 0's verdict and record (on the others). A process at its end
        goes on: its peers may still run, and a silent one is still named."""
        own = self.sample(now, done)
        self.publish(own)
        if self.index == 0:
            self.judge(now, self.read(now))
        else:
            self.follow(now, own)

    def run(self, stopping: Callable[[], bool]) -> None:
        first = True
        while not self.stopped.is_set():
            if not first:
                self.woken.wait(self.interval)
                self.woken.clear()
            first, now = False, time.monotonic()
            if self.stopped.is_set():
                return
            try:
                self.tick(now, stopping())
            except Exception:  # the service is gone: the peer watch or JAX ends this process
                continue

    def wake(self) -> None:
        """Publishes now rather than at the next interval (this process reached its end)."""
        self.woken.set()

    def stop(self) -> None:
        """Stops the watch, once this process's exit is agreed (before JAX's shutdown)."""
        self.stopped.set()
        self.woken.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=self.interval + 5.0)


def _gone(silence: float, step: int) -> str:
    """The reason given for a process that stopped publishing, e.g. "gone: it has ..."; the
    step count is its last record's, as old as the silence (it may have stepped since)."""
    return (
        f"{GONE} it has published nothing for {silence:.0f} s (its last record counted "
        f"{_steps(step)}): it was killed, its machine was lost, or its Python threads cannot "
        "run (frozen, or a C extension holding the GIL)"
    )


def interval_for(hang_timeout: float | None, heartbeat_timeout: float) -> float:
    """Seconds between publications: a fifth of the shorter bound, 0.25 .. 5."""
    bound = min(hang_timeout or MIN_HANG_TIMEOUT, heartbeat_timeout / 2)
    return min(5.0, max(0.25, bound / 5))


def start(
    client: Any,
    where: tuple[int, int],
    timeouts: tuple[float | None, float],
    end: Callable[[int, str, str], None],
    stopping: Callable[[], bool],
) -> _Watch:
    """Starts this process's hang watch in a daemon thread; returns it (its `quietest`,
    `wake` and `stop`).

    Args:
      client: the coordination service's client.
      where: (this process's index, the process count).
      timeouts: (hang_timeout or None for the default rule, heartbeat_timeout).
      end: called with (culprit, reason, text) to tell the others and exit.
      stopping: whether this process has reached its end (its last record says done).
    """
    hang_timeout, heartbeat_timeout = timeouts
    interval = interval_for(hang_timeout, heartbeat_timeout)
    stale_after = max(3 * interval, heartbeat_timeout / 2)
    watch = _Watch(where[0], where[1], hang_timeout, stale_after, interval, client, end)
    watch.thread = threading.Thread(target=watch.run, args=(stopping,), name="spmd-hang-watch")
    watch.thread.daemon = True
    watch.thread.start()
    RUNNING.set()
    return watch
