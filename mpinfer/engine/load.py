"""``load_engine_runner``: open an engine artefact as a Runner after checking it belongs on this machine."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from mpinfer.backends.base import Runner
from mpinfer.backends.ort import cuda_usable
from mpinfer.backends.trt_runner import TrtRunner
from mpinfer.engine.ort_engine import OrtEngineRunner
from mpinfer.engine.sidecar import MachineFacts, check_compatible, read_sidecar, sidecar_path
from mpinfer.errors import BackendUnavailableError, InvalidInputError, ModelLoadError, format_message
from mpinfer.fileio import sha256_file
from mpinfer.gpu import gpu_info, probe_tensorrt, require_gpu

logger = logging.getLogger(__name__)

# Suffixes that mark an engine artefact even without a sidecar (trtexec writes .engine/.plan/.trt).
TENSORRT_SUFFIXES = (".engine", ".plan", ".trt")
ORT_SUFFIXES = (".ort",)


def is_engine_artifact(path: str | os.PathLike[str]) -> bool:
    """True for a file with an mpinfer engine sidecar, or with a TensorRT/ORT-format engine suffix."""
    p = Path(path)
    if p.suffix.lower() in TENSORRT_SUFFIXES + ORT_SUFFIXES:
        return True
    try:
        return read_sidecar(p) is not None
    except ModelLoadError:
        return False


def _engine_backend(path: Path, sidecar: dict[str, Any] | None) -> str:
    if sidecar is not None:
        return str(sidecar.get("backend"))
    if path.suffix.lower() in TENSORRT_SUFFIXES:
        return "tensorrt"
    if path.suffix.lower() in ORT_SUFFIXES:
        return "onnxruntime"
    raise ModelLoadError(
        format_message(
            f"Engine '{path}'",
            "a file without a sidecar and with an unknown suffix",
            f"{sidecar_path(path).name} beside it, or a .engine/.plan/.ort file",
            "build it with mpinfer build-engine",
        )
    )


def _check_unchanged(path: Path, sidecar: dict[str, Any]) -> None:
    """The engine file, and its external data file when the sidecar records one, are those build-engine wrote."""
    engine = sidecar.get("engine") or {}
    files = [(path, engine.get("sha256"), engine.get("bytes"))]
    data = engine.get("data") or {}
    if data:
        files.append((path.with_name(str(data.get("path"))), data.get("sha256"), data.get("bytes")))
    for file, sha, size in files:
        if not file.is_file():
            raise ModelLoadError(format_message(f"Engine '{path}'", f"no data file '{file.name}' beside it",
                                                "the engine's external data file", "rebuild it with --force"))
        # the size first: a multi-GB data file is hashed only when its size matches
        if (isinstance(size, int) and file.stat().st_size != size) or (sha and sha != sha256_file(file)):
            raise ModelLoadError(
                format_message(
                    f"Engine '{path}'",
                    f"a file ('{file.name}') whose sha256 differs from its sidecar",
                    "the engine that build-engine wrote",
                    "the engine was replaced or corrupted; rebuild it with --force",
                )
            )


def load_engine_runner(path: str | os.PathLike[str], *, device: str = "auto") -> Runner:
    """Open a TensorRT or ONNX Runtime engine built by ``build-engine`` as a Runner.

    The sidecar is checked against this machine first: an engine built with another TensorRT version or
    for another GPU generation is refused with a message that says how to rebuild it.

    Args:
        path: The engine file.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``. An engine runs on the device kind it was built for.

    Returns:
        An inactive Runner (use it in a ``with`` block).

    Raises:
        ModelLoadError: Missing or changed engine, broken sidecar, wrong TensorRT/onnxruntime version or GPU.
        BackendUnavailableError: TensorRT, a GPU or the CUDA provider is missing here.
    """
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(
            format_message(f"Engine '{path}'", "no such file", "an engine built by build-engine")
        )
    sidecar = read_sidecar(p)
    backend = _engine_backend(p, sidecar)
    if sidecar is None:
        logger.warning("Engine %s has no sidecar %s: version and GPU checks skipped", p, sidecar_path(p).name)
    else:
        _check_unchanged(p, sidecar)
    if backend == "tensorrt":
        return _tensorrt_runner(p, sidecar, device)
    if backend == "onnxruntime":
        return _ort_runner(p, sidecar, device)
    raise ModelLoadError(
        format_message(
            f"Engine sidecar '{sidecar_path(p)}'", f"backend {backend!r}", "tensorrt or onnxruntime"
        )
    )


def _tensorrt_runner(path: Path, sidecar: dict[str, Any] | None, device: str) -> Runner:

    probe = probe_tensorrt()
    if probe.version is None:
        raise BackendUnavailableError(probe.reason)
    gpu = require_gpu("cuda:0" if device == "auto" else device, f"TensorRT engine '{path}'")
    if sidecar is not None:
        here = MachineFacts("tensorrt", probe.version, gpu.name, gpu.capability_text)
        for warning in check_compatible(MachineFacts.from_sidecar(sidecar), here, path):
            logger.warning(warning)
    return TrtRunner(path, device_index=gpu.index)


def _ort_runner(path: Path, sidecar: dict[str, Any] | None, device: str) -> Runner:
    import onnxruntime as ort

    settings = dict((sidecar or {}).get("onnxruntime") or {"providers": ["CPUExecutionProvider"]})
    built_cuda = "CUDAExecutionProvider" in settings.get("providers", [])
    if device == "cpu" and built_cuda or device.startswith("cuda") and not built_cuda:
        kind = "cuda" if built_cuda else "cpu"
        raise InvalidInputError(
            format_message(
                f"--device {device} for engine '{path}'",
                f"an engine optimised for {kind}",
                f"--device {kind} or auto",
                f"build another engine with mpinfer build-engine --backend onnxruntime --device {device}",
            )
        )
    usable = cuda_usable()
    gpu = gpu_info(0) if usable else None
    if sidecar is not None:
        here = MachineFacts(
            "onnxruntime",
            ort.__version__,
            gpu.name if gpu else None,
            gpu.capability_text if gpu else None,
            tuple(p for p in ort.get_available_providers() if p != "CUDAExecutionProvider" or usable),
        )
        recorded = MachineFacts.from_sidecar(sidecar)
        if not built_cuda:  # a CPU engine does not depend on the GPU
            recorded = MachineFacts(recorded.backend, recorded.runtime_version, providers=recorded.providers)
        for warning in check_compatible(recorded, here, path):
            logger.warning(warning)
    return OrtEngineRunner(path, settings)
