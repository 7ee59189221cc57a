"""Keras' `class_weight`: each example's class weight multiplied into its sample weight."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from spmd._src.data.dataset import DistributedDataset
from spmd._src.data.tf_source import is_tf_dataset
from spmd._src.errors import BatchError, ConfigurationError, message, received
from spmd._src.trainer.data import is_arrays

__all__ = ["check_class_weight", "with_class_weight"]


def check_class_weight(class_weight: Any) -> np.ndarray | None:
    """The weight of each class id 0..max as a float32 table (1.0 for an id not named,
    as Keras); None for None.

    Raises:
      ConfigurationError: not a dict of non-negative int class ids to finite weights.
    """
    if class_weight is None:
        return None
    ok = isinstance(class_weight, Mapping) and bool(class_weight)
    ok = ok and all(
        isinstance(k, int | np.integer) and not isinstance(k, bool) and k >= 0 for k in class_weight
    )
    ok = ok and all(
        isinstance(v, int | float | np.number) and np.isfinite(v) for v in class_weight.values()
    )
    if not ok:
        raise ConfigurationError(
            message(
                "class_weight is a dict from class ids (ints >= 0) to finite weights, as "
                "Keras takes it.",
                received(class_weight=class_weight),
                "pass e.g. class_weight={0: 1.0, 1: 5.0}; for one-hot labels the class id is "
                "the column of the 1.",
            )
        )
    table = np.ones(int(max(class_weight)) + 1, np.float32)
    for k, v in class_weight.items():
        table[int(k)] = v
    return table


def with_class_weight(data: Any, table: np.ndarray | None, what: str) -> Any:
    """`data` whose batches carry sample weights multiplied by their labels' class weights.

    Arrays `(x, y[, w])` become `(x, y, w x table[ids])`; an iterable's batches
    are mapped as they are read (a tf.data dataset by its own `map`, so its
    sharding and cardinality stay tf.data's); ids are integer labels of shape
    (batch,) or (batch, 1), or the argmax of one-hot labels (Keras' reading).

    Raises:
      ConfigurationError: a distributed dataset (its batches are already placed:
        put the weights in its batches).
      BatchError: a label above every class id `class_weight` names.
    """
    if table is None:
        return data
    if isinstance(data, DistributedDataset):
        raise ConfigurationError(
            message(
                "class_weight weighs the batches fit reads from data it distributes itself: "
                "arrays, an iterable of batches or a tf.data dataset.",
                received(data="a distributed dataset", class_weight="given"),
                "pass the data before strategy.distribute_dataset, or put the weights in its "
                "batches: (x, y, sample_weight * class_weights[y]).",
            )
        )
    if is_tf_dataset(data):
        return _tf_weighted(data, table)
    if is_arrays(data) and len(data) > 1:
        return _weighted(tuple(data), table, what)
    if isinstance(data, Iterator):
        return (_weighted(batch, table, what) for batch in data)
    if isinstance(data, Iterable):
        return _Mapped(data, table, what)
    return data


class _Mapped:
    """A re-iterable whose batches are weighted as they are read."""

    def __init__(self, data: Iterable, table: np.ndarray, what: str) -> None:
        self.data, self.table, self.what = data, table, what

    def __iter__(self) -> Iterator:
        return (_weighted(batch, self.table, self.what) for batch in self.data)


def _ids(y: np.ndarray) -> np.ndarray:
    if y.ndim == 2 and y.shape[1] > 1:
        return np.argmax(y, axis=-1)
    return y.reshape(y.shape[0]).astype(np.int64)


def _weighted(batch: Any, table: np.ndarray, what: str) -> Any:
    """A batch `(x, y[, w])` with w multiplied by the class weights of y's ids."""
    if not isinstance(batch, tuple | list) or len(batch) not in (2, 3):
        return batch  # not (x, y[, w]): train_args names what it is
    x, y, *w = batch
    ids = _ids(np.asarray(y))
    if ids.size and (ids.min() < 0 or ids.max() >= len(table)):
        raise BatchError(
            message(
                f"Every label {what} weighs by class_weight is a class id it names (ids "
                f"0..{len(table) - 1}; ids it leaves out weigh 1.0).",
                received(labels_min=int(ids.min()), labels_max=int(ids.max())),
                "name every class in class_weight, or map the labels into its range.",
            )
        )
    weights = table[ids]
    if w and np.shape(w[0]) not in ((len(ids),), (len(ids), 1)):
        return batch  # the sample weights' shape check names it
    if w:
        weights = np.asarray(w[0], np.float32).reshape(len(ids)) * weights
    return (x, y, weights)


def _tf_range_message(classes: int) -> str:
    """The message of tf.data's check of the labels (TF prints the labels after it)."""
    return message(
        f"Every label fit weighs by class_weight is a class id it names (ids 0..{classes - 1}; "
        "ids it leaves out weigh 1.0).",
        "Received: the labels below",
        "name every class in class_weight, or map the labels into its range.",
    )


def _tf_weighted(dataset: Any, table: np.ndarray) -> Any:
    """A tf.data dataset with the class weights mapped in, in tf.data's own graph."""
    import tensorflow as tf

    constant = tf.constant(table)

    def weigh(x, y, *w):
        ids = tf.argmax(y, -1) if y.shape.rank == 2 and y.shape[1] != 1 else tf.reshape(y, [-1])
        ids = tf.cast(ids, tf.int32)
        tf.debugging.assert_less(ids, len(table), message=_tf_range_message(len(table)))
        weights = tf.gather(constant, ids)
        if w:
            weights = tf.cast(tf.reshape(w[0], [-1]), tf.float32) * weights
        return x, y, weights

    return dataset.map(weigh)
