"""What the Trainer accepts as data, and how it reads a batch: inputs, labels, weights, mask."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from spmd._src.data.dataset import DistributedDataset, InputOptions
from spmd._src.data.sources import PaddedBatch
from spmd._src.data.tf_source import is_tf_dataset
from spmd._src.errors import BatchError, ConfigurationError, message, received
from spmd._src.validate import positive_int

if TYPE_CHECKING:
    from spmd._src.strategy.base import Strategy

__all__ = [
    "BatchSpecs",
    "as_dataset",
    "check_batch_size",
    "check_batched",
    "check_count",
    "check_distributed",
    "check_examples",
    "check_label_range",
    "check_lists",
    "check_microbatches",
    "check_rows",
    "check_sample_weight",
    "check_tf_elements",
    "check_tuple",
    "host_first",
    "is_arrays",
    "is_bare_arrays",
    "split_batch",
    "train_args",
]

_ARRAY = (np.ndarray, jax.Array)

_RANGE = jax.jit(lambda y: (jnp.min(y), jnp.max(y)))
_KINDS = {"i": "int", "u": "uint", "f": "float", "b": "bool"}


def _is_inputs(x: Any) -> bool:
    """An array, a dict of arrays (named inputs) or a list/tuple of arrays (Keras' inputs list)."""
    if isinstance(x, _ARRAY):
        return True
    values = x.values() if isinstance(x, dict) else x if isinstance(x, list | tuple) else ()
    return bool(values) and all(isinstance(v, _ARRAY) for v in values)


def is_bare_arrays(x: Any) -> bool:
    """A list/tuple of arrays: several inputs, or several batches of one input."""
    return isinstance(x, list | tuple) and bool(x) and all(isinstance(v, _ARRAY) for v in x)


def is_arrays(data: Any) -> bool:
    """Whether `data` is `(x,)`, `(x, y)` or `(x, y, sample_weight)` of in-memory arrays.

    `x` may be a dict of arrays (named inputs) or a list of arrays (several
    inputs, given to the model as a list, as Keras does); `y` and
    `sample_weight` are arrays. Read as an iterable of batches, such data
    would have a bare array `y` for a batch, which fit and evaluate never take.
    """
    return (
        isinstance(data, tuple | list)
        and 1 <= len(data) <= 3
        and _is_inputs(data[0])
        and (len(data) > 1 or not isinstance(data[0], list | tuple))  # [(x, y)]: one batch
        and all(isinstance(a, _ARRAY) for a in data[1:])
    )


def as_dataset(
    strategy: Strategy,
    data: Any,
    batch_size: int | None,
    *,
    shuffle: bool,
    pad: bool,
    seed: int,
    what: str,
    microbatches: int = 1,
    keep_partial: bool = False,
) -> DistributedDataset:
    """The distributed dataset of `data`: arrays, an iterable of batches, or one already.

    With `pad` (evaluate, predict), or `keep_partial` (fit on arrays, as Keras
    trains on the last partial batch), a last partial batch of arrays is
    padded and every batch is a `PaddedBatch`, so nothing is dropped and
    padding never counts; without either, it is dropped. An iterable's batch
    smaller than its first (a generator's last, the end of each pass of a
    tf.data `.batch(n).repeat()`) is padded to the first's shape and masked
    (`remainder="pad_if_partial"`): one compiled shape, the loss a mean over
    its real rows; for predict only the last batch may be smaller
    (`remainder="pad"`, every batch masked).
    A global batch the replicas (times `microbatches`) do not split evenly is
    padded at its end with masked rows (`uneven_batch="pad_if_uneven"`): the
    steps weigh only the real rows, so the global batch, and the training,
    are the same at any replica count.

    Raises:
      BatchError: arrays without a batch size, or without examples (or, for
        training, fewer than one batch); a distributed dataset known to yield
        nothing, or (with `pad`) to drop examples; a tf.data dataset of
        unbatched, ragged or sparse elements.
      ConfigurationError: data of a kind the Trainer does not read (a dict; Python
        lists of numbers, `check_lists`; a tuple of four arrays or more);
        `batch_size` beside batched data.
    """

    check_tuple(data, what)
    check_lists(data, what)
    check_batch_size(data, batch_size, what)
    if isinstance(data, DistributedDataset):
        check_distributed(data, pad=pad, what=what)
        return data
    uneven = {"uneven_batch": "pad_if_uneven", "microbatches": microbatches}
    if is_arrays(data):
        check_examples(data, batch_size, pad=pad or keep_partial, what=what)
        if batch_size is None:
            raise BatchError(
                message(
                    f"{what} with arrays needs batch_size: the global batch size.",
                    received(batch_size=None, examples=len(jax.tree.leaves(data[0])[0])),
                    f"pass batch_size=, e.g. 64 (a multiple of the {strategy.num_replicas_in_sync} "
                    "replicas is never padded).",
                )
            )
        arrays = tuple(jax.tree.map(np.asarray, a) for a in data)
        ds = strategy.make_numpy_dataset(
            arrays, batch_size, shuffle=shuffle, seed=seed, drop_remainder=not (pad or keep_partial)
        )
        return strategy.distribute_dataset(ds, InputOptions(**uneven))
    if is_tf_dataset(data):
        check_tf_elements(data, what)
    if isinstance(data, Iterable) and not isinstance(data, dict | str | bytes):
        # Keras trains (and evaluates) on a smaller batch wherever the data yields one: it
        # is padded to the compiled batch shape, its padding masked. predict pads its last
        # batch and masks every batch, so a list batch stays one element: several inputs.
        remainder = "pad" if what == "predict" else "pad_if_partial"
        options = InputOptions(remainder=remainder, **uneven)
        return strategy.distribute_dataset(data, options)
    raise ConfigurationError(
        message(
            f"{what} takes (x, y) arrays with batch_size (x may be a dict of named inputs), "
            "an iterable of (x, y) batches, or a distributed dataset.",
            received(data=_kind(data)),
            "pass e.g. trainer.fit((x_train, y_train), batch_size=64); for a dict "
            '{"x": ..., "y": ...} pass (d["x"], d["y"]); for named inputs '
            '({"image": ..., "text": ...}, y).',
        )
    )


_DATA_NAMES = {"predict": "x", "validation_data": "validation_data"}  # the data's argument


def check_batch_size(data: Any, batch_size: Any, what: str) -> None:
    """Raises for a `batch_size` Keras would refuse: beside batched data, or not an int.

    Raises:
      ConfigurationError: `batch_size` with a dataset or an iterable of batches
        (they are batched already, and Keras raises too); an array there (Keras'
        `fit(x, y)`, which spmd spells `fit((x, y))`).
    """
    if batch_size is None:
        return
    if isinstance(batch_size, _ARRAY):
        call = (
            "predict(x, batch_size=64)" if what == "predict" else f"{what}((x, y), batch_size=64)"
        )
        raise ConfigurationError(
            message(
                f"{what} takes the data as its first argument, (x, y) in one tuple: Keras' "
                f"{what}(x, y, ...) would put y in batch_size.",
                received(batch_size=f"an array of shape {np.shape(batch_size)}"),
                f"pass trainer.{call}; sample weights go in the tuple: (x, y, sample_weight).",
            )
        )
    if isinstance(data, dict | str | bytes):  # not data as_dataset reads: it says so
        return
    inputs = isinstance(data, tuple) and len(data) == 1 and _is_inputs(data[0])  # predict's
    if not is_arrays(data) and not inputs:
        name = "validation_batch_size" if what == "validation_data" else "batch_size"
        raise ConfigurationError(
            message(
                f"{what} takes {name} only with arrays: a dataset or an iterable yields "
                f"batches already (Keras raises for {name} with a dataset too).",
                received(**{name: batch_size, _DATA_NAMES.get(what, "data"): _kind(data)}),
                f"drop {name}= (each batch the data yields is a global batch), or rebatch "
                "the data: a tf.data dataset by ds.unbatch().batch(n), or pass the arrays "
                "(x, y) with batch_size.",
            )
        )


def check_tuple(data: Any, what: str) -> None:
    """Raises for a tuple of four arrays or more, which Keras' (x, y, sample_weight) is not.

    Raises:
      ConfigurationError: naming the elements and Keras' reading of a tuple.
    """
    if not (isinstance(data, tuple) and len(data) > 3 and _is_inputs(data[0])):
        return
    if not all(isinstance(a, _ARRAY) for a in data[1:]):
        return
    raise ConfigurationError(
        message(
            f"{what} reads a tuple of arrays as Keras does: (x,), (x, y) or (x, y, "
            "sample_weight); a fourth element has no place in it.",
            received(tuple_elements=len(data), shapes=_describe(data)),
            "pass (x, y, sample_weight) with one weight per example (multiply several "
            "weights together: w1 * w2); several inputs go in x as a list or dict: "
            "([x1, x2], y).",
        )
    )


def check_tf_elements(dataset: Any, what: str) -> None:
    """Raises for a tf.data dataset whose elements spmd cannot read as batches.

    Raises:
      BatchError: an element of ragged or sparse tensors, or one with a leaf of no
        dimension (an unbatched dataset: its elements are examples, not batches).
    """
    import tensorflow as tf

    specs = tf.nest.flatten(dataset.element_spec, expand_composites=False)
    odd = [type(s).__name__ for s in specs if not isinstance(s, tf.TensorSpec)]
    if odd:
        raise BatchError(
            message(
                f"{what} reads dense batches: every element of a tf.data dataset a tuple of "
                "dense tensors with the batch on the leading axis.",
                received(element_spec=odd),
                "make the ragged or sparse tensors dense before batching them: "
                "ds.padded_batch(n) (pads each batch to its longest row), or "
                ".map(lambda x, y: (x.to_tensor(), y)) for a RaggedTensor, "
                "tf.sparse.to_dense for a SparseTensor.",
            )
        )
    if any(s.shape.rank == 0 for s in specs):
        shapes = [s.shape.as_list() for s in specs]
        raise BatchError(
            message(
                f"{what} reads batches: a tf.data dataset's elements have the batch on their "
                "leading axis; these have a leaf of no dimension, so they are single "
                "examples (an unbatched dataset).",
                received(element_shapes=shapes),
                "batch it: ds.batch(global_batch_size) (a smaller last batch is padded and "
                "masked; drop_remainder=True drops it).",
            )
        )


def _is_numbers(value: Any) -> bool:
    """A Python list or tuple of numbers (or of such lists): a column of examples, which
    no batch is (a batch is a tuple of arrays)."""
    if not isinstance(value, list | tuple) or not value:
        return False
    while isinstance(value, list | tuple) and value:
        value = value[0]
    return isinstance(value, bool | int | float | complex | np.number | np.bool_)


def check_lists(data: Any, what: str) -> None:
    """Raises for (x, y) (or x alone, for predict) given as Python lists of numbers.

    Raises:
      ConfigurationError: a list of numbers where an array of examples goes: read
        as an iterable of batches, each number or row would be taken for a batch.
    """
    parts = tuple(data) if isinstance(data, tuple | list) and 1 <= len(data) <= 3 else ()
    names = ("x", "y", "sample_weight")[: len(parts)]
    lists = {n: v for n, v in zip(names, parts, strict=True) if _is_numbers(v)}
    if what == "predict" and _is_numbers(data):
        lists = {"x": data}
    elif not lists or not all(_is_numbers(v) or _is_inputs(v) for v in parts):
        return
    shown = ", ".join(f"np.asarray({n})" for n in lists)
    call = "predict(np.asarray(x)" if what == "predict" else "fit((np.asarray(x), np.asarray(y))"
    raise ConfigurationError(
        message(
            f"{what} takes its examples as arrays: a Python list is read as an iterable of "
            "batches, so a list of numbers would be read as batches, not as examples.",
            received(**{n: _list_kind(v) for n, v in lists.items()}),
            f"convert the lists to arrays ({shown}); e.g. trainer.{call}, batch_size=64).",
        )
    )


def _list_kind(value: list | tuple) -> str:
    inner = "lists" if isinstance(value[0], list | tuple) else "numbers"
    return f"a {type(value).__name__} of {len(value)} {inner}"


def check_examples(data: tuple, batch_size: int | None, *, pad: bool, what: str) -> None:
    """Raises if arrays have no example, or (training) fewer than one batch.

    Raises:
      BatchError: 0 examples; or, without padding, fewer examples than `batch_size`
        (training that drops the partial batch would train on nothing).
    """
    examples = np.shape(jax.tree.leaves(data[0])[0])[0]
    if examples == 0:
        raise BatchError(
            message(
                f"The data given to {what} has examples: at least one row.",
                received(**{f"{what}_examples": 0}),
                "pass arrays with examples on the leading axis (check the slicing or "
                "filtering that made them).",
            )
        )
    if not pad and isinstance(batch_size, int) and 0 < examples < batch_size:
        raise BatchError(
            message(
                f"{what} here trains on whole batches of batch_size examples (the model's "
                "training pass writes state, so a partial last batch, which would need "
                "padding, is dropped), so the data needs at least batch_size examples.",
                received(batch_size=batch_size, examples=examples),
                f"pass batch_size={examples} or less (a multiple of the replicas), or more "
                "examples.",
            )
        )


def check_distributed(data: DistributedDataset, *, pad: bool, what: str) -> None:
    """Raises if a distributed dataset is known to give no batch, or to drop examples.

    Raises:
      BatchError: training data with 0 batches an epoch; or, for evaluate and
        predict, a dataset that drops its last partial batch (they count every
        example once).
    """
    if data.num_batches == 0:
        raise BatchError(
            message(
                f"The dataset given to {what} yields at least one batch an epoch.",
                received(num_batches=0, num_examples=data.num_examples),
                "pass more examples than one global batch, or pad the last batch "
                '(drop_remainder=False, or InputOptions(remainder="pad")).',
            )
        )
    if pad and data.num_dropped:
        raise BatchError(
            message(
                f"{what} counts every example exactly once, so its dataset must not drop "
                "the last partial batch.",
                received(
                    num_examples=data.num_examples + data.num_dropped,
                    dropped_examples=data.num_dropped,
                ),
                "build the dataset with drop_remainder=False (make_numpy_dataset, "
                'FileDataset) or InputOptions(remainder="pad"): the last batch is then '
                "padded and masked, or pass the arrays themselves with batch_size.",
            )
        )


def check_endless(data: DistributedDataset, steps_per_epoch: int | None) -> None:
    """Raises for an endless dataset without `steps_per_epoch`, as Keras does.

    Raises:
      ConfigurationError: the dataset never ends (`repeat()`), so an epoch
        would never end either.
    """
    if data.infinite and steps_per_epoch is None:
        raise ConfigurationError(
            message(
                "fit on a dataset that never ends (repeat() with no count) needs "
                "steps_per_epoch: the number of batches that make an epoch.",
                received(steps_per_epoch=None, dataset="infinite"),
                "pass steps_per_epoch=N (e.g. examples // global_batch_size), or repeat the "
                "dataset a finite number of times.",
            )
        )


def check_rows(batch: tuple, what: str) -> None:
    """Raises if a batch has no rows (it would give a NaN loss, or nothing).

    Raises:
      BatchError: a leaf of the batch with a leading size of 0.
    """
    sizes = [np.shape(v)[0] for v in jax.tree.leaves(batch) if np.ndim(v)]
    if sizes and min(sizes) == 0:
        raise BatchError(
            message(
                f"Every batch given to {what} has rows: a leading (batch) size of 1 or more.",
                received(**{f"{what}_batch": _describe(batch)}),
                "leave empty batches out of the data (check the slicing or filtering that "
                "made them).",
            )
        )


def check_sample_weight(batch: tuple, what: str) -> None:
    """Raises unless a batch's sample weights are one per example: shape (batch,) or
    (batch, 1), as Keras takes them for a loss of one value per example.

    Raises:
      BatchError: weights of another shape (they would broadcast against the
        per-example loss into a wrong number, or not at all).
    """
    y, w = batch[1], batch[2]
    if w is None:
        return
    rows = np.shape(jax.tree.leaves(y)[0])[0] if jax.tree.leaves(y) else None
    shape = tuple(np.shape(w))
    if rows is not None and shape in ((rows,), (rows, 1)):
        return
    raise BatchError(
        message(
            f"{what}'s sample weights are one weight per example: shape (batch,) or "
            "(batch, 1), as the loss is one value per example.",
            received(
                sample_weight_shape=shape, labels_shape=tuple(np.shape(jax.tree.leaves(y)[0]))
            ),
            "pass one weight per example (for per-timestep weights, fold them into a loss of "
            "your own: (outputs, labels) -> per-example loss).",
        )
    )


def check_batched(batch: tuple, what: str) -> None:
    """Raises for a batch with a leaf of no dimension: an example, not a batch of them.

    Raises:
      BatchError: naming the leaves' shapes and how to batch the data.
    """
    leaves = jax.tree.leaves(batch)
    if all(np.ndim(v) for v in leaves):
        return
    raise BatchError(
        message(
            f"{what} reads batches: every leaf of an element has the batch on its leading "
            "axis; this element has a leaf of no dimension, so it is a single example (an "
            "unbatched dataset).",
            received(**{f"{what}_element": _describe(tuple(e for e in batch if e is not None))}),
            "batch the examples: ds.batch(global_batch_size) for tf.data, or yield (x, y) "
            "arrays with the examples on the leading axis.",
        )
    )


def _kind(data: Any) -> str:
    if isinstance(data, dict):
        return f"dict with keys {sorted(map(str, data))}"
    return type(data).__name__


def split_batch(batch: Any) -> tuple[tuple, Any]:
    """(the batch's elements, its padding mask or None): the mask is known by type only.

    A `PaddedBatch` ends with its mask; any other tuple is all data, so an
    `(x, y)` batch is never mistaken for `(x, mask)`.
    """
    if type(batch) is tuple:  # the common case, first: the batch itself, not a copy
        return batch, None
    if isinstance(batch, PaddedBatch):
        return batch.inputs, batch.mask
    if isinstance(batch, tuple | list):
        return tuple(batch), None
    return (batch,), None


def train_args(batch: Any, what: str) -> tuple:
    """`(x, y, sample_weight, mask)` of a batch for the train/eval steps; absent ones None.

    Raises:
      BatchError: the batch is not `(x, y)` or `(x, y, sample_weight)`.
    """
    elements, mask = split_batch(batch)
    if len(elements) not in (2, 3):
        raise BatchError(
            message(
                f"{what} reads batches of (x, y) or (x, y, sample_weight).",
                received(batch_elements=len(elements), batch=_describe(elements)),
                "yield (x, y) tuples (a padded dataset's mask is added by spmd, as a "
                "spmd.PaddedBatch).",
            )
        )
    x, y, *weights = elements
    return x, y, weights[0] if weights else None, mask


def _describe(elements: tuple) -> str:
    return ", ".join(str(jax.tree.map(lambda a: tuple(np.shape(a)), e)) for e in elements)


def host_first(data: Any, batch_size: int | None, what: str) -> Any:
    """The first batch of `data` on the host, if reading it changes nothing; else None.

    Every batch of a list or tuple of batches is checked for rows.

    Arrays give their first `batch_size` rows; a re-iterable (a list) its first
    element; a distributed dataset or a one-shot iterator None (reading would
    use up a batch or move the dataset to its next epoch).
    """

    if data is None or isinstance(data, DistributedDataset | Iterator):
        return None
    if is_arrays(data):
        return tuple(jax.tree.map(lambda a: np.asarray(a)[:batch_size], part) for part in data)
    if isinstance(data, list | tuple):  # in memory: every batch is checked for rows now
        for batch in data:
            check_rows(split_batch(batch)[0], what)
    if isinstance(data, Iterable) and not isinstance(data, dict | str | bytes):
        return next(iter(getattr(data, "as_numpy_iterator", lambda: data)()), None)  # tf.data
    return None


def check_count(name: str, value: Any, *, allow_none: bool) -> None:
    """Raises unless `value` is a positive int (or None where allowed)."""
    if value is None and allow_none:
        return
    unit = "batches" if "steps" in name else "epochs"
    or_none = ", or leave it None for the whole dataset" if allow_none else ""
    positive_int(value, name, fix=f"pass {name}=1 or more {unit}{or_none}.")


def check_microbatches(batch: tuple, steps: int, replicas: int) -> None:
    """Raises unless each replica's rows split into `steps` equal microbatches."""
    if steps == 1:
        return
    size = np.shape(jax.tree.leaves(batch[0])[0])[0]
    per_replica = size // replicas
    if per_replica % steps:
        raise BatchError(
            message(
                f"grad_accum_steps={steps} splits each replica's rows into {steps} equal "
                "microbatches.",
                received(
                    grad_accum_steps=steps,
                    global_batch_size=size,
                    per_replica_batch_size=per_replica,
                    num_replicas_in_sync=replicas,
                ),
                f"use a global batch size that is a multiple of {steps * replicas} "
                f"(grad_accum_steps x replicas), or a grad_accum_steps that divides "
                f"{per_replica}, or let the dataset pad it: InputOptions(uneven_batch="
                f'"pad_if_uneven", microbatches={steps}) (fit pads arrays so by itself).',
            )
        )


def check_label_range(loss_name: str, outputs: jax.ShapeDtypeStruct, y: Any, what: str) -> None:
    """Checks a batch's labels lie in the loss's range (class ids, or 0..1 for binary).

    One small reduction on the devices, the same answer on every process.

    Raises:
      BatchError: a label outside the range, which would give a NaN or a wrong loss.
    """
    if loss_name == "sparse_categorical_crossentropy":
        low, high, want = 0, outputs.shape[-1] - 1, f"class ids in [0, {outputs.shape[-1] - 1}]"
    elif loss_name == "binary_crossentropy":
        low, high, want = 0, 1, "labels in [0, 1]"
    else:
        return
    lo, hi = (float(v) for v in jax.device_get(_RANGE(y)))
    if lo < low or hi > high:
        raise BatchError(
            message(
                f"The loss {loss_name!r} needs {want} (the model has {outputs.shape[-1]} outputs).",
                received(**{f"{what}_labels_min": lo, f"{what}_labels_max": hi}),
                "map the labels into that range, or give the model as many outputs as classes.",
            )
        )


class BatchSpecs:
    """The training data's per-example shapes and label kind, that other data must match."""

    def __init__(self) -> None:
        self._train: tuple | None = None

    def check(self, what: str, x: Any, y: jax.ShapeDtypeStruct) -> None:
        """Records the spec for "fit"; for other data, raises if it differs from training's.

        Raises:
          BatchError: another per-example shape of x or y, or another label kind
            (class ids against one-hot or float labels).
        """
        spec = _spec(x, y)
        if what == "fit":
            self._train = spec
            return
        if self._train is None or spec == self._train:
            return
        raise BatchError(
            message(
                f"{what} must look like the training data: the same per-example shapes and "
                "label kind.",
                received(**{what: _show(spec), "training_data": _show(self._train)}),
                "give it the training data's encoding (e.g. class ids, not one-hot) and shapes.",
            )
        )


def _spec(x: Any, y: jax.ShapeDtypeStruct) -> tuple:
    inputs = tuple((tuple(v.shape[1:]), np.dtype(v.dtype).kind) for v in jax.tree.leaves(x))
    return jax.tree.structure(x), inputs, tuple(y.shape[1:]), np.dtype(y.dtype).kind


def _show(spec: tuple) -> str:
    _, inputs, label_shape, label_kind = spec
    shown = [f"{shape} {_KINDS.get(kind, kind)}" for shape, kind in inputs]
    return f"x {', '.join(shown)}; y {label_shape} {_KINDS.get(label_kind, label_kind)}"
