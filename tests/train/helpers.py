"""Tiny models built in the tests (none is checked in as a binary)."""

from __future__ import annotations

# Metrics-record fields that measure time or memory use: they differ between two runs of the same training.
TIMINGS = ("samples_per_s", "epoch_time_s", "step_time_s", "peak_memory_bytes")


def tiny_cnn():
    """models/digits_cnn.py at width 8 (fast)."""
    from models import digits_cnn

    return digits_cnn.build(width=8)


def amplified_mlp():
    """An MLP whose module ``amp`` multiplies by 1e5 (FP16 overflows there) and ``shrink`` undoes it.

    FP32 training is well behaved (the product is exact), so the overflow shows only in FP16.
    """
    import torch
    from torch import nn

    class Scale(nn.Module):
        def __init__(self, factor: float) -> None:
            super().__init__()
            self.factor = factor

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.factor

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), Scale(1e5), Scale(1e-5), nn.Linear(32, 10)
    )


def dropout_cnn():
    """A small CNN with dropout, so that a resumed run depends on the restored RNG state."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Flatten(),
        nn.Linear(8 * 64, 10),
    )


def plain_mlp():
    """No BatchNorm and no dropout: micro-batching cannot change the maths, only the rounding."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
