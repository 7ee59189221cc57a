"""The strategy family: the `Strategy` value (base), the named strategies, the compiled
`Step`, the per-replica context and ops, and flax nnx state handling.

Its modules are internal; the public names are exported by `spmd` itself.
"""
