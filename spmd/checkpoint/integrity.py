"""Checksums of a checkpoint's arrays, data position and metadata; which step folders are intact.

An array's checksum is a property of its values, not of its files: each
element's bits are mixed with its row-major index by a nonlinear 32-bit
finalizer (murmur3's), then summed; two such sums with different seeds make
64 bits. So changes to two elements never cancel out (short of a 2**-64
chance), and the sum is the same for every sharding and process count.
`save` computes it on the devices (a reduction over each shard, then one
all-reduce) and stores it in the step's metadata; `restore` computes it again
on what it read and compares. The data position and the metadata are JSON:
their checksum is a SHA-256 of their canonical text, and the metadata's own
checksum covers everything in it (the array checksums included). So a
flipped bit in any file of a step, a truncated chunk Orbax fills with zeros,
or a shard read from the wrong place is an error that names the step.

Formats (saved in each step's metadata): 1, no checksums (restored with a
warning); 2, array checksums of an earlier, linear kind; 3, the above.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from spmd.errors import CheckpointError, message, received

__all__ = [
    "FORMAT",
    "Damaged",
    "Pending",
    "PendingRecord",
    "RecordHandler",
    "checksums",
    "commit_time",
    "compile_count",
    "damage",
    "dispatch",
    "failed_steps",
    "is_damage",
    "json_checksum",
    "read_error",
    "read_failed",
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


class Damaged(CheckpointError):
    """A step whose files are unreadable or whose arrays fail their checksums."""


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


def _position(shape: tuple[int, ...], xp: Any) -> Any:
    """Each element's row-major index (mod 2**32), built per dimension: no reshape, no gather."""
    index = xp.zeros(shape, xp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        iota = xp.arange(shape[dim], dtype=xp.uint32).reshape(
            [-1 if d == dim else 1 for d in range(len(shape))]
        )
        index = index + iota * xp.uint32(stride % 2**32)
        stride *= shape[dim]
    return index


def _fold_linear(bits: Any, xp: Any) -> tuple[Any, Any]:
    """Format 2's two 32-bit halves of the checksum of `bits` (uint32), wrapping arithmetic."""
    index = _position(bits.shape, xp) + xp.uint32(1)
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


def _fold_mixed(bits: Any, xp: Any) -> tuple[Any, Any]:
    """Format 3's halves: the sums of each element's bits mixed with its index, two seeds."""
    index = _position(bits.shape, xp)
    low, high = (
        xp.sum(_mix(bits ^ (index * _MUL[i] + seed), xp), dtype=xp.uint32)
        for i, seed in enumerate(_SEEDS)
    )
    return low, high


_FOLDS = {2: _fold_linear, 3: _fold_mixed}


_BATCH = 128  # leaves of one kind per call: XLA:CPU's compile time grows with parameter count
_programs: dict[tuple, Any] = {}  # (version, shape, dtype, sharding, batch) -> compiled program
_compiles = 0  # how many checksum programs were compiled


def compile_count() -> int:
    """How many checksum programs were compiled so far: one per kind of leaf (shape, dtype,
    sharding) of the states saved, whatever their leaf counts."""
    return _compiles


def _programs_for(version: int, kinds: list[tuple]) -> list[Any]:
    """The compiled program of each (shape, dtype, sharding, batch); new ones compiled at once.

    One program folds a batch of same-kind leaves, stacked on a new leading axis
    (no communication: one layout) by one vmapped reduction, so a state of
    10,000 leaves of a few kinds compiles a few small programs, once: XLA:CPU
    takes ~1.6 s to compile even trivial sums over 2,000 parameters, and over a
    minute for one program over 10,000. New programs compile in parallel threads.
    """
    global _compiles
    missing = [k for k in dict.fromkeys(kinds) if (version, *k) not in _programs]
    if missing:
        fold = jax.vmap(lambda bits: _FOLDS[version](bits, jnp))

        def sums(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
            return fold(jnp.stack([_bits_jax(x) for x in leaves]))

        lowered = [
            jax.jit(sums).lower([jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)] * batch)
            for shape, dtype, sharding, batch in missing
        ]
        with ThreadPoolExecutor(min(len(lowered), os.cpu_count() or 1)) as pool:
            compiled = list(pool.map(lambda low: low.compile(), lowered))
        for kind, program in zip(missing, compiled, strict=True):
            _programs[(version, *kind)] = program
        _compiles += len(missing)
    return [_programs[(version, *k)] for k in kinds]


class Pending:
    """Checksums dispatched to the devices, not yet fetched: `result()` waits for them.

    JAX dispatches the programs asynchronously: their inputs are held until they
    have run, so the caller may donate or overwrite the arrays once `dispatch` returns.
    """

    def __init__(self, calls: list[tuple[list[str], Any]], host: dict):
        self._calls, self._host = calls, host
        self._result: dict[str, str] | None = None

    def result(self) -> dict[str, str]:
        """path -> 16 hex digits (blocks until the device programs have run, once)."""
        if self._result is None:
            found = dict(self._host)
            fetched = jax.device_get([sums for _, sums in self._calls])
            for (paths, _), (low, high) in zip(self._calls, fetched, strict=True):
                found.update({p: (low[i], high[i]) for i, p in enumerate(paths)})
            self._result = {p: f"{int(hi):08x}{int(lo):08x}" for p, (lo, hi) in found.items()}
            self._calls = []
        return self._result


def dispatch(arrays: dict[str, Any], version: int = FORMAT) -> Pending:
    """Starts `checksums(arrays)`: the device programs are dispatched, not waited for.

    numpy arrays are summed here, on the host (the caller may change them after).
    With several processes, every process must call it (a collective).
    """
    on_device = {p: _in_device_memory(x) for p, x in arrays.items() if isinstance(x, jax.Array)}
    host = {p: _host_sum(x, version) for p, x in arrays.items() if p not in on_device}
    by_kind: dict[tuple, list[str]] = {}
    for p, x in on_device.items():
        by_kind.setdefault((x.shape, x.dtype, x.sharding), []).append(p)
    batches = []  # (kind with batch size, paths)
    for kind, paths in by_kind.items():
        size = min(len(paths), _BATCH)
        batches += [((*kind, size), paths[i : i + size]) for i in range(0, len(paths), size)]
    programs = _programs_for(version, [kind for kind, _ in batches])
    calls = []
    for ((*_, size), paths), program in zip(batches, programs, strict=True):
        leaves = [on_device[p] for p in paths]
        leaves += leaves[-1:] * (size - len(leaves))  # the last batch, padded: one program
        calls.append((paths, program(leaves)))
    return Pending(calls, host)


def _host_sum(x: Any, version: int) -> tuple[Any, Any]:
    with np.errstate(over="ignore"):
        return _FOLDS[version](_bits_np(np.asarray(x)), np)


def _in_device_memory(x: jax.Array) -> jax.Array:
    """`x`, copied to device memory if it lives in host memory (CentralStorageStrategy)."""
    kind = getattr(x.sharding, "memory_kind", None)
    if kind in (None, "device"):
        return x
    return jax.device_put(x, x.sharding.with_memory_kind("device"))


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

    `save` hands it to Orbax in place of the record; `RecordHandler` resolves it
    in the save's background commit, beside the array writes, so that `save`
    returns without waiting for the checksums, and the step is committed only
    once its record, checksums included, is written.
    """

    def __init__(self, meta: dict, sums: Pending):
        self._meta, self._sums = meta, sums

    def resolve(self) -> dict:
        """The sealed record: `meta` with "checksums", and its own checksum."""
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
