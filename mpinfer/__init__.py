"""mpinfer: trained FP32 PyTorch model to fast mixed-precision inference, with the numbers that prove it.

``import mpinfer`` is light: torch, onnx, onnxruntime and tensorrt are imported where they are used. The
public API functions are re-exported lazily from their stage packages.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

# public name -> module that defines it (imported on first attribute access)
_LAZY = {
    # the API that reads like the CLI (mpinfer.api); mpinfer.export and mpinfer.compare are packages made callable
    "convert": "mpinfer.api",
    "export": "mpinfer.api",
    "compare": "mpinfer.api",
    "export_onnx": "mpinfer.export",
    "ExportConfig": "mpinfer.export",
    "convert_precision": "mpinfer.precision",
    "ConvertConfig": "mpinfer.precision",
    "PrecisionPlan": "mpinfer.precision",
    "compare_models": "mpinfer.compare",
    "ComparisonResult": "mpinfer.compare",
    "write_report": "mpinfer.report",
    "build_engine": "mpinfer.engine",
    "BuildConfig": "mpinfer.engine",
    "run_pipeline": "mpinfer.pipeline",
    "AmpTrainer": "mpinfer.train",
    "AmpConfig": "mpinfer.train",
    "load_feeds": "mpinfer.data",
    "Precision": "mpinfer.specs",
    "TensorSpec": "mpinfer.specs",
    "MpinferError": "mpinfer.errors",
}


def __getattr__(name: str) -> Any:
    if name in ("export", "compare"):  # the package, callable (importing it sets the attribute for good)
        return importlib.import_module(f"mpinfer.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mpinfer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
