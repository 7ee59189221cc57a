"""Losses and metrics by name, as the Trainer takes them, with label checks that teach."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from spmd.errors import BatchError, ConfigurationError, message, received

__all__ = ["LOSSES", "METRICS", "Metric", "check_labels", "resolve_loss", "resolve_metrics"]

LossFn = Callable[[jax.Array, jax.Array], jax.Array]


def _sparse_ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels.astype(jnp.int32))


def _categorical_ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy(logits, labels)


def _binary_ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    per = optax.sigmoid_binary_cross_entropy(logits, labels.astype(logits.dtype))
    return per.reshape(per.shape[0], -1).mean(-1)


def _mse(outputs: jax.Array, labels: jax.Array) -> jax.Array:
    err = (outputs - labels.astype(outputs.dtype)) ** 2
    return err.reshape(err.shape[0], -1).mean(-1)


def _mae(outputs: jax.Array, labels: jax.Array) -> jax.Array:
    err = jnp.abs(outputs - labels.astype(outputs.dtype))
    return err.reshape(err.shape[0], -1).mean(-1)


# Named losses take the model's raw outputs: logits for the cross-entropies
# (tf.keras's from_logits=True), values for the regressions.
LOSSES: dict[str, LossFn] = {
    "sparse_categorical_crossentropy": _sparse_ce,
    "categorical_crossentropy": _categorical_ce,
    "binary_crossentropy": _binary_ce,
    "mse": _mse,
    "mean_squared_error": _mse,
    "mae": _mae,
    "mean_absolute_error": _mae,
}


def resolve_loss(loss: str | LossFn) -> tuple[str, LossFn]:
    """The (name, function) of a loss given by name or as `(outputs, labels) -> per-example`.

    Raises:
      ConfigurationError: an unknown name (the message lists the known ones).
    """
    if callable(loss):
        return getattr(loss, "__name__", "loss"), loss
    if isinstance(loss, str) and loss.lower() in LOSSES:
        return loss.lower(), LOSSES[loss.lower()]
    raise ConfigurationError(
        message(
            f"A loss is a callable (outputs, labels) -> per-example loss, or one of {sorted(LOSSES)}.",
            received(loss=loss),
            'pass e.g. loss="sparse_categorical_crossentropy" or your own function.',
        )
    )


@dataclass(frozen=True)
class Metric:
    """A metric the Trainer sums per example and divides by the count of real examples.

    Attributes:
      name: the key in the logs ("accuracy", "val_accuracy").
      fn: (outputs, labels) -> per-example values, shape (batch,).
    """

    name: str
    fn: LossFn


def _accuracy_for(loss_name: str) -> LossFn:
    def sparse(outputs, labels):
        return (jnp.argmax(outputs, -1) == labels.astype(jnp.int32)).astype(jnp.float32)

    def categorical(outputs, labels):
        return (jnp.argmax(outputs, -1) == jnp.argmax(labels, -1)).astype(jnp.float32)

    def binary(outputs, labels):
        hits = (outputs > 0) == (labels > 0.5)
        return hits.reshape(hits.shape[0], -1).mean(-1).astype(jnp.float32)

    return {"categorical_crossentropy": categorical, "binary_crossentropy": binary}.get(
        loss_name, sparse
    )


METRICS = ("accuracy", "mse", "mae")


def resolve_metrics(metrics: Sequence[str | Metric], loss_name: str) -> tuple[Metric, ...]:
    """Metric objects for names ("accuracy" follows the loss: sparse, categorical or binary).

    Raises:
      ConfigurationError: an unknown metric name.
    """
    if isinstance(metrics, str):
        metrics = (metrics,)
    out = []
    for metric in metrics:
        if isinstance(metric, Metric):
            out.append(metric)
        elif metric in ("accuracy", "acc"):
            out.append(Metric("accuracy", _accuracy_for(loss_name)))
        elif metric in ("mse", "mae"):
            out.append(Metric(metric, LOSSES[metric]))
        else:
            raise ConfigurationError(
                message(
                    f"A metric is a spmd.losses.Metric or one of {list(METRICS)}.",
                    received(metric=metric),
                    'pass metrics=("accuracy",), or Metric("name", fn) for your own.',
                )
            )
    return tuple(out)


def check_labels(
    loss_name: str, outputs: jax.ShapeDtypeStruct, labels: jax.ShapeDtypeStruct
) -> None:
    """Checks labels against the model's outputs for a named loss, before tracing it.

    Raises:
      BatchError: the labels' shape or dtype cannot go with these outputs.
    """
    out, lab = tuple(outputs.shape), tuple(labels.shape)
    if loss_name == "sparse_categorical_crossentropy":
        ok = lab == out[:-1] and jnp.issubdtype(labels.dtype, jnp.integer)
        want = f"integer class ids of shape {out[:-1]}"
        fix = "pass class ids (not one-hot), or use loss='categorical_crossentropy' for one-hot labels."
    elif loss_name in (
        "categorical_crossentropy",
        "binary_crossentropy",
        "mse",
        "mean_squared_error",
        "mae",
        "mean_absolute_error",
    ):
        ok = lab == out
        want = f"labels of the outputs' shape {out}"
        fix = "reshape the labels to the outputs' shape (e.g. y[:, None] for one output)."
    else:
        return
    if not ok:
        raise BatchError(
            message(
                f"The loss '{loss_name}' needs {want}.",
                received(labels_shape=lab, labels_dtype=str(labels.dtype), outputs_shape=out),
                fix,
            )
        )
