"""Checks that keep a checkpoint directory consistent: one manager, agreed steps, bounded waits.

Processes agree through the key-value store of JAX's coordination service,
with a deadline: a process that never arrives (hung, or a save entered under
`if is_chief:`), or that brings another directory or step, is an error named
within `timeout` seconds on the processes that did arrive, never a hang in a
collective.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax
from etils import epath

from spmd._src.clusters.jax_state import coordination_client
from spmd._src.clusters.launch_results import not_arrived
from spmd._src.errors import CheckpointError, message, received

__all__ = [
    "NO_LOCK",
    "DirectoryLock",
    "agree",
    "check_newer_steps",
    "check_no_file",
    "every_pipeline",
    "first_line",
    "not_listable",
    "open_directory",
    "read_only_error",
    "same_step",
    "write_failed",
]

_LOCK_NAME = ".spmd-lock"
_PROBE = ".spmd-probe-"
_calls = itertools.count()  # this process's agreements, in order: the same on every process
# Each agreement's keys, under _KEYS<call>/: process 0 deletes those of call n once every
# process has posted its value for call n + 1 (so has read call n's), keeping one call's.
_KEYS = "spmd/_src/checkpoint/"
_WAIT_S = 1.0  # the longest blocking read of a missing value (signals are handled between)


class DirectoryLock:
    """An exclusive lock on a local checkpoint directory, held while a manager is open.

    Uses `flock`, which also conflicts between two managers of one process.
    Object stores (gs://, s3://) are not locked.
    """

    def __init__(self, directory: epath.Path):
        self._file = None
        self.holder: str | None = None  # who holds it, when this one could not take it
        if "://" in str(directory):
            return
        path = os.path.join(os.fspath(directory), _LOCK_NAME)
        try:
            handle = open(path, "a+")  # noqa: SIM115 - held open while the manager lives
        except OSError as e:
            raise not_writable(directory, e) from e
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            self.holder = handle.read().strip() or "another process"
            handle.close()
            return
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
        handle.flush()
        self._file = handle
        try:
            _check_creates(directory)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Lets another manager open the directory."""
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def _check_creates(directory: epath.Path) -> None:
    """Raises `not_writable` if no file can be made in `directory`: a lock file that is
    writable in a folder that is not (mode 555 after a run) would let a writer open, and
    its saves fail only at close."""
    probe = os.path.join(os.fspath(directory), f"{_PROBE}{uuid.uuid4().hex}")
    try:
        with open(probe, "x"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise not_writable(directory, e) from e


class _NoLock:
    holder = None

    def release(self) -> None:
        """Nothing to release: only process 0 locks, and readers never do."""


NO_LOCK = _NoLock()  # what a read-only manager holds


def open_directory(
    root: epath.Path, shared: bool, timeout: float, read_only: bool = False
) -> DirectoryLock | _NoLock:
    """Locks `root` (process 0) and checks that every process opens the same shared folder.

    Before anything is written: process 0 takes the directory's lock and, with a
    shared filesystem and several processes, writes a probe file the others must see.
    A reader (`read_only`) does neither: it holds no lock, and writes nothing.

    Returns:
      The lock, held by process 0 (an empty one elsewhere): release it on close.

    Raises:
      CheckpointError: another manager holds the directory; or with `shared`, the
        processes name different folders or do not all see process 0's probe.
    """
    if read_only:
        return NO_LOCK
    chief, several = jax.process_index() == 0, jax.process_count() > 1
    lock, token = _NoLock(), None
    if chief:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise not_writable(root, e) from e
        lock = DirectoryLock(root)
        if shared and several and lock.holder is None:
            token = f"{_PROBE}{uuid.uuid4().hex}"
            (root / token).write_text("")
    try:
        _check_same_folder(root, shared, lock.holder, token, timeout)
    except BaseException:
        lock.release()
        raise
    finally:
        if token is not None:
            (root / token).unlink(missing_ok=True)
    return lock


def _check_same_folder(
    root: epath.Path, shared: bool, holder: str | None, token: str | None, timeout: float
) -> None:
    what = "CheckpointManager(directory)"
    fix = (
        "with shared_filesystem=True every process passes the same folder of a filesystem "
        "they all mount (or an object store); if each host writes its own disk, pass "
        "shared_filesystem=False."
    )

    def same_folder(opened: dict[int, Any]) -> CheckpointError | None:
        if opened[0]["holder"] is not None:
            return lock_error(root, opened[0]["holder"])
        folders = {p: v["directory"] for p, v in opened.items()}
        if shared and len(set(folders.values())) > 1:
            return differ(what, "directory", folders, fix)
        return None

    opened = agree(
        what, {"directory": str(root), "holder": holder, "token": token}, timeout, same_folder
    )
    if not shared or len(opened) == 1:
        return

    def all_see(sees: dict[int, bool]) -> CheckpointError | None:
        blind = [p for p, seen in sees.items() if not seen]
        if not blind:
            return None
        return CheckpointError(
            message(
                "With shared_filesystem=True every process sees the files process 0 writes "
                "in the directory.",
                received(directory=str(root), processes_that_do_not_see_it=blind),
                fix,
            )
        )

    agree(what, (root / opened[0]["token"]).exists(), timeout, all_see)


def not_writable(directory: epath.Path, error: OSError) -> CheckpointError:
    """The error for a writer's directory it cannot write (a read-only mount, permissions,
    a file at its path or above it)."""
    blocking = _file_on_the_way(directory)
    if blocking is not None:
        return CheckpointError(
            message(
                "A CheckpointManager's directory is a folder (or a path it can create).",
                received(directory=str(directory), file=blocking),
                "pass a folder's path: move that file away, or name another directory "
                "(e.g. one beside it).",
            )
        )
    return CheckpointError(
        message(
            "A CheckpointManager that saves needs a directory it can write.",
            received(directory=str(directory), error=first_line(error)),
            "to only read the steps another job writes (an evaluator), pass read_only=True; "
            "to save, give this process write access or another directory.",
        )
    )


def _file_on_the_way(directory: epath.Path) -> str | None:
    """The path of a file at `directory` or at a folder above it, if there is one (local)."""
    path = os.path.abspath(os.fspath(directory)) if "://" not in str(directory) else None
    while path and path != os.path.dirname(path):
        if os.path.lexists(path):
            return path if not os.path.isdir(path) else None
        path = os.path.dirname(path)
    return None


def not_listable(directory: epath.Path, error: OSError) -> CheckpointError:
    """The error for a directory whose step folders cannot be listed (permissions, I/O)."""
    got = {"directory": str(directory), "error": first_line(error)}
    if error.errno:
        got["errno"] = f"{errno.errorcode.get(error.errno, error.errno)} ({error.errno})"
    return CheckpointError(
        message(
            "A CheckpointManager lists the step folders of its directory, so it must be able "
            "to read it.",
            received(**got),
            "give this process read (and search) access to the directory: its owner, mode "
            "or mount. Nothing in it was skipped or set aside.",
        )
    )


def read_only_error(what: str, directory: epath.Path) -> CheckpointError:
    """The error for a write asked of a CheckpointManager(read_only=True)."""
    return CheckpointError(
        message(
            f"{what}() writes to the checkpoint directory, which a "
            "CheckpointManager(read_only=True) never does.",
            received(directory=str(directory), read_only=True),
            "save from the training job's own manager (read_only=False, one per directory); "
            "use this one to list and restore the steps it writes.",
        )
    )


def lock_error(directory: epath.Path, holder: str) -> CheckpointError:
    """The error for a directory another open CheckpointManager holds."""
    return CheckpointError(
        message(
            "One CheckpointManager at a time writes to a checkpoint directory.",
            received(directory=str(directory), held_by=holder),
            "close() the other manager first (or use `with CheckpointManager(...)`), or give "
            "this run its own directory.",
        )
    )


def agree(
    what: str,
    value: Any,
    timeout: float,
    check: Callable[[dict[int, Any]], CheckpointError | None] | None = None,
) -> dict[int, Any]:
    """Every process's `value` for this call, once all have arrived; bounded by `timeout`.

    Every process must call `agree` the same number of times, in the same order.

    Args:
      what: the call being agreed on, for the message (e.g. "save(step=10)").
      value: this process's JSON value.
      timeout: seconds to wait for the other processes.
      check: given every process's value, the error to raise, or None. Every
        process gets the same values, so all of them raise it, once all have read.

    Returns:
      process index -> value (just this process's with one process).

    Raises:
      CheckpointError: some processes did not arrive within `timeout`, or `check`'s error.
    """
    if jax.process_count() == 1:
        found = {jax.process_index(): value}
    else:
        client = _client()
        call = next(_calls)
        prefix = f"{_KEYS}{call}/"
        deadline = time.monotonic() + timeout
        texts = _gather(client, f"{prefix}value/", json.dumps(value), what, deadline, timeout)
        found = {p: json.loads(v) for p, v in sorted(texts.items())}
        if call and jax.process_index() == 0:  # every process posted this call's value, so
            client.key_value_delete(f"{_KEYS}{call - 1}")  # it is done reading the previous
    error = check(found) if check else None
    if error is not None:
        if jax.process_count() > 1:  # all have read before any raises (and maybe exits,
            # taking down the coordination service with process 0)
            _gather(client, f"{prefix}read/", "", what, deadline, timeout)
        raise error
    return found


def _gather(client: Any, prefix: str, value: str, what: str, deadline: float, timeout: float):
    """Sets this process's key under `prefix`, then waits for every process's."""
    me, count = jax.process_index(), jax.process_count()
    client.key_value_set(f"{prefix}{me}", value)
    while True:  # one listing, then a blocking read of a missing value, then the listing again
        found = {int(k.rsplit("/", 1)[1]): v for k, v in client.key_value_dir_get(prefix)}
        missing = sorted(set(range(count)) - set(found))
        if not missing:
            return found
        left = deadline - time.monotonic()
        if left <= 0:
            raise _absent(what, missing, sorted(found), timeout)
        with contextlib.suppress(Exception):  # the client raises at its timeout: list again
            wait_ms = max(1, int(min(left, _WAIT_S) * 1000))
            client.blocking_key_value_get(f"{prefix}{missing[0]}", wait_ms)


def _client() -> Any:
    client = coordination_client()
    if client is None:
        raise CheckpointError(
            message(
                "Several processes coordinate checkpoints through jax.distributed.",
                received(process_count=jax.process_count(), distributed_client=None),
                "call spmd.initialize() at the start of every process.",
            )
        )
    return client


def _absent(what: str, missing: list[int], present: list[int], timeout: float) -> CheckpointError:
    """The error for a collective some processes did not reach: they lead it, as at fault."""
    return CheckpointError(
        message(
            f"{not_arrived(missing, what, timeout)}: every process calls {what} together "
            "(it is a collective), so this one cannot go on without them.",
            received(arrived=present, not_arrived_within_s={timeout: missing}),
            f"look at what processes {missing} were doing (their output above; py-spy dump "
            "--pid) — stuck in a data loader, a deadlock, a lost host; if they are only slow, "
            "raise coordination_timeout. If they never call it: call the CheckpointManager's "
            "methods on every process with the same arguments, never under `if is_chief:` (the "
            "manager decides which process writes what).",
        )
    )


def differ(what: str, name: str, values: dict[int, Any], fix: str) -> CheckpointError:
    """The error for processes that brought different `name`s to the same call."""
    return CheckpointError(
        message(
            f"Every process calls {what} with the same {name}.",
            received(**{f"{name}_by_process": values}),
            fix,
        )
    )


def check_newer_steps(step: int, existing: list[int], directory: epath.Path) -> None:
    """Raises if `directory` already holds steps after `step` (another run's, or a later one)."""
    newer = [s for s in existing if s > step]
    if not newer:
        return
    raise CheckpointError(
        message(
            "A checkpoint directory holds one run, its steps saved in increasing order.",
            received(step=step, directory=str(directory), newer_steps=newer),
            "resume from the latest step (restore_or_init does), give this run its own "
            f"directory, or delete steps {newer} if they are from a run you abandoned.",
        )
    )


def check_no_file(step: int, step_dir: epath.Path) -> None:
    """Raises if something that is not a step folder has step `step`'s name."""
    if not step_dir.exists() or step_dir.is_dir():
        return
    raise CheckpointError(
        message(
            f"Saving step {step} writes a folder named {step_dir.name} in the checkpoint "
            "directory.",
            received(step=step, path=str(step_dir), existing="a file, not a step folder"),
            "move or delete that file (the checkpoint directory holds only step folders), or "
            "give this run its own directory.",
        )
    )


def same_step(votes: dict[int, dict]) -> CheckpointError | None:
    """The error for a save that processes call with different steps, or None."""
    steps = {p: v["step"] for p, v in votes.items()}
    if len(set(steps.values())) == 1:
        return None
    return differ(
        "save",
        "step",
        steps,
        "count steps the same way on every process (e.g. from the train state's step, not a "
        "per-process counter), and call save on every process at every step.",
    )


def first_line(error: BaseException) -> str:
    """`Type: message`, its first line, at most 500 characters."""
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:500]


def write_failed(steps: list[int], directory: epath.Path, error: BaseException) -> CheckpointError:
    """The error for saves that failed: the steps they were, where, and the cause."""
    text = str(error)
    full = any(s in text for s in ("RESOURCE_EXHAUSTED", "No space left", "ENOSPC", "quota"))
    return CheckpointError(
        message(
            "A checkpoint save must write all its files.",
            received(steps=steps, directory=str(directory), error=first_line(error)),
            ("free space on the checkpoint disk (or lower max_to_keep), then " if full else "")
            + "restart from the latest complete step (restore_or_init); the failed steps are "
            "not listed, never restored.",
        )
    )


def every_pipeline(position: dict | None, timeout: float) -> dict | None:
    """The position with every input pipeline's part of `per_pipeline` (a grain iterator's state).

    Each process knows only its own pipeline's source state; the saved
    position holds all of them, so each process restores its own.
    """
    if not isinstance(position, dict) or not isinstance(position.get("per_pipeline"), dict):
        return position
    votes = agree("save(data=...)", position["per_pipeline"], timeout)
    merged: dict = {}
    for process, parts in votes.items():
        for pipeline, state in parts.items():
            if merged.setdefault(pipeline, state) != state:
                raise CheckpointError(
                    message(
                        "Processes of one input pipeline read the same data, so they are at "
                        "the same source position.",
                        received(input_pipeline=pipeline, process=process, differs=str(state)[:80]),
                        "build every process's pipeline from the same data, seed and shard "
                        "options (spmd.grain_shard_options(strategy)).",
                    )
                )
    return {**position, "per_pipeline": merged}
