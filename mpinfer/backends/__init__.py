"""Runners: one interface over ONNX Runtime, torch and TensorRT (strict: :mod:`mpinfer.precision.emulator.runner`).

:func:`mpinfer.runners.open_runner` picks the runner for a path or spec.
"""

from __future__ import annotations

from mpinfer.backends.base import Runner, check_feeds

__all__ = ["Runner", "check_feeds"]
