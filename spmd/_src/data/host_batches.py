"""The stream of host batches: each global batch flattened once, checked, padded, cut per process."""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from spmd._src.data.input_context import BlockContext, InputContext, Padding, Remainder, rows_of
from spmd._src.errors import BatchError, ConfigurationError, message, received

__all__ = [
    "HostBatch",
    "check_equal_parts",
    "batch_mask",
    "fingerprint",
    "fingerprint_leaves",
    "global_batches",
    "is_masked",
    "leading_size",
    "local_batches",
    "partial_message",
    "pipeline_rows",
    "placed_rows",
]

NO_PADDING = Padding()  # a global batch the replicas do not split is an error

_KINDS = {"U": "str", "S": "bytes", "O": "object", "V": "void", "M": "datetime", "m": "timedelta"}
_SAMPLE_BYTES = 1 << 18  # a leaf bigger than this is fingerprinted by evenly spaced rows


class HostBatch:
    """This process's rows of one global batch, still on the host.

    It holds the rows flattened (`leaves`, `treedef`), as the sources compute
    them once and the placement reads them: no stage flattens a batch again.

    Attributes:
      leaves: the rows' leaves (numpy arrays, batch axis first).
      treedef: the structure `leaves` unflatten into.
      mask: 1.0 for real rows and 0.0 for padding, when the dataset pads.
      global_size: the leading size of the global array the rows are placed
        in: the global batch, padded where the replicas do not split it.
      content: under DATA sharding, computes a fingerprint of the whole global
        batch (which every process reads), for the check that the processes
        read the same one; None where each process reads its own data.
      batch_size: the global batch size as the data has it (what a position
        counts in): `global_size` less the rows padded for the replicas.
    """

    __slots__ = ("batch_size", "content", "global_size", "leaves", "mask", "treedef")

    def __init__(
        self,
        tree: Any,
        mask: np.ndarray | None,
        global_size: int,
        content: Callable[[], str] | None = None,
        batch_size: int | None = None,
    ):
        leaves, self.treedef = jax.tree.flatten(tree)
        self.leaves = [np.asarray(x) for x in leaves]
        self.mask, self.global_size, self.content = mask, global_size, content
        self.batch_size = global_size if batch_size is None else batch_size

    @classmethod
    def of_leaves(
        cls,
        leaves: list[np.ndarray],
        treedef: Any,
        mask: np.ndarray | None,
        global_size: int,
        content: Callable[[], str] | None = None,
        batch_size: int | None = None,
    ) -> HostBatch:
        """A batch of already flattened rows (every leaf a numpy array)."""
        batch = cls.__new__(cls)
        batch.leaves, batch.treedef = leaves, treedef
        batch.mask, batch.global_size, batch.content = mask, global_size, content
        batch.batch_size = global_size if batch_size is None else batch_size
        return batch

    @property
    def tree(self) -> Any:
        """The rows: a pytree of numpy arrays, batch axis first."""
        return self.treedef.unflatten(self.leaves)


def global_batches(
    elements: Iterable[Any],
    ctx: InputContext,
    remainder: Remainder,
    start: int = 0,
    batch_size: int | None = None,
    *,
    resumed: bool = False,
    padding: Padding = NO_PADDING,
) -> Iterator[HostBatch]:
    """This process's rows of each global batch of `elements` (DATA sharding).

    A global batch the replicas do not split evenly is padded at its end
    (`padding`), before it is cut per process: each real row keeps its place.

    Args:
      elements: global batches (pytrees of arrays, batch axis first); every
        batch but the last must have the same size.
      ctx: this process's pipeline.
      remainder: what to do with a smaller last batch.
      start: how many batches to skip (a resumed position).
      batch_size: the global batch size, if known before the first batch.
      resumed: `elements` start where a saved position left off (not at the
        start of the data), so that having none is not an empty dataset.
      padding: what to do with a global batch the replicas do not split evenly.
    """
    pipelines, replicas = ctx.num_input_pipelines, ctx.num_replicas_in_sync
    per_pipeline = _sized(elements, remainder, start, batch_size, resumed)
    for index, leaves, treedef, expected, real in per_pipeline:
        rows = placed_rows(expected, replicas, padding, index)
        masked = is_masked(remainder, real, expected) or padding.masked(expected, replicas)
        whole, mask = _pad(leaves, real, rows, masked)
        mine = whole
        if pipelines > 1:
            low, high = rows_of(ctx, rows)
            mine = [x[low:high] if x.ndim else x for x in whole]
            mask = None if mask is None else mask[low:high]
        content = functools.partial(fingerprint_leaves, whole, treedef)
        yield HostBatch.of_leaves(mine, treedef, mask, rows, content, expected)


def local_batches(
    elements: Iterable[Any],
    ctx: InputContext,
    remainder: Remainder,
    start: int = 0,
    batch_size: int | None = None,
    *,
    resumed: bool = False,
    padding: Padding = NO_PADDING,
) -> Iterator[HostBatch]:
    """Each element is already this pipeline's part of a global batch (FILE, OFF, a function).

    Args are as for `global_batches`, with `batch_size` the rows per pipeline;
    padding pads each pipeline's part at its end.
    """
    pipelines, replicas = ctx.num_input_pipelines, ctx.num_replicas_in_sync
    check_equal_parts(ctx)
    for index, leaves, treedef, expected, real in _sized(
        elements, remainder, start, batch_size, resumed
    ):
        size = expected * pipelines
        rows = placed_rows(size, replicas, padding, index, per_pipeline=expected)
        masked = is_masked(remainder, real, expected) or padding.masked(size, replicas)
        leaves, mask = _pad(leaves, real, rows // pipelines, masked)
        yield HostBatch.of_leaves(leaves, treedef, mask, rows, batch_size=size)


def is_masked(remainder: Remainder, real: int, expected: int) -> bool:
    """Whether a batch of `real` rows of `expected` carries a mask for `remainder`: under
    "pad" always, under "pad_if_partial" when it is smaller than the others."""
    return remainder == "pad" or (remainder == "pad_if_partial" and real < expected)


def placed_rows(
    size: int, replicas: int, padding: Padding, index: int | None, per_pipeline: int | None = None
) -> int:
    """The rows a global batch of `size` is placed as (`Padding.rows`).

    Raises:
      BatchError: the replicas (times the microbatches) do not split it, and
        `padding` does not pad: naming both ways out.
    """
    rows = padding.rows(size, replicas)
    if rows:
        return rows
    multiple = replicas * padding.microbatches
    where = {} if index is None else {"batch_index": index}
    extra = {} if per_pipeline is None else {"per_pipeline_batch_size": per_pipeline}
    micro = {} if padding.microbatches == 1 else {"microbatches": padding.microbatches}
    parts = f"{replicas} replicas" + (
        f" x {padding.microbatches} microbatches" if padding.microbatches > 1 else ""
    )
    raise BatchError(
        message(
            f"The global batch must split evenly over the {parts}.",
            received(
                **where,
                global_batch_size=size,
                **extra,
                num_replicas_in_sync=replicas,
                **micro,
            ),
            f"batch with a global batch size that is a multiple of {multiple} (e.g. "
            f"{math.ceil(size / multiple) * multiple}; in a dataset function, batch by "
            "ctx.get_per_pipeline_batch_size(global_batch_size)), or keep this one and pad "
            'it: InputOptions(uneven_batch="pad") pads each global batch at its end with '
            "masked rows and makes every batch a spmd.PaddedBatch, whose mask the loss "
            "weighs (docs/input.md).",
        )
    )


def pipeline_rows(size: int, ctx: InputContext, padding: Padding) -> int:
    """The rows each input pipeline feeds of a global batch of `size`, where each
    reads its own part (FILE, OFF, a dataset function): `size / num_input_pipelines`.

    Raises:
      BatchError: `size` does not split over the pipelines, or (not padding)
        over the replicas.
    """
    placed_rows(size, ctx.num_replicas_in_sync, padding, None)
    check_equal_parts(ctx)
    pipelines = ctx.num_input_pipelines
    if size % pipelines:
        raise BatchError(
            message(
                "Where each process reads its own part of the data (FILE or OFF sharding, a "
                f"dataset function), the global batch splits evenly over the {pipelines} "
                "input pipelines (processes); padding evens it over the replicas, not these.",
                received(global_batch_size=size, num_input_pipelines=pipelines),
                f"use a global batch size that is a multiple of {pipelines}, or "
                "AutoShardPolicy.DATA: every process reads each global batch and keeps its "
                "rows, which padding splits at any size.",
            )
        )
    return size // pipelines


def check_equal_parts(ctx: InputContext) -> None:
    """Raises where processes hold unequal parts of the global batch (a `BlockContext`):
    a pipeline that reads its own part (FILE, OFF, a dataset function) cannot feed one.

    Raises:
      ConfigurationError: naming DATA sharding as the way.
    """
    if isinstance(ctx, BlockContext):
        raise ConfigurationError(
            message(
                "Where each process reads its own part of the data (FILE or OFF sharding, a "
                "dataset function), every process feeds an equal part of the global batch; "
                "this strategy's processes hold unequal numbers of replicas (a mesh over the "
                "devices that divide the global batch).",
                received(
                    replica_block=ctx.replica_block, num_replicas_in_sync=ctx.num_replicas_in_sync
                ),
                "read with AutoShardPolicy.DATA (strategy.distribute_dataset of global "
                "batches: every process keeps its rows), or use a strategy over every device "
                "and let spmd pad the batch.",
            )
        )


def _sized(
    elements: Iterable[Any],
    remainder: Remainder,
    start: int,
    batch_size: int | None,
    resumed: bool = False,
) -> Iterator[tuple[int, list[np.ndarray], Any, int, int]]:
    """(index, leaves, treedef, expected size, real size) for each batch from `start` kept.

    Each element is flattened once (its leaves copied by `_with_last`) and
    checked on those leaves.

    Raises:
      BatchError: no element at all from the start of the data (an empty
        dataset), a leaf that is not numeric, or batches of uneven sizes.
    """
    expected = batch_size
    if not start and not resumed:
        elements = _not_empty(elements)
    for index, (leaves, treedef, is_last) in enumerate(_with_last(elements)):
        size = _checked_size(leaves, treedef, index)
        if size == 0:
            raise BatchError(_empty_message(index))
        expected = expected or size
        if index < start:
            continue
        if size == expected:
            yield index, leaves, treedef, expected, size
            continue
        if size > expected and remainder == "pad_if_partial":
            raise BatchError(_larger_message(index, size, expected))
        if size > expected or size == 0 or not (is_last or remainder == "pad_if_partial"):
            raise BatchError(
                message(
                    "Every batch but the last must have the same size, and the last no more.",
                    received(batch_index=index, batch_size=size, first_batch_size=expected),
                    "batch the data with one batch size (drop_remainder=True, or let spmd "
                    "pad the last batch with remainder='pad', or any smaller batch with "
                    "remainder='pad_if_partial', as Trainer.fit does).",
                )
            )
        if remainder == "error":
            raise BatchError(partial_message(index, size, expected))
        if remainder == "drop":
            return
        yield index, leaves, treedef, expected, size


def _larger_message(index: int, size: int, expected: int) -> str:
    """Why a batch larger than the first is refused where smaller ones are padded."""
    return message(
        "Every batch is at most as large as the first: the first fixes the shape the step "
        "is compiled for, and a smaller one is padded to it (remainder='pad_if_partial').",
        received(batch_index=index, batch_size=size, first_batch_size=expected),
        "batch the data with one batch size, so that only a pass's last batch is smaller "
        "(tf.data's .batch(n) does), or put a largest batch first.",
    )


def _checked_size(leaves: list[np.ndarray], treedef: Any, index: int) -> int:
    """The batch's leading size, after checking every leaf is numeric and the sizes agree.

    One pass over the leaves; on anything wrong the batch is rebuilt and
    checked by `_check_numeric` and `leading_size`, which raise the errors
    (numeric first, naming the leaf).

    Raises:
      BatchError: a leaf that is not numeric, a ragged batch, or no leaf
        with a batch axis.
    """
    size = -1
    for x in leaves:  # numpy arrays: _with_last copied them
        if not holdable(x.dtype):
            break
        if x.ndim:
            if size < 0:
                size = x.shape[0]
            elif x.shape[0] != size:
                break
    else:
        if size >= 0:
            return size
    tree = treedef.unflatten(leaves)
    _check_numeric(tree, index)
    return leading_size(tree, what="batch", index=index)


def _check_numeric(batch: Any, index: int) -> None:
    """Raises for a leaf no device array can hold: text, Python objects, dates, long doubles.

    Raises:
      BatchError: naming the leaf, its dtype and how to leave it out.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if not holdable(leaf.dtype):
            raise BatchError(unholdable_message(leaf.dtype, index, jax.tree_util.keystr(path)))


@functools.lru_cache(maxsize=64)
def holdable(dtype: np.dtype) -> bool:
    """Whether a jax.Array can hold this dtype: numbers and bool, ml_dtypes' bfloat16,
    float8 and int4 included; not text, objects, dates or long doubles."""
    if dtype.kind in "biufc":
        return dtype.itemsize <= 16 and not (dtype.kind == "f" and dtype.itemsize > 8)
    if dtype.kind != "V":
        return False
    try:  # ml_dtypes' types are numpy 'V'oid dtypes that jax takes
        return bool(jax.dtypes.issubdtype(dtype, np.number))
    except TypeError:
        return False


def unholdable_message(dtype: np.dtype, index: int | None, leaf: str) -> str:
    """The BatchError's text for a leaf of a dtype no jax.Array holds."""
    kind = _KINDS.get(dtype.kind, "extended precision" if dtype.kind in "fc" else dtype.kind)
    where = {} if index is None else {"batch_index": index}
    return message(
        "Every leaf of a batch is numeric or bool (bfloat16 and float8 included): it becomes a "
        "jax.Array on the devices.",
        received(**where, leaf=leaf or "(the batch)", dtype=f"{dtype} ({kind})"),
        "drop that leaf before distributing (e.g. .map(lambda e: {k: v for k, v in e.items() "
        "if k != 'name'})), tokenize/encode text to integer ids, or convert it in the "
        "pipeline (dates to int64 seconds with .astype('int64'); long doubles to float64).",
    )


def _not_empty(elements: Iterable[Any]) -> Iterator[Any]:
    """`elements`, or a BatchError if there is none: an empty dataset is an epoch of no batch."""
    empty = True
    for element in elements:
        empty = False
        yield element
    if empty:
        raise BatchError(
            message(
                "A dataset yields at least one batch a pass.",
                received(batches=0),
                "check that the data is not empty: its source, a filter, or a shard that "
                "leaves this input pipeline nothing (e.g. fewer records than pipelines).",
            )
        )


def _empty_message(index: int) -> str:
    return message(
        "Every batch of a dataset has rows: a leading (batch) size of 1 or more.",
        received(batch_index=index, batch_size=0),
        "leave empty batches out of the data (check the slicing or filtering that made them).",
    )


def _with_last(elements: Iterable[Any]) -> Iterator[tuple[list[np.ndarray], Any, bool]]:
    """(leaves, treedef, is_last) of each element, the leaves owned (one element of lookahead).

    An error while looking ahead is raised after the element before it, where
    it belongs.
    """
    iterator = iter(elements)
    try:
        previous = _own(next(iterator))
    except StopIteration:
        return
    while True:
        try:
            element = _own(next(iterator))
        except StopIteration:
            yield *previous, True
            return
        except Exception:
            yield *previous, True
            raise
        yield *previous, False
        previous = element


def _own(element: Any) -> tuple[list[np.ndarray], Any]:
    """An element flattened, its leaves copied before the next element is read.

    A loader may refill the buffer it yielded for its next element (and XLA:CPU
    can alias a host buffer it places, even when asked to copy): each batch
    keeps the values it had when it was read.
    """
    leaves, treedef = jax.tree.flatten(element)
    owned = [np.array(x) for x in _no_keys(leaves)]
    for i, x in enumerate(owned):
        if not x.dtype.isnative:  # big-endian data from a file: the same values, native order
            owned[i] = x.astype(x.dtype.newbyteorder("="))
    return owned, treedef


def _no_keys(leaves: list) -> list:
    """The leaves, after checking that none is a typed PRNG key array (no host form).

    Raises:
      BatchError: naming the key array and how to pass it.
    """
    for x in leaves:
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            raise BatchError(
                message(
                    "Every leaf of a batch has a host form the input pipeline can copy and "
                    "place: a typed PRNG key array has none.",
                    received(leaf_dtype=str(x.dtype), shape=x.shape),
                    "pass jax.random.key_data(keys) in the batch and jax.random.wrap_key_data "
                    "them in the step, or split a key held in the state inside the step.",
                )
            )
    return leaves


def _pad(
    leaves: list[np.ndarray], real: int, size: int, masked: bool
) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Pads each leaf to `size` rows by repeating its last real row; the mask marks real rows.

    Padding repeats a real example (not zeros) so that what the step computes
    on padding stays finite: a NaN times a zero weight is still NaN.
    """
    mask = batch_mask(size, real) if masked else None
    if real == size:
        return leaves, mask
    fill = np.full(size - real, real - 1)
    return [np.concatenate([x, x[fill]]) if x.ndim else x for x in leaves], mask


def batch_mask(size: int, real: int) -> np.ndarray:
    """The mask of a padded batch: 1.0 for its `real` first rows, 0.0 for the rest.

    A fresh array each batch: a placed host buffer may be aliased by the device array.
    """
    if real < size:
        return (np.arange(size) < real).astype(np.float32)
    return np.ones(size, np.float32)


def fingerprint(tree: Any) -> str:
    """A cheap fingerprint of a pytree of arrays: CRC-32 of its shapes, dtypes and bytes.

    A leaf over 256 KiB contributes evenly spaced rows (about 256 KiB of them),
    first and last included, so the cost stays bounded for large batches.
    """
    leaves, treedef = jax.tree.flatten(tree)
    return fingerprint_leaves(leaves, treedef)


def fingerprint_leaves(leaves: list[Any], treedef: Any) -> str:
    """`fingerprint` of the tree that `leaves` and `treedef` make."""
    crc = zlib.crc32(str(treedef).encode())
    for leaf in leaves:
        x = np.asarray(leaf)
        crc = zlib.crc32(f"{x.dtype}{x.shape}".encode(), crc)
        if x.nbytes > _SAMPLE_BYTES and x.ndim and x.shape[0] > 1:
            rows = max(2, _SAMPLE_BYTES * x.shape[0] // x.nbytes)
            x = x[np.linspace(0, x.shape[0] - 1, rows).astype(np.int64)]
        crc = zlib.crc32(np.ascontiguousarray(x).view(np.uint8).reshape(-1), crc)
    return f"{crc:08x}"


def leading_size(tree: Any, *, what: str, index: int | None = None) -> int:
    """The common leading size of the leaves of `tree` (those with a batch axis).

    Raises:
      BatchError: the leaves' leading sizes differ (a ragged batch), or none has one.
    """
    leaves = jax.tree.leaves(tree)
    sizes = {np.shape(x)[0] for x in leaves if np.ndim(x) > 0}
    if len(sizes) == 1:
        return sizes.pop()
    where = {} if index is None else {"batch_index": index}
    if not sizes:
        shapes = [list(np.shape(x)) for x in leaves[:4]]
        raise BatchError(
            message(
                f"Every array of the {what} has a leading (batch) axis: an element of the data "
                "is a whole global batch, not one example.",
                received(**where, leaf_shapes=shapes, num_leaves=len(leaves)),
                "batch the examples: end a grain or tf.data pipeline with "
                ".batch(global_batch_size), or pass arrays with the examples on the leading "
                "axis.",
            )
        )
    raise BatchError(
        message(
            f"Every array of the {what} must have the same leading (batch) size.",
            received(**where, leading_sizes=sorted(sizes)),
            "give x, y and every other leaf the same number of examples.",
        )
    )


def partial_message(index: int, size: int, expected: int) -> str:
    return message(
        "The last batch is smaller than the others, and the dataset does not say what to do "
        "with it.",
        received(batch_index=index, batch_size=size, global_batch_size=expected),
        "drop it (drop_remainder=True, or InputOptions(remainder='drop')) for training, or "
        "pad it (drop_remainder=False, or InputOptions(remainder='pad')) for evaluation; "
        "padded batches carry a mask.",
    )
