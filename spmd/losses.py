"""`spmd.losses`: the Trainer's named losses and metrics (public name; they live in spmd/_src/trainer/losses.py)."""

from spmd._src.trainer.losses import LOSSES as LOSSES
from spmd._src.trainer.losses import METRICS as METRICS
from spmd._src.trainer.losses import Metric as Metric
from spmd._src.trainer.losses import per_example as per_example
from spmd._src.trainer.losses import resolve_loss as resolve_loss
from spmd._src.trainer.losses import resolve_metrics as resolve_metrics

__all__ = [
    "LOSSES",
    "METRICS",
    "Metric",
    "per_example",
    "resolve_loss",
    "resolve_metrics",
]
