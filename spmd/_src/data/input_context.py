"""What an input pipeline knows about its place: InputContext, AutoShardPolicy, InputOptions."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import jax

from spmd._src.errors import BatchError, ConfigurationError, enum_member, message, received
from spmd._src.validate import positive_int, positive_number

if TYPE_CHECKING:
    from spmd._src.strategy.base import Strategy

__all__ = [
    "AutoShardPolicy",
    "BlockContext",
    "InputContext",
    "InputOptions",
    "Padding",
    "input_context",
    "rows_of",
]

Remainder = Literal["error", "drop", "pad", "pad_if_partial"]
_REMAINDERS = ("error", "drop", "pad", "pad_if_partial")
UnevenBatch = Literal["error", "pad", "pad_if_uneven"]
_UNEVEN = ("error", "pad", "pad_if_uneven")


class AutoShardPolicy(enum.Enum):
    """How `distribute_dataset` gives each input pipeline (process) its share of the data.

    Attributes:
      AUTO: FILE for a dataset made of files with at least one file per
        pipeline, DATA otherwise. Says which it picked once (logging, chief).
      FILE: each pipeline reads its own files (`files[id::num_pipelines]`);
        fewer files than pipelines is an error.
      DATA: each pipeline takes its rows of every global batch; in-memory
        arrays (`make_numpy_dataset`) read only those rows.
      OFF: the data is already this pipeline's share: each element is this
        process's part of the global batch (global batch / pipelines rows).
    """

    AUTO = "AUTO"
    FILE = "FILE"
    DATA = "DATA"
    OFF = "OFF"

    @classmethod
    def parse(cls, policy: AutoShardPolicy | str) -> AutoShardPolicy:
        """Accepts an `AutoShardPolicy` or its name in any case ("data", "FILE")."""
        return enum_member(
            cls,
            policy,
            field="auto_shard_policy",
            fix='pass spmd.AutoShardPolicy.DATA or "DATA" (or AUTO, FILE, OFF).',
        )


@dataclass(frozen=True)
class InputContext:
    """Where one input pipeline sits, as `distribute_datasets_from_function` tells `fn`.

    There is one input pipeline per distinct part of the global batch that a
    process feeds: with `MultiWorkerMirroredStrategy`, one per process.

    Attributes:
      num_input_pipelines: how many pipelines feed each global batch together.
      input_pipeline_id: this pipeline's index, 0 to `num_input_pipelines - 1`;
        it feeds rows `[id * n, (id + 1) * n)` of each global batch of size
        `n * num_input_pipelines`.
      num_replicas_in_sync: the data-parallel replicas over all pipelines.

    Example:
      >>> def dataset_fn(ctx: spmd.InputContext):
      ...     rows = ctx.get_per_pipeline_batch_size(64)     # this process's rows per step
      ...     return my_batches(shard=ctx.input_pipeline_id, num_shards=ctx.num_input_pipelines,
      ...                       batch_size=rows)
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The rows each replica gets of a global batch.

        Raises:
          BatchError: the global batch does not split evenly over the replicas.
        """
        return self._divide(global_batch_size, self.num_replicas_in_sync, "replicas")

    def get_per_pipeline_batch_size(self, global_batch_size: int) -> int:
        """The rows this pipeline feeds of each global batch: what `fn` should batch by.

        Raises:
          BatchError: the global batch does not split evenly over the replicas.
        """
        self.get_per_replica_batch_size(global_batch_size)
        return global_batch_size // self.num_input_pipelines

    def _divide(self, global_batch_size: int, parts: int, what: str) -> int:
        if global_batch_size % parts:
            raise BatchError(
                message(
                    f"The global batch must split evenly over the {parts} {what}.",
                    received(global_batch_size=global_batch_size, num_replicas_in_sync=parts),
                    f"use a global batch size that is a multiple of {parts} "
                    f"(e.g. {_round_up(global_batch_size, parts)}).",
                )
            )
        return global_batch_size // parts


@dataclass(frozen=True)
class InputOptions:
    """How a distributed dataset shards, pads, prefetches and checks its input.

    Attributes:
      auto_shard_policy: how each process gets its share (see `AutoShardPolicy`).
      prefetch: how many batches a background thread places on the devices
        ahead of the step; 0 turns the thread off.
      remainder: what to do with a last batch smaller than the others:
        "drop" it, "pad" it (every batch then carries a mask, see
        docs/input.md), or raise ("error"); "pad_if_partial" pads a smaller
        batch anywhere in the stream (a `.batch(n).repeat()` pipeline's end of
        each pass, as Keras trains on it) and gives only padded batches a
        mask. None takes the dataset's own choice
        (`drop_remainder=` of `make_numpy_dataset` / `FileDataset`), else "error".
      check_hosts: with several processes, check before each batch that every
        process has one and that their shapes agree; a disagreement is an
        error on every process instead of a hang.
      host_timeout: seconds to wait for the other processes' batch before that
        check gives up with an error.
      check_contents: with `check_hosts`, under DATA sharding (every process
        reads the same global batches and keeps its rows), also compare a
        CRC-32 fingerprint of each global batch, so processes that read
        different data (another seed, file order or source) fail instead of
        training on a mix. Large leaves are fingerprinted by sampled rows
        (about 256 KiB a leaf); the cost is measured in bench/bench_input.py.
      uneven_batch: what to do with a global batch that does not split evenly
        over the replicas (times `microbatches`), e.g. 6 rows on 4 replicas
        after an elastic job lost a host: "error" raises a `BatchError`;
        "pad" pads each global batch at its end with masked rows, to the next
        multiple (8 rows, 2 per replica), and makes every batch a
        `PaddedBatch` at every replica count, padded or not, so one loop
        serves every size (pass its mask to `compute_average_loss`, see
        docs/input.md); "pad_if_uneven" pads likewise, but only batches that
        need padding carry a mask (`Trainer` reads both forms, and pads so).
      microbatches: the equal parts each replica's rows are split into by a
        step that accumulates gradients (`Trainer(grad_accum_steps=...)`):
        a padded global batch is a multiple of replicas x microbatches.
    """

    auto_shard_policy: AutoShardPolicy | str = AutoShardPolicy.AUTO
    prefetch: int = 2
    remainder: Remainder | None = None
    check_hosts: bool = True
    host_timeout: float = 300.0
    check_contents: bool = True
    uneven_batch: UnevenBatch = "error"
    microbatches: int = 1

    def __post_init__(self):
        object.__setattr__(self, "auto_shard_policy", AutoShardPolicy.parse(self.auto_shard_policy))
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ConfigurationError(
                message(
                    "prefetch is the number of batches to place ahead: an int >= 0.",
                    received(prefetch=self.prefetch),
                    "pass prefetch=2 (the default), or 0 to turn prefetching off.",
                )
            )
        if self.remainder is not None and self.remainder not in _REMAINDERS:
            raise ConfigurationError(
                message(
                    f"remainder is one of {_REMAINDERS} (or None for the dataset's own choice).",
                    received(remainder=self.remainder),
                    'pass remainder="drop" for training or remainder="pad" for evaluation.',
                )
            )
        positive_number(self.host_timeout, "host_timeout", fix="pass e.g. host_timeout=300.")
        if self.uneven_batch not in _UNEVEN:
            raise ConfigurationError(
                message(
                    f"uneven_batch is one of {_UNEVEN}.",
                    received(uneven_batch=self.uneven_batch),
                    'pass uneven_batch="pad" to pad a global batch the replicas do not split '
                    'evenly (its batches then carry a mask), or "error" (the default).',
                )
            )
        positive_int(self.microbatches, "microbatches", fix="pass microbatches=1 or more.")

    @property
    def padding(self) -> Padding:
        """What the pipeline does with a global batch the replicas do not split evenly."""
        return Padding(self.uneven_batch, self.microbatches)


@dataclass(frozen=True)
class Padding:
    """How a pipeline places a global batch of `size` rows over `replicas` replicas.

    Attributes:
      uneven: `InputOptions.uneven_batch`.
      microbatches: `InputOptions.microbatches`: each replica's rows split into
        this many equal parts.
    """

    uneven: UnevenBatch = "error"
    microbatches: int = 1

    def rows(self, size: int, replicas: int) -> int:
        """The rows a global batch of `size` is placed as: `size` if replicas x
        microbatches divides it, else (padding) the next multiple, or 0 (an error)."""
        multiple = replicas * self.microbatches
        if size % multiple == 0:
            return size
        return 0 if self.uneven == "error" else _round_up(size, multiple)

    def masked(self, size: int, replicas: int) -> bool:
        """Whether the batches of `size` rows carry a mask for this padding: under
        "pad" always, under "pad_if_uneven" when they are padded."""
        if self.uneven == "pad":
            return True
        return self.uneven == "pad_if_uneven" and self.rows(size, replicas) != size


@dataclass(frozen=True)
class BlockContext(InputContext):
    """An input pipeline whose block of the global batch differs in size from others'.

    A strategy over the devices that divide a global batch
    (`MultiWorkerMirroredStrategy(global_batch_size=...)`) may give processes
    unequal numbers of replicas: this pipeline feeds replicas `replica_block`
    (first, end) of `num_replicas_in_sync`. Only DATA sharding can feed it.
    """

    replica_block: tuple[int, int] = (0, 1)


def rows_of(ctx: InputContext, rows: int) -> tuple[int, int]:
    """(low, high): the rows of a placed global batch of `rows` this pipeline feeds."""
    if isinstance(ctx, BlockContext):
        per_replica = rows // ctx.num_replicas_in_sync
        first, end = ctx.replica_block
        return first * per_replica, end * per_replica
    per = rows // ctx.num_input_pipelines
    return ctx.input_pipeline_id * per, (ctx.input_pipeline_id + 1) * per


def input_context(strategy: Strategy) -> InputContext:
    """The input pipeline this process is, for a strategy's batch layout.

    A process feeds the rows of the global batch its devices hold. Those rows
    must form one contiguous block; processes that hold the same block share a
    pipeline id and read the same data. Where the blocks differ in size (a
    strategy over the devices that divide the batch), the context is a
    `BlockContext`.

    Raises:
      ConfigurationError: this process holds no device of the mesh, or its
        rows are not one contiguous block, or blocks overlap.
    """
    replicas = strategy.num_replicas_in_sync
    index_map = strategy.batch_sharding(1).devices_indices_map((replicas,))
    held: dict[int, set[int]] = {}
    for device, index in index_map.items():
        held.setdefault(device.process_index, set()).update(range(*index[0].indices(replicas)))
    rows = held.get(jax.process_index(), set())
    if not rows:
        raise ConfigurationError(
            message(
                "An input pipeline runs in a process that holds devices of the strategy's mesh.",
                received(strategy=strategy, mesh_devices=len(strategy.devices)),
                "build the strategy over devices of every process (e.g. MultiWorkerMirroredStrategy()).",
            )
        )
    blocks = sorted({(min(r), max(r) + 1) for r in held.values()})
    contiguous = all(len(r) == max(r) + 1 - min(r) for r in held.values())
    overlap = any(a[1] > b[0] for a, b in zip(blocks, blocks[1:], strict=False))
    if not contiguous or overlap:
        raise ConfigurationError(
            message(
                "Each process must hold one contiguous block of the global batch.",
                received(batch_axes=strategy.batch_axes, replica_rows=sorted(rows)),
                "put the axis that crosses processes first in batch_axes "
                "(hosts outermost, as spmd.make_mesh lays them out).",
            )
        )
    mine = (min(rows), max(rows) + 1)
    if len({end - first for first, end in blocks}) == 1:
        return InputContext(len(blocks), blocks.index(mine), replicas)
    return BlockContext(len(blocks), blocks.index(mine), replicas, mine)


def _round_up(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple
