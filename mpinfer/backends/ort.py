"""ONNX Runtime runner (CPU, or CUDA when a GPU and the CUDA provider are present)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mpinfer.backends.base import Runner
from mpinfer.errors import BackendUnavailableError, format_message
from mpinfer.modelio import load_onnx, ort_session
from mpinfer.specs import TensorSpec, dim_symbol, specs_from_onnx

logger = logging.getLogger(__name__)

# onnxruntime's input type strings → numpy dtypes.
_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
}


def available_providers() -> list[str]:
    """The onnxruntime execution providers of this installation."""
    import onnxruntime as ort

    return list(ort.get_available_providers())


def cuda_usable() -> bool:
    """True when onnxruntime has the CUDA provider and a CUDA device is visible to torch."""
    if "CUDAExecutionProvider" not in available_providers():
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def resolve_providers(device: str) -> list[str]:
    """Map ``cpu`` / ``cuda`` / ``auto`` to an onnxruntime provider list.

    Raises:
        BackendUnavailableError: ``cuda`` asked for where it cannot run.
    """
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device in ("cuda", "gpu"):
        if not cuda_usable():
            have = available_providers()
            why = ("no visible GPU (onnxruntime has CUDAExecutionProvider)"
                   if "CUDAExecutionProvider" in have else f"an onnxruntime without CUDAExecutionProvider ({have})")
            raise BackendUnavailableError(
                format_message("ONNX Runtime CUDA provider (--device cuda)", why, "a visible NVIDIA GPU and "
                               "onnxruntime's CUDAExecutionProvider",
                               "install onnxruntime-gpu on a machine with an NVIDIA GPU, or use --device cpu")
            )
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "auto":
        return resolve_providers("cuda") if cuda_usable() else ["CPUExecutionProvider"]
    raise BackendUnavailableError(format_message("Device", repr(device), "cpu, cuda or auto"))


class OrtRunner(Runner):
    """Runs an ONNX model (path or ModelProto) in onnxruntime.

    Args:
        model: Path to a .onnx file or an ``onnx.ModelProto``.
        device: ``cpu``, ``cuda`` or ``auto``.
        name: Display name (defaults to the file name).
        session_options: Optional ``onnxruntime.SessionOptions``.
        output_names: Restrict the outputs fetched (default: all graph outputs).
    """

    def __init__(
        self,
        model: Any,
        *,
        device: str = "cpu",
        name: str | None = None,
        session_options: Any = None,
        output_names: Sequence[str] | None = None,
    ) -> None:
        default = os.path.basename(str(model)) if isinstance(model, (str, os.PathLike)) else "onnx-model"
        super().__init__(name or default)
        self._model = model
        self.device = device
        self._session_options = session_options
        self._requested_outputs = list(output_names) if output_names else None
        self._session: Any = None
        self._specs: list[TensorSpec] = []

    def _activate(self) -> None:

        providers = resolve_providers(self.device)
        proto = self._model
        if isinstance(self._model, (str, os.PathLike)):
            proto = load_onnx(self._model, load_external_data=False)  # path checks with clear errors
        self._session = ort_session(self._model, providers, self._session_options)
        self._specs = self._session_specs(specs_from_onnx(proto))

    def _session_specs(self, declared: Sequence[TensorSpec]) -> list[TensorSpec]:
        """The session's inputs, with the value ranges and dim sizes export recorded in the model (``declared``)."""
        by_name = {s.name: s for s in declared}
        specs = []
        for i in self._session.get_inputs():
            dtype = np.dtype(_ORT_TYPES.get(i.type, np.float32))
            shape = tuple(
                d if isinstance(d, int) and d > 0 else dim_symbol(i.name, k, d if isinstance(d, str) else None)
                for k, d in enumerate(i.shape)
            )
            known = by_name.get(i.name)
            specs.append(TensorSpec(i.name, shape, dtype, known.value_range if known else None,
                                    dict(known.dim_sizes) if known else {}, dict(known.graph_sizes) if known else {}))
        return specs

    @property
    def session(self) -> Any:
        """The ONNX Runtime session while active (None otherwise)."""
        return self._session

    def input_specs(self) -> list[TensorSpec]:
        """The session's inputs."""
        return list(self._specs)

    def output_names(self) -> list[str]:
        """The session's outputs (or the requested subset)."""
        return self._requested_outputs or [o.name for o in self._session.get_outputs()]

    def _infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = self.output_names()
        outs = self._session.run(names, {k: np.asarray(v) for k, v in feeds.items()})
        return dict(zip(names, outs))

    def _deactivate(self) -> None:
        self._session = None

    def describe(self) -> dict[str, Any]:
        """Backend facts: providers actually used and the numerics they imply."""
        info = super().describe()
        providers = self._session.get_providers() if self._session is not None else resolve_providers(self.device)
        info.update({"backend": "onnxruntime", "providers": providers,
                     "numerics": "ort-cuda" if providers[0] == "CUDAExecutionProvider" else "ort-cpu"})
        return info


def onnx_input_specs(model: Any) -> list[TensorSpec]:
    """Input specs of an ONNX model given as a path or ModelProto."""
    if isinstance(model, (str, os.PathLike)):
        model = load_onnx(model, load_external_data=False)
    return specs_from_onnx(model)
