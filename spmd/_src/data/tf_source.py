"""tf.data pipelines as spmd input, sharded the way tf.distribute shards them.

A `tf.data.Dataset` of global batches passed to `distribute_dataset` is read
here. Under DATA every process runs the whole pipeline and keeps its rows of
each global batch: what tf.distribute's `AutoShardPolicy.DATA` gives (rebatch
to the per-worker size, keep every n-th element). Under FILE tf.distribute's
own rewrite runs: the global batches are rebatched to the per-process size
and the file source is sharded, so process i reads files `i::n`. Under OFF
each element already is this process's part. Under AUTO the dataset's own
`options().experimental_distribute.auto_shard_policy` is honoured when set,
and DATA is used otherwise (spmd does not guess files inside a graph).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import jax

from spmd._src.data.host_batches import pipeline_rows
from spmd._src.data.input_context import AutoShardPolicy, InputContext, InputOptions, Padding
from spmd._src.data.iterator import Plan
from spmd._src.data.sources import HostBatch, global_batches, local_batches
from spmd._src.errors import BatchError, ConfigurationError, message, received

__all__ = ["is_tf_dataset", "plan_tf"]

logger = logging.getLogger("spmd.data")

_INFINITE = -1  # tf.data.INFINITE_CARDINALITY


def is_tf_dataset(dataset: Any) -> bool:
    """Whether `dataset` is a `tf.data.Dataset` (without importing TensorFlow otherwise)."""
    if not type(dataset).__module__.startswith("tensorflow."):
        return False
    import tensorflow as tf

    return isinstance(dataset, tf.data.Dataset)


def plan_tf(dataset: Any, ctx: InputContext, options: InputOptions) -> Plan:
    """What `distribute_dataset` reads of a tf.data pipeline, under tf.distribute's sharding."""
    policy = _policy(dataset, options.auto_shard_policy)
    remainder = options.remainder or "error"
    batch_size = per = None
    passes = Passes(dataset)
    if policy is AutoShardPolicy.FILE:
        dataset, batch_size = _file_sharded(dataset, ctx, options.padding)
        per = batch_size // ctx.num_input_pipelines
        passes = Passes(dataset)  # after the probe for files, which a resumed run makes too

    def read(epoch: int, start: int) -> Iterator[HostBatch]:
        elements = passes.open(epoch)
        if policy is AutoShardPolicy.DATA:
            return global_batches(elements, ctx, remainder, start, padding=options.padding)
        return local_batches(elements, ctx, remainder, start, per, padding=options.padding)

    count = _cardinality(dataset, remainder) if policy is not AutoShardPolicy.FILE else None
    return Plan(
        read,
        policy.name,
        remainder,
        ctx,
        num_batches=count if count is None or count >= 0 else None,
        global_batch_size=batch_size,
        infinite=count == _INFINITE,
    )


def _cardinality(dataset: Any, remainder: str) -> int | None:
    """Batches a pass yields, -1 for an endless dataset, None when not known before reading.

    A known count is the count of batches only when no partial last batch is
    dropped: remainder "error" or "pad", or a batch size fixed in the graph
    (`.batch(n, drop_remainder=True)`).
    """
    import tensorflow as tf

    count = int(dataset.cardinality())
    if count == tf.data.INFINITE_CARDINALITY:
        return _INFINITE
    if count < 0:
        return None
    shapes = [s.shape for s in tf.nest.flatten(dataset.element_spec) if s.shape.rank]
    fixed = bool(shapes) and all(s[0] is not None for s in shapes)
    return count if remainder != "drop" or fixed else None


class Passes:
    """Opens pass `epoch` of a tf.data pipeline in the order an uninterrupted run reads it.

    A `shuffle` with `reshuffle_each_iteration` (tf.data's default) draws a
    new order for each iterator made of the dataset, from a seed that each
    one advances. A dataset built anew (a resumed process) has made none, so
    for pass `e` the first `e` iterators are made and dropped: each one
    advances the seed without reading a record.
    """

    def __init__(self, dataset: Any):
        self._dataset, self._opened = dataset, 0
        self._reshuffles = reshuffles(dataset)
        self._lock = threading.Lock()

    def open(self, epoch: int) -> Iterator[Any]:
        """A numpy iterator over pass `epoch`.

        Raises:
          ConfigurationError: a reshuffling dataset asked for a pass it has
            already started (its order is gone: tf.data cannot go back).
        """
        with self._lock:
            if self._reshuffles:
                if self._opened > epoch:
                    raise ConfigurationError(_replay_message(epoch, self._opened))
                while self._opened < epoch:
                    self._dataset.as_numpy_iterator()  # advances the shuffle's seed
                    self._opened += 1
            self._opened += 1
            return self._dataset.as_numpy_iterator()


def reshuffles(dataset: Any) -> bool:
    """Whether a `shuffle(..., reshuffle_each_iteration=True)` is part of the pipeline."""
    stack, seen = [dataset], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if getattr(node, "_reshuffle_each_iteration", False) is True:
            return True
        try:
            stack.extend(node._inputs())
        except (AttributeError, NotImplementedError):
            continue
    return False


def _replay_message(epoch: int, opened: int) -> str:
    return message(
        "A tf.data pipeline that reshuffles each iteration (shuffle's default "
        "reshuffle_each_iteration=True) gives pass e its order once: a pass already started "
        "cannot be read again in the same order.",
        received(epoch=epoch, passes_already_opened=opened),
        "restore into a dataset built anew (a new tf.data.Dataset, as a restarted process "
        "does), or shuffle with reshuffle_each_iteration=False (one order for every pass).",
    )


def _policy(dataset: Any, policy: AutoShardPolicy) -> AutoShardPolicy:
    """spmd's policy, or under AUTO the one the dataset's tf.data options name (DATA if none)."""
    tf_policy = dataset.options().experimental_distribute.auto_shard_policy.name
    if tf_policy not in AutoShardPolicy.__members__:
        raise ConfigurationError(
            message(
                "spmd shards a tf.data.Dataset by AUTO, FILE, DATA or OFF.",
                received(dataset_auto_shard_policy=tf_policy),
                "set the dataset's auto_shard_policy to one of those (or leave it at AUTO).",
            )
        )
    asked = AutoShardPolicy[tf_policy]
    if policy is AutoShardPolicy.AUTO:
        policy = AutoShardPolicy.DATA if asked is AutoShardPolicy.AUTO else asked
        if jax.process_index() == 0:
            logger.info("AutoShardPolicy.AUTO chose %s for a tf.data.Dataset.", policy.name)
    elif asked not in (AutoShardPolicy.AUTO, policy):
        raise ConfigurationError(
            message(
                "A tf.data.Dataset is sharded one way: spmd's auto_shard_policy and the "
                "dataset's options().experimental_distribute.auto_shard_policy agree.",
                received(auto_shard_policy=policy.name, dataset_auto_shard_policy=tf_policy),
                "set one of them (or the same policy in both).",
            )
        )
    return policy


def _file_sharded(dataset: Any, ctx: InputContext, padding: Padding) -> tuple[Any, int]:
    """tf.distribute's FILE rewrite: per-process batches of this process's files.

    Returns:
      The sharded dataset and the global batch size.
    """
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops import distribute as tf_distribute
    from tensorflow.python.distribute import input_ops

    try:
        size = int(tf_distribute.compute_batch_size(dataset))
    except (IndexError, ValueError, TypeError):  # an element without a batch axis
        size = -1
    if size <= 0:
        raise BatchError(
            message(
                "FILE sharding of a tf.data.Dataset rebatches its global batches per process, "
                "so it must end in .batch(global_batch_size).",
                received(batch_size="unknown (no final .batch, or a transformation after it)"),
                "end the pipeline with .batch(global_batch_size), or use AutoShardPolicy.DATA.",
            )
        )
    per = pipeline_rows(size, ctx, padding)
    tf_options = tf.data.Options()
    tf_options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
    try:
        sharded = input_ops.auto_shard_dataset(
            dataset.rebatch(per).with_options(tf_options),
            ctx.num_input_pipelines,
            ctx.input_pipeline_id,
            ctx.num_replicas_in_sync,
        )
        first = list(sharded.take(1).as_numpy_iterator())  # TF says "not enough files" on reading
    except tf.errors.OpError as e:
        raise _no_files(ctx, str(e).splitlines()[0][:200]) from e
    if not first:  # TF gives the pipelines past the last file nothing, without an error
        raise _no_files(ctx, "no file, so no batch, for this input pipeline")
    return sharded, size


def _no_files(ctx: InputContext, why: str) -> ConfigurationError:
    return ConfigurationError(
        message(
            "FILE sharding needs a tf.data pipeline that reads files (TFRecordDataset, "
            "TextLineDataset, list_files, ...), at least one per input pipeline.",
            received(
                input_pipeline_id=ctx.input_pipeline_id,
                num_input_pipelines=ctx.num_input_pipelines,
                tensorflow=why,
            ),
            "read the data from at least as many files as processes, or use AutoShardPolicy.DATA.",
        )
    )
