"""A model with data-dependent control flow that exports to an ONNX ``If``.

The branch depends on the input's mean, so neither exporter can trace it away: the TorchScript exporter
scripts the module (torch.jit.script) and emits ``If``; the dynamo exporter uses ``torch.cond``.
"""

from __future__ import annotations

import torch
from torch import nn

INPUT_SPECS = ["x:batchx16:float32"]


class Gate(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def hot(x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.a(x))

        def cold(x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.b(x)) * 2.0

        return torch.cond(x.mean() > 0, hot, cold, (x,))


class ScriptableGate(nn.Module):
    """The same function written with Python `if`, for torch.jit.script (TorchScript exporter)."""

    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self.a = gate.a
        self.b = gate.b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.mean() > 0):
            return torch.relu(self.a(x))
        return torch.tanh(self.b(x)) * 2.0


def build(dim: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return Gate(dim).eval()


def build_scriptable(dim: int = 16) -> torch.jit.ScriptModule:
    return torch.jit.script(ScriptableGate(build(dim)).eval())


def example_inputs(batch: int = 4) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, 16, generator=torch.Generator().manual_seed(0)),)
