"""Cluster resolvers: one file per place a cluster description can come from.

`spmd._src.clusters.initialize.RESOLVERS` lists them in the order `resolve()` asks them.
Its modules are internal.
"""
