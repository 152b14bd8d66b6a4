"""Dynamic loss scaling: ``torch.amp.GradScaler`` plus skipped-step accounting and a minimum-scale stop.

The GradScaler is enabled for FP16 only (BF16 has FP32's exponent range and needs no scaling). A step is
*skipped* when the scaler found Inf/NaN gradients, which shows as the scale dropping in ``update()``. When
the scale falls below the configured minimum the run stops with a :class:`LossScaleCollapseError` instead of
halving towards zero and silently training nothing (pytorch issue 40497).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpinfer.errors import MpinferError, format_message

logger = logging.getLogger(__name__)


class LossScaleCollapseError(MpinferError):
    """The FP16 loss scale fell below the minimum: the model overflows FP16 even without scaling."""


@dataclass
class StepOutcome:
    """Result of one optimizer step through the scaler.

    Attributes:
        applied: False when the scaler skipped the step (Inf/NaN gradients).
        scale: Loss scale after the update (1.0 when scaling is off).
    """

    applied: bool
    scale: float


class LossScaler:
    """A GradScaler wrapper that counts skipped steps and enforces a minimum loss scale.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``.
        enabled: Scale losses (True for FP16).
        init_scale: Initial scale.
        min_scale: Smallest acceptable scale; :meth:`step` raises below it.
        sharded: Gradients are FSDP shards: ``ShardedGradScaler``, which all-reduces the Inf/NaN flag so that
            every rank skips the same steps (a rank sees only its own shard's gradients).
    """

    state_dict_key = "amp_scaler"

    def __init__(
        self, device_type: str, *, enabled: bool, init_scale: float, min_scale: float, sharded: bool = False
    ) -> None:
        import torch

        self.enabled = enabled
        self.min_scale = min_scale
        self.skipped = 0
        self._quiet: Any = contextlib.nullcontext
        self._scaler: Any
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            from mpinfer.train.sharded import quiet_found_inf

            self._scaler = ShardedGradScaler(device_type, init_scale=init_scale, enabled=enabled)
            self._quiet = quiet_found_inf
        else:
            self._scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, enabled=enabled)

    @property
    def scale(self) -> float:
        """Current loss scale (1.0 when disabled)."""
        return float(self._scaler.get_scale()) if self.enabled else 1.0

    def backward(self, loss: Any) -> None:
        """Backward of the (scaled) loss."""
        self._scaler.scale(loss).backward()

    def unscale_(self, optimizer: Any) -> None:
        """Divide the optimizer's gradients by the scale in place (call before clipping)."""
        with self._quiet():
            self._scaler.unscale_(optimizer)

    def step(self, optimizer: Any, *, step: int, overflow_report: Path | None = None) -> StepOutcome:
        """``optimizer.step()`` through the scaler, then ``update()``; count a skip when the scale dropped.

        Args:
            optimizer: The optimizer.
            step: Index of this optimizer step (for the error message).
            overflow_report: Where overflow statistics were written, named in the error message.

        Returns:
            Whether the step was applied and the new scale.

        Raises:
            LossScaleCollapseError: If the new scale is below ``min_scale``.
        """
        if not self.enabled:
            optimizer.step()
            return StepOutcome(True, 1.0)
        before = self.scale
        with self._quiet():
            self._scaler.step(optimizer)
        self._scaler.update()
        after = self.scale
        applied = not after < before
        if not applied:
            self.skipped += 1
            logger.debug("step %d skipped: Inf/NaN gradients, loss scale %g -> %g", step, before, after)
        if after < self.min_scale:
            raise LossScaleCollapseError(
                collapse_message(after, self.min_scale, step, self.skipped, overflow_report)
            )
        return StepOutcome(applied, after)

    def state_dict(self) -> dict[str, Any]:
        """The GradScaler state (empty when disabled)."""
        return dict(self._scaler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the GradScaler state; an empty state (saved without scaling) keeps the initial scale."""
        if self.enabled and state:
            self._scaler.load_state_dict(state)
        elif self.enabled:
            logger.warning(
                "The checkpoint has no loss-scaler state (it was not trained in fp16); "
                "starting from the initial loss scale."
            )


def collapse_message(scale: float, min_scale: float, step: int, skipped: int, report: Path | None) -> str:
    """The error message for a collapsed loss scale: scale, step, and what to do."""
    where = (
        f"per-module overflow statistics so far are in {report}"
        if report is not None
        else "rerun with --overflow-report to find the modules that overflow"
    )
    return format_message(
        f"FP16 loss scale collapsed at optimizer step {step}",
        f"scale {scale:g} after {skipped} skipped steps",
        f"a scale >= --min-loss-scale {min_scale:g}",
        "FP16 overflows even without scaling, usually in the forward pass. Train with --precision bf16 "
        f"(FP32's range, no scaling needed), or keep the offending modules in FP32; {where}.",
    )
