"""grain pipelines as spmd input: grain's shard options per input pipeline, grain's state in the position.

A grain `MapDataset`, `IterDataset` or `DataLoader` passed to
`distribute_dataset` is read through this module. Its sharding is grain's
own: `grain_shard_options(strategy)` is the `grain.sharding.ShardOptions` of
this process's input pipeline, for `IndexSampler(shard_options=...)` or
`dataset[opts.shard_index::opts.shard_count]`. Its position is grain's own
too: the state of grain's iterator before each batch is kept, and saved in
spmd's data position (`per_pipeline`, one entry per input pipeline), so a
restored iterator calls grain's `set_state` and goes on at the exact example
instead of reading the batches before it again.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax

from spmd._src.data.input_context import AutoShardPolicy, InputContext, InputOptions, input_context
from spmd._src.data.iterator import Plan
from spmd._src.data.sources import HostBatch, global_batches, local_batches
from spmd._src.errors import ConfigurationError, message, received

if TYPE_CHECKING:
    from spmd._src.strategy.base import Strategy

__all__ = ["GrainPositions", "grain_shard_options", "is_grain", "plan_grain"]

logger = logging.getLogger("spmd.data")

_BYTES = "grain_bytes"  # a DataLoader's state is JSON bytes: kept as text under this key


def is_grain(dataset: Any) -> bool:
    """Whether `dataset` is a grain `MapDataset`, `IterDataset` or `DataLoader`."""
    if not type(dataset).__module__.startswith("grain."):
        return False
    import grain

    return isinstance(dataset, grain.MapDataset | grain.IterDataset | grain.DataLoader)


def grain_shard_options(strategy: Strategy, *, drop_remainder: bool = True) -> Any:
    """grain's shard options for this process's input pipeline.

    Processes that hold the same rows of the global batch share a pipeline
    and read the same shard, which `grain.sharding.ShardByJaxProcess` would
    not do once a model axis crosses processes.

    Args:
      strategy: the strategy whose batch layout names the pipelines.
      drop_remainder: grain's option: every shard gets the same number of
        records (the last `records % pipelines` are left out). With False
        the first shards get one record more, so pipelines can run out at
        different batches, which spmd's host check reports as an error.

    Returns:
      `grain.sharding.ShardOptions(shard_index=input_pipeline_id,
      shard_count=num_input_pipelines, drop_remainder=drop_remainder)`.
    """
    import grain

    ctx = input_context(strategy)
    return grain.sharding.ShardOptions(
        shard_index=ctx.input_pipeline_id,
        shard_count=ctx.num_input_pipelines,
        drop_remainder=drop_remainder,
    )


def plan_grain(dataset: Any, ctx: InputContext, options: InputOptions) -> Plan:
    """What `distribute_dataset` reads of a grain pipeline: its batches, with grain's positions.

    Under DATA each element is a global batch and every process keeps its
    rows; under OFF each element is already this pipeline's part of one
    (grain sharded it). AUTO is OFF for a `DataLoader` sharded for these
    pipelines, DATA otherwise.
    """
    policy = _policy(dataset, ctx, options.auto_shard_policy)
    remainder = options.remainder or "error"
    positions = GrainPositions(dataset, ctx.input_pipeline_id, keep=2 * options.prefetch + 32)
    batches = global_batches if policy is AutoShardPolicy.DATA else local_batches

    def read(epoch: int, start: int) -> Iterator[HostBatch]:
        elements, skip = positions.open(epoch, start)
        return batches(elements, ctx, remainder, skip, resumed=start > 0, padding=options.padding)

    return Plan(
        read,
        policy.name,
        remainder,
        ctx,
        positions=positions,
        source=describe(dataset),
        infinite=_endless(dataset),
    )


def _endless(dataset: Any) -> bool:
    """Whether a grain MapDataset repeats without end (grain gives it a length near 2**61)."""
    import grain

    if not isinstance(dataset, grain.MapDataset):
        return False
    try:
        return len(dataset) >= sys.maxsize // 8
    except (TypeError, ValueError, NotImplementedError):
        return False


def describe(dataset: Any) -> str:
    """A grain pipeline's seeded transformations, e.g. "ShuffleMapDataset[seed=7]".

    A position (grain's state) only means the same records in a pipeline
    shuffled (or randomly mapped) with the same seeds. Other transformations
    are left out: a map added on resume (a counter, a new augmentation) keeps
    the records where they were.
    """
    found: list[str] = []
    stack = [dataset]
    while stack:
        node = stack.pop()
        seeds = [
            f"{name.strip('_')}={getattr(node, name)}"
            for name in ("_seed", "_seed_rng_seed")
            if getattr(node, name, None) is not None
        ]
        if seeds:
            found.append(f"{type(node).__name__}[{', '.join(seeds)}]")
        stack.extend(getattr(node, "_parents", ()))
    return ", ".join(found)


def _policy(dataset: Any, ctx: InputContext, policy: AutoShardPolicy) -> AutoShardPolicy:
    shard = getattr(dataset, "_shard_options", None)  # a DataLoader's (its sampler's) options
    count = getattr(shard, "shard_count", 1)
    ours = (ctx.input_pipeline_id, ctx.num_input_pipelines)
    if policy is AutoShardPolicy.AUTO:
        policy = AutoShardPolicy.OFF if count > 1 else AutoShardPolicy.DATA
        if jax.process_index() == 0:
            logger.info("AutoShardPolicy.AUTO chose %s for a grain %s.", policy.name, type(dataset))
    if policy is AutoShardPolicy.FILE:
        raise ConfigurationError(
            message(
                "grain shards records, not files: its sampler or a slice gives each "
                "input pipeline its share.",
                received(auto_shard_policy="FILE", dataset=type(dataset).__name__),
                "build the pipeline with spmd.grain_shard_options(strategy) and pass "
                "AutoShardPolicy.OFF (a sharded DataLoader is found under AUTO).",
            )
        )
    if count > 1 and (policy is AutoShardPolicy.DATA or (shard.shard_index, count) != ours):
        raise ConfigurationError(
            message(
                "A grain DataLoader sharded by its sampler must be sharded for spmd's input "
                "pipelines, and read as each pipeline's share (OFF or AUTO).",
                received(
                    shard_options=shard,
                    auto_shard_policy=policy.name,
                    input_pipeline_id=ctx.input_pipeline_id,
                    num_input_pipelines=ctx.num_input_pipelines,
                ),
                "shard with spmd.grain_shard_options(strategy) and leave auto_shard_policy at "
                "AUTO, or give the DataLoader no shard options for DATA.",
            )
        )
    return policy


class GrainPositions:
    """grain iterator states by (epoch, batch): the source positions spmd saves.

    The reading thread runs ahead of the batches handed out (prefetch), so
    the state of grain's iterator is kept for each batch it starts, and the
    one asked for is that of the batch the consumer is at.
    """

    def __init__(self, dataset: Any, pipeline: int, keep: int):
        self._dataset, self._pipeline, self._keep = dataset, pipeline, keep
        self._states: collections.OrderedDict[tuple[int, int], Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def open(self, epoch: int, start: int) -> tuple[Iterator[Any], int]:
        """A grain iterator at batch `start` of `epoch`, and how many batches are still to skip.

        With grain's state for `start` known (kept, or restored by `seek`),
        grain goes there itself; without it the batches before are read again.
        """
        iterator = iter(self._dataset)
        with self._lock:
            saved = self._states.get((epoch, start)) if start else None
        if saved is None:
            return self._recorded(iterator, epoch, 0), start
        iterator.set_state(_decode(saved))
        return self._recorded(iterator, epoch, start), 0

    def _recorded(self, iterator: Any, epoch: int, index: int) -> Iterator[Any]:
        for element in iterator:
            index += 1
            saved = _encode(iterator.get_state())
            with self._lock:
                self._states[(epoch, index)] = saved
                while len(self._states) > self._keep:
                    self._states.popitem(last=False)
            yield element

    def state(self, epoch: int, batch: int) -> dict | None:
        """{pipeline id: grain's state before batch `batch`}, or None at an epoch's start."""
        if batch == 0:
            return None
        with self._lock:
            saved = self._states.get((epoch, batch))
        if saved is None:
            raise ConfigurationError(
                message(
                    "grain's position is kept for the batches near the one being read.",
                    received(epoch=epoch, batch=batch, kept=list(self._states)[:4]),
                    "take get_state() from the iterator being read (or the dataset), "
                    "not from one that has moved on.",
                )
            )
        return {str(self._pipeline): saved}

    def seek(self, state: dict) -> None:
        """Keeps this pipeline's grain state of `state` for `open` at its (epoch, batch).

        Raises:
          ConfigurationError: the state holds grain positions, but not this
            pipeline's (it was taken on one process, not saved by a
            CheckpointManager, which gathers every pipeline's).
        """
        per_pipeline = state.get("per_pipeline")
        if not state["batch"] or per_pipeline is None:  # an epoch's start, or replayed
            return
        saved = per_pipeline.get(str(self._pipeline)) if isinstance(per_pipeline, dict) else None
        if saved is None:
            raise ConfigurationError(
                message(
                    "A grain position holds the state of every input pipeline's grain iterator.",
                    received(
                        input_pipeline_id=self._pipeline,
                        saved_pipelines=sorted(per_pipeline)
                        if isinstance(per_pipeline, dict)
                        else per_pipeline,
                    ),
                    "save the position with spmd.CheckpointManager.save(step, state, "
                    "data=iterator) on every process: it gathers each pipeline's state.",
                )
            )
        with self._lock:
            self._states[(state["epoch"], state["batch"])] = saved


def _encode(state: Any) -> Any:
    return {_BYTES: state.decode()} if isinstance(state, bytes) else state


def _decode(saved: Any) -> Any:
    if isinstance(saved, dict) and set(saved) == {_BYTES}:
        return saved[_BYTES].encode()
    return saved
