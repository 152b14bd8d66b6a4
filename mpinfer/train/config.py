"""Typed configuration and result of the AMP trainer.

:class:`AmpConfig` is the single input of :func:`mpinfer.train.train_model` and of ``mpinfer train``; it is
frozen and validated at construction, so a bad value fails before any model is built or file is written.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.specs import Precision

# GradScaler's own default: 2**16 leaves headroom below FP16's max (65504) for typical losses.
DEFAULT_INIT_SCALE = 2.0**16
# A loss scale below 1 means the gradients overflow FP16 even unscaled (usually the forward pass itself
# overflows); halving further cannot help and only hides the problem (pytorch issue 40497).
DEFAULT_MIN_LOSS_SCALE = 1.0
# Share of optimizer steps spent in linear warm-up when no explicit warm-up is given.
DEFAULT_WARMUP_FRACTION = 0.05
# Overflow diagnostics sample one step in this many: per-module reductions on every step would slow
# training by a large factor; one in 10 gives the statistics at a few percent of the cost.
DEFAULT_OVERFLOW_EVERY = 10
DEVICES = ("auto", "cpu", "cuda")
SCHEDULES = ("cosine", "constant")
STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True)
class AmpConfig:
    """Everything one training run needs.

    Attributes:
        model: ``"file.py:factory"`` (factory defaults to ``build``) or a zero-argument callable returning an
            ``nn.Module``.
        output: Run folder; gets ``best.pt``, ``last.pt``, ``metrics.jsonl``, ``summary.json`` and, with
            ``overflow_report``, ``overflow.json``.
        data: ``"digits"`` (built-in, offline), a path to an ``.npz`` with input arrays and ``_labels``, or a
            ``torch.utils.data.Dataset`` yielding ``(inputs, label)``. None: the model file's ``train_data()``
            (returning ``(train, eval)`` Datasets) when it defines one, else ``"digits"``.
        eval_data: Held-out data of the same kinds. None: the built-in digits test split for ``"digits"``,
            a fixed 20% hold-out of an ``.npz``, no evaluation for a Dataset.
        precision: Autocast precision; FP32 turns AMP off.
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        epochs: Passes over the training data.
        batch_size: Samples per micro-batch (per process under DDP).
        lr: Peak learning rate of AdamW.
        weight_decay: AdamW weight decay.
        schedule: ``cosine`` (linear warm-up, then cosine decay to 0) or ``constant``.
        warmup_steps: Warm-up length in optimizer steps; None: 5% of all steps.
        grad_accum: Micro-batches accumulated per optimizer step.
        clip_grad_norm: Max global gradient norm (computed on unscaled gradients); None: no clipping.
        init_scale: Initial loss scale of the GradScaler (FP16 only).
        min_loss_scale: Stop with an error when the loss scale falls below this (FP16 only).
        seed: Seeds model init order, shuffling and dropout.
        overflow_report: Record per-module FP16 overflow/underflow and write ``overflow.json``.
        overflow_every: Sample the overflow statistics on one optimizer step in this many.
        resume: A ``last.pt`` (or ``best.pt``) to continue from, bit-exactly.
        force: Overwrite the artefacts of an earlier run in ``output``.
        quiet: No progress bars.
        num_workers: DataLoader worker processes.
        strategy: ``"ddp"`` (every process holds the whole model) or ``"fsdp"`` (FSDP2: parameters, gradients
            and optimizer state sharded over the processes). None: ddp under torchrun, a single process
            otherwise.
    """

    model: str | Callable[[], Any]
    output: Path
    data: Any = None
    eval_data: Any = None
    precision: Precision = Precision.FP32
    device: str = "auto"
    epochs: int = 5
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.01
    schedule: str = "cosine"
    warmup_steps: int | None = None
    grad_accum: int = 1
    clip_grad_norm: float | None = None
    init_scale: float = DEFAULT_INIT_SCALE
    min_loss_scale: float = DEFAULT_MIN_LOSS_SCALE
    seed: int = 0
    overflow_report: bool = False
    overflow_every: int = DEFAULT_OVERFLOW_EVERY
    resume: Path | None = None
    force: bool = False
    quiet: bool = False
    num_workers: int = 0
    strategy: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision.parse(self.precision))
        object.__setattr__(self, "output", Path(self.output))
        if self.resume is not None:
            object.__setattr__(self, "resume", Path(self.resume))
        if self.device not in DEVICES:
            raise InvalidInputError(
                format_message("Device", repr(self.device), "one of " + ", ".join(DEVICES))
            )
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise InvalidInputError(
                format_message("Strategy", repr(self.strategy), "one of " + ", ".join(STRATEGIES))
            )
        if self.schedule not in SCHEDULES:
            raise InvalidInputError(
                format_message("LR schedule", repr(self.schedule), "one of " + ", ".join(SCHEDULES))
            )
        for name in ("epochs", "batch_size", "grad_accum", "overflow_every"):
            _positive_int(name, getattr(self, name))
        if self.num_workers < 0:
            raise InvalidInputError(format_message("num_workers", self.num_workers, "0 or more"))
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise InvalidInputError(format_message("Warm-up steps", self.warmup_steps, "0 or more"))
        for name in ("lr", "init_scale"):
            _positive_float(name, getattr(self, name))
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise InvalidInputError(format_message("Weight decay", self.weight_decay, "a finite value >= 0"))
        if self.clip_grad_norm is not None:
            _positive_float("clip_grad_norm", self.clip_grad_norm)
        fp16 = self.precision is Precision.FP16
        if not (
            math.isfinite(self.min_loss_scale)
            and 0 <= self.min_loss_scale
            and (self.min_loss_scale < self.init_scale or not fp16)
        ):
            raise InvalidInputError(
                format_message(
                    "Minimum loss scale",
                    self.min_loss_scale,
                    f"a value in [0, init_scale={self.init_scale:g})",
                )
            )

    def to_dict(self) -> dict[str, Any]:
        """The config as primitives (str/int/float/bool/None) for checkpoints and summary.json."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            out[f.name] = _primitive(getattr(self, f.name))
        return out


@dataclass(frozen=True)
class TrainResult:
    """What a training run produced.

    Attributes:
        best: Checkpoint with the best evaluation accuracy (or lowest training loss without evaluation).
        last: Checkpoint after the last epoch (resume from it).
        metrics: JSON-lines file, one record per epoch.
        summary: The contents of ``summary.json``.
        overflow: ``overflow.json`` when the overflow report was on, else None.
    """

    best: Path
    last: Path
    metrics: Path
    summary: dict[str, Any]
    overflow: Path | None = None


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidInputError(format_message(name, repr(value), "a positive integer"))


def _positive_float(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidInputError(format_message(name, repr(value), "a positive finite number"))


def _primitive(value: Any) -> Any:
    if isinstance(value, Precision):  # a str subclass: check it first
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _primitive(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_primitive(v) for v in value]
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}:{value.__qualname__}"
    return f"<{type(value).__name__}>"
