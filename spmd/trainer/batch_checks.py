"""The checks `Trainer` runs on a batch before a step: its form once per batch signature, the labels and outputs on a first batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np

from spmd.errors import BatchError, message, received
from spmd.trainer.data import (
    BatchSpecs,
    check_label_range,
    check_microbatches,
    check_rows,
)
from spmd.trainer.losses import check_fit, check_labels, check_outputs

if TYPE_CHECKING:
    from spmd.trainer.trainer import Trainer

__all__ = ["BatchChecks"]

_CHECKED_SIZE = 256  # batch signatures whose checks are remembered


class BatchChecks:
    """A trainer's batch checks, with the batch signatures whose form already passed."""

    def __init__(self) -> None:
        self.specs = BatchSpecs()
        self._checked: set = set()
        self._outputs: dict = {}  # first batches' shapes -> the model's outputs (abstract)

    def check(self, trainer: Trainer, batch: tuple, what: str, first: bool) -> None:
        """Checks a batch before it runs: rows and microbatches once per batch signature
        (structure and shapes: all they read), labels and outputs on a first batch.

        Raises:
          BatchError: a batch without rows, rows that do not split into the
            microbatches, a padded batch for a model with BatchNorm statistics,
            or (first batch) labels that do not fit the loss and the outputs.
        """
        leaves, treedef = jax.tree.flatten(batch)
        try:  # arrays (the common case): their shape attribute, not np.shape's dispatch
            shapes = [v.shape for v in leaves]
        except AttributeError:
            shapes = [np.shape(v) for v in leaves]
        signature = (what, treedef, *shapes)
        if not first and signature in self._checked:
            return
        _check_form(trainer, batch, what)
        if len(self._checked) >= _CHECKED_SIZE:
            self._checked.clear()
        self._checked.add(signature)
        if first:
            self._check_first(trainer, batch, what)

    def _check_first(self, trainer: Trainer, batch: tuple, what: str) -> None:
        """The checks of a first batch: its specs, the model's outputs, the labels' range."""
        x, y = batch[0], batch[1]
        abstract = jax.tree.map(  # shapes only: the state may live in host memory
            lambda v: jax.ShapeDtypeStruct(
                np.shape(v), np.asarray(v).dtype if not hasattr(v, "dtype") else v.dtype
            ),
            (trainer.state["params"], trainer.state["rest"], x, y),
        )
        labels = abstract[3]
        leaves, treedef = jax.tree.flatten(abstract)
        key = (what, treedef, *leaves)
        outputs = self._outputs.get(key)
        if outputs is None:  # what only the shapes decide: once per shapes (a trace each)
            self.specs.check(what, abstract[2], labels)
            outputs = jax.eval_shape(
                lambda p, r, x: trainer._forward(p, r, x, False)[0], *abstract[:3]
            )
            check_outputs(trainer.loss_name, trainer.metrics, outputs)
            check_labels(trainer.loss_name, outputs, labels)
            check_fit(trainer.loss_name, trainer.loss_fn, trainer.metrics, outputs, labels)
            if len(self._outputs) >= _CHECKED_SIZE:
                self._outputs.clear()
            self._outputs[key] = outputs
        check_label_range(trainer.loss_name, outputs, y, what)  # the values: every first batch


def _check_form(trainer: Trainer, batch: tuple, what: str) -> None:
    """The checks of a batch's form (rows, microbatches, a mask with BatchNorm)."""
    check_rows(batch, what)
    if what == "fit":
        check_microbatches(batch, trainer.grad_accum_steps, trainer.strategy.num_replicas_in_sync)
        if batch[3] is not None and trainer._model.batch_stats:
            raise BatchError(_PADDED_BATCH_STATS)


_PADDED_BATCH_STATS = message(
    "Training on padded batches needs a model without BatchNorm statistics: the mask keeps "
    "the padding out of the loss, but the padded rows would enter the batch statistics.",
    received(remainder="pad", model_has_batch_stats=True),
    "train on a dataset that drops the last partial batch (drop_remainder=True, or "
    'InputOptions(remainder="drop")), or pass the arrays with batch_size (fit drops it); '
    "keep padding for evaluate and predict.",
)
