"""The input family: datasets and their sharding (dataset, input_context), host-side batch
sources, the distributed iterator and the device prefetcher. Its public names are `spmd`'s."""
