"""A plain MLP: Gemm/MatMul + GELU + LayerNorm + a softmax head."""

from __future__ import annotations

import torch
from torch import nn

INPUT_SPECS = ["x:batchx64:float32"]


class MLP(nn.Module):
    def __init__(self, din: int = 64, hidden: int = 256, dout: int = 10, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = din
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.LayerNorm(hidden), nn.GELU()]
            d = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(d, dout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.head(self.body(x)), dim=-1)


def build(hidden: int = 256, depth: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return MLP(hidden=hidden, depth=depth).eval()


def example_inputs(batch: int = 4) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, 64, generator=torch.Generator().manual_seed(0)),)
