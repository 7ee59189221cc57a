"""The checkpoint family: `CheckpointManager` (manager), the on-disk store, the tree of
saved leaves, integrity checks, the save guard, and preemption handling.

Its modules are internal; the public names are exported by `spmd` itself.
"""
