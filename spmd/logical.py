"""`spmd.logical`: logical axis rules' words of spmd's own (flax's rules do the rest).

`REST` as a rule's logical name, `(spmd.logical.REST, None)`, replicates every
logical name that no other rule maps, as MaxText's configs leave names such as
`layers` or `kv` unsharded; without it an unmapped name is an error that lists
every one (see docs/flax.md).
"""

from spmd._src.logical import REST as REST

__all__ = ["REST"]
