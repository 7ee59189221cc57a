"""Input distribution: datasets in, global jax.Arrays over the replicas out, one batch ahead."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax

from spmd._src.data.grain_source import grain_shard_options, is_grain, plan_grain
from spmd._src.data.host_batches import check_equal_parts, pipeline_rows, placed_rows
from spmd._src.data.input_context import (
    AutoShardPolicy,
    BlockContext,
    InputContext,
    InputOptions,
    Padding,
    input_context,
)
from spmd._src.data.iterator import FUNCTION, DistributedDataset, DistributedIterator, Plan
from spmd._src.data.sources import (
    FileDataset,
    HostBatch,
    NumpyDataset,
    PaddedBatch,
    global_batches,
    local_batches,
    partial_message,
)
from spmd._src.data.tf_source import is_tf_dataset, plan_tf
from spmd._src.errors import BatchError, ConfigurationError, message, received

if TYPE_CHECKING:
    from spmd._src.strategy.base import Strategy

__all__ = [
    "AutoShardPolicy",
    "DistributedDataset",
    "DistributedIterator",
    "FileDataset",
    "InputContext",
    "InputOptions",
    "NumpyDataset",
    "PaddedBatch",
    "distribute_dataset",
    "distribute_datasets_from_function",
    "grain_shard_options",
    "make_numpy_dataset",
]

logger = logging.getLogger("spmd.data")

_MSG_ONE_SHOT = """\
A one-shot iterator (a generator) gives its batches once, so it cannot be read again
for a second epoch, nor replayed to resume a position (set_state) or restart after close().
Received: dataset={name}, being read a second time
To fix: pass something that starts over on each iter(): a list, an object whose
__iter__ returns a new generator, strategy.make_numpy_dataset(...), or use
strategy.distribute_datasets_from_function(lambda ctx: make_generator()), which
calls the function again for each pass."""


def distribute_dataset(
    strategy: Strategy, dataset: Iterable[Any], options: InputOptions | None = None
) -> DistributedDataset:
    """Makes a dataset of global batches into global jax.Arrays over the replicas.

    Each element of `dataset` is a global batch: a pytree of arrays with the
    global batch on the leading axis. With several processes each one reads
    only its share, by `options.auto_shard_policy`: FILE for a `FileDataset`
    (its own files), DATA otherwise (its rows of each global batch; a
    `NumpyDataset` reads only those rows), OFF when `dataset` already is this
    process's share. A `tf.data.Dataset` is sharded as tf.distribute shards
    it (spmd/_src/data/tf_source.py: FILE by TF's own file rewrite, AUTO from its
    options); a grain pipeline by grain's shard options, with grain's state
    in the position (`grain_shard_options`).

    Args:
      strategy: the strategy whose batch axes split the batches.
      dataset: a `NumpyDataset` (`strategy.make_numpy_dataset`), a
        `FileDataset`, or any iterable of global batches.
      options: sharding, padding, prefetch and host checks; see `InputOptions`.

    Returns:
      A `DistributedDataset`.

    Raises:
      ConfigurationError: FILE for a dataset without files, or fewer files
        than processes.
      BatchError: a global batch size that does not split over the replicas
        (unless `options.uneven_batch` pads it), known before reading.
    """
    options = options or InputOptions()
    ctx = input_context(strategy)
    plan = _plan_dataset(dataset, ctx, options)
    return DistributedDataset(strategy, plan, options)


def distribute_datasets_from_function(
    strategy: Strategy,
    dataset_fn: Callable[[InputContext], Iterable[Any]],
    options: InputOptions | None = None,
) -> DistributedDataset:
    """Distributes the batches each process's own pipeline makes.

    `dataset_fn(ctx)` runs on every process and returns that process's part
    of each global batch: `ctx.get_per_pipeline_batch_size(global_batch_size)`
    rows, from its share of the data (e.g. `shard(ctx.input_pipeline_id,
    ctx.num_input_pipelines)`). It is called now, and again for each later
    pass over the data.

    Note: tf.distribute's dataset function batches by the *per-replica* size;
    spmd's batches by the per-pipeline (per-process) size.

    Args:
      strategy: the strategy whose batch axes split the batches.
      dataset_fn: builds this process's pipeline from its `InputContext`.
      options: padding, prefetch and host checks; the function does the
        sharding, so `auto_shard_policy` must stay AUTO (or OFF).

    Returns:
      A `DistributedDataset`.
    """
    options = options or InputOptions()
    if options.auto_shard_policy not in (AutoShardPolicy.AUTO, AutoShardPolicy.OFF):
        raise ConfigurationError(
            message(
                "A dataset function shards its data itself, so spmd shards nothing more.",
                received(auto_shard_policy=options.auto_shard_policy),
                "leave auto_shard_policy at AUTO (or OFF); shard inside the function by "
                "ctx.input_pipeline_id and ctx.num_input_pipelines.",
            )
        )
    own = input_context(strategy)
    check_equal_parts(own)
    ctx = _AskedContext(*dataclasses.astuple(own), padding=options.padding)
    first = [dataset_fn(ctx)]

    def elements() -> Iterable[Any]:
        return first.pop() if first else dataset_fn(ctx)

    def batches(epoch: int, start: int) -> Iterator[HostBatch]:
        padding = options.padding
        for index, batch in enumerate(
            local_batches(elements(), ctx, remainder, start, padding=padding)
        ):
            if not index:
                ctx.check_rows(batch.batch_size // ctx.num_input_pipelines)
            yield batch

    remainder = options.remainder or "error"
    plan = Plan(batches, FUNCTION, remainder, ctx)
    return DistributedDataset(strategy, plan, options)


class _AskedContext(InputContext):
    """The InputContext a dataset function gets: it notes the per-replica sizes asked for.

    tf.distribute's dataset function batches by `get_per_replica_batch_size`;
    spmd's by the per-pipeline size. Where the two differ, a function ported
    unchanged would train on a global batch `num_replicas / num_pipelines`
    times smaller than meant, so its first batch is compared with what it asked.
    """

    def __init__(self, *fields: int, padding: Padding):
        super().__init__(*fields)
        object.__setattr__(self, "_asked", set())
        object.__setattr__(self, "_padding", padding)

    def __repr__(self) -> str:
        return repr(InputContext(*dataclasses.astuple(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InputContext):
            return NotImplemented
        return dataclasses.astuple(self) == dataclasses.astuple(other)

    __hash__ = InputContext.__hash__

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The rows each replica gets of a global batch (see `InputContext`)."""
        per_replica = super().get_per_replica_batch_size(global_batch_size)
        self._asked.add(global_batch_size)
        return per_replica

    def get_per_pipeline_batch_size(self, global_batch_size: int) -> int:
        """The rows this pipeline feeds of each global batch (see `InputContext`); with
        `InputOptions(uneven_batch=...)` padding, the replicas need not split it."""
        if self._padding.uneven == "error":
            return super().get_per_pipeline_batch_size(global_batch_size)
        return pipeline_rows(global_batch_size, self, self._padding)

    def check_rows(self, rows: int) -> None:
        """Raises if `rows` (per pipeline) is a per-replica size that the function asked for.

        Raises:
          BatchError: the function batched by `get_per_replica_batch_size(g)`
            where the pipeline feeds `get_per_pipeline_batch_size(g)` rows.
        """
        for size in sorted(self._asked):
            per_replica = size // self.num_replicas_in_sync
            if rows == per_replica != size // self.num_input_pipelines:
                raise BatchError(
                    message(
                        "A dataset function batches by the rows its input pipeline feeds: "
                        "ctx.get_per_pipeline_batch_size(global_batch_size) (tf.distribute's "
                        "functions batch per replica; spmd's per pipeline, i.e. process).",
                        received(
                            rows_per_pipeline=rows,
                            get_per_replica_batch_size=f"{size} -> {per_replica}",
                            get_per_pipeline_batch_size=f"{size} -> "
                            f"{size // self.num_input_pipelines}",
                        ),
                        f"batch by ctx.get_per_pipeline_batch_size({size}): the global batch "
                        f"is now {rows * self.num_input_pipelines}, not {size}.",
                    )
                )


def make_numpy_dataset(
    strategy: Strategy,
    arrays: Any,
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    drop_remainder: bool = True,
) -> NumpyDataset:
    """In-memory arrays as a dataset of global batches, for `distribute_dataset`.

    The batch size is checked against the strategy's replicas where the
    dataset is distributed (`distribute_dataset`), which may pad it
    (`InputOptions(uneven_batch=...)`).

    Args:
      strategy: the strategy the dataset is for.
      arrays: a pytree of arrays with the examples on the leading axis, e.g. (x, y).
      batch_size: the global batch size.
      shuffle: a new order each epoch, from `seed`, the same on every process.
      seed: the seed of the shuffle.
      drop_remainder: drop the last partial batch (training), or pad it and
        append a mask to every batch (evaluation; see docs/input.md).

    Returns:
      A `NumpyDataset`.

    Raises:
      BatchError: the arrays have different numbers of examples.
    """
    del strategy  # the replicas are checked against the batch by distribute_dataset
    return NumpyDataset(
        arrays, batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder
    )


def _plan_dataset(dataset: Any, ctx: InputContext, options: InputOptions) -> Plan:
    if is_grain(dataset):
        return plan_grain(dataset, ctx, options)
    if is_tf_dataset(dataset):
        return plan_tf(dataset, ctx, options)
    policy = _resolve_policy(dataset, ctx, options.auto_shard_policy)
    remainder = options.remainder or getattr(dataset, "remainder", None) or "error"
    padding = options.padding
    if isinstance(dataset, NumpyDataset):
        return _plan_numpy(dataset, ctx, policy, remainder, padding)
    if isinstance(dataset, FileDataset):
        return _plan_files(dataset, ctx, policy, remainder, padding)
    passes = _passes(dataset)
    batches = global_batches if policy is AutoShardPolicy.DATA else local_batches
    return Plan(
        lambda epoch, start: batches(passes(), ctx, remainder, start, padding=padding),
        policy.name,
        remainder,
        ctx,
    )


def _resolve_policy(dataset: Any, ctx: InputContext, policy: AutoShardPolicy) -> AutoShardPolicy:
    files = isinstance(dataset, FileDataset)
    if policy is AutoShardPolicy.AUTO:
        equal = not isinstance(ctx, BlockContext)  # unequal parts: DATA only
        enough = equal and files and len(dataset.files) >= ctx.num_input_pipelines
        policy = AutoShardPolicy.FILE if enough else AutoShardPolicy.DATA
        if jax.process_index() == 0:
            logger.info(
                "AutoShardPolicy.AUTO chose %s for %r over %d input pipeline(s).",
                policy.name,
                dataset
                if isinstance(dataset, FileDataset | NumpyDataset)
                else type(dataset).__name__,
                ctx.num_input_pipelines,
            )
    if policy is AutoShardPolicy.FILE and not files:
        raise ConfigurationError(
            message(
                "FILE sharding splits a dataset made of files: a spmd.FileDataset.",
                received(auto_shard_policy="FILE", dataset=type(dataset).__name__),
                "wrap the files in spmd.FileDataset(files, batch_size), or use "
                "AutoShardPolicy.DATA (or AUTO).",
            )
        )
    return policy


def _passes(dataset: Any) -> Callable[[], Iterable[Any]]:
    """A fresh pass over `dataset` each call: tf.data via as_numpy_iterator, else iter()."""
    if hasattr(dataset, "as_numpy_iterator"):
        return dataset.as_numpy_iterator
    if not isinstance(dataset, Iterable):
        raise ConfigurationError(
            message(
                "distribute_dataset takes an iterable of global batches.",
                received(dataset=type(dataset).__name__),
                "pass a list or generator of (x, y) batches, strategy.make_numpy_dataset(...), "
                "or a spmd.FileDataset.",
            )
        )
    if not isinstance(dataset, Iterator):
        return lambda: dataset
    passes = []

    def once() -> Iterable[Any]:  # a generator can be read once: a second pass would be wrong
        if passes:
            raise ConfigurationError(_MSG_ONE_SHOT.format(name=type(dataset).__name__))
        passes.append(dataset)
        return dataset

    return once


def _plan_numpy(ds: NumpyDataset, ctx: InputContext, policy, remainder, padding: Padding) -> Plan:
    if policy is AutoShardPolicy.OFF:  # this process's own arrays: its part of each batch
        per = pipeline_rows(ds.batch_size, ctx, padding)
        own = NumpyDataset(ds.arrays, per, shuffle=ds.shuffle, seed=ds.seed)
        # this pipeline alone, over its replicas: its part padded at its end
        mine = InputContext(1, 0, ctx.num_replicas_in_sync // ctx.num_input_pipelines)

        def batches(epoch: int, start: int) -> Iterator[HostBatch]:
            for b in own.host_batches(epoch, start, mine, remainder, padding):
                rows = b.global_size * ctx.num_input_pipelines
                yield HostBatch(b.tree, b.mask, rows, batch_size=ds.batch_size)

        count = _count(own.num_examples, own.batch_size, remainder)
    else:
        placed_rows(ds.batch_size, ctx.num_replicas_in_sync, padding, None)
        count = _count(ds.num_examples, ds.batch_size, remainder)

        def batches(epoch: int, start: int) -> Iterator[HostBatch]:
            return ds.host_batches(epoch, start, ctx, remainder, padding)

    known = policy is not AutoShardPolicy.OFF or ctx.num_input_pipelines == 1
    if remainder == "drop":
        examples = count * ds.batch_size
        dropped = ds.num_examples - examples if known else None
    else:  # under OFF the other processes' arrays are not known here
        examples = None if policy is AutoShardPolicy.OFF else ds.num_examples
        dropped = 0
    return Plan(
        batches,
        policy.name,
        remainder,
        ctx,
        num_batches=count,
        num_examples=examples,
        global_batch_size=ds.batch_size,
        seed=ds.seed if ds.shuffle else None,
        num_dropped=dropped,
    )


def _count(examples: int, size: int, remainder: str) -> int:
    """The batches `remainder` makes of `examples` rows in batches of `size`.

    Raises:
      BatchError: remainder "error" with a partial last batch: known before
        reading, so raised now rather than after the other batches ran.
    """
    whole, rest = divmod(examples, size)
    if rest and remainder == "error":
        raise BatchError(partial_message(whole, rest, size))
    return whole + (1 if rest and remainder in ("pad", "pad_if_partial") else 0)


def _plan_files(ds: FileDataset, ctx: InputContext, policy, remainder, padding: Padding) -> Plan:
    if policy is AutoShardPolicy.DATA:
        placed_rows(ds.batch_size, ctx.num_replicas_in_sync, padding, None)

        def batches(epoch: int, start: int) -> Iterator[HostBatch]:
            return global_batches(
                ds.rows(ds.files, ds.batch_size),
                ctx,
                remainder,
                start,
                ds.batch_size,
                padding=padding,
            )

        return Plan(batches, policy.name, remainder, ctx, global_batch_size=ds.batch_size)
    per = pipeline_rows(ds.batch_size, ctx, padding)
    files = ds.files_for(ctx) if policy is AutoShardPolicy.FILE else ds.files

    def own(epoch: int, start: int) -> Iterator[HostBatch]:
        return local_batches(ds.rows(files, per), ctx, remainder, start, per, padding=padding)

    return Plan(own, policy.name, remainder, ctx, global_batch_size=ds.batch_size)
