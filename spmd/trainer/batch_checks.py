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

    def check(
        self, trainer: Trainer, batch: tuple, what: str, first: bool, placed: bool = True
    ) -> None:
        """Checks a batch before it runs: rows and microbatches once per batch signature
        (structure and shapes: all they read), labels and outputs on a first batch.

        A batch not `placed` is the data's own first rows, read before the
        dataset pads them for the replicas: its microbatches are not checked.

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
        signature = (what, placed, treedef, *shapes)
        if not first and signature in self._checked:
            return
        _check_form(trainer, batch, what, placed)
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


def _check_form(trainer: Trainer, batch: tuple, what: str, placed: bool) -> None:
    """The checks of a batch's form (rows, microbatches, a mask with BatchNorm)."""
    check_rows(batch, what)
    if what == "fit":
        if placed:
            replicas = trainer.strategy.num_replicas_in_sync
            check_microbatches(batch, trainer.grad_accum_steps, replicas)
        if batch[3] is not None and trainer._model.batch_stats:
            raise BatchError(_padded_batch_stats(trainer, batch))


def _padded_batch_stats(trainer: Trainer, batch: tuple) -> str:
    """Why a model with BatchNorm statistics cannot train on a padded batch, and the ways out."""
    rows = np.shape(jax.tree.leaves(batch[0])[0])[0]
    return message(
        "Training on padded batches needs a model without BatchNorm statistics: the mask keeps "
        "the padding out of the loss, but the padded rows would enter the batch statistics. "
        "Batches are padded where the last batch is partial (remainder='pad'), or where the "
        "global batch does not split evenly over the replicas (x grad_accum_steps).",
        received(
            model_has_batch_stats=True,
            batch_rows=rows,
            num_replicas_in_sync=trainer.strategy.num_replicas_in_sync,
            grad_accum_steps=trainer.grad_accum_steps,
        ),
        "train on a dataset that drops the last partial batch (drop_remainder=True, or "
        'InputOptions(remainder="drop"); fit on arrays drops it), with a global batch size '
        "that splits over the replicas x grad_accum_steps at every process count the job runs "
        "at (e.g. 12 for 6, 4 and 2 replicas), or over a strategy whose replica count divides "
        "it: spmd.MultiWorkerMirroredStrategy(global_batch_size=...) uses the most devices "
        "that do; keep padding for evaluate and predict.",
    )
