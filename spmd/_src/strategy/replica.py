"""The per-replica view: ReduceOp, PerReplica values, ReplicaContext and loss helpers."""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmd._src.data import in_flight
from spmd._src.errors import (
    ArgumentTypeError,
    ConfigurationError,
    enum_member,
    message,
    received,
    warn,
)
from spmd._src.validate import is_integer

__all__ = [
    "Island",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "compute_average_loss",
    "get_replica_context",
    "scale_regularization_loss",
]

_CONTEXT: contextvars.ContextVar[ReplicaContext | None] = contextvars.ContextVar(
    "spmd_replica_context", default=None
)
# The strategy of the open scope, or of the `strategy.run` being traced (a Strategy).
_STRATEGY: contextvars.ContextVar[Any] = contextvars.ContextVar("spmd_strategy", default=None)
_ISLAND: contextvars.ContextVar[Island | None] = contextvars.ContextVar("spmd_island", default=None)


class ReduceOp(enum.Enum):
    """How values from the replicas are combined. `SUM` and `MEAN` as in tf.distribute."""

    SUM = "SUM"
    MEAN = "MEAN"
    MAX = "MAX"
    MIN = "MIN"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        """Accepts a `ReduceOp` or its name in any case ("sum", "MEAN")."""
        return enum_member(
            cls, op, field="op", fix='pass spmd.ReduceOp.SUM or "SUM" (or MEAN, MAX, MIN).'
        )


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PerReplica:
    """One value per replica, as `strategy.run` returns it.

    `values` is a pytree whose leaves are stacked: leaf `i` of the leading axis
    is replica `i`'s value. Pass it to `strategy.reduce`, `strategy.gather`,
    `strategy.local_results`, or back into `strategy.run`, where each replica
    sees its own value again.
    """

    values: Any


@dataclass(frozen=True)
class ReplicaContext:
    """What a function under `strategy.run` knows about its replica.

    Attributes:
      num_replicas_in_sync: how many replicas run the function together.
      axis_names: the mesh axes the replicas are laid over.
    """

    num_replicas_in_sync: int
    axis_names: tuple[str, ...]

    @property
    def replica_id_in_sync_group(self) -> jax.Array | int:
        """This replica's index, 0 to `num_replicas_in_sync - 1` (traced inside `run`)."""
        if not self.axis_names:
            return 0
        return jax.lax.axis_index(self.axis_names)

    def all_reduce(self, op: ReduceOp | str, value: Any) -> Any:
        """Combines `value` (a pytree) over the replicas; every replica gets the result."""
        op = ReduceOp.parse(op)
        if not self.axis_names:
            return value
        collective = {
            ReduceOp.SUM: jax.lax.psum,
            ReduceOp.MEAN: jax.lax.pmean,
            ReduceOp.MAX: jax.lax.pmax,
            ReduceOp.MIN: jax.lax.pmin,
        }[op]
        return jax.tree.map(lambda x: collective(x, self.axis_names), value)

    def all_gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenates every replica's `value` along `axis`; every replica gets the result."""
        if not self.axis_names:
            return value
        return jax.tree.map(
            lambda x: jax.lax.all_gather(x, self.axis_names, axis=axis, tiled=True), value
        )


_DEFAULT_CONTEXT = ReplicaContext(num_replicas_in_sync=1, axis_names=())


@dataclass(frozen=True)
class Island:
    """What the trace of a `spmd.DiLoCo` step knows of the island it runs the step for.

    Each island is a data-parallel job of its own: its "global batch" is its
    slice of the step's batch, and its replicas in sync are its own.

    Attributes:
      strategy: the `DiLoCo` strategy whose step is traced.
      islands: how many islands train apart.
      batch: the island's rows of the step's batch (the global batch / islands),
        or None for a step without batch arrays.
    """

    strategy: Any
    islands: int
    batch: int | None


def current_island() -> Island | None:
    """The island whose step is being traced (`spmd.DiLoCo`), else None."""
    return _ISLAND.get()


@contextlib.contextmanager
def island_context(island: Island) -> Iterator[Island]:
    """Makes `island` the one `current_island()` returns, while an island's step is traced."""
    token = _ISLAND.set(island)
    try:
        yield island
    finally:
        _ISLAND.reset(token)


def current_strategy() -> Any:
    """The strategy of the open scope or of the running `strategy.run`, else None."""
    return _STRATEGY.get()


@contextlib.contextmanager
def running_strategy(strategy: Any) -> Iterator[Any]:
    """Makes `strategy` the current one while a replica fn of its `run` is traced."""
    token = _STRATEGY.set(strategy)
    try:
        yield strategy
    finally:
        _STRATEGY.reset(token)


def in_cross_replica_context() -> bool:
    """True inside a strategy's scope but outside `strategy.run` (tf.distribute's meaning)."""
    return _STRATEGY.get() is not None and _CONTEXT.get() is None


def in_replica_context() -> bool:
    """True while a replica function of `strategy.run` is traced."""
    return _CONTEXT.get() is not None


@contextlib.contextmanager
def replica_context(context: ReplicaContext) -> Iterator[ReplicaContext]:
    """Makes `context` the one `get_replica_context()` returns, while tracing a replica fn."""
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


def get_replica_context() -> ReplicaContext | None:
    """The replica context of the function being run.

    Inside `strategy.run` it is that replica's context. Outside any strategy
    scope it is the default context of one replica. Inside a strategy's scope
    but outside `run` (the cross-replica context) it is None, as in tf.distribute.

    Returns:
      A `ReplicaContext`, or None in the cross-replica context.
    """
    context = _CONTEXT.get()
    if context is not None:
        return context
    return None if in_cross_replica_context() else _DEFAULT_CONTEXT


def _replicas() -> int:
    context = _CONTEXT.get()
    return context.num_replicas_in_sync if context is not None else 1


def compute_average_loss(
    per_example_loss: jax.Array,
    global_batch_size: int | jax.Array | None = None,
    sample_weight: jax.Array | float | None = None,
) -> jax.Array:
    """Sums a per-example loss and divides by the *global* batch size.

    Inside `strategy.run` each replica sees part of the batch; dividing by the
    global batch size makes the sum over replicas (the all-reduce of the
    gradients) the mean over the whole batch. In a global-view step the
    per-example loss already covers the whole batch. A `sample_weight` of 0
    drops an example (padding): divide by the count of real examples by
    passing `global_batch_size` yourself, or let evaluation helpers do it.
    Semantics and checks are tf.nn.compute_average_loss's. Inside a
    `spmd.DiLoCo` step each island is a data-parallel job of its own, as a
    worker of tf.distribute's parameter server training was: the global batch
    is the island's (the step's batch / islands), which None gives; the batch
    across all islands is an error, since it would make each island's loss
    1/islands of its mean.

    Args:
      per_example_loss: shape (batch, ...), rank at least 1; extra axes are summed too.
      global_batch_size: a positive integer (Python, numpy or a scalar integer
        array, traced or not); by default this replica's batch size times the
        number of replicas in sync.
      sample_weight: a scalar, or of `per_example_loss`'s rank (a trailing axis
        of size 1 more or less is squeezed or added) with each axis 1 or equal.

    Returns:
      A scalar of `per_example_loss`'s dtype.

    Raises:
      ConfigurationError: `per_example_loss` is a scalar, `global_batch_size` is
        not a positive integer scalar, or `sample_weight` does not broadcast;
        inside a DiLoCo step, `global_batch_size` is the batch across islands.

    Example:
      >>> loss = spmd.compute_average_loss(per_example, global_batch_size=64)
    """
    loss = jnp.asarray(per_example_loss)
    if loss.ndim == 0:
        raise ConfigurationError(
            message(
                "compute_average_loss needs a per-example loss of rank at least 1, (batch, ...).",
                received(per_example_loss_shape=loss.shape),
                "pass the loss of each example, before taking its mean.",
            )
        )
    padded = in_flight.padded()
    if padded is not None and (global_batch_size is None or sample_weight is None):
        warn(_padded_call(padded, global_batch_size, sample_weight))
    if sample_weight is not None:
        loss = (loss * _weights_like(jnp.asarray(sample_weight), loss)).astype(loss.dtype)
    if global_batch_size is None:
        global_batch_size = loss.shape[0] * _replicas()
    _check_global_batch_size(global_batch_size)
    _check_island_batch(global_batch_size, loss)
    return jnp.sum(loss) / jnp.asarray(global_batch_size).astype(loss.dtype)


def _padded_call(padded: in_flight.Padded, global_batch_size: Any, sample_weight: Any) -> str:
    """Why a call without the mask or the real rows is wrong on a padding dataset's batch."""
    wrong = []
    if sample_weight is None:
        wrong.append("without sample_weight the padded rows enter the sum")
    if global_batch_size is None:
        wrong.append(
            f"without global_batch_size it divides by all {padded.rows} rows, padding included"
        )
    return message(
        'On a padding dataset\'s batch (InputOptions(uneven_batch="pad") or '
        'remainder="pad"), compute_average_loss takes the mask as sample_weight and the real '
        "rows as global_batch_size, so that padded rows count in neither the sum nor the "
        f"divisor: {'; '.join(wrong)}.",
        received(
            global_batch_size=global_batch_size,
            sample_weight=None if sample_weight is None else "given",
            batch_rows=padded.rows,
            data_global_batch_size=padded.batch_size,
        ),
        "pass spmd.compute_average_loss(per_example_loss, global_batch_size="
        f"{padded.batch_size}, sample_weight=mask): the global batch size you batch by (the "
        "real rows of a partial last batch: jnp.sum(mask).astype(jnp.int32) in a global-view "
        "step).",
    )


def _check_global_batch_size(size: Any) -> None:
    """A positive integer scalar; a traced one is checked for dtype and rank only."""
    is_int = is_integer(size)
    if isinstance(size, jax.Array | np.ndarray):
        is_int = size.ndim == 0 and jnp.issubdtype(size.dtype, jnp.integer)
        if is_int and isinstance(size, jax.core.Tracer):
            return
    if not is_int or int(size) < 1:
        # A float or an array of another rank is TensorFlow's TypeError; 0 or -3 its ValueError.
        raise (ConfigurationError if is_int else ArgumentTypeError)(
            message(
                "global_batch_size is a positive integer scalar: the number of examples "
                "over every replica.",
                received(global_batch_size=size),
                "pass e.g. global_batch_size=64 (an int, not 64.0 or [64]), or leave it None "
                "for the replica batch times num_replicas_in_sync.",
            )
        )


def _check_island_batch(size: Any, loss: jax.Array) -> None:
    """Inside a DiLoCo step, refuses the batch across islands as an island's global batch:
    `islands` times the island's rows of the step's batch, or times the elements of a loss
    that covers those rows (per token). A traced size counts rows of the island's own data."""
    island = _ISLAND.get()
    if island is None or island.islands == 1 or isinstance(size, jax.core.Tracer):
        return
    size, replicas = int(size), _replicas()
    rows, elements = loss.shape[0] * replicas, loss.size * replicas  # the island's
    across = set() if island.batch is None else {island.islands * island.batch}
    if rows == island.batch:
        across.add(island.islands * elements)
    if size == elements or size not in across:
        return
    raise ConfigurationError(
        message(
            "Inside a spmd.DiLoCo step each island is a data-parallel job of its own: "
            "compute_average_loss's global_batch_size is the island's batch (the step's "
            "batch / islands), so that each island's loss is the mean over its examples. "
            f"The batch across all {island.islands} islands makes it 1/{island.islands} of "
            f"that mean (for SGD, a {island.islands}x smaller learning rate).",
            received(
                global_batch_size=size,
                islands=island.islands,
                island_batch_size=island.batch,
                per_example_loss_shape=tuple(loss.shape),
            ),
            "leave global_batch_size=None, which is the island's batch under DiLoCo and the "
            "global batch under any other strategy, or pass "
            f"global_batch_size={size // island.islands} (global batch // strategy.islands).",
        )
    )


def _weights_like(weight: jax.Array, loss: jax.Array) -> jax.Array:
    """`weight` shaped to multiply `loss`, as tf.distribute's losses utilities do it."""
    if weight.ndim == loss.ndim + 1 and weight.shape[-1] == 1:
        weight = weight[..., 0]
    elif weight.ndim + 1 == loss.ndim and weight.ndim > 0:
        weight = weight[..., None]
    fits = weight.ndim == 0 or (
        weight.ndim == loss.ndim
        and all(w in (1, n) for w, n in zip(weight.shape, loss.shape, strict=True))
    )
    if not fits:
        raise ConfigurationError(
            message(
                "sample_weight is a scalar or has the per-example loss's shape (each axis "
                "equal or 1).",
                received(sample_weight_shape=weight.shape, per_example_loss_shape=loss.shape),
                "pass one weight per example, of shape (batch,) for a loss of shape (batch,).",
            )
        )
    return weight.astype(loss.dtype)


def scale_regularization_loss(regularization_loss: jax.Array) -> jax.Array:
    """Sums a regularization loss and divides it by the number of replicas in sync.

    Each replica adds the regularization term to its loss; after the gradients
    are summed over the replicas it counts once. A non-scalar loss is summed
    first, as tf.nn.scale_regularization_loss does (`[5.0, 12.4, 10.0]` over 2
    replicas is 13.7 on each). Outside `strategy.run` (one replica, or a
    global-view step) the sum is returned.
    """
    return jnp.sum(jnp.asarray(regularization_loss)) / _replicas()
