"""AMP trainer: torch.amp autocast (FP16/BF16), GradScaler, checkpoints, exact resume, DDP, FSDP2, overflow report.

Public API: :class:`AmpConfig`, :class:`AmpTrainer`, :func:`train_model` -> :class:`TrainResult`.
Importing this package does not import torch; the trainer does when it runs.
"""

from __future__ import annotations

from mpinfer.train.config import AmpConfig, TrainResult
from mpinfer.train.scaling import LossScaleCollapseError
from mpinfer.train.trainer import AmpTrainer, TrainingDivergedError, train_model

__all__ = [
    "AmpConfig",
    "AmpTrainer",
    "LossScaleCollapseError",
    "TrainResult",
    "TrainingDivergedError",
    "train_model",
]
