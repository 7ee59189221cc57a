"""`spmd.callbacks`: the Trainer's callbacks (public name; they live in spmd/trainer/)."""

from spmd.trainer.callbacks import BackupAndRestore as BackupAndRestore
from spmd.trainer.callbacks import Callback as Callback
from spmd.trainer.callbacks import CallbackList as CallbackList
from spmd.trainer.callbacks import EarlyStopping as EarlyStopping
from spmd.trainer.callbacks import EpochLogger as EpochLogger
from spmd.trainer.callbacks import History as History
from spmd.trainer.callbacks import ModelCheckpoint as ModelCheckpoint
from spmd.trainer.callbacks import ProgressBar as ProgressBar
from spmd.trainer.tensorboard import TensorBoard as TensorBoard

__all__ = [
    "BackupAndRestore",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "EpochLogger",
    "History",
    "ModelCheckpoint",
    "ProgressBar",
    "TensorBoard",
]
