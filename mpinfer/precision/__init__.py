"""FP32 → mixed FP16/BF16: rules, calibration, search, plan, apply and the validity gate.

The public entry point is :func:`convert_precision` with a :class:`ConvertConfig`; it returns a
:class:`ConvertResult` holding the written model, the plan file and the :class:`PrecisionPlan`.
Names are imported lazily so that ``import mpinfer.precision.emulator.emulate`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "convert_precision": "mpinfer.precision.convert",
    "ConvertConfig": "mpinfer.precision.convert",
    "ConvertResult": "mpinfer.precision.convert",
    "convert_model": "mpinfer.precision.convert",
    "ModelConversion": "mpinfer.precision.convert",
    "PrecisionPlan": "mpinfer.precision.core.plan",
    "NodeDecision": "mpinfer.precision.core.plan",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mpinfer.precision' has no attribute {name!r}")
