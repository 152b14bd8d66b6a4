"""From a model path or spec to the runner that runs it: ONNX Runtime, strict emulation, torch or an engine.

The dispatch sits above the packages it picks from (:mod:`mpinfer.backends` for the runners,
:mod:`mpinfer.precision.emulator.runner` for the strict FP16/BF16 emulation, :mod:`mpinfer.engine` for built
engines), so none of them imports another to find its runner.
"""

from __future__ import annotations

import os
from pathlib import Path

from mpinfer.backends.base import Runner
from mpinfer.backends.ort import OrtRunner
from mpinfer.backends.torch_runner import TorchRunner
from mpinfer.engine import is_engine_artifact, load_engine_runner
from mpinfer.errors import InvalidInputError, ModelLoadError, format_message
from mpinfer.precision.emulator import StrictRunner

# File suffixes of built engines (TensorRT plans, ONNX Runtime ORT-format engines).
ENGINE_SUFFIXES = (".engine", ".trt", ".plan", ".ort")
# Numerics an ONNX model can be run with: onnxruntime's kernels, or the strict FP16/BF16 emulation.
NUMERICS = ("ort", "strict")
# What a model argument may name, for the messages.
MODEL_KINDS = "an .onnx file, an engine, or file.py:factory[@weights]"


def is_torch_spec(path_or_spec: str | os.PathLike[str]) -> bool:
    """True for a ``file.py:factory[@weights]`` spec."""
    text = str(path_or_spec).partition("@")[0]
    return ".py:" in text


def open_runner(
    path_or_spec: str | os.PathLike[str],
    *,
    device: str = "cpu",
    numerics: str = "ort",
    name: str | None = None,
) -> Runner:
    """Return an (inactive) runner for a model path or spec.

    Args:
        path_or_spec: ``model.onnx``; an engine (``.engine``/``.trt``/``.plan``/``.ort``, or any file with
            an engine sidecar from ``build-engine``); or
            ``file.py:factory[@weights]``.
        device: ``cpu``, ``cuda`` or ``auto``.
        numerics: ``ort`` (onnxruntime kernels) or ``strict`` (every FP16/BF16 node emulated in its
            precision).
        name: Display name (default: the path or spec).

    Returns:
        A Runner; use it as a context manager.

    Raises:
        InvalidInputError: For an unknown numerics mode or file kind.
        ModelLoadError: For a missing file.
        BackendUnavailableError: When the needed backend is not installed.
    """
    if numerics not in NUMERICS:
        raise InvalidInputError(format_message("Numerics", repr(numerics), " or ".join(NUMERICS)))
    text = str(path_or_spec)
    label = name or text
    if is_torch_spec(text):
        return TorchRunner(text, device=device, name=label)
    path = _model_file(text)
    if is_engine_artifact(path):  # an engine suffix, or any file with an engine sidecar
        return load_engine_runner(path, device=device)
    if path.suffix.lower() == ".onnx":
        if numerics == "strict":
            return StrictRunner(path, name=label)
        return OrtRunner(path, device=device, name=label)
    raise InvalidInputError(
        format_message(
            f"Model '{text}'",
            f"a '{path.suffix}' file",
            "an .onnx file, an engine (" + ", ".join(ENGINE_SUFFIXES) + ") or file.py:factory[@weights]",
        )
    )


def _model_file(text: str) -> Path:
    """The model path, refusing a directory or a missing file."""
    path = Path(text)
    if path.is_dir():
        raise ModelLoadError(
            format_message(
                f"Model '{text}'",
                "a directory",
                MODEL_KINDS,
                "name the model file inside it (a model folder is exported first: mpinfer export FOLDER -o m.onnx)",
            )
        )
    if not path.is_file():
        raise ModelLoadError(format_message(f"Model '{text}'", "no such file", MODEL_KINDS))
    return path


__all__ = ["ENGINE_SUFFIXES", "NUMERICS", "is_torch_spec", "open_runner"]
