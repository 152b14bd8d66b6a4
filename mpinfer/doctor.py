"""What this machine can run: versions, providers, GPU, TensorRT, with the install hint for what's missing."""

from __future__ import annotations

import importlib
import platform
import sys
from dataclasses import dataclass
from typing import Any

from mpinfer import __version__

TENSORRT_HINT = ("pip install tensorrt, with NVIDIA's package index as an extra index (see NVIDIA's TensorRT "
                 "install guide), on a machine with an NVIDIA GPU")


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
    trt = _version("tensorrt")
    trt_detail = trt or "missing"
    if trt is not None:
        trt_detail += " (strongly typed only)" if int(trt.split(".")[0]) >= 11 else " (strong and weak typing)"
    checks.append(Check("tensorrt", trt is not None, trt_detail, "" if trt else TENSORRT_HINT))
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
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                cap = torch.cuda.get_device_capability(i)
                gpus.append(f"{torch.cuda.get_device_name(i)} (sm_{cap[0]}{cap[1]})")
        no_gpu = "TensorRT engines, ONNX Runtime CUDA and fast fp16 training need an NVIDIA GPU"
        checks.append(Check("CUDA GPU", bool(gpus), ", ".join(gpus) or "none visible to torch",
                            "" if gpus else no_gpu))
        checks.append(Check("bf16 on CPU (torch)", True, "available (autocast cpu, bfloat16)"))
    return gpus


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
