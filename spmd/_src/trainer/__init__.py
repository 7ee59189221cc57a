"""The Keras-style trainer family: `Trainer` (trainer), its data and model helpers, callbacks
and losses.

Its modules are internal; the public names are exported by `spmd`, `spmd.callbacks` and
`spmd.losses`.
"""
