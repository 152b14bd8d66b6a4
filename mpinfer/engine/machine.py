"""What this machine offers for engines: TensorRT version, GPU name and compute capability.

The probes import TensorRT and torch only when called. The decisions built on them (which backend, which
TensorRT network mode, whether a GPU is new enough for a precision) are pure functions of the probed facts,
so they are unit-tested with facts written by hand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.util import find_spec

from mpinfer.errors import BackendUnavailableError, InvalidInputError, format_message
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

TENSORRT_INSTALL_HINT = (
    "install it with `pip install tensorrt`, NVIDIA's package index added as an extra index (NVIDIA's "
    "TensorRT install guide gives it), on a Linux or Windows machine with an NVIDIA GPU and driver; or build an "
    "ONNX Runtime engine with --backend onnxruntime"
)
# Oldest TensorRT major with strongly typed networks (NetworkDefinitionCreationFlag.STRONGLY_TYPED) and the
# name-based I/O tensor API (set_input_shape / set_tensor_address / execute_async_v3) used here.
MIN_TENSORRT_MAJOR = 10
# First TensorRT major where every network is strongly typed and BuilderFlag.FP16/BF16 are gone.
STRONG_ONLY_TENSORRT_MAJOR = 11
# Oldest compute capability per precision. FP16: sm_53 introduced native half arithmetic (HFMA2); older
# GPUs (Maxwell sm_50/52, Kepler) can only store half and would emulate it in FP32, so an "FP16 engine"
# there is a mislabelled FP32 one. BF16: Ampere (sm_80) introduced bf16 arithmetic and tensor cores; there
# is no bf16 math before it.
MIN_COMPUTE_CAPABILITY = {Precision.FP16: (5, 3), Precision.BF16: (8, 0)}
# Below this FP16 runs without tensor cores (Pascal sm_60/61: 2x or 1/64 of FP32 rate), so it works but
# is rarely faster than FP32: worth a warning, not a refusal.
FP16_TENSOR_CORE_CAPABILITY = (7, 0)


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


def tensorrt_major(version: str) -> int:
    """The major number of a TensorRT version string.

    Raises:
        InvalidInputError: For a string that does not start with a number.
    """
    head = version.strip().split(".")[0]
    if not head.isdigit():
        raise InvalidInputError(format_message("TensorRT version", repr(version), "a version like 10.13.0"))
    return int(head)


def check_tensorrt_version(version: str) -> int:
    """Return the major version, refusing versions older than :data:`MIN_TENSORRT_MAJOR`.

    Raises:
        BackendUnavailableError: TensorRT older than 10.
    """
    major = tensorrt_major(version)
    if major < MIN_TENSORRT_MAJOR:
        raise BackendUnavailableError(
            format_message(
                "TensorRT",
                f"version {version}",
                f"{MIN_TENSORRT_MAJOR}.0 or newer",
                "mpinfer builds strongly typed networks and uses the name-based tensor API of TensorRT 10; "
                "upgrade with `pip install -U tensorrt from NVIDIA's package index`",
            )
        )
    return major


def cuda_device_count() -> int:
    """Number of CUDA devices torch can see (0 without torch or without a GPU)."""
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


def check_capability(
    precisions: set[Precision] | frozenset[Precision], capability: tuple[int, int], gpu_name: str
) -> list[str]:
    """Refuse a GPU too old for the low precisions asked for; return warnings for slow-but-valid ones.

    Args:
        precisions: Low precisions the engine computes in (from the graph or the weak flags).
        capability: The GPU's ``(major, minor)``.
        gpu_name: For the message.

    Returns:
        Warnings (FP16 without tensor cores).

    Raises:
        BackendUnavailableError: The GPU has no arithmetic for one of the precisions.
    """
    warnings = []
    for p in sorted(precisions, key=lambda p: p.value):
        need = MIN_COMPUTE_CAPABILITY.get(p)
        if need is None:
            continue
        if capability < need:
            raise BackendUnavailableError(
                format_message(
                    f"GPU {gpu_name} (compute capability {capability[0]}.{capability[1]})",
                    f"a model computing in {p.value}",
                    f"compute capability {need[0]}.{need[1]} or newer for {p.value}",
                    "convert with --precision fp16 for older GPUs (fp16 needs 5.3+), "
                    "or keep the model in fp32"
                    if p is Precision.BF16
                    else "keep the model in fp32 on this GPU",
                )
            )
        if p is Precision.FP16 and capability < FP16_TENSOR_CORE_CAPABILITY:
            warnings.append(
                f"GPU {gpu_name} (compute capability {capability[0]}.{capability[1]}) has no "
                "tensor cores: fp16 may be no faster than fp32 there"
            )
    return warnings
