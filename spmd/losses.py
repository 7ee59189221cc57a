"""`spmd.losses`: the Trainer's named losses and metrics (public name; they live in spmd/trainer/losses.py)."""

from spmd.trainer.losses import LOSSES as LOSSES
from spmd.trainer.losses import METRICS as METRICS
from spmd.trainer.losses import Metric as Metric
from spmd.trainer.losses import per_example as per_example
from spmd.trainer.losses import resolve_loss as resolve_loss
from spmd.trainer.losses import resolve_metrics as resolve_metrics

__all__ = [
    "LOSSES",
    "METRICS",
    "Metric",
    "per_example",
    "resolve_loss",
    "resolve_metrics",
]
