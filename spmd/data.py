"""Input distribution: global batches in, global jax.Arrays over the replicas out."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spmd.strategy import Strategy

__all__ = ["distribute_dataset"]


def distribute_dataset(strategy: Strategy, dataset: Iterable[Any]) -> Iterator[Any]:
    """Yields every global batch of `dataset` as global jax.Arrays split over the replicas.

    Each batch is a pytree of arrays whose leading axis is the global batch.
    With several processes every process iterates the same global batches and
    places only the rows its own devices hold.

    Args:
      strategy: the strategy whose batch axes split the batches.
      dataset: an iterable of global batches (numpy or jax arrays).

    Yields:
      The batches as global `jax.Array`s.
    """
    for batch in dataset:
        yield strategy.distribute_batch(batch)
