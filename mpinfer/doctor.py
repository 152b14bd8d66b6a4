"""What this machine can run: versions, providers, GPU, TensorRT, with the install hint for what's missing."""

from __future__ import annotations

import importlib
import platform
import sys
from dataclasses import dataclass
from typing import Any

from mpinfer import __version__
from mpinfer.gpu import TENSORRT_INSTALL_HINT, probe_tensorrt, tensorrt_installed, visible_gpus


@dataclass(frozen=True)
class Check:
    """One line of the doctor's table."""

    name: str
    ok: bool
    detail: str
    hint: str = ""


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:  # any import failure means "not usable here"
        return None
    return str(getattr(mod, "__version__", "installed"))


def collect_checks() -> list[Check]:
    """Inspect the machine (imports torch/onnxruntime/tensorrt lazily)."""
    checks = [Check("python", sys.version_info >= (3, 10), f"{platform.python_version()} on {platform.platform()}",
                    "mpinfer needs Python >= 3.10"),
              Check("mpinfer", True, __version__)]
    gpus = _torch_checks(checks)
    ov = _version("onnx")
    checks.append(Check("onnx", ov is not None, ov or "missing", "pip install onnx"))
    _ort_checks(checks, gpus)
    checks.append(_tensorrt_check())
    for mod, hint in (("ml_dtypes", "pip install ml_dtypes"), ("matplotlib", "pip install matplotlib"),
                      ("transformers", "pip install 'mpinfer[hf]' (Hugging Face folders)")):
        v = _version(mod)
        checks.append(Check(mod, v is not None, v or "missing", "" if v else hint))
    return checks


def _torch_checks(checks: list[Check]) -> list[str]:
    """Append torch's checks (version, CUDA GPUs, CPU bf16) to ``checks``; the GPUs torch sees."""
    tv = _version("torch")
    checks.append(Check("torch", tv is not None, tv or "missing", "pip install torch==2.13.0"))
    gpus: list[str] = []
    if tv is not None:
        gpus = [f"{g.name} (sm_{g.compute_capability[0]}{g.compute_capability[1]})" for g in visible_gpus()]
        no_gpu = "TensorRT engines, ONNX Runtime CUDA and fast fp16 training need an NVIDIA GPU"
        checks.append(Check("CUDA GPU", bool(gpus), ", ".join(gpus) or "none visible to torch",
                            "" if gpus else no_gpu))
        checks.append(Check("bf16 on CPU (torch)", True, "available (autocast cpu, bfloat16)"))
    return gpus


def _tensorrt_check() -> Check:
    """TensorRT as build-engine sees it (mpinfer.gpu.probe_tensorrt): the PyPI stub or a placeholder is not usable."""
    probe = probe_tensorrt()
    if probe.version is None:
        if tensorrt_installed():
            return Check("tensorrt", False, "installed but not usable", probe.reason)
        return Check("tensorrt", False, "missing", TENSORRT_INSTALL_HINT)
    typing = " (strongly typed only)" if int(probe.version.split(".")[0]) >= 11 else " (strong and weak typing)"
    return Check("tensorrt", True, probe.version + typing)


def _ort_checks(checks: list[Check], gpus: list[str]) -> None:
    """Append onnxruntime's checks (version, providers, a usable CUDA provider) to ``checks``."""
    ortv = _version("onnxruntime")
    checks.append(Check("onnxruntime", ortv is not None, ortv or "missing", "pip install onnxruntime-gpu"))
    if ortv is not None:
        import onnxruntime as ort

        providers = ort.get_available_providers()
        cuda = "CUDAExecutionProvider" in providers
        checks.append(Check("ORT providers", True, ", ".join(providers)))
        checks.append(Check("ORT CUDA provider", cuda and bool(gpus),
                            "usable" if cuda and gpus else ("installed, no GPU" if cuda else "not installed"),
                            "" if cuda and gpus else "onnxruntime-gpu on a machine with an NVIDIA GPU"))


def environment() -> dict[str, Any]:
    """A compact dict of the machine facts, for sidecars and reports."""
    return {c.name: c.detail for c in collect_checks()}
