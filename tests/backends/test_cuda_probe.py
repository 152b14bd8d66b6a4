"""The CUDA probe of the ONNX Runtime runner: no torch import where no CUDA driver is installed."""

from __future__ import annotations

import ctypes
import sys
from types import SimpleNamespace

import pytest

from mpinfer import gpu
from mpinfer.backends import ort


class _Untouchable:
    """Stands in for torch: any attribute read fails the test (the probe must not need torch)."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"torch.{name} read although no CUDA driver is present")


def _no_driver(*args: object, **kwargs: object) -> object:
    raise OSError("libcuda.so.1: cannot open shared object file")


def test_without_a_cuda_driver_auto_is_the_cpu_and_torch_is_not_asked(monkeypatch):
    """onnxruntime-gpu lists its CUDA provider on a machine without a driver: the answer needs no torch."""
    monkeypatch.setattr(ort, "available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ctypes, "CDLL", _no_driver)
    monkeypatch.setitem(sys.modules, "torch", _Untouchable())
    assert not gpu.cuda_driver_present()
    assert not ort.cuda_usable()
    assert gpu.cuda_device_count() == 0
    assert ort.resolve_providers("auto") == ["CPUExecutionProvider"]


@pytest.mark.parametrize("visible", [True, False])
def test_with_a_cuda_driver_torch_decides(monkeypatch, visible):
    """Where the driver loads, whether a device is visible is still torch's answer (as before the probe)."""
    monkeypatch.setattr(ort, "available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: object())
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: visible)))
    assert gpu.cuda_driver_present()
    assert ort.cuda_usable() is visible
    assert ort.resolve_providers("auto") == (["CUDAExecutionProvider", "CPUExecutionProvider"] if visible
                                             else ["CPUExecutionProvider"])
