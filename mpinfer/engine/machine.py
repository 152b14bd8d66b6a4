"""Engine decisions on the machine's facts: TensorRT version rules and GPU compute capability per precision.

The probes themselves (CUDA devices, importing TensorRT) live in :mod:`mpinfer.gpu`. The decisions here (which
TensorRT network mode, whether a GPU is new enough for a precision) are pure functions of the probed facts, so
they are unit-tested with facts written by hand.
"""

from __future__ import annotations

import logging

from mpinfer.engine.expand import EXPANDABLE_OPS
from mpinfer.errors import BackendUnavailableError, InvalidInputError, format_message
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

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


# ONNX ops the TensorRT ONNX parser imports only from a given release on (major, minor): RMSNormalization
# (opset 23), which `mpinfer convert` fuses a decoder's RMSNorm chains into, arrived in TensorRT 10.15 (an NVIDIA
# maintainer on onnx/onnx-tensorrt#1046). build-engine expands it for an older parser (mpinfer.engine.expand).
TENSORRT_OP_SINCE = {"RMSNormalization": (10, 15)}


def tensorrt_ops_to_expand(
    version: str, op_types: set[str] | frozenset[str], expandable: frozenset[str] = EXPANDABLE_OPS
) -> set[str]:
    """The ops of ``op_types`` this TensorRT's ONNX parser predates and build-engine writes as plain ONNX ops.

    Raises:
        BackendUnavailableError: An op of ``op_types`` needs a newer TensorRT than ``version`` and cannot be
            expanded.
    """
    parts = [int(p) if p.isdigit() else 0 for p in version.strip().split(".")[:2]] + [0]
    have = (tensorrt_major(version), parts[1])
    expand = set()
    for op in sorted(op_types):
        need = TENSORRT_OP_SINCE.get(op)
        if need is None or have >= need:
            continue
        if op in expandable:
            expand.add(op)
            continue
        raise BackendUnavailableError(
            format_message(
                "TensorRT",
                f"version {version}, whose ONNX parser cannot import {op}",
                f"TensorRT {need[0]}.{need[1]} or newer for a model with {op}",
                "upgrade TensorRT, or build with --backend onnxruntime",
            )
        )
    return expand


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
