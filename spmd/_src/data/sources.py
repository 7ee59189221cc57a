"""Host-side input: in-memory and file datasets (the batch stream is spmd/_src/data/host_batches.py)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from spmd._src.data.host_batches import (
    NO_PADDING,
    HostBatch,
    batch_mask,
    fingerprint,
    global_batches,
    holdable,
    is_masked,
    leading_size,
    local_batches,
    partial_message,
    placed_rows,
    unholdable_message,
)
from spmd._src.data.input_context import InputContext, Padding, Remainder, rows_of
from spmd._src.errors import BatchError, ConfigurationError, message, received

__all__ = [
    "FileDataset",
    "HostBatch",
    "NumpyDataset",
    "PaddedBatch",
    "global_batches",
    "local_batches",
]


class PaddedBatch(tuple):
    """A batch of a padding dataset: the batch's elements, then its mask, as one tuple.

    It is a tuple, so `xb, yb, mask = batch` works; its type (not its length
    or shapes) is what says that the last element is a mask: 1.0 for real
    rows, 0.0 for padding. `(x, y)` batches become `PaddedBatch((x, y, mask))`;
    any other batch (a dict, an array) becomes `PaddedBatch((batch, mask))`.
    It is a pytree node, so it passes through `jax.tree.map` and steps.

    Example:
      >>> for batch in evaluation:          # remainder="pad"
      ...     *inputs, mask = batch         # or batch.inputs, batch.mask
    """

    __slots__ = ()

    @property
    def mask(self) -> Any:
        """The mask: 1.0 for real rows, 0.0 for padding."""
        return self[-1]

    @property
    def inputs(self) -> tuple:
        """Everything before the mask, as a plain tuple."""
        return tuple(self[:-1])

    def __repr__(self) -> str:
        return f"PaddedBatch{tuple.__repr__(self)}"


jax.tree_util.register_pytree_node(
    PaddedBatch, lambda b: (tuple(b), None), lambda _, children: PaddedBatch(children)
)


def _device_ready(array: Any) -> np.ndarray:
    """An in-memory array as the dataset keeps it: big-endian data in native order
    (the same values), a dtype no jax.Array holds refused before any batch.

    Raises:
      BatchError: text, objects, dates or long doubles, naming the dtype.
    """
    array = np.asarray(array)
    if not holdable(array.dtype):
        raise BatchError(unholdable_message(array.dtype, None, f"an array of shape {array.shape}"))
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return array


class NumpyDataset:
    """In-memory arrays cut into global batches; each process reads only its rows.

    Build it with `strategy.make_numpy_dataset` and give it to
    `strategy.distribute_dataset`. Epoch `e` visits the examples in the order
    `np.random.default_rng([seed, e]).permutation(n)` when shuffling (the same
    on every process), else in order.

    Args:
      arrays: a pytree of arrays with the examples on the leading axis, e.g. (x, y).
      batch_size: the global batch size.
      shuffle: visit the examples in a new order each epoch.
      seed: the seed of that order.
      drop_remainder: drop a last batch smaller than `batch_size` (True), or
        pad it and give every batch a mask (False); see docs/input.md.

    Raises:
      BatchError: the arrays have different numbers of examples.
    """

    def __init__(
        self,
        arrays: Any,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_remainder: bool = True,
    ):
        self.arrays = jax.tree.map(_device_ready, arrays)
        self.num_examples = leading_size(self.arrays, what="data")
        if self.num_examples == 0:
            raise BatchError(
                message(
                    "A NumpyDataset's arrays have examples: at least one row.",
                    received(num_examples=0, batch_size=batch_size),
                    "pass arrays with the examples on the leading axis (check the slicing "
                    "or filtering that made them).",
                )
            )
        _check_batch_size(batch_size)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_remainder = drop_remainder
        self._fingerprint: str | None = None

    @property
    def remainder(self) -> Remainder:
        """ "drop" or "pad", from `drop_remainder`."""
        return "drop" if self.drop_remainder else "pad"

    @property
    def num_batches(self) -> int:
        """The global batches in one epoch."""
        rounding = math.floor if self.drop_remainder else math.ceil
        return int(rounding(self.num_examples / self.batch_size))

    def order(self, epoch: int) -> np.ndarray:
        """The example indices of `epoch`, in the order they are visited."""
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def host_batches(
        self,
        epoch: int,
        start: int,
        ctx: InputContext,
        remainder: Remainder,
        padding: Padding = NO_PADDING,
    ) -> Iterator[HostBatch]:
        """This process's rows of batches `start, start + 1, ...` of `epoch`.

        Each batch's rows are a copy (a process never hands the devices a view
        of the caller's arrays); without shuffling a whole batch is a slice of
        them, copied, rather than a gather. A batch the replicas do not split
        evenly is padded at its end by `padding` (its last real row repeated,
        masked).

        Raises:
          BatchError: the replicas do not split the batch and `padding` does not pad.
        """
        order, size = self.order(epoch), self.batch_size
        arrays, (leaves, treedef) = self.fingerprint, jax.tree.flatten(self.arrays)
        replicas = ctx.num_replicas_in_sync
        rows = placed_rows(size, replicas, padding, None)
        masked = remainder == "pad" or padding.masked(size, replicas)
        low, high = rows_of(ctx, rows)
        rounding = math.floor if remainder == "drop" else math.ceil
        count = int(rounding(self.num_examples / size))
        for b in range(start, count):
            picked = order[b * size : (b + 1) * size]
            real = len(picked)
            if real < size and remainder == "error":
                raise BatchError(partial_message(b, real, size))
            partial = is_masked(remainder, real, size)
            mask = batch_mask(rows, real)[low:high] if masked or partial else None
            if real == rows and not self.shuffle:  # in order: rows b*size+low .. b*size+high
                first = b * size
                mine = [np.array(a[first + low : first + high]) for a in leaves]
            else:
                index = picked
                if real < rows:
                    index = np.concatenate([picked, np.full(rows - real, picked[-1])])
                index = index[low:high]
                mine = [a[index] for a in leaves]
            yield HostBatch.of_leaves(
                mine,
                treedef,
                mask,
                rows,
                lambda picked=picked: f"{arrays()}:{fingerprint(picked)}",
                size,
            )

    def fingerprint(self) -> str:
        """A fingerprint of the arrays (computed once): processes compare it under DATA."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.arrays)
        return self._fingerprint

    def batches(self, epoch: int = 0) -> Iterator[Any]:
        """The global batches of `epoch` as numpy, a mask appended when padding."""
        for batch in self.host_batches(epoch, 0, InputContext(), self.remainder):
            yield with_mask(batch.tree, batch.mask)

    def __iter__(self) -> Iterator[Any]:
        return self.batches(0)

    def __repr__(self) -> str:
        return (
            f"NumpyDataset(num_examples={self.num_examples}, batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, seed={self.seed}, drop_remainder={self.drop_remainder})"
        )


def _load(path: str) -> Any:
    """Reads a .npy file (an array) or a .npz file (a dict of arrays)."""
    if path.endswith(".npz"):
        with np.load(path) as data:
            return dict(data)
    return np.load(path)


class FileDataset:
    """A dataset made of files, each holding some examples; FILE sharding splits the files.

    Under `AutoShardPolicy.FILE` pipeline `i` of `n` reads `files[i::n]` and
    cuts its rows into batches of `batch_size / n` (its part of each global
    batch); under DATA every process reads every file and keeps its rows of
    each global batch.

    Args:
      files: the paths, in order.
      batch_size: the global batch size.
      read: `read(path)` returns a pytree of arrays with the file's examples on
        the leading axis. By default `np.load` (.npy: an array, .npz: a dict).
      drop_remainder: drop a last batch smaller than the others (True), or
        pad it and give every batch a mask (False).

    Example:
      >>> ds = spmd.FileDataset(sorted(glob.glob("/data/train-*.npz")), batch_size=256)
      >>> dist = strategy.distribute_dataset(ds)     # AUTO picks FILE
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike[str]],
        batch_size: int,
        *,
        read: Callable[[str], Any] | None = None,
        drop_remainder: bool = True,
    ):
        if isinstance(files, str | os.PathLike):
            files = [files]
        self.files = tuple(os.fspath(f) for f in files)
        _check_batch_size(batch_size)
        self.batch_size = batch_size
        self.read = read or _load
        self.drop_remainder = drop_remainder

    @property
    def remainder(self) -> Remainder:
        """ "drop" or "pad", from `drop_remainder`."""
        return "drop" if self.drop_remainder else "pad"

    def files_for(self, ctx: InputContext) -> tuple[str, ...]:
        """The files pipeline `ctx.input_pipeline_id` reads under FILE sharding.

        Raises:
          ConfigurationError: fewer files than input pipelines.
        """
        n = ctx.num_input_pipelines
        if len(self.files) < n:
            raise ConfigurationError(
                message(
                    f"FILE sharding gives each of the {n} input pipelines (processes) at "
                    "least one file of its own.",
                    received(num_files=len(self.files), num_input_pipelines=n),
                    f"split the data into at least {n} files (a multiple of {n} keeps the "
                    "pipelines even), or use AutoShardPolicy.DATA.",
                )
            )
        return self.files[ctx.input_pipeline_id :: n]

    def rows(self, files: Sequence[str], batch_size: int) -> Iterator[Any]:
        """The examples of `files`, in order, cut into batches of `batch_size` rows."""
        return rebatch((jax.tree.map(np.asarray, self.read(f)) for f in files), batch_size)

    def __repr__(self) -> str:
        return f"FileDataset({len(self.files)} files, batch_size={self.batch_size})"


def rebatch(chunks: Iterable[Any], size: int) -> Iterator[Any]:
    """Cuts a stream of pytrees with a leading example axis into batches of `size` rows.

    The last batch holds what is left (fewer rows).
    """
    pending, count = [], 0
    for chunk in chunks:
        pending.append(chunk)
        count += leading_size(chunk, what="file")
        while count >= size:
            joined = _concat(pending)
            yield jax.tree.map(lambda x: x[:size], joined)
            rest = jax.tree.map(lambda x: x[size:], joined)
            pending, count = [rest], count - size
    if count:
        yield _concat(pending)


def _concat(trees: list[Any]) -> Any:
    return trees[0] if len(trees) == 1 else jax.tree.map(lambda *xs: np.concatenate(xs), *trees)


def with_mask(tree: Any, mask: np.ndarray | jax.Array | None) -> Any:
    """The element a padding dataset yields: a `PaddedBatch`, `(*tree, mask)` or `(tree, mask)`."""
    if mask is None:
        return tree
    return PaddedBatch((*tree, mask) if type(tree) is tuple else (tree, mask))


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int | np.integer) or batch_size < 1:
        raise ConfigurationError(
            message(
                "batch_size is the global batch size: a positive int.",
                received(batch_size=batch_size),
                "pass e.g. batch_size=64 (a multiple of strategy.num_replicas_in_sync).",
            )
        )
