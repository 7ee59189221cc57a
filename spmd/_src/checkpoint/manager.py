"""CheckpointManager: the state, PRNG keys, data position and metadata saved together, over Orbax."""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from etils import epath

from spmd._src.checkpoint import final, guard, integrity, quiet
from spmd._src.checkpoint import tree as ct
from spmd._src.checkpoint.integrity import Damaged
from spmd._src.checkpoint.notices import NoticeBoard
from spmd._src.checkpoint.position import as_json as _json
from spmd._src.checkpoint.position import position_of as _position
from spmd._src.checkpoint.position import restore_position as _set_position
from spmd._src.checkpoint.preemption import Mode, Preempted, PreemptionWatcher, check_options
from spmd._src.checkpoint.store import SharedStore, forget_listings, make_store
from spmd._src.clusters.initialize import check_initialized_under_launcher
from spmd._src.errors import CheckpointError, ConfigurationError, message, received
from spmd._src.strategy.base import get_strategy
from spmd._src.strategy.islands import DiLoCoState
from spmd._src.topologies import check_placeable
from spmd._src.validate import boolean, positive_int, positive_number

__all__ = ["CheckpointManager"]

_log = logging.getLogger("spmd.checkpoint")

_PARTIAL = "pass partial=True to restore a part of the checkpoint, else leave it out."


class CheckpointManager:
    """Saves and restores a train state with its data position; every process calls it.

    Built on `orbax.checkpoint.CheckpointManager`. Each step is one Orbax
    checkpoint of three items: `state` (the arrays, as an Orbax PyTree: each
    process writes the shards it owns), `data` (the input position, JSON) and
    `metadata` (your JSON plus the PRNG key implementations). Orbax writes a
    step into a temporary folder and renames it when every process is done,
    so a save that did not finish is never listed or restored.

    Call `save(step, ...)` after every train step: it writes every
    `save_interval_steps` steps, and at the step all processes agree on after a
    preemption notice (SIGTERM), after which it raises `Preempted` (exit code
    42) so that `spmd launch` restarts the job and `restore_or_init` resumes it.

    Args:
      directory: where checkpoints go, one folder per step. With several
        processes, a folder every process sees (a shared filesystem, or an
        object store such as gs://), unless `shared_filesystem=False`.
      max_to_keep: how many of the latest checkpoints to keep (None: all).
      save_interval_steps: `save` writes only at multiples of this step count.
      async_save: write in background threads; `save` returns once the arrays
        are copied to host memory and their checksums are started on the
        devices (they run beside the write; the step commits once both are done).
      shared_filesystem: False when the hosts have no folder in common (each
        its own disk): process 0 then writes the whole state (arrays sharded
        over processes are all-gathered first) to its own `directory`, and
        restoring broadcasts it from there. Every method is then a collective.
      preemption: how a preemption notice is caught and agreed on: "auto",
        "jax", "signal" or "off" (see docs/checkpoints.md, preemption).
      exit_on_preemption: after the preemption checkpoint, close and raise
        `Preempted`; if False, `save` returns True and `preempted_step` is set.
      preemption_check_steps: with the "signal" mechanism and several
        processes, agree on notices every this many steps.
      coordination_timeout: with several processes, how many seconds the
        processes wait for each other when they agree on the directory (at
        construction), on the step (each save that writes a checkpoint) and
        on preemption notices (every `preemption_check_steps`): a process that
        never comes, or brings another directory or step, is a
        `CheckpointError` after at most this long, never a hang.
      read_only: a reader of a directory another job (or manager) writes,
        e.g. an evaluator's: it takes no lock (any number of readers beside
        the one writer), never creates, writes or deletes anything (not
        even a writer's unfinished saves), and lists the directory anew at
        each `all_steps`, `latest_step` and `restore`, so it sees steps as
        the writer commits them; never one being written, nor a damaged
        one; a step the writer's `max_to_keep` removes meanwhile is skipped
        with a log line. Works on a read-only filesystem. `save` and `mark_final` are
        errors; the saving arguments are ignored.

    Raises:
      ConfigurationError: an argument is out of range.
      InitializationError: `spmd launch` started this process and
        `spmd.initialize()` was not called.
      CheckpointError: another open writer holds the directory, or (several
        processes) they passed different directories with
        `shared_filesystem=True`, or do not all see the directory.

    Example:
      >>> ckpt = spmd.CheckpointManager("/tmp/run", max_to_keep=3)  # doctest: +SKIP
      >>> state, start = ckpt.restore_or_init(create_state, key, data=batches)  # doctest: +SKIP
      >>> for step in range(start, total_steps):  # doctest: +SKIP
      ...     state, metrics = train_step(state, *next(batches))
      ...     ckpt.save(step + 1, state, data=batches)
      >>> ckpt.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
        *,
        shared_filesystem: bool = True,
        preemption: Mode = "auto",
        exit_on_preemption: bool = True,
        preemption_check_steps: int = 1,
        coordination_timeout: float = 30.0,
        read_only: bool = False,
    ):
        check_initialized_under_launcher()
        if max_to_keep is not None:
            _check_positive(max_to_keep, "max_to_keep", "or None to keep every checkpoint")
        _check_positive(save_interval_steps, "save_interval_steps", "e.g. 100")
        self._root = _absolute(directory)
        self._interval = save_interval_steps
        self.read_only = boolean(read_only, "read_only", fix="pass read_only=True for a reader.")
        self._exit_on_preemption = boolean(
            exit_on_preemption, "exit_on_preemption", fix="pass exit_on_preemption=False."
        )
        async_save = boolean(async_save, "async_save", fix="pass async_save=False.")
        shared_filesystem = boolean(
            shared_filesystem, "shared_filesystem", fix="pass shared_filesystem=False."
        )
        self._timeout = _check_timeout(coordination_timeout)
        watch = "off" if read_only else preemption
        check_options(watch, preemption_check_steps)  # before anything is opened
        self._board = NoticeBoard(self._timeout)  # the preemption notices, where not agreed
        self._pending: list[int] = []  # steps saved since the last wait that succeeded
        self._maybe_final = False  # this writer marked a final step (a later save clears it)
        self._session = final.new_session()  # names this writer in the markers it writes
        self._prepared = False  # whether the checksums' programs for the state were started
        self._async_save = async_save
        # The SIGTERM watch is the last thing opened: a manager that fails to open leaves
        # the process's SIGTERM handling as it found it.
        self._lock = guard.open_directory(self._root, shared_filesystem, self._timeout, read_only)
        try:
            store = (max_to_keep, save_interval_steps, async_save, shared_filesystem, read_only)
            self._store = make_store(self._root, *store)
            self._hold = self._hold_final()
            self._watcher = PreemptionWatcher(watch, preemption_check_steps)
        except BaseException:
            if getattr(self, "_hold", None) is not None:
                self._release_hold()
            if getattr(self, "_store", None) is not None:
                with contextlib.suppress(Exception):
                    self._store.close()
            self._lock.release()
            raise
        self._closed = False
        if not read_only:
            quiet.writer_opened(self)

    def _hold_final(self) -> final.Hold | None:
        """A writer takes an ended run's final-step marker away while it holds the directory
        (process 0; see spmd/_src/checkpoint/final.py); put back at close or exit if it saved nothing."""
        if self.read_only or jax.process_index() != 0:
            return None
        hold = final.Hold(self.directory, self._session)
        self._release_hold = weakref.finalize(self, hold.release)
        return hold

    # -- what is there ----------------------------------------------------------

    @property
    def directory(self) -> epath.Path:
        """The checkpoint folder (with `shared_filesystem=False`, process 0's)."""
        return self._store.directory

    @property
    def preempted_step(self) -> int | None:
        """The step at which the processes agreed to stop after a preemption notice, if any."""
        return self._watcher.step

    def all_steps(self) -> list[int]:
        """Every committed, intact checkpoint's step, oldest first.

        Unfinished saves and damaged step folders (see `damaged_steps`) are
        never listed. Damaged array data is found when restoring (checksums).
        """
        return self._store.all_steps()

    def damaged_steps(self) -> dict[int, str]:
        """step -> why, for step folders that are not complete checkpoints (left out of all_steps)."""
        return self._store.damaged_steps()

    def latest_step(self) -> int | None:
        """The latest committed, intact checkpoint's step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def final_step(self) -> int | None:
        """The step the training run marked as its last (`mark_final`), or None while it runs."""
        forget_listings(self.directory)  # the writer may be another process
        mark = final.read(self.directory)
        return None if mark is None else mark.step

    def mark_final(self, step: int | None = None) -> int:
        """Marks `step` (the latest by default) as the run's last checkpoint; every process calls it.

        Waits for saves in flight first. Readers (`read_only=True`, a
        `SidecarEvaluator`) then know the run has ended: an evaluator stops
        once it has evaluated this step. `Trainer.fit`'s `ModelCheckpoint`
        calls it when fit ends. A later `save` removes the mark (the run goes
        on), and so does the next writer that opens the directory (a second
        fit, a resumed run) until it closes having saved nothing.

        Returns:
          The step marked.

        Raises:
          CheckpointError: a read-only manager, or `step` is not the latest
            complete checkpoint (or there is none).
        """
        self._check_writer("mark_final")
        self.wait()
        step = final.check(step, self.all_steps(), self.directory)
        if jax.process_index() == 0:
            final.write(self.directory, step, self._session)
        self._maybe_final = True
        guard.agree("mark_final", step, self._timeout)
        return step

    def reached_preemption(self, step: int) -> bool:
        """Whether `step` is where every process agreed to save and stop (see `save`)."""
        return self._watcher.reached(step)

    # -- save -------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        data: Any = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves `state` (and the data position) as checkpoint `step`, if it is time to.

        Every process calls it, at every step, with the same step numbers.

        Args:
          step: the number of steps done; checkpoints are named by it.
          state: a pytree of arrays (optax states, typed PRNG keys included) or
            flax NNX objects (their `nnx.state` is saved).
          data: the input position: an iterator with `get_state() -> dict`, or
            a JSON dict, or None.
          metadata: a small JSON dict saved with the step; read it back with
            `metadata(step)`.
          force: save even if `step` is not a multiple of `save_interval_steps`.

        Returns:
          Whether a checkpoint was written at this step. A step already saved
          is never overwritten.

        Raises:
          Preempted: after saving the step every process agreed on after a
            preemption notice (with `exit_on_preemption=True`).
          CheckpointError: `data` or `metadata` is not JSON, the manager is
            closed, the directory holds later steps than `step`, the
            processes pass different steps or not all of them call it
            (after `coordination_timeout`), or an earlier asynchronous save
            failed (the message names its step).
        """
        self._check_writer("save")
        due = force or step % self._interval == 0
        preempted = self._watcher.reached(step, notices=self._notices(step, due))
        saved = False
        if due or preempted:
            saved = self._save(step, state, data, metadata)
        elif not self._prepared:  # compile the checksums' programs before the first write
            integrity.prepare(ct.to_saveable(_leaves(state))[0])
            self._prepared = True
        if preempted:
            self._stop(step)
        return saved

    def _notices(self, step: int, due: bool) -> list[bool]:
        """Every process's preemption notice at `step`, exchanged only where they could differ.

        A step due for a save (every process computes the same `due` from the
        same step) is agreed on in full: the step numbers are compared, and the
        notices ride along. Another step needs an exchange only where the
        processes look for notices ("signal" mode, every preemption_check_steps):
        a barrier, no key kept (see notices.py). Elsewhere nothing is exchanged.
        """
        noticed = self._watcher.noticed()
        if jax.process_count() == 1:
            return [noticed]
        if due:
            vote = {"step": step, "notice": noticed}
            votes = guard.agree(f"save(step={step})", vote, self._timeout, guard.same_step)
            return [v["notice"] for v in votes.values()]
        if self._watcher.mode == "signal" and step % self._watcher.check_every == 0:
            return self._board.exchange(step, noticed)
        return []

    def _save(self, step: int, state: Any, data: Any, metadata: Any) -> bool:
        folders = self._store.step_folders()
        if step in folders:
            return False
        guard.check_newer_steps(step, folders, self.directory)
        guard.check_no_file(step, self._store.step_dir(step))
        if self._maybe_final and jax.process_index() == 0:
            final.clear(self.directory)  # the run goes on past the step it marked
        self._maybe_final = False
        if self._hold is not None:
            self._hold.saved = True  # the marker it took away stays away
        arrays, keys = ct.to_saveable(_leaves(state))
        if not self._prepared:  # the first write: compile beside Orbax's copies to host
            integrity.prepare(arrays)
            self._prepared = True
        position = guard.every_pipeline(_position(data), self._timeout)
        record = integrity.PendingRecord(
            {
                "format": integrity.FORMAT,
                "prng_keys": keys,
                "user": _json(metadata, "metadata"),
                "data_checksum": integrity.json_checksum(position),
            }
        )
        # The record is sealed in the save's commit, once the checksums are in: a step is
        # never committed without them. They start once Orbax's async save has copied the
        # arrays to host memory, so they run beside its write; a synchronous save commits
        # before it returns, so there they start first.
        if not self._async_save:
            record.start(arrays)
        try:
            saved = self._store.save(step, arrays, position, record)
        except CheckpointError:
            raise
        except Exception as e:
            raise self._write_failed([*self._pending, step], e) from e
        finally:  # after a failure too: with several processes some checksums are collectives
            record.start(arrays)
        self._pending.append(step)
        return saved

    def _stop(self, step: int) -> None:
        self.wait()
        self._watcher.answered()
        if self._exit_on_preemption:
            self.close()
            raise Preempted(step, str(self._root))

    # -- restore ----------------------------------------------------------------

    def restore(
        self,
        step: int | None = None,
        target: Any = None,
        *,
        data: Any = None,
        partial: bool = False,
    ) -> Any:
        """Restores checkpoint `step` (the latest by default) into `target`'s layout.

        Args:
          step: which checkpoint; None for the latest complete one.
          target: the state's form and placement: a placed state, or an
            abstract one (`ShapeDtypeStruct`s with shardings, e.g. from
            `strategy.abstract_state`), or NNX objects (updated in place).
            Any strategy and device count: the arrays are resharded. Leaves
            without a sharding take the current strategy's layout. None
            returns the saved tree as nested dicts of numpy arrays (PRNG keys
            as their key data), for inspection.
          data: an iterator with `set_state(dict)`, or a dict, to restore the
            data position into.
          partial: `target` may leave out parts of the checkpoint (e.g. the
            parameters without the optimizer state): only its paths are read
            (and checksummed); each must be in the checkpoint.

        Returns:
          The state, shaped and placed like `target` (NNX objects: `target` itself).

        Raises:
          CheckpointError: no such checkpoint, `target`'s tree differs from
            the saved one (the message names the paths), the step's files
            are damaged (missing or invalid, or an array's values, the data
            position or the metadata are not the ones saved: the message
            names the step and the arrays), or they exist but cannot be read
            (permission, I/O error: the message names the path and errno).
        """
        self._check_open("restore")
        step = self._resolve_step(step)
        quiet.drop_late_completions()  # before the reads: a failed one's late siblings can come at once
        if target is None:
            result = self._restore_numpy(step)
        else:
            check_placeable(target, "CheckpointManager.restore")
            result = self._restore_into(step, target, boolean(partial, "partial", fix=_PARTIAL))
        if data is not None:
            _set_position(data, self._saved_position(step), step)
        return result

    def restore_data(self, step: int | None = None) -> dict | None:
        """The data position saved with checkpoint `step` (latest by default), or None.

        Raises:
          CheckpointError: no such step, or its position or metadata is damaged
            (checksum) or cannot be read.
        """
        self._check_open("restore_data")
        return self._saved_position(self._resolve_step(step))

    def metadata(self, step: int | None = None) -> dict | None:
        """The `metadata` dict saved with checkpoint `step` (latest by default), or None.

        Raises:
          CheckpointError: no such step, or its metadata is damaged (checksum)
            or cannot be read.
        """
        self._check_open("metadata")
        return self._record(self._resolve_step(step)).get("user")

    def saved_arrays(self, step: int | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        """The arrays saved at `step` (the latest by default), read from its metadata alone.

        Returns:
          '/'-joined path in the saved state -> (shape, dtype name), e.g.
          {"params/w": ((8, 64), "float32"), ...}: what a restore target must hold.

        Raises:
          CheckpointError: no such step, or its files cannot be read.
        """
        self._check_open("saved_arrays")
        step = self._resolve_step(step)
        tree = self._read(step, "tree", lambda: self._store.saved_tree(step))
        return {p: (tuple(shape), np.dtype(dtype).name) for p, (shape, dtype) in tree.items()}

    def restore_or_init(
        self,
        create_fn: Callable[..., Any],
        *args: Any,
        data: Any = None,
        strategy: Any = None,
        **kwargs: Any,
    ) -> tuple[Any, int]:
        """Restores the latest complete checkpoint, or creates a fresh state if there is none.

        The fault-tolerant start of a training loop: after a crash or a
        preemption, the relaunched job resumes where the last checkpoint left off.

        Args:
          create_fn, *args, **kwargs: make the state, as for `strategy.init`;
            on restore only their shapes are used (`strategy.abstract_state`).
          data: an iterator or dict whose position is restored too.
          strategy: where the state goes; the current strategy by default.

        Damaged steps are skipped, each with a warning that says why (see
        `restore_newest`): a damaged latest step never stops a job from starting.

        Returns:
          (state, step): step 0 for a fresh state, else the restored step.
        """

        strategy = strategy or get_strategy()
        if self.latest_step() is None and not self.damaged_steps():
            return strategy.init(create_fn, *args, **kwargs), 0
        target = strategy.abstract_state(create_fn, *args, **kwargs)
        state, step = self.restore_newest(target, data=data)
        if step is None:
            return strategy.init(create_fn, *args, **kwargs), 0
        return state, step

    def restore_newest(self, target: Any, *, data: Any = None) -> tuple[Any, int | None]:
        """Restores the newest intact checkpoint into `target`, skipping damaged ones.

        A step is skipped when its folder is incomplete (`damaged_steps`), its
        files cannot be read, or an array's checksum differs; each skip is
        logged as a warning naming the step and why. Skipped step folders are
        renamed to `<step>.damaged` (kept for inspection, never listed again),
        so that the run can save those step numbers anew.

        Args:
          target: the state's form and placement, as for `restore`.
          data: an iterator or dict whose position is restored too.

        Returns:
          (state, step), or (None, None) if no step could be restored.
        """
        self._check_open("restore_newest")
        skipped = self.damaged_steps()
        for step, why in skipped.items():
            _log.warning("skipping checkpoint step %d in %s: %s", step, self.directory, why)
        restored = None, None
        for step in reversed(self.all_steps()):
            try:
                _log.info("restoring step %d from %s", step, self.directory)
                restored = self.restore(step, target=target, data=data), step
                break
            except Damaged as e:
                skipped[step] = str(e).splitlines()[1]
                _log.warning("skipping checkpoint step %d in %s: %s", step, self.directory, e)
        self._set_aside(sorted(skipped))
        return restored

    def _set_aside(self, steps: list[int]) -> None:
        if not steps or self.read_only:  # a reader leaves the writer's folders as they are
            return
        self._store.set_aside(steps)
        guard.agree("restore_newest (setting damaged steps aside)", steps, self._timeout)
        self._store.reload()

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None and steps:
            return steps[-1]
        if step in steps:
            return step
        raise CheckpointError(
            message(
                "restore needs a complete checkpoint at the step asked for.",
                received(step=step, directory=str(self.directory), complete_steps=steps),
                "save one first, pick one of the complete steps, or use restore_or_init() "
                "to start fresh when there is none.",
            )
        )

    def _restore_numpy(self, step: int) -> dict:
        values = self._read(step, "arrays", lambda: self._store.restore_numpy(step))
        self._verify(step, values)
        return ct.nest(values)

    def _restore_into(self, step: int, target: Any, partial: bool = False) -> Any:
        flat, rebuild = ct.flatten(target)
        shardings = ct.target_shardings(target, flat)
        abstract = {p: ct.abstract_leaf(leaf, shardings[p]) for p, leaf in flat.items()}
        wanted = {p: (a.shape, np.dtype(a.dtype)) for p, a in abstract.items()}
        saved = self._read(step, "tree", lambda: self._store.saved_tree(step))
        ct.check_match(saved, wanted, step, partial, diloco=isinstance(target, DiLoCoState))
        restore = lambda: self._store.restore_placed(step, abstract, partial)  # noqa: E731
        values = self._read(step, "arrays", restore)
        ct.check_restored_dtypes(saved, values, step)  # before the checksum: not damage
        self._verify(step, values)
        return rebuild(ct.wrap_keys(values, flat))

    def _read(self, step: int, what: str, read: Callable[[], Any]) -> Any:
        """`read()`, compared over processes: any process's error is every process's.

        Missing or invalid content is `Damaged` (skipped by restore_newest); a
        file that exists but cannot be read (permission, I/O error) is not.
        """
        error = None
        try:
            result = read()
        except CheckpointError:
            raise
        except Exception as e:  # tensorstore and Orbax raise many types for damaged files
            error, result = e, None
        report = error and {"error": guard.first_line(error), "damage": integrity.is_damage(error)}
        reports = guard.agree(f"restore(step={step})", report, self._timeout)
        failed = {p: r for p, r in reports.items() if r is not None}
        if failed:
            where = str(self._store.step_dir(step))
            if self.read_only and all(r["damage"] for r in failed.values()) and self._gone(step):
                errors = {p: r["error"] for p, r in failed.items()}
                raise integrity.removed(step, where, what, errors) from error
            raise integrity.read_failed(step, where, what, failed, error) from error
        return result

    def _gone(self, step: int) -> bool:
        """Whether step `step`'s folder is gone (a reader's: the writer removed it); only
        a shared folder can tell (with shared_filesystem=False it is process 0's)."""
        if not isinstance(self._store, SharedStore):
            return False
        try:
            return not self._store.step_dir(step).exists()
        except OSError:
            return False

    def _record(self, step: int) -> dict:
        """The step's metadata record, verified (format and checksum)."""
        meta = self._read(step, "metadata", lambda: self._store.read_json(step, "metadata"))
        return integrity.verify_record(meta, step, str(self._store.step_dir(step)))

    def _saved_position(self, step: int) -> Any:
        """The step's data position, verified against its checksum."""
        meta = self._record(step)
        item = self._read(step, "data", lambda: self._store.read_json(step, "data"))
        return integrity.verify_position(item, meta, step, str(self._store.step_dir(step)))

    def _verify(self, step: int, values: ct.Flat) -> None:
        meta = self._record(step)
        if meta["format"] == 1:
            _log.warning("checkpoint step %d has no checksums (format 1): not verified", step)
        integrity.verify(values, meta, step, str(self._store.step_dir(step)))

    # -- lifetime ---------------------------------------------------------------

    def wait(self) -> None:
        """Blocks until every save in flight is written and committed.

        Raises:
          CheckpointError: a save in flight failed (e.g. the disk is full);
            the message names the steps and the directory.
        """
        if not self._closed:
            self._finish(self._store.wait)

    def close(self) -> None:
        """Waits for saves in flight, stops Orbax's threads, puts back the SIGTERM handler."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish(self._store.close)
        finally:
            quiet.writer_closed(self)
            if self._hold is not None:
                self._release_hold()  # before the lock: no other writer comes between
            self._lock.release()
            self._watcher.close()
            self._board.close()

    def _finish(self, wait: Callable[[], None]) -> None:
        try:
            wait()
        except Exception as e:
            raise self._write_failed(self._pending, e) from e
        finally:
            self._pending = []

    def _write_failed(self, steps: list[int], error: Exception) -> CheckpointError:
        """The error for saves of `steps` that failed, each reported once: the steps since
        the last success are forgotten (the later `wait` and `close` do not name them
        again), and the failed ones' temporary folders removed (their space is freed)."""
        failed = self._failed(steps)
        self._pending = []
        self._store.discard_unfinished(failed)
        return guard.write_failed(failed, self.directory, error)

    def _failed(self, steps: list[int]) -> list[int]:
        """Those of `steps` not committed intact (a process that cannot see process 0's disk
        with shared_filesystem=False cannot tell: all of them)."""
        if not getattr(self._store, "is_chief", True):
            return steps
        return integrity.failed_steps(steps, self._store.step_dir)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        extra = ", read_only=True" if self.read_only else ""
        return f"CheckpointManager({str(self._root)!r}{extra})"

    def _check_writer(self, what: str) -> None:
        self._check_open(what)
        if self.read_only:
            raise guard.read_only_error(what, self._root)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CheckpointError(
                message(
                    f"{what}() needs an open CheckpointManager.",
                    received(directory=str(self._root), closed=True),
                    "create a new CheckpointManager for the directory (close() is final).",
                )
            )


# -- helpers ------------------------------------------------------------------


def _absolute(directory: str | os.PathLike[str]) -> epath.Path:
    if not isinstance(directory, str | os.PathLike) or not str(directory):
        raise ConfigurationError(
            message(
                "directory is a path (local, or a URL such as gs://bucket/run).",
                received(directory=directory),
                'pass e.g. "/tmp/run/checkpoints".',
            )
        )
    text = os.fspath(directory)
    return epath.Path(text if "://" in text else os.path.abspath(text))


def _check_timeout(value: Any) -> float:
    return positive_number(value, "coordination_timeout", fix="pass e.g. 30.")


def _check_positive(value: Any, name: str, hint: str) -> None:
    positive_int(value, name, fix=f"pass {hint}.")


def _leaves(state: Any) -> ct.Flat:
    """The state's leaves by path; a state without arrays, or an abstract one, is an error."""
    flat = ct.flatten(state)[0]
    if not flat:
        raise CheckpointError(
            message(
                "save needs a state with at least one array.",
                received(state_type=type(state).__name__, leaves=0),
                "pass the train state itself (params, optimizer state, ...).",
            )
        )
    abstract = [path for path, leaf in flat.items() if isinstance(leaf, jax.ShapeDtypeStruct)]
    if abstract:
        raise CheckpointError(
            message(
                "save writes a placed state (arrays), not an abstract one (jax.ShapeDtypeStruct "
                "leaves, as strategy.abstract_state returns: shapes, no values).",
                received(abstract_leaves=abstract[:5], of=len(flat)),
                "save the state strategy.init(...) or a step returns; an abstract state is "
                "what manager.restore(step, target=...) takes.",
            )
        )
    return flat
