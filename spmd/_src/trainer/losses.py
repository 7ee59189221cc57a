"""Losses and metrics by name, as the Trainer takes them, with label checks that teach."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from spmd._src.errors import BatchError, ConfigurationError, message, received

__all__ = [
    "LOSSES",
    "METRICS",
    "Metric",
    "check_fit",
    "check_labels",
    "check_outputs",
    "per_example",
    "resolve_loss",
    "resolve_metrics",
]

LossFn = Callable[[jax.Array, jax.Array], jax.Array]
_REGRESSION = ("mse", "mean_squared_error", "mae", "mean_absolute_error")

METRICS = ("accuracy", "mse", "mae")
RESERVED = ("loss", "count", "weight_sum")  # keys of the Trainer's sums; "val_*" names its logs


def per_example(fn: LossFn, what: str) -> LossFn:
    """`fn` with its values averaged over every axis but the batch axis: shape (batch,).

    Like Keras (which averages over the last axis), a loss of a sequence
    model's (batch, time, classes) logits is one value per example, the mean
    over its time steps; it is never broadcast against the (batch,) weights.

    Raises:
      BatchError: `fn` returns a scalar (a mean over the batch, not per example).
    """

    def reduced(outputs: jax.Array, labels: jax.Array) -> jax.Array:
        values = jnp.asarray(fn(outputs, labels))
        if values.ndim == 0:
            raise BatchError(
                message(
                    f"The {what} returns one value per example: shape (batch, ...).",
                    received(**{f"{what.split()[0]}_shape": values.shape}),
                    "return the per-example values (no mean over the batch); the Trainer "
                    "weights them and divides by the number of real examples.",
                )
            )
        return values.reshape(values.shape[0], -1).mean(-1) if values.ndim > 1 else values

    reduced.__name__ = getattr(fn, "__name__", what)
    return reduced


def _sparse_ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    labels = labels.astype(jnp.int32)
    per = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    outside = (labels < 0) | (labels >= logits.shape[-1])  # -1 would index from the end
    return jnp.where(outside, jnp.nan, per)  # NaN, never a wrong finite loss


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
        return getattr(loss, "__name__", "loss"), per_example(loss, "loss")
    if isinstance(loss, str) and loss.lower() in LOSSES:
        return loss.lower(), per_example(LOSSES[loss.lower()], "loss")
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

    def binary(outputs, labels):  # the named loss takes logits: > 0 is probability > 0.5
        hits = (outputs > 0) == (labels > 0.5)
        return hits.reshape(hits.shape[0], -1).mean(-1).astype(jnp.float32)

    def by_shape(outputs, labels):  # a loss of your own: Keras' rule, from the shapes
        if outputs.shape[-1] == 1 and labels.shape in (outputs.shape, outputs.shape[:-1]):
            return _binary_accuracy(outputs, labels.reshape(outputs.shape))
        if labels.ndim == outputs.ndim - 1 and jnp.issubdtype(labels.dtype, jnp.integer):
            return sparse(outputs, labels)
        if labels.shape == outputs.shape:
            return categorical(outputs, labels)
        raise BatchError(
            message(
                "metric 'accuracy' compares class ids (outputs' shape without its last axis), "
                "one-hot labels (the outputs' shape), or, for one output column, binary labels "
                "of shape (batch,) or (batch, 1) with the outputs.",
                received(labels_shape=labels.shape, outputs_shape=outputs.shape),
                "pass labels of one of those shapes, or a Metric of your own.",
            )
        )

    return {
        "sparse_categorical_crossentropy": sparse,
        "categorical_crossentropy": categorical,
        "binary_crossentropy": binary,
    }.get(loss_name, by_shape)


def _binary_accuracy(outputs: jax.Array, labels: jax.Array) -> jax.Array:
    """Keras' BinaryAccuracy(threshold=0.5): whether (output > 0.5) equals the 0/1 label."""
    hits = (outputs > 0.5).astype(jnp.float32) == labels.astype(jnp.float32)
    return hits.reshape(hits.shape[0], -1).mean(-1).astype(jnp.float32)


def resolve_metrics(metrics: Sequence[str | Metric], loss_name: str) -> tuple[Metric, ...]:
    """Metric objects for names ("accuracy" follows the loss: sparse, categorical or binary).

    Raises:
      ConfigurationError: an unknown metric name, or a name the Trainer's logs
        already use ("loss", "count", "weight_sum", "val_*") or used twice.
    """
    if isinstance(metrics, str):
        metrics = (metrics,)
    out: list[Metric] = []
    for metric in metrics:
        if isinstance(metric, Metric):
            fn = per_example(metric.fn, f"metric {metric.name!r}")
            out.append(Metric(metric.name, fn))
        elif metric in ("accuracy", "acc"):
            if loss_name in _REGRESSION:
                raise ConfigurationError(_misfit("accuracy", loss_name))
            out.append(Metric("accuracy", _builtin(_accuracy_for(loss_name))))
        elif metric in ("mse", "mae"):
            if loss_name == "sparse_categorical_crossentropy":
                raise ConfigurationError(_misfit(metric, loss_name))
            out.append(Metric(metric, _builtin(LOSSES[metric])))
        else:
            raise ConfigurationError(
                message(
                    f"A metric is a spmd.losses.Metric or one of {list(METRICS)}.",
                    received(metric=metric),
                    'pass metrics=("accuracy",), or Metric("name", fn) for your own.',
                )
            )
        _check_name(out[-1].name, [m.name for m in out[:-1]])
    return tuple(out)


def _builtin(fn: LossFn) -> LossFn:
    reduced = per_example(fn, "metric")
    reduced.builtin = True  # type: ignore[attr-defined]  # takes one array of outputs
    return reduced


def _check_name(name: str, before: list[str]) -> None:
    """Raises if a metric's name would overwrite a key of the logs (or another metric's)."""
    if not isinstance(name, str) or not name:
        problem = "a non-empty string"
    elif name in RESERVED or name.startswith("val_"):
        problem = f"not one of the Trainer's own keys {list(RESERVED)} nor a 'val_' name"
    elif name in before:
        problem = "different from every other metric's name"
    else:
        return
    raise ConfigurationError(
        message(
            f"A metric's name is its key in the logs: {problem}, or it would overwrite the "
            "numbers every average is made of.",
            received(metric_name=name, other_metrics=before),
            'give the metric another name, e.g. Metric("my_count", fn).',
        )
    )


def _misfit(metric: str, loss_name: str) -> str:
    kind = "class ids" if loss_name.startswith("sparse") else "regression targets"
    return message(
        f"A metric must fit the loss: metric {metric!r} cannot be computed from the "
        f"{kind} that loss {loss_name!r} takes.",
        received(metric=metric, loss=loss_name),
        "drop the metric (Trainer's default is no metrics, as in Keras), or pick one that "
        'fits: "accuracy" for a classification loss, "mse" / "mae" for a regression.',
    )


def check_fit(
    loss_name: str,
    loss_fn: LossFn,
    metrics: Sequence[Metric],
    outputs: jax.ShapeDtypeStruct,
    labels: jax.ShapeDtypeStruct,
) -> None:
    """Traces the loss and each metric on the outputs' and labels' shapes, before a step runs.

    Raises:
      BatchError: the loss or a metric fails on these shapes, or does not give
        one value per example; the message names both the metric and the loss.
    """
    leaves = jax.tree.leaves(outputs)
    batch = leaves[0].shape[0] if leaves and leaves[0].shape else None
    for name, fn in (("loss", loss_fn), *((f"metric {m.name!r}", m.fn) for m in metrics)):
        try:
            shape = jax.eval_shape(fn, outputs, labels).shape
        except BatchError:
            raise
        except Exception as error:  # a shape error of the user's function: say whose
            raise BatchError(
                message(
                    f"The {name} must compute on the model's outputs and the labels "
                    f"(loss {loss_name!r}).",
                    received(
                        outputs_shape=jax.tree.map(lambda o: tuple(o.shape), outputs),
                        labels_shape=tuple(labels.shape),
                        error=str(error).splitlines()[0],
                    ),
                    "give labels that fit the outputs, or drop / replace the metric.",
                )
            ) from None
        if shape != (batch,):
            raise BatchError(
                message(
                    f"The {name} gives one value per example (loss {loss_name!r}).",
                    received(values_shape=shape, batch=batch),
                    "return values with the batch on the leading axis.",
                )
            )


def check_labels(
    loss_name: str, outputs: jax.ShapeDtypeStruct, labels: jax.ShapeDtypeStruct
) -> None:
    """Checks labels against the model's outputs for a named loss, before tracing it.

    Raises:
      BatchError: the labels' shape or dtype cannot go with these outputs.
    """
    if loss_name not in LOSSES:  # a loss of your own: check_fit traces it
        return
    out, lab = tuple(outputs.shape), tuple(labels.shape)
    if loss_name == "sparse_categorical_crossentropy":
        ok = lab == out[:-1] and jnp.issubdtype(labels.dtype, jnp.integer)
        want = f"integer class ids of shape {out[:-1]}"
        fix = "pass class ids (not one-hot), or use loss='categorical_crossentropy' for one-hot labels."
    elif loss_name in ("categorical_crossentropy", "binary_crossentropy", *_REGRESSION):
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


def check_outputs(loss_name: str, metrics: Sequence[Metric], outputs: object) -> None:
    """Checks that a model returning a pytree of outputs has a loss and metrics that take one.

    A loss of your own (and a `Metric` of your own) gets the pytree as it is;
    a named loss and the built-in metrics take one array.

    Raises:
      ConfigurationError: a named loss or a built-in metric with a tuple/dict of outputs.
    """
    if isinstance(outputs, jax.ShapeDtypeStruct):
        return
    shapes = jax.tree.map(lambda o: tuple(o.shape), outputs)
    builtin = [m.name for m in metrics if getattr(m.fn, "builtin", False)]
    if loss_name in LOSSES or builtin:
        what = f"loss {loss_name!r}" if loss_name in LOSSES else f"metric {builtin[0]!r}"
        raise ConfigurationError(
            message(
                f"The model returns several outputs (a {type(outputs).__name__}); the {what} "
                "takes one array of outputs.",
                received(outputs_shapes=shapes, loss=loss_name, metrics=[m.name for m in metrics]),
                "pass a loss of your own, (outputs, labels) -> per-example loss, that reads the "
                "outputs' structure, and metrics as spmd.losses.Metric(name, fn) that do too.",
            )
        )
