"""`spmd.callbacks`: the Trainer's callbacks (public name; they live in spmd/_src/trainer/)."""

from spmd._src.trainer.callbacks import BackupAndRestore as BackupAndRestore
from spmd._src.trainer.callbacks import BatchLogs as BatchLogs
from spmd._src.trainer.callbacks import Callback as Callback
from spmd._src.trainer.callbacks import CallbackList as CallbackList
from spmd._src.trainer.callbacks import EarlyStopping as EarlyStopping
from spmd._src.trainer.callbacks import EpochLogger as EpochLogger
from spmd._src.trainer.callbacks import History as History
from spmd._src.trainer.callbacks import ModelCheckpoint as ModelCheckpoint
from spmd._src.trainer.callbacks import ProgressBar as ProgressBar
from spmd._src.trainer.tensorboard import TensorBoard as TensorBoard

__all__ = [
    "BackupAndRestore",
    "BatchLogs",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "EpochLogger",
    "History",
    "ModelCheckpoint",
    "ProgressBar",
    "TensorBoard",
]
