"""Numpy kernels of the strict emulator, one module per op family; see :mod:`mpinfer.precision.emulator.emulate`."""

from __future__ import annotations

from mpinfer.precision.emulator.kernels import attention, elementwise, linalg, norm, pool, quant, recurrent, tensor
from mpinfer.precision.emulator.kernels.fallback import reference_available, reference_kernel
from mpinfer.precision.emulator.kernels.numerics import (
    NodeInfo,
    Numerics,
    RejectedInput,
    UnsupportedVariant,
    is_float,
    is_low_float,
)


def kernel_table() -> dict[str, object]:
    """A fresh op type -> kernel mapping (ai.onnx domain)."""
    table: dict[str, object] = {}
    for mod in (attention, elementwise, linalg, norm, pool, quant, recurrent, tensor):
        table.update(mod.KERNELS)
    return table


__all__ = [
    "NodeInfo",
    "Numerics",
    "RejectedInput",
    "UnsupportedVariant",
    "is_float",
    "is_low_float",
    "kernel_table",
    "reference_available",
    "reference_kernel",
]
