"""A small CNN for the 8x8 digits data set (1 channel, 10 classes); the trainer's default model."""

from __future__ import annotations

import torch
from torch import nn

INPUT_SPECS = ["x:batchx1x8x8:float32"]


class DigitsCNN(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return DigitsCNN(width).eval()


def example_inputs(batch: int = 4) -> tuple[torch.Tensor, ...]:
    return (torch.rand(batch, 1, 8, 8, generator=torch.Generator().manual_seed(0)),)
