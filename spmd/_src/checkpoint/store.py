"""Where checkpoints live: one folder every process sees, or process 0's own disk."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from spmd._src.checkpoint import guard, turns
from spmd._src.checkpoint import tree as ct
from spmd._src.checkpoint.integrity import Damaged, RecordHandler, damage
from spmd._src.errors import CheckpointError
from spmd._src.placement import from_host

__all__ = ["ChiefStore", "SharedStore", "forget_listings", "make_store"]

_SAVE = {"state": ocp.args.PyTreeSave, "data": ocp.args.JsonSave, "metadata": ocp.args.JsonSave}
_RESTORE = {"state": ocp.args.PyTreeRestore, "data": ocp.args.JsonRestore}
_RESTORE["metadata"] = ocp.args.JsonRestore
_UNFINISHED = ".orbax-checkpoint-tmp"  # how Orbax names a step folder still being written
_COMMITTED = "commit_success.txt"  # how Orbax commits a step on an object store (no rename)
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")  # how Orbax names a step folder (its default format)
# Where max_to_keep moves a step before spmd deletes it (local and mounted folders): a reader
# sees a step whole or not at all, never half deleted (which would read as damaged).
_REMOVED = ".spmd-removed"
_A_FILE = "a file, not a step folder, has the step's name"
_REMOVED_WHILE_LISTED = "removed by the writer (max_to_keep) while it was listed: skipped"
_log = logging.getLogger("spmd.checkpoint")


class SharedStore:
    """Orbax's multi-host checkpointing: each process writes the shards it owns into one folder.

    Process 0 writes the metadata and renames the step's temporary folder once
    every process is done. Needs a folder every process sees: a shared
    filesystem, or an object store such as gs://.
    """

    def __init__(
        self,
        directory: epath.Path,
        max_to_keep: int | None,
        interval: int,
        async_save: bool,
        multiprocessing: ocp.options.MultiprocessingOptions | None = None,
        read_only: bool = False,
    ):
        multiprocessing = multiprocessing or ocp.options.MultiprocessingOptions()
        chief_only = multiprocessing.active_processes is not None
        role = "read" if read_only else "chief" if chief_only else "write"
        prefix = turns.barrier_prefix(directory, role)  # two managers' barriers never meet
        multiprocessing = dataclasses.replace(multiprocessing, barrier_sync_key_prefix=prefix)
        self.read_only = read_only
        self._async = async_save and not read_only
        self._failure: Exception | None = None  # a save in flight that failed, while settled
        self._intact: set[int] = set()  # a reader's steps found whole: committed, they stay so
        if chief_only and not read_only:  # Orbax creates the root only when all processes write
            directory.mkdir(parents=True, exist_ok=True)
        if read_only:  # no folder made, no save, no deletion, no cleanup of a writer's tmp folders
            options = ocp.CheckpointManagerOptions(
                read_only=True,
                lightweight_initialize=True,  # no step's file read: the writer may remove it
                create=False,
                cleanup_tmp_directories=False,
                save_interval_steps=0,
                max_to_keep=None,
                enable_async_checkpointing=False,
                multiprocessing_options=multiprocessing,
            )
        else:
            options = ocp.CheckpointManagerOptions(
                save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(interval),
                preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep),
                enable_async_checkpointing=async_save,
                cleanup_tmp_directories=True,
                create=not chief_only,
                multiprocessing_options=multiprocessing,
                todelete_subdir=None if "://" in str(directory) else _REMOVED,
            )
        with _listing(directory):
            self.manager = ocp.CheckpointManager(
                directory, options=options, handler_registry=_registry(multiprocessing)
            )
        # Orbax deletes leftover temporary folders in a background thread. Wait for it: a
        # program that ends right after (an error at startup) would race interpreter shutdown.
        await_cleanup = getattr(self.manager, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:  # private: guarded, Orbax may move it
            await_cleanup()

    @property
    def directory(self) -> epath.Path:
        """The folder of the step folders."""
        return self.manager.directory

    def all_steps(self) -> list[int]:
        """The committed, intact steps, oldest first (see `damaged_steps`)."""
        return self._looked_at(self.step_folders())[0]

    def damaged_steps(self) -> dict[int, str]:
        """step -> why its folder is not a complete checkpoint, for the step folders that are
        not, and for files that have a step folder's name."""
        found = self._looked_at(self.step_folders())[1]
        for step in self._step_files():
            found[step] = _A_FILE
        return dict(sorted(found.items()))

    def _looked_at(self, steps: list[int]) -> tuple[list[int], dict[int, str]]:
        """(the intact steps of `steps`, step -> why for the others).

        A reader looks at each folder until it is found whole, not at every
        listing: a committed step changes no more (a deleted one leaves the
        listing). A folder the writer removed since it was listed (max_to_keep)
        is in neither, with a log line: it is not damaged.
        """
        fresh = [s for s in steps if s not in self._intact]
        found = {s: damage(self.step_dir(s), s) for s in fresh}
        gone = set()
        if self.read_only:
            gone = {s for s, why in found.items() if why is not None and self._removed(s)}
            self._intact = {s for s in steps if s in self._intact or found.get(s, "") is None}
        damaged = {s: why for s, why in found.items() if why is not None and s not in gone}
        return [s for s in steps if s not in damaged and s not in gone], damaged

    def _removed(self, step: int) -> bool:
        """Whether step `step`'s folder is gone (a reader's listing; logged when it is)."""
        if self.step_dir(step).exists():
            return False
        _log.info("checkpoint step %d in %s: %s", step, self.directory, _REMOVED_WHILE_LISTED)
        return True

    def step_dir(self, step: int) -> epath.Path:
        """The folder of step `step` (Orbax's default names: the step number)."""
        return self.directory / str(step)

    def step_folders(self) -> list[int]:
        """Every step folder's step, intact or not, oldest first.

        A read-only store lists the directory anew each time: another
        process writes (and deletes) its steps.
        """
        if self.read_only:
            return self._listed()[0]
        return sorted(self.manager.all_steps())

    def _listed(self) -> tuple[list[int], list[int]]:
        """(step folders, files with a step's name) in the directory now, by name alone.

        A reader's listing: no file of a step is read (Orbax's listing reads each
        step's metadata, and a step the writer's max_to_keep removes meanwhile
        made it fail), so a step removed during it is simply not listed. On an
        object store a step is listed once its commit marker is there.
        """
        forget_listings(self.directory)
        with _listing(self.directory):
            try:
                names = [p.name for p in self.directory.iterdir()]
            except (FileNotFoundError, NotADirectoryError):
                return [], []  # no directory yet (a NotADirectoryError: a file there; see open)
        folders, files = [], []
        remote = "://" in str(self.directory)
        for name in names:
            if not _STEP_NAME.fullmatch(name):
                continue
            path = self.directory / name
            if path.is_dir():
                if not remote or (path / _COMMITTED).exists():
                    folders.append(int(name))
            elif path.exists():
                files.append(int(name))
        return sorted(folders), sorted(files)

    def _step_files(self) -> list[int]:
        """Steps whose name a file (not a folder) has in the directory."""
        if self.read_only:
            return self._listed()[1]
        folders = set(self.step_folders())
        with contextlib.suppress(OSError):
            return sorted(
                int(p.name)
                for p in self.directory.iterdir()
                if _STEP_NAME.fullmatch(p.name) and int(p.name) not in folders and not p.is_dir()
            )
        return []

    def set_aside(self, steps: list[int]) -> None:
        """Renames the folders of `steps` to `<step>.damaged` (process 0; call `reload` after)."""
        if jax.process_index() != 0:
            return
        for step in steps:
            folder, aside = self.step_dir(step), self.directory / f"{step}.damaged"
            n = 1
            while aside.exists():
                aside, n = self.directory / f"{step}.damaged.{n}", n + 1
            if folder.exists():
                folder.rename(aside)

    def reload(self) -> None:
        """Lists the step folders anew (after `set_aside`)."""
        self.manager.reload()

    def discard_unfinished(self, steps: list[int]) -> None:
        """Removes the temporary folders of saves of `steps` that failed (process 0), so that
        they stop taking the disk's space for the rest of the run. Best effort: an error
        path calls it."""
        if jax.process_index() != 0 or self.read_only:
            return
        for step in steps:
            for folder in self.directory.glob(f"{step}{_UNFINISHED}*"):
                with contextlib.suppress(OSError):
                    folder.rmtree()

    def save(self, step: int, arrays: ct.Flat, data: Any, meta: dict) -> bool:
        """Writes one step (in the background if async); False if it already exists."""
        if step in self.manager.all_steps():
            return False
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(ct.nest(arrays)),
            data=ocp.args.JsonSave({"position": data}),
            metadata=ocp.args.JsonSave(meta),
        )
        turns.take_turn(self)
        self._raise_failure()
        self._delete_removed()
        if self._async:
            turns.in_flight(self)
        self.manager.save(step, args=args, force=True)
        return True

    def _delete_removed(self, all_of_it: bool = False) -> None:
        """Deletes the steps max_to_keep moved aside (process 0, which moved them). Best
        effort: one the finalizing save is moving now goes at the next call."""
        aside = self.directory / _REMOVED
        if jax.process_index() != 0 or self.read_only or not aside.exists():
            return
        with contextlib.suppress(OSError):
            for folder in list(aside.iterdir()):
                folder.rmtree()
            if all_of_it:
                aside.rmdir()

    def settle(self) -> None:
        """Waits for this store's saves in flight (another store's turn); a failure is kept
        and raised by this store's next `save`, `wait` or `close`."""
        turns.settled(self)
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            self._failure = self._failure or e

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def saved_tree(self, step: int) -> dict[str, tuple]:
        """path -> (shape, dtype) of the arrays saved at `step`."""
        meta = self.manager.item_metadata(step)["state"]
        tree = getattr(meta, "tree", meta)
        leaves = ct.unnest(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
        return {p: (tuple(m.shape), np.dtype(m.dtype)) for p, m in leaves.items()}

    def restore_numpy(self, step: int) -> ct.Flat:
        """path -> whole numpy array, on every process."""
        as_numpy = {p: ocp.RestoreArgs(restore_type=np.ndarray) for p in self.saved_tree(step)}
        args = ocp.args.PyTreeRestore(restore_args=ct.nest(as_numpy))
        return ct.unnest(self.manager.restore(step, args=ocp.args.Composite(state=args)).state)

    def restore_placed(self, step: int, abstract: ct.Flat, partial: bool = False) -> ct.Flat:
        """path -> jax.Array laid out as `abstract`'s ShapeDtypeStructs; Orbax reshards.
        With `partial`, `abstract` may name only some of the saved arrays: only those are read."""
        item = ct.nest(abstract)
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=partial)
        return ct.unnest(self.manager.restore(step, args=ocp.args.Composite(state=args)).state)

    def read_json(self, step: int, item: str) -> Any:
        """The JSON item ("data" or "metadata") of `step`."""
        args = ocp.args.Composite(**{item: ocp.args.JsonRestore()})
        return self.manager.restore(step, args=args)[item]

    def wait(self) -> None:
        """Blocks until saves in flight are committed."""
        turns.settled(self)
        self._raise_failure()
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Waits, then stops Orbax's threads."""
        try:
            self.wait()
        finally:
            self.manager.close()
            self._delete_removed(all_of_it=True)


class ChiefStore:
    """Process 0 writes the whole state to its own disk; restoring broadcasts it to the others.

    For hosts without a shared filesystem (the seeds' per-worker paths). Every
    call is a collective: all processes make it, in the same order. Saving
    gathers arrays sharded over processes to every host; restoring reads on
    process 0 and broadcasts each array. The checkpoint lives on process 0's
    disk alone: lose that host and the checkpoint is lost with it.
    """

    def __init__(
        self,
        directory: epath.Path,
        max_to_keep: int | None,
        interval: int,
        async_save: bool,
        read_only: bool = False,
    ):
        self.is_chief = jax.process_index() == 0
        self._directory = directory
        self._inner: SharedStore | None = None
        if self.is_chief:
            only_me = ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0})
            self._inner = SharedStore(
                directory, max_to_keep, interval, async_save, only_me, read_only
            )

    @property
    def directory(self) -> epath.Path:
        """The folder of the step folders, on process 0's disk."""
        return self._directory

    def all_steps(self) -> list[int]:
        """Process 0's committed, intact steps, on every process."""
        return self._from_chief(lambda: self._inner.all_steps())

    def damaged_steps(self) -> dict[int, str]:
        """Process 0's damaged step folders and why, on every process."""
        found = self._from_chief(lambda: self._inner.damaged_steps())
        return {int(s): why for s, why in found.items()}

    def step_dir(self, step: int) -> epath.Path:
        """The folder of step `step`, on process 0's disk."""
        return self._directory / str(step)

    def step_folders(self) -> list[int]:
        """Process 0's step folders, intact or not, on every process."""
        return self._from_chief(lambda: self._inner.step_folders())

    def set_aside(self, steps: list[int]) -> None:
        """Renames process 0's folders of `steps` to `<step>.damaged`."""
        if self._inner:
            self._inner.set_aside(steps)

    def reload(self) -> None:
        """Process 0 lists its step folders anew."""
        if self._inner:
            self._inner.reload()

    def discard_unfinished(self, steps: list[int]) -> None:
        """Process 0 removes the temporary folders of failed saves of `steps`."""
        if self._inner:
            self._inner.discard_unfinished(steps)

    def save(self, step: int, arrays: ct.Flat, data: Any, meta: dict) -> bool:
        """Gathers every array (collective); process 0 writes them as numpy arrays."""
        host = {p: _to_host(x) for p, x in arrays.items()}
        return self._inner.save(step, host, data, meta) if self._inner else True

    def saved_tree(self, step: int) -> dict[str, tuple]:
        """path -> (shape, dtype) of process 0's checkpoint, on every process."""

        def read() -> dict:
            tree = self._inner.saved_tree(step)
            return {p: [list(s), d.name] for p, (s, d) in tree.items()}

        return {p: (tuple(s), np.dtype(d)) for p, (s, d) in self._from_chief(read).items()}

    def restore_numpy(self, step: int) -> ct.Flat:
        """Process 0 reads, then broadcasts each array to every process."""
        shapes = self.saved_tree(step)
        read: ct.Flat = {}

        def load() -> None:
            read.update(self._inner.restore_numpy(step))

        self._from_chief(load)  # every process learns that process 0 could not read
        return {
            p: np.asarray(
                multihost_utils.broadcast_one_to_all(read[p] if self.is_chief else np.zeros(s, d))
            )
            for p, (s, d) in sorted(shapes.items())
        }

    def restore_placed(self, step: int, abstract: ct.Flat, partial: bool = False) -> ct.Flat:
        """The broadcast arrays placed as `abstract`; each process fills its own shards.
        (Every array is read and broadcast; those `abstract` names are placed.)"""
        host = self.restore_numpy(step)
        return {p: from_host(host[p], a.sharding) for p, a in abstract.items()}

    def read_json(self, step: int, item: str) -> Any:
        """Process 0's JSON item, on every process."""
        return self._from_chief(lambda: self._inner.read_json(step, item))

    def _from_chief(self, read: Callable[[], Any]) -> Any:
        """`read()` on process 0, broadcast; if it raised, every process raises its like."""
        sent: dict = {}
        error = None
        if self._inner:
            try:
                sent = {"value": read()}
            except Exception as e:
                error, sent = e, {"error": _encode(e)}
        got = _broadcast_json(sent)
        if "error" not in got:
            return got["value"]
        if error is not None:
            raise error
        raise _decode(got["error"])

    def wait(self) -> None:
        """Blocks until process 0's saves in flight are committed."""
        if self._inner:
            self._inner.wait()

    def close(self) -> None:
        """Waits, then stops Orbax's threads on process 0."""
        if self._inner:
            self._inner.close()


def make_store(
    directory: epath.Path,
    max_to_keep: int | None,
    interval: int,
    async_save: bool,
    shared_filesystem: bool,
    read_only: bool = False,
) -> SharedStore | ChiefStore:
    """The store for this job: shared unless asked otherwise with several processes."""
    if shared_filesystem or jax.process_count() == 1:
        return SharedStore(directory, max_to_keep, interval, async_save, read_only=read_only)
    return ChiefStore(directory, max_to_keep, interval, async_save, read_only)


def forget_listings(directory: epath.Path) -> None:
    """Drops the listings fsspec keeps, so that the next look at `directory` asks the store.

    epath reaches gs:// through fsspec (gcsfs) when TensorFlow is not installed
    or EPATH_USE_TF=false, and fsspec keeps every listing it made until told:
    a reader in another process than the writer would never see a new step
    (nor a removed one go). Local paths and TensorFlow's gfile keep none.
    """
    backend = getattr(directory, "_backend", None)  # epath's choice (private: guarded)
    if "://" in str(directory) and backend is epath.backend.fsspec_backend:
        backend.fs(str(directory)).invalidate_cache()


@contextlib.contextmanager
def _listing(directory: epath.Path) -> Iterator[None]:
    """Orbax's listing of `directory`: a folder that cannot be read is a CheckpointError
    naming it and the errno (a missing one is Orbax's: no steps, or a folder it creates)."""
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as error:
        raise guard.not_listable(directory, error) from error


def _registry(
    multiprocessing: ocp.options.MultiprocessingOptions,
) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """The three items of every checkpoint and the Orbax handlers that write them."""
    handlers = {
        "state": ocp.PyTreeCheckpointHandler(multiprocessing_options=multiprocessing),
        "data": ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing),
        "metadata": RecordHandler(multiprocessing_options=multiprocessing),
    }
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item, handler in handlers.items():
        registry.add(item, _SAVE[item], handler)
        registry.add(item, _RESTORE[item], handler)
    return registry


def _to_host(x: Any) -> np.ndarray:
    """A whole array in this process's memory; arrays sharded over processes are all-gathered."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


def _broadcast_json(value: Any) -> Any:
    """Process 0's JSON value, on every process (two small collectives)."""
    text = json.dumps(value).encode() if jax.process_index() == 0 else b""
    size = int(multihost_utils.broadcast_one_to_all(np.int32(len(text))))
    buffer = np.zeros(size, np.uint8)
    buffer[: len(text)] = np.frombuffer(text, np.uint8)
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))))


def _encode(error: Exception) -> dict:
    """What another process needs to raise an error of the same kind as process 0's."""
    code = next(
        (e.errno for e in (error, error.__cause__) if isinstance(e, OSError) and e.errno), None
    )
    kind = "damaged" if isinstance(error, Damaged) else "checkpoint"
    if not isinstance(error, CheckpointError):
        kind = "os" if code else "other"
    return {"kind": kind, "errno": code, "text": f"on process 0: {type(error).__name__}: {error}"}


def _decode(sent: dict) -> Exception:
    """Process 0's error (from `_encode`), to raise on this process."""
    text = sent["text"]
    if sent["kind"] == "damaged":
        return Damaged(text.split(": ", 2)[-1])
    if sent["kind"] == "checkpoint":
        return CheckpointError(text.split(": ", 2)[-1])
    if sent["kind"] == "os":
        return OSError(sent["errno"], f"{text} ({errno.errorcode.get(sent['errno'], '')})")
    return RuntimeError(text)
