"""Checksums of a checkpoint's arrays, data position and metadata; which step folders are intact.

An array's checksum is a property of its values, not of its files: each
element's bits are mixed with its row-major index by a nonlinear 32-bit
finalizer (murmur3's), then summed; two such sums with different seeds make
64 bits. So changes to two elements never cancel out (short of a 2**-64
chance), and the sum is the same for every sharding and process count: it
adds up over blocks. `save` computes it on the devices, each device folding
the blocks it holds (one copy of each), beside Orbax's write, and stores it
in the step's metadata; `restore` computes it again on what it read and compares. The data position and the metadata are JSON:
their checksum is a SHA-256 of their canonical text, and the metadata's own
checksum covers everything in it (the array checksums included). So a
flipped bit in any file of a step, a truncated chunk Orbax fills with zeros,
or a shard read from the wrong place is an error that names the step.

Formats (saved in each step's metadata): 1, no checksums (restored with a
warning); 2, array checksums of an earlier, linear kind; 3, the above.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import SingleDeviceSharding

from spmd._src.errors import CheckpointError, message, received
from spmd._src.placement import in_device_memory

__all__ = [
    "FORMAT",
    "Damaged",
    "Pending",
    "PendingRecord",
    "RecordHandler",
    "Removed",
    "checksums",
    "commit_time",
    "compile_count",
    "damage",
    "dispatch",
    "failed_steps",
    "is_damage",
    "json_checksum",
    "prepare",
    "read_error",
    "read_failed",
    "removed",
    "seal",
    "verify",
    "verify_position",
    "verify_record",
]

FORMAT = 3  # the format `save` writes (see the module docstring)
# Odd 32-bit multipliers: the two halves of a format-2 checksum weigh positions differently.
_MUL = (np.uint32(0x9E3779B1), np.uint32(0x85EBCA77))
_SEEDS = (np.uint32(0x9E3779B9), np.uint32(0x7F4A7C15))  # the two halves of a format-3 one
_ITEMS = ("state", "data", "metadata")  # the items of every spmd checkpoint
_SHOWN = 8
# Errors whose cause is missing or invalid content (damage), not an unreadable disk.
_DAMAGE_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)
_NOT_DAMAGE_TEXT = (
    "PERMISSION_DENIED",
    "Permission denied",
    "Operation not permitted",
    "Input/output error",
)

_BATCH = 128  # most leaves of one kind per call (stacked: it compiles about as fast as one)
_BATCH_BYTES = 32 * 2**20  # most bytes of one call's blocks on a device: the call stacks them


class Damaged(CheckpointError):
    """A step whose files are unreadable or whose arrays fail their checksums."""


class Removed(Damaged):
    """A step a reader listed whole, which its writer removed (max_to_keep) while it was read.

    A `Damaged`: whatever skips damaged steps (restore_newest, SidecarEvaluator) skips it.
    """


def removed(step: int, where: str, what: str, errors: dict[int, str]) -> Removed:
    """The error for a read of `step` that failed because the step's folder went away."""
    return Removed(
        message(
            f"Checkpoint step {step} stays in place while it is read ({what}).",
            received(step=step, checkpoint=where, exists=False, errors_by_process=errors),
            "the training job's max_to_keep removed it while this reader read it: read a "
            "later step (latest_step()), or keep more steps (a larger max_to_keep) so that "
            "a reader has time to read each one.",
        )
    )


def _bits_np(x: np.ndarray) -> np.ndarray:
    """The element bits of a numpy array as uint32, one or two words per element."""
    x = np.ascontiguousarray(x)
    if np.iscomplexobj(x):
        x = np.stack([x.real, x.imag], axis=-1)
    if x.dtype.itemsize == 8:
        return x.view(np.uint32).reshape(*x.shape, 2)
    return x.view(np.dtype(f"uint{8 * x.dtype.itemsize}")).astype(np.uint32)


def _bits_jax(x: jax.Array) -> jax.Array:
    """`_bits_np` for a jax array, on its devices."""
    if jnp.iscomplexobj(x):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    size = x.dtype.itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)


def _position(shape: tuple[int, ...], xp: Any, start: Any = None, full: Any = None) -> Any:
    """Each element's row-major index (mod 2**32) in an array of shape `full`, for its block
    of shape `shape` that begins at `start` (by default the whole array): built per
    dimension, no reshape, no gather."""
    full = shape if full is None else full
    index = xp.zeros(shape, xp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        iota = xp.arange(shape[dim], dtype=xp.uint32)
        if start is not None:
            iota = iota + start[dim]
        iota = iota.reshape([-1 if d == dim else 1 for d in range(len(shape))])
        index = index + iota * xp.uint32(stride % 2**32)
        stride *= full[dim]
    return index


def _fold_linear(bits: Any, index: Any, xp: Any) -> tuple[Any, Any]:
    """Format 2's two 32-bit halves of the checksum of `bits` (uint32) at positions `index`."""
    index = index + xp.uint32(1)
    rotated = (bits << xp.uint32(7)) | (bits >> xp.uint32(25))
    low = xp.sum(bits * (index * _MUL[0]), dtype=xp.uint32)
    high = xp.sum((rotated ^ index) * _MUL[1], dtype=xp.uint32)
    return low, high


def _mix(h: Any, xp: Any) -> Any:
    """murmur3's 32-bit finalizer: every input bit changes about half the output bits."""
    h = h ^ (h >> xp.uint32(16))
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> xp.uint32(13))
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> xp.uint32(16))


def _fold_mixed(bits: Any, index: Any, xp: Any) -> tuple[Any, Any]:
    """Format 3's halves: the sums of each element's bits mixed with its index, two seeds."""
    low, high = (
        xp.sum(_mix(bits ^ (index * _MUL[i] + seed), xp), dtype=xp.uint32)
        for i, seed in enumerate(_SEEDS)
    )
    return low, high


_FOLDS = {2: _fold_linear, 3: _fold_mixed}


# -- the device programs ---------------------------------------------------------------------

_programs: dict[tuple, Future] = {}  # program key (see `_calls`) -> its compile
_plans: dict[tuple, list] = {}  # kind of leaf -> the blocks this process folds (`_plan`)
_compiles = 0  # how many checksum programs were compiled
_lock = threading.Lock()  # `prepare` and `dispatch` may run on two threads
_compiler = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="spmd-checksums")


def compile_count() -> int:
    """How many checksum programs were compiled so far: one per kind of leaf (shape, dtype,
    sharding) and device holding its blocks, whatever the leaf counts."""
    return _compiles


def _kind(x: jax.Array) -> tuple:
    """(shape, dtype, sharding) of the array the programs read: `x` in device memory."""
    sharding = x.sharding
    if getattr(sharding, "memory_kind", None) not in (None, "device"):
        sharding = sharding.with_memory_kind("device")
    return x.shape, x.dtype, sharding


def _batches(kinds: dict[str, tuple]) -> list[tuple[tuple, list[str]]]:
    """The calls for leaves of these kinds: ((shape, dtype, sharding, batch), paths), a call
    per `batch` leaves of one kind (the last one padded), `batch` bounded by count and bytes."""
    by_kind: dict[tuple, list[str]] = {}
    for path, kind in kinds.items():
        by_kind.setdefault(kind, []).append(path)
    calls = []
    for kind, paths in by_kind.items():
        size = max(1, min(len(paths), _BATCH, _BATCH_BYTES // _block_bytes(*kind)))
        calls += [((*kind, size), paths[i : i + size]) for i in range(0, len(paths), size)]
    return calls


def _block_bytes(shape: tuple[int, ...], dtype: Any, sharding: Any) -> int:
    """Bytes of an array's block on one device (of the whole array, if split unevenly)."""
    try:
        block = sharding.shard_shape(shape)
    except ValueError:
        block = shape
    return max(1, math.prod(block)) * np.dtype(dtype).itemsize


def _plan(kind: tuple, x: jax.Array) -> list[tuple[int, Any, jax.Array, tuple[int, ...]]]:
    """The blocks of arrays of this kind that this process folds, one per distinct block
    (replica 0): (its place among the addressable shards, device, start, block shape)."""
    if kind not in _plans:
        plan = []
        for i, shard in enumerate(x.addressable_shards):
            if shard.replica_id == 0:
                bounds = [s.indices(n)[:2] for s, n in zip(shard.index, x.shape, strict=True)]
                start = np.array([lo for lo, _ in bounds], np.uint32)
                block = tuple(hi - lo for lo, hi in bounds)
                plan.append((i, shard.device, jax.device_put(start, shard.device), block))
        _plans[kind] = plan
    return _plans[kind]


def _calls(version: int, key: tuple, x: jax.Array) -> list[tuple[tuple, Callable]]:
    """(program key, what to call the program with: leaves -> args) for one batch.

    An array this process holds whole is folded block by block, each on its device by
    a program of that device alone: no communication, and JAX launches a one-device
    program from the calling thread, so it returns at once (XLA:CPU runs a program
    over several devices through a few worker threads and returns once every device
    has started, which on a host with fewer cores than devices waits for the first
    devices' work). The host adds the blocks' partial sums. An array sharded over
    processes is folded by one program over all its devices, which adds them up (an
    all-reduce): every process must dispatch it.
    """
    shape, dtype, sharding, size = key
    if not sharding.is_fully_addressable:
        return [(("whole", version, *key), lambda leaves: (leaves,))]
    calls = []
    for i, device, start, block in _plan(key[:3], x):
        program = ("block", version, shape, dtype, block, device, size)
        calls.append(
            (program, lambda leaves, i=i, s=start: ([a.addressable_data(i) for a in leaves], s))
        )
    return calls


def _programs_for(keys: list[tuple]) -> list[Future]:
    """The compile of each program: new ones start at once, each in a thread of its own
    (up to one per core)."""
    global _compiles
    with _lock:
        for key in dict.fromkeys(keys):
            if key not in _programs:
                _programs[key] = _compiler.submit(_compile, *key)
                _compiles += 1
        return [_programs[key] for key in keys]


def _ready(keys: list[tuple]) -> list[Any]:
    """The compiled programs, once compiled (a compile that failed is tried again next time)."""
    futures = _programs_for(keys)
    try:
        return [f.result() for f in futures]
    except Exception:
        with _lock:
            for key, f in zip(keys, futures, strict=True):
                if f.done() and f.exception() is not None:
                    _programs.pop(key, None)
        raise


def _compile(how: str, version: int, shape: tuple, dtype: Any, *rest: Any) -> Any:
    """The program of a key from `_calls`: (batch, 2) sums of `batch` leaves (or blocks)."""
    if how == "whole":
        sharding, size = rest
        args = ([jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)] * size,)
        fold = functools.partial(_fold_stack, version, start=None, full=shape)
    else:
        block, device, size = rest
        one = SingleDeviceSharding(device)
        args = (
            [jax.ShapeDtypeStruct(block, dtype, sharding=one)] * size,
            jax.ShapeDtypeStruct((len(shape),), jnp.uint32, sharding=one),
        )
        fold = functools.partial(_fold_stack, version, full=shape)
    return jax.jit(fold).lower(*args).compile()


def _fold_stack(version: int, arrays: list[Any], start: Any, full: tuple[int, ...]) -> Any:
    """(len(arrays), 2): each array's (low, high), for blocks at `start` of arrays shaped `full`."""

    def one(bits: jax.Array) -> jax.Array:
        extra = bits.shape[len(full) :]  # complex and 8-byte elements: 2 or 4 words each
        at = None if start is None else [*start, *[jnp.uint32(0)] * len(extra)]
        index = _position(bits.shape, jnp, at, (*full, *extra))
        return jnp.stack(_FOLDS[version](bits, index, jnp))

    return jax.vmap(one)(jnp.stack([_bits_jax(x) for x in arrays]))


class Pending:
    """Checksums dispatched to the devices, not yet fetched: `result()` waits for them.

    JAX dispatches the programs asynchronously: their inputs are held until they
    have run, so the caller may donate or overwrite the arrays once `dispatch` returns.
    """

    def __init__(self, calls: list[tuple[list[str], list[Any]]], host: dict):
        self._calls, self._host = calls, host
        self._result: dict[str, str] | None = None

    def result(self) -> dict[str, str]:
        """path -> 16 hex digits (blocks until the device programs have run, once)."""
        if self._result is None:
            found = dict(self._host)
            fetched = jax.device_get([parts for _, parts in self._calls])
            for (paths, _), parts in zip(self._calls, fetched, strict=True):
                sums = np.sum(np.stack(parts), axis=0, dtype=np.uint32)  # over the blocks
                found.update({p: (sums[i, 0], sums[i, 1]) for i, p in enumerate(paths)})
            self._result = {p: f"{int(hi):08x}{int(lo):08x}" for p, (lo, hi) in found.items()}
            self._calls = []
        return self._result


def prepare(arrays: dict[str, Any], version: int = FORMAT) -> None:
    """Starts compiling, in background threads, the programs `dispatch(arrays)` will need."""
    on_device = {p: x for p, x in arrays.items() if isinstance(x, jax.Array)}
    _programs_for([program for _, _, calls in _work(version, on_device) for program, _ in calls])


def dispatch(arrays: dict[str, Any], version: int = FORMAT) -> Pending:
    """Starts `checksums(arrays)`: the device programs are dispatched, not waited for.

    Waits only for programs still compiling (the first time a kind of leaf is seen,
    unless `prepare` compiled it ahead). numpy arrays are summed here, on the host
    (the caller may change them after). With several processes, every process must
    call it (a collective for arrays sharded over processes).
    """
    on_device = {p: in_device_memory(x) for p, x in arrays.items() if isinstance(x, jax.Array)}
    host = {p: _host_sum(x, version) for p, x in arrays.items() if p not in on_device}
    work = _work(version, on_device)
    programs = iter(_ready([program for _, _, calls in work for program, _ in calls]))
    pending = []
    for (*_, size), paths, calls in work:
        leaves = [on_device[p] for p in paths]
        leaves += leaves[-1:] * (size - len(leaves))  # the last batch, padded: one program
        pending.append((paths, [next(programs)(*args(leaves)) for _, args in calls]))
    return Pending(pending, host)


def _work(version: int, arrays: dict[str, jax.Array]) -> list[tuple[tuple, list[str], list]]:
    """(batch key, paths, its calls from `_calls`) of every batch of these arrays."""
    batches = _batches({p: _kind(x) for p, x in arrays.items()})
    with _lock:
        return [(key, paths, _calls(version, key, arrays[paths[0]])) for key, paths in batches]


def _host_sum(x: Any, version: int) -> tuple[Any, Any]:
    bits = _bits_np(np.asarray(x))
    with np.errstate(over="ignore"):
        return _FOLDS[version](bits, _position(bits.shape, np), np)


def checksums(arrays: dict[str, Any], version: int = FORMAT) -> dict[str, str]:
    """path -> 16 hex digits, for jax arrays (on their devices) and numpy arrays (on the host).

    With several processes, every process must call it (a collective for arrays
    sharded over processes); every process gets the same values.

    Args:
      arrays: path -> array.
      version: the checkpoint format whose checksum to compute (2 or 3).
    """
    return dispatch(arrays, version).result()


class PendingRecord:
    """A step's metadata record whose array checksums are still being computed.

    `save` hands it to Orbax in place of the record, then `start`s the checksums
    once Orbax has copied the arrays to host memory, so that they run beside
    Orbax's write and never delay its copies (on XLA:CPU both share the same
    worker threads). `RecordHandler` resolves it in the save's background
    commit: the step is committed only once its record, checksums included, is
    written.
    """

    def __init__(self, meta: dict):
        self._meta = meta
        self._sums: Pending | None = None
        self._error: Exception | None = None
        self._started = threading.Event()

    def start(self, arrays: dict[str, Any]) -> None:
        """Dispatches the checksums of `arrays`, once. Never raises: a failure to start
        them fails `resolve`, so the step is not committed and `wait()` reports it."""
        if self._started.is_set():
            return
        try:
            self._sums = dispatch(arrays)
        except Exception as e:
            self._error = e
        finally:
            self._started.set()

    def resolve(self) -> dict:
        """The sealed record: `meta` with "checksums", and its own checksum (waits for
        `start`, then for the device programs)."""
        self._started.wait()
        if self._error is not None:
            raise self._error
        return seal({**self._meta, "checksums": self._sums.result()})


class RecordHandler(ocp.JsonCheckpointHandler):
    """Orbax's JSON handler for the `metadata` item; resolves a `PendingRecord` as it writes."""

    async def _save_fn(self, x: Any, directory: epath.Path) -> None:
        if isinstance(x, PendingRecord):
            x = x.resolve()
        await super()._save_fn(x, directory)


def json_checksum(value: Any) -> str:
    """SHA-256 (hex) of a JSON value's canonical text: sorted keys, no spaces."""
    value = json.loads(json.dumps(value))  # as it reads back: tuples as lists, keys as text
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def seal(meta: dict) -> dict:
    """`meta` with "checksum": the checksum of everything else in it."""
    return {**meta, "checksum": json_checksum(meta)}


def _damaged(step: int, where: str, expected: str, **got: Any) -> Damaged:
    return Damaged(
        message(
            expected,
            received(step=step, checkpoint=where, **got),
            f"the files of step {step} are damaged (disk or copy error): restore an earlier "
            "step (restore_or_init skips damaged steps by itself), or delete the step's folder.",
        )
    )


def verify_record(meta: Any, step: int, where: str) -> dict:
    """The step's metadata record, once its format and checksum say it is intact.

    Raises:
      Damaged: not a dict, an unknown format, a format that has checksums without
        them (or format 1 with them), or a record checksum that differs.
    """
    expected = "A step's metadata record must be intact (its format and checksum)."
    if not isinstance(meta, dict) or meta.get("format") not in (1, 2, 3):
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise _damaged(step, where, expected, format=got)
    needed = {1: (), 2: ("checksums",), 3: ("checksums", "data_checksum", "checksum")}
    keys = needed[meta["format"]]
    missing = [k for k in keys if not isinstance(meta.get(k), dict | str)]
    stray = [k for k in ("checksums", "checksum") if meta["format"] == 1 and k in meta]
    if missing or stray:
        what = {"missing": missing} if missing else {"unexpected_in_format_1": stray}
        raise _damaged(step, where, expected, format=meta["format"], **what)
    if meta["format"] == 3:
        rest = {k: v for k, v in meta.items() if k != "checksum"}
        if json_checksum(rest) != meta["checksum"]:
            raise _damaged(step, where, expected, checksum="differs from the saved one")
    return meta


def verify_position(item: Any, meta: dict, step: int, where: str) -> Any:
    """The data position in the `data` item read from `step`, once it matches its checksum."""
    expected = "A restored data position must be the one that was saved (its checksum must match)."
    if not isinstance(item, dict) or "position" not in item:
        raise _damaged(step, where, expected, data=f"no position in {str(item)[:80]!r}")
    if meta["format"] == 3 and json_checksum(item["position"]) != meta["data_checksum"]:
        raise _damaged(step, where, expected, data="checksum differs from the saved one")
    return item["position"]


def verify(arrays: dict[str, Any], meta: dict, step: int, where: str) -> None:
    """Raises Damaged naming the arrays whose values are not the ones saved.

    Args:
      arrays: path -> restored array.
      meta: the step's metadata record, checked by `verify_record`.
      step: the checkpoint's step, for the message.
      where: the step's folder, for the message.
    """
    saved = meta.get("checksums")
    if meta["format"] == 1:
        return
    got = checksums(arrays, meta["format"])
    bad = sorted(p for p in got if saved.get(p) != got[p])
    if bad:
        raise _damaged(
            step,
            where,
            "A restored array must have the values that were saved (its checksum, written at "
            "save, must match).",
            arrays=bad[:_SHOWN],
        )


def is_damage(error: BaseException) -> bool:
    """Whether a read error means damaged content, not a disk that cannot be read now.

    A missing file is damage; a permission error or another OS error (EIO) is not,
    nor is a tensorstore error that reports one.
    """
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno not in (None, *_DAMAGE_ERRNOS):
            return False
        if any(t in str(e) for t in _NOT_DAMAGE_TEXT):
            return False
    return True


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def read_error(
    step: int, where: str, error: BaseException | None, by_process: dict[int, str] | None = None
) -> CheckpointError:
    """The error for files of `step` that exist but cannot be read (permission, EIO).

    Args:
      step, where: the step and its folder, for the message.
      error: this process's error, if it had one of this kind.
      by_process: process -> first line of its error, when processes compared them.
    """
    chain = _chain(error) if error is not None else []
    code = next((e.errno for e in chain if isinstance(e, OSError) and e.errno), None)
    got: dict[str, Any] = {"step": step, "checkpoint": where}
    if code:
        got["errno"] = f"{errno.errorcode.get(code, code)} ({code})"
    if error is not None:
        got["error"] = (str(error).splitlines() or [type(error).__name__])[0][:300]
    if by_process:
        got["errors_by_process"] = by_process
    return CheckpointError(
        message(
            f"The files of checkpoint step {step} must be readable by every process.",
            received(**got),
            "give the processes read access to the checkpoint (owner, mode, mount) or fix "
            "the disk, then start again. The step is not damaged: it was neither skipped "
            "nor set aside.",
        )
    )


def read_failed(
    step: int, where: str, what: str, failed: dict[int, dict], error: BaseException | None
) -> CheckpointError:
    """The error for a read of `step` that failed on some processes (`failed`: process ->
    {"error": first line, "damage": bool}): Damaged only if every failure is damage."""
    unreadable = {p: r["error"] for p, r in failed.items() if not r["damage"]}
    if unreadable:
        own = error if error is not None and not is_damage(error) else None
        return read_error(step, where, own, unreadable)
    return _damaged(
        step,
        where,
        f"The files of checkpoint step {step} must be readable and valid ({what}).",
        errors_by_process={p: r["error"] for p, r in failed.items()},
    )


def damage(step_dir: epath.Path, step: int) -> str | None:
    """Why `step_dir` is not a complete, intact step folder, or None if it looks whole.

    Cheap: looks at files only (every item's folder, the state's _METADATA, Orbax's
    commit record); damaged array data is found by `verify` when restoring.

    Raises:
      CheckpointError: a file exists but cannot be read (permission, I/O error).
    """
    try:
        return _damage(step_dir)
    except OSError as e:
        if is_damage(e):
            return f"unreadable ({e})"
        raise read_error(step, str(step_dir), e) from e


def _damage(step_dir: epath.Path) -> str | None:
    try:
        record = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
    except FileNotFoundError:
        return "no _CHECKPOINT_METADATA (the save never committed, or the folder was emptied)"
    except ValueError as e:
        return f"unreadable _CHECKPOINT_METADATA ({e})"
    if not isinstance(record, dict) or not record.get("commit_timestamp_nsecs"):
        return "_CHECKPOINT_METADATA has no commit time (the save never committed)"
    needed = [step_dir / "state" / "_METADATA", *(step_dir / i / "metadata" for i in _ITEMS[1:])]
    missing = [str(p.relative_to(step_dir)) for p in needed if not _present(p)]
    if missing:
        return f"missing {', '.join(missing)}"
    return None


def commit_time(step_dir: epath.Path) -> int | None:
    """When Orbax committed the step in `step_dir` (ns), or None if that cannot be read: two
    checkpoints of one step number at one path (a run re-created there) differ in it."""
    try:
        record = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())
    except (OSError, ValueError):
        return None
    return record.get("commit_timestamp_nsecs") if isinstance(record, dict) else None


def _present(path: epath.Path) -> bool:
    """Whether `path` exists; a local path that cannot be looked at (a folder without read
    or search permission on the way) raises its OSError, never reads as missing."""
    if "://" in str(path):
        return path.exists()
    try:
        os.stat(os.fspath(path))
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def failed_steps(steps: list[int], step_dir: Callable[[int], epath.Path]) -> list[int]:
    """Those of `steps` (saves since the last successful wait) that did not commit intact.

    A step whose folder is committed and whole (`damage` finds nothing) did not
    fail; nor did one older than such a step whose folder is gone (`max_to_keep`
    deleted it after a newer save committed: Orbax saves one step at a time, in
    order). Looks at files only: no collective, safe in an error path.

    Args:
      steps: the steps saved since the last successful wait, oldest first.
      step_dir: step -> its folder.
    """
    intact = [s for s in steps if _looks_intact(step_dir(s), s)]
    newest = max(intact, default=None)
    return [
        s
        for s in steps
        if s not in intact and (newest is None or s > newest or _exists(step_dir(s)))
    ]


def _looks_intact(step_dir: epath.Path, step: int) -> bool:
    try:
        return step_dir.exists() and damage(step_dir, step) is None
    except (OSError, CheckpointError):
        return False  # unreadable now: not known to be intact


def _exists(path: epath.Path) -> bool:
    try:
        return path.exists()
    except OSError:
        return True
