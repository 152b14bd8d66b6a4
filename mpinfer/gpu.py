"""What this machine offers: CUDA devices as torch sees them, and an importable TensorRT.

Shared by the runners (mpinfer.backends), the engine builder (mpinfer.engine) and the evaluators
(mpinfer.precision), so it belongs to none of them. TensorRT and torch are imported only when a probe is called.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

from mpinfer.errors import BackendUnavailableError, format_message

TENSORRT_INSTALL_HINT = (
    "install it with `pip install tensorrt`, NVIDIA's package index added as an extra index (NVIDIA's "
    "TensorRT install guide gives it), on a Linux or Windows machine with an NVIDIA GPU and driver; or build an "
    "ONNX Runtime engine with --backend onnxruntime"
)

@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device as torch sees it.

    Attributes:
        index: CUDA device index.
        name: Marketing name, e.g. ``NVIDIA H100 80GB HBM3``.
        compute_capability: ``(major, minor)``.
        total_memory: Bytes.
    """

    index: int
    name: str
    compute_capability: tuple[int, int]
    total_memory: int

    @property
    def capability_text(self) -> str:
        """``"9.0"``-style compute capability."""
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"


def tensorrt_installed() -> bool:
    """True when a ``tensorrt`` package is importable (without importing it)."""
    return find_spec("tensorrt") is not None


def import_tensorrt() -> object:
    """Import TensorRT, or raise with the install hint.

    Raises:
        BackendUnavailableError: TensorRT is missing or fails to import (e.g. the registry stub).
    """
    if not tensorrt_installed():
        raise BackendUnavailableError(
            format_message(
                "TensorRT", "no `tensorrt` Python package", "TensorRT 10 or 11", TENSORRT_INSTALL_HINT
            )
        )
    try:
        import tensorrt as trt  # type: ignore[import-not-found]
    except Exception as err:  # the PyPI stub raises while importing when NVIDIA's index was unreachable
        raise BackendUnavailableError(
            format_message(
                "TensorRT",
                f"a `tensorrt` package that fails to import ({err})",
                "a working TensorRT 10 or 11",
                TENSORRT_INSTALL_HINT,
            )
        ) from err
    if not hasattr(trt, "Builder"):
        raise BackendUnavailableError(
            format_message(
                "TensorRT",
                "a placeholder `tensorrt` package without the bindings",
                "a working TensorRT 10 or 11",
                TENSORRT_INSTALL_HINT,
            )
        )
    return trt


@dataclass(frozen=True)
class TensorRTProbe:
    """Whether TensorRT can be used here, and why not.

    Attributes:
        version: ``tensorrt.__version__``, or None when unusable.
        reason: Why it is unusable (empty when usable).
    """

    version: str | None
    reason: str = ""


def probe_tensorrt() -> TensorRTProbe:
    """Try to import TensorRT (the PyPI stub fails here) and report the version or the reason."""
    try:
        trt: Any = import_tensorrt()
    except BackendUnavailableError as err:
        return TensorRTProbe(None, str(err))
    return TensorRTProbe(str(trt.__version__))


def cuda_driver_present() -> bool:
    """Whether the CUDA driver library loads here: without it no CUDA device is visible to anyone (torch included).

    A cheap negative answer (a ``dlopen``) that spares importing torch (seconds, hundreds of MB) on machines with
    no NVIDIA driver, where onnxruntime-gpu still lists its CUDA provider.
    """
    import ctypes
    import sys

    try:
        ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")  # as the CUDA runtime loads it
    except OSError:
        return False
    return True


def cuda_device_count() -> int:
    """Number of CUDA devices torch can see (0 without torch or without a GPU)."""
    if not cuda_driver_present():
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def gpu_info(index: int = 0) -> GpuInfo | None:
    """Facts about CUDA device ``index``, or None when there is no such device."""
    if cuda_device_count() <= index:
        return None
    import torch

    props = torch.cuda.get_device_properties(index)
    return GpuInfo(
        index=index,
        name=str(props.name),
        compute_capability=(int(props.major), int(props.minor)),
        total_memory=int(props.total_memory),
    )


def visible_gpus() -> list[GpuInfo]:
    """Every CUDA device torch can see (empty without torch or without a GPU)."""
    return [info for i in range(cuda_device_count()) if (info := gpu_info(i)) is not None]


def device_index(device: str) -> int:
    """CUDA index of ``cuda:N`` (0 for ``cuda``, ``gpu`` and ``auto``)."""
    return int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0


def require_gpu(device: str, what: str) -> GpuInfo:
    """Return the GPU ``device`` names, or refuse.

    Raises:
        BackendUnavailableError: ``cpu`` asked for, or no such CUDA device here.
    """
    if device == "cpu":
        raise BackendUnavailableError(
            format_message(
                what,
                "--device cpu",
                "a CUDA GPU",
                "TensorRT runs only on NVIDIA GPUs; use --backend onnxruntime for a CPU engine",
            )
        )
    idx = device_index(device)
    info = gpu_info(idx)
    if info is None:
        count = cuda_device_count()
        raise BackendUnavailableError(
            format_message(
                what,
                f"no CUDA device {idx} (this machine has {count} visible GPU(s))",
                "an NVIDIA GPU",
                "run on a machine with an NVIDIA GPU and driver (check `nvidia-smi`), or build an ONNX "
                "Runtime "
                "engine with --backend onnxruntime",
            )
        )
    return info
