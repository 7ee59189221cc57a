"""The TensorBoard callback: a fit's and an evaluator's metrics as TensorBoard event files."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spmd._src.errors import ConfigurationError, message, received
from spmd._src.placement import in_device_memory
from spmd._src.trainer.arguments import check_keras_arguments
from spmd._src.trainer.callbacks import Callback, check_freq
from spmd._src.trainer.event_files import EventFiles
from spmd._src.trainer.model import averages

__all__ = ["TensorBoard"]


class TensorBoard(Callback):
    """Writes the logs as TensorBoard scalars (real event files), from the chief only.

    Training scalars go to `log_dir/train`, validation ones (`val_*`, without
    the prefix) to `log_dir/validation`, per epoch; with `update_freq=N` the
    running training metrics also every N batches; an evaluation's metrics
    (`on_test_end`: fit's validation, `Trainer.evaluate(callbacks=...)`,
    `spmd.SidecarEvaluator`) to `log_dir/validation` at the train step, as
    `evaluation_<name>_vs_iterations`, as Keras writes them.

    The files are written by a background thread, so a step never waits for
    them; each epoch's and each evaluation's scalars are flushed to disk
    before its hook returns (TensorBoard shows them at once, and a process
    killed later keeps them), the batch scalars by the thread at most a
    second after it writes them, and all of them at `flush()`. Needs `tensorboardX`
    (`pip install "spmd[tensorboard]"`).

    Args:
      log_dir: the folder TensorBoard reads (`tensorboard --logdir log_dir`).
      update_freq: "epoch", or a number of batches.
    """

    def __init__(self, log_dir: str, update_freq: str | int = "epoch", **keras: Any) -> None:
        check_keras_arguments("TensorBoard", keras, ("log_dir", "update_freq"))
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
        self._files = EventFiles(log_dir)

    def flush(self) -> None:
        """Returns once every scalar logged so far is in the event files, on disk."""
        self._files.flush()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if jax.process_index() or not isinstance(self.update_freq, int):
            return
        if self.trainer.iterations % self.update_freq == 0:
            sums = self.trainer.entry("metrics")
            scalars = functools.partial(_batch_scalars, list(sums), _snapshot(list(sums.values())))
            self._files.add("train", scalars, self.trainer.iterations)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if jax.process_index():
            return
        runs: dict[str, dict[str, float]] = {"train": {}, "validation": {}}
        for key, value in (logs or {}).items():
            run, name = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
            runs[run][f"epoch_{name}"] = float(value)
        for run, scalars in runs.items():
            if scalars:
                self._files.add(run, scalars, epoch)
        self.flush()

    def on_test_end(self, logs: dict | None = None) -> None:
        """An evaluation's metrics (`spmd.SidecarEvaluator`'s, one per checkpoint) at the
        train step evaluated, as Keras does: `validation/evaluation_<name>_vs_iterations`."""
        if jax.process_index():
            return
        scalars = {f"evaluation_{k}_vs_iterations": float(v) for k, v in (logs or {}).items()}
        self._files.add("validation", scalars, self.trainer.iterations)
        self.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        self._files.close()

    on_train_abort = on_train_end


_stack = jax.jit(jnp.stack)


def _snapshot(sums: list[jax.Array]) -> jax.Array:
    """The running sums, stacked into a new array on this process's first device: one
    dispatch, no wait for the step; the writer thread reads it after the next step has
    taken (donated) the state it came from."""
    local = [a.addressable_data(0) for a in sums]
    return _stack([in_device_memory(a) for a in local])  # host-placed: where a program reads it


def _batch_scalars(names: list[str], stacked: jax.Array) -> dict[str, float]:
    """The running metrics of a `_snapshot` (on the writer thread: it waits for the step)."""
    sums = dict(zip(names, np.asarray(stacked).tolist(), strict=True))
    return {f"batch_{k}": v for k, v in averages(sums).items()}
