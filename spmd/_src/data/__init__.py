"""The input family: datasets and their sharding (dataset, input_context), host-side batch
sources, the distributed iterator and the device prefetcher.

Its modules are internal; the public names are exported by `spmd` itself. `PaddedBatch` is
also reachable here as `spmd._src.data.PaddedBatch`, its name before the package existed.
"""

from spmd._src.data.sources import PaddedBatch as PaddedBatch

__all__ = ["PaddedBatch"]
