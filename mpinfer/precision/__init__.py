"""FP32 → mixed FP16/BF16: rules, calibration, search, plan, apply and the validity gate.

The public entry point is :func:`convert_precision` with a :class:`ConvertConfig`; it returns a
:class:`ConvertResult` holding the written model, the plan file and the :class:`PrecisionPlan`.
Names are imported lazily so that importing one stage (``mpinfer.precision.emulator``) stays light.

One sub-package per stage of the recipe, each importing only from those before it (pinned by
``tests/test_import_graph.py``): ``core`` (GraphInfo, the plan, format limits) ← ``emulator`` (strict
executor) ← ``graph`` (rewrites and the validity gate) ← ``rules`` (policy → decisions) ← ``calib`` (the
FP32 reference run) ← ``numerics`` (how a candidate runs) ← ``budget`` (search, verification, repair) ← the
recipe (``convert``, ``config``, ``options``, ``plandata``, ``notices``, ``weights``). docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "convert_precision": "mpinfer.precision.convert",
    "ConvertConfig": "mpinfer.precision.config",
    "ConvertResult": "mpinfer.precision.config",
    "convert_model": "mpinfer.precision.convert",
    "ModelConversion": "mpinfer.precision.convert",
    "PrecisionPlan": "mpinfer.precision.core",
    "NodeDecision": "mpinfer.precision.core",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mpinfer.precision' has no attribute {name!r}")
