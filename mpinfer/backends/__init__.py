"""Runners: one interface over ONNX Runtime, strict FP16/BF16 emulation, torch and TensorRT."""

from mpinfer.backends.base import Runner, check_feeds

__all__ = ["Runner", "check_feeds"]
