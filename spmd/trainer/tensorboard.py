"""The TensorBoard callback: a fit's and an evaluator's metrics as TensorBoard event files."""

from __future__ import annotations

from typing import Any

import jax

from spmd.errors import ConfigurationError, message, received
from spmd.trainer.callbacks import Callback, check_freq

__all__ = ["TensorBoard"]


class TensorBoard(Callback):
    """Writes the logs as TensorBoard scalars (real event files), from the chief only.

    Training scalars go to `log_dir/train`, validation ones (`val_*`, without
    the prefix) to `log_dir/validation`, per epoch; with `update_freq=N` the
    running training metrics also every N batches; an evaluation's metrics
    (`on_test_end`, called by `spmd.SidecarEvaluator`) to `log_dir/validation`
    at the train step evaluated. Needs `tensorboardX`
    (`pip install "spmd[tensorboard]"`).

    Args:
      log_dir: the folder TensorBoard reads (`tensorboard --logdir log_dir`).
      update_freq: "epoch", or a number of batches.
    """

    def __init__(self, log_dir: str, update_freq: str | int = "epoch") -> None:
        check_freq(update_freq, "TensorBoard")
        try:
            import tensorboardX  # noqa: F401
        except ImportError as error:
            raise ConfigurationError(
                message(
                    "The TensorBoard callback writes event files with the tensorboardX package.",
                    received(tensorboardX="not installed"),
                    'pip install "spmd[tensorboard]" (or pip install tensorboardX).',
                )
            ) from error
        self.log_dir, self.update_freq = log_dir, update_freq
        self._writers: dict[str, Any] = {}

    def _writer(self, name: str):
        if name not in self._writers:
            from tensorboardX import SummaryWriter

            self._writers[name] = SummaryWriter(f"{self.log_dir}/{name}")
        return self._writers[name]

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if jax.process_index() or not isinstance(self.update_freq, int):
            return
        if self.trainer.iterations % self.update_freq == 0:
            for key, value in self.trainer.running_metrics().items():
                self._writer("train").add_scalar(f"batch_{key}", value, self.trainer.iterations)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if jax.process_index():
            return
        for key, value in (logs or {}).items():
            split, name = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
            self._writer(split).add_scalar(f"epoch_{name}", float(value), epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_test_end(self, logs: dict | None = None) -> None:
        """An evaluation's metrics (`spmd.SidecarEvaluator`'s, one per checkpoint) at the
        train step evaluated, as Keras does: `validation/evaluation_<name>_vs_iterations`."""
        if jax.process_index():
            return
        writer = self._writer("validation")
        for key, value in (logs or {}).items():
            writer.add_scalar(
                f"evaluation_{key}_vs_iterations", float(value), self.trainer.iterations
            )
        writer.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}

    on_train_abort = on_train_end
