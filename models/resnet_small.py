"""A small ResNet-style CNN: conv, batch norm, residual adds, pooling, a linear head."""

from __future__ import annotations

import torch
from torch import nn

INPUT_SPECS = ["x:batchx3x64x64:float32"]
NUM_CLASSES = 10


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.down is None else self.down(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + idt)


class ResNetSmall(nn.Module):
    def __init__(self, in_channels: int = 3, num_classes: int = NUM_CLASSES, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        self.layer1 = BasicBlock(width, width, 1)
        self.layer2 = BasicBlock(width, 2 * width, 2)
        self.layer3 = BasicBlock(2 * width, 4 * width, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.head(torch.flatten(self.pool(x), 1))


def build(width: int = 16, in_channels: int = 3, num_classes: int = NUM_CLASSES) -> nn.Module:
    torch.manual_seed(0)
    model = ResNetSmall(in_channels, num_classes, width)
    # Non-trivial batch-norm statistics, as a trained network has.
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model.eval()


def example_inputs(batch: int = 2) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(0)),)
