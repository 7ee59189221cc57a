"""`spmd.logical`: `REST` (every name no other rule maps), `constrain` (an activation by names)."""

# `(spmd.logical.REST, None)` in `logical_axis_rules` replicates every logical name that no
# other rule maps, as MaxText's configs leave `layers` or `kv` unsharded; without it an
# unmapped name is an error listing every one (docs/flax.md).
from spmd._src.activations import ACTIVATIONS as ACTIVATIONS
from spmd._src.activations import constrain as constrain
from spmd._src.logical import REST as REST

__all__ = ["ACTIVATIONS", "REST", "constrain"]
