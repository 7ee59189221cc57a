"""The checks `Trainer` runs on a batch before a step: its form once per batch signature, the labels and outputs on a first batch."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from spmd._src.errors import BatchError, message, received
from spmd._src.rules import path_str
from spmd._src.strategy.diloco import DiLoCo
from spmd._src.trainer import islands
from spmd._src.trainer.data import (
    BatchSpecs,
    check_batched,
    check_label_range,
    check_microbatches,
    check_rows,
    check_sample_weight,
)
from spmd._src.trainer.losses import check_fit, check_labels, check_outputs

if TYPE_CHECKING:
    from spmd._src.trainer.trainer import Trainer

__all__ = ["BatchChecks"]

_CHECKED_SIZE = 256  # batch signatures whose checks are remembered
_log = logging.getLogger("spmd.trainer")
# Where fit on arrays does not do as Keras does (docs/migration.md).
_DROPPED = (
    "fit drops the last partial batch of each epoch, %d of %d examples (batch_size=%d), "
    "where Keras trains on it: the model's training pass writes %s, which the padding and "
    "mask that batch needs would enter, so it is never padded. To train on every example, "
    "pass a batch_size that divides the examples."
)
_DROPPED_ISLANDS = (
    "fit drops the last partial batch of each epoch, %d of %d examples (batch_size=%d), "
    "where Keras trains on it: on spmd.DiLoCo each island steps its own optimizer on its "
    "rows of the batch, and an island given padding only would still take a step. To train "
    "on every example, pass a batch_size that divides the examples."
)


class BatchChecks:
    """A trainer's batch checks, with the batch signatures whose form already passed."""

    def __init__(self) -> None:
        self.specs = BatchSpecs()
        self._checked: set = set()
        self._outputs: dict = {}  # first batches' shapes -> the model's outputs (abstract)
        self._written: list[str] | None = None  # state the training pass writes (traced once)

    def check(
        self, trainer: Trainer, batch: tuple, what: str, first: bool, placed: bool = True
    ) -> None:
        """Checks a batch before it runs: rows and microbatches once per batch signature
        (structure and shapes: all they read), labels and outputs on a first batch.

        A batch not `placed` is the data's own first rows, read before the
        dataset pads them for the replicas: its microbatches are not checked.

        Raises:
          BatchError: a batch without rows, rows that do not split into the
            microbatches, a padded batch for a model whose training pass writes
            state (`written_state`), or (first batch) labels that do not fit
            the loss and the outputs.
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
        if what == "fit" and batch[3] is not None:
            self._check_padded(trainer, batch)
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
            (trainer.entry("params"), trainer.entry("rest"), x, y),
        )
        labels = abstract[3]
        leaves, treedef = jax.tree.flatten(abstract)
        key = (what, treedef, *leaves)
        outputs = self._outputs.get(key)
        if outputs is None:  # what only the shapes decide: once per shapes (a trace each)
            self.specs.check(what, abstract[2], labels)
            with _step_context(trainer):  # the step's mesh: spmd.pipeline's stages
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

    def keeps_partial(self, trainer: Trainer, data: tuple, batch_size: Any) -> bool:
        """Whether fit on arrays trains on their last partial batch, padded and masked, as
        Keras trains on it: unless the model's training pass writes state, which padded
        rows would enter (`written_state`); that batch is then dropped, said at WARNING.
        """
        examples = np.shape(jax.tree.leaves(data[0])[0])[0]
        if not isinstance(batch_size, int) or batch_size <= 0 or examples % batch_size == 0:
            return False
        if isinstance(trainer.strategy, DiLoCo):
            if examples > batch_size:
                _log.warning(_DROPPED_ISLANDS, examples % batch_size, examples, batch_size)
            return False
        if self._written is None:
            first = jax.tree.map(lambda a: np.asarray(a)[:batch_size], data[0])
            self._written = written_state(trainer, first)
        if not self._written:
            return True
        if examples > batch_size:  # fewer: check_examples says why in an error
            _log.warning(_DROPPED, examples % batch_size, examples, batch_size, self._written)
        return False

    def _check_padded(self, trainer: Trainer, batch: tuple) -> None:
        """Raises if the training pass writes state that padded rows would enter.

        Raises:
          BatchError: the forward pass in training mode writes a variable other
            than a parameter or RNG state (BatchNorm statistics, a running mean,
            a counter, a sown value), found by tracing it once; or any padded
            batch on spmd.DiLoCo, where an island given padding only would
            still step its optimizer.
        """
        if isinstance(trainer.strategy, DiLoCo):
            raise BatchError(_padded_islands(trainer, batch))
        if self._written is None:
            self._written = written_state(trainer, batch[0])
        if self._written:
            raise BatchError(_padded_state(trainer, batch, self._written))


def written_state(trainer: Trainer, x: Any) -> list[str]:
    """The variables the training forward pass writes, besides parameters and RNG state.

    One trace on the shapes of `x` (nothing runs): a variable the pass leaves
    alone comes out as the very value it went in as; any other was written,
    whatever it computed. RNG state (`nnx.RngState`: Dropout's key counts) is
    left out: what it draws does not depend on the rows. Each as "path (Type)".
    """
    shapes = jax.tree.map(  # shapes only: the state may live in host memory
        lambda v: jax.ShapeDtypeStruct(np.shape(v), v.dtype),
        (trainer.entry("params"), trainer.entry("rest"), x),
    )
    written: list[str] = []

    def forward(params, rest, x):
        new = trainer._forward(params, rest, x, True)[1]
        before = _variables(rest)
        for path, variable in _variables(new).items():
            old = before.get(path)
            if isinstance(variable, nnx.RngState):
                continue
            if old is None or variable.get_value() is not old.get_value():
                written.append(f"{path} ({type(variable).__name__})")
        return new

    with _step_context(trainer):
        jax.eval_shape(forward, *shapes)
    return written


def _step_context(trainer: Trainer) -> Any:
    """The mesh and rules the Trainer's step traces its model under (abstract): a
    DiLoCo's synchronous strategy's, whose mesh holds an island's axes."""
    return islands.synchronous(trainer.strategy).context(traced=True)


def _variables(tree: Any) -> dict[str, nnx.Variable]:
    """The NNX variables of `tree` by their '/'-joined path."""
    leaves = jax.tree_util.tree_leaves_with_path(
        tree, is_leaf=lambda v: isinstance(v, nnx.Variable)
    )
    return {path_str(p): v for p, v in leaves if isinstance(v, nnx.Variable)}


def _check_form(trainer: Trainer, batch: tuple, what: str, placed: bool) -> None:
    """The checks of a batch's form (a batch, rows, sample weights, microbatches)."""
    check_batched(batch, what)
    check_rows(batch, what)
    check_sample_weight(batch, what)
    if what == "fit" and placed:
        replicas = trainer.strategy.num_replicas_in_sync
        check_microbatches(batch, trainer.grad_accum_steps, replicas)


def _padded_islands(trainer: Trainer, batch: tuple) -> str:
    """Why a Trainer on spmd.DiLoCo does not train on a padded batch, and the ways out."""
    rows = np.shape(jax.tree.leaves(batch[0])[0])[0]
    return message(
        "A Trainer on spmd.DiLoCo trains on whole batches only: each island steps its own "
        "optimizer on its rows of the batch, and an island given padding only would still "
        "take a step. Batches are padded where a batch is smaller than the first (an "
        "iterable's or tf.data's partial batch) or where the global batch does not split "
        "evenly over the islands' replicas.",
        received(
            batch_rows=rows,
            num_replicas_in_sync=trainer.strategy.num_replicas_in_sync,
        ),
        "give fit batches of one size that splits over num_replicas_in_sync: drop the last "
        "partial batch (tf.data's .batch(n, drop_remainder=True), or "
        'InputOptions(remainder="drop")); fit on arrays drops it itself, said at WARNING. '
        "evaluate and predict pad and mask as on any strategy.",
    )


def _padded_state(trainer: Trainer, batch: tuple, written: list[str]) -> str:
    """Why a model whose training pass writes state cannot train on a padded batch, and the
    ways out."""
    rows = np.shape(jax.tree.leaves(batch[0])[0])[0]
    return message(
        "Training on padded batches needs a model whose training pass writes no state but its "
        "parameters (and RNG state): the mask keeps the padding out of the loss and the "
        "gradients, but the padded rows would enter the variables the forward pass writes "
        "(BatchNorm statistics, a running mean, a counter of rows). Batches are "
        "padded where a batch is smaller than the others (an iterable's or tf.data's "
        "partial batch, remainder='pad' or 'pad_if_partial'), or where the global batch "
        "does not split evenly over the replicas (x grad_accum_steps).",
        received(
            written_variables=written,
            batch_rows=rows,
            num_replicas_in_sync=trainer.strategy.num_replicas_in_sync,
            grad_accum_steps=trainer.grad_accum_steps,
        ),
        "train on a dataset that drops the last partial batch (tf.data's .batch(n, "
        "drop_remainder=True), drop_remainder=True, or "
        'InputOptions(remainder="drop"); fit on arrays drops it for such a model), with a global batch size '
        "that splits over the replicas x grad_accum_steps at every process count the job runs "
        "at (e.g. 12 for 6, 4 and 2 replicas), or over a strategy whose replica count divides "
        "it: spmd.MultiWorkerMirroredStrategy(global_batch_size=...) uses the most devices "
        "that do; keep padding for evaluate and predict.",
    )
