"""Runners: one interface over ONNX Runtime, strict FP16/BF16 emulation, torch and TensorRT.

:func:`open_runner` picks the runner for a path or spec; backends are imported only when used.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mpinfer.backends.base import Runner, check_feeds
from mpinfer.backends.ort import OrtRunner
from mpinfer.backends.torch_runner import TorchRunner
from mpinfer.errors import BackendUnavailableError, InvalidInputError, ModelLoadError, format_message

# File suffixes of built engines (TensorRT plans, ONNX Runtime ORT-format engines).
ENGINE_SUFFIXES = (".engine", ".trt", ".plan", ".ort")
# Numerics an ONNX model can be run with: onnxruntime's kernels, or the strict FP16/BF16 emulation.
NUMERICS = ("ort", "strict")


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
    path = Path(text)
    if path.is_dir():
        raise ModelLoadError(
            format_message(
                f"Model '{text}'",
                "a directory",
                "an .onnx file, an engine, or file.py:factory[@weights]",
                "name the model file inside it (a model folder is exported first: mpinfer export FOLDER -o m.onnx)",
            )
        )
    if not path.is_file():
        raise ModelLoadError(
            format_message(
                f"Model '{text}'", "no such file", "an .onnx file, an engine, or file.py:factory[@weights]"
            )
        )
    if _is_engine(path):
        return _engine_runner(path, device)
    if path.suffix.lower() == ".onnx":
        if numerics == "strict":
            return _strict_runner(path, label)

        return OrtRunner(path, device=device, name=label)
    if path.suffix.lower() in ENGINE_SUFFIXES:
        return _engine_runner(path, device)
    raise InvalidInputError(
        format_message(
            f"Model '{text}'",
            f"a '{path.suffix}' file",
            "an .onnx file, an engine (" + ", ".join(ENGINE_SUFFIXES) + ") or file.py:factory[@weights]",
        )
    )


def _is_engine(path: Path) -> bool:
    """An engine suffix, or (with the engine backend installed) any file with an engine sidecar."""
    if path.suffix.lower() in ENGINE_SUFFIXES:
        return True
    try:
        from mpinfer.engine import is_engine_artifact
    except ImportError:
        return False
    return bool(is_engine_artifact(path))


def _strict_runner(path: Path, name: str) -> Runner:
    try:
        from mpinfer.backends.strict import StrictRunner
    except ImportError as err:
        raise BackendUnavailableError(
            format_message(
                "Strict numerics",
                "a build without mpinfer.backends.strict",
                "the strict FP16/BF16 emulation runner",
                "use --numerics ort",
            )
        ) from err
    runner: Runner = StrictRunner(path, name=name)
    return runner


def _engine_runner(path: Path, device: str) -> Runner:
    try:
        from mpinfer.engine import load_engine_runner
    except ImportError as err:
        raise BackendUnavailableError(
            format_message(
                f"Engine '{path}'",
                "a build without the engine backend (mpinfer.engine)",
                "mpinfer.engine.load_engine_runner",
                "install mpinfer with the engine support, or compare the .onnx instead",
            )
        ) from err
    runner: Any = load_engine_runner(path, device=device)
    return runner  # type: ignore[no-any-return]


__all__ = ["ENGINE_SUFFIXES", "NUMERICS", "Runner", "check_feeds", "is_torch_spec", "open_runner"]
