"""ONNX Runtime runner (CPU, or CUDA when a GPU and the CUDA provider are present)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.backends.base import Runner
from mpinfer.errors import BackendUnavailableError, InvalidInputError, format_message
from mpinfer.gpu import cuda_driver_present
from mpinfer.modelio import default_opset, ir_version_for, load_onnx, ort_log_level, ort_session
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
    """True when onnxruntime has the CUDA provider and a CUDA device is visible to torch.

    Without a CUDA driver (:func:`mpinfer.gpu.cuda_driver_present`) the answer is False without importing torch.
    """
    if "CUDAExecutionProvider" not in available_providers() or not cuda_driver_present():
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
            known = by_name.get(i.name)
            empty = {k for k, d in enumerate(known.shape) if d == 0} if known else set()  # a declared 0 is static
            shape = tuple(
                d if isinstance(d, int) and (d > 0 or (d == 0 and k in empty))
                else dim_symbol(i.name, k, d if isinstance(d, str) else None)
                for k, d in enumerate(i.shape)
            )
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


def load_check(model: Any, path: Path | None) -> None:
    """Load ``model`` (a ModelProto or its bytes; or the file ``path``) in an ONNX Runtime CPU session, unoptimized.

    Raises what ONNX Runtime raises.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = ort_log_level()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.add_session_config_entry("session.disable_prepacking", "1")  # a load check needs no packed copies
    so.intra_op_num_threads = so.inter_op_num_threads = 1  # nor a thread pool (a third of a 600-node model's load)
    src = str(path) if path is not None else model if isinstance(model, bytes) else model.SerializeToString()
    ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


# What every onnxruntime this package accepts (1.20 or newer: pyproject.toml) loads: IR version 10 and default-domain
# opset 21. A model within both needs no probe of the installed runtime's limits (:func:`fit_runtime`).
ORT_FLOOR_IR = 10
ORT_FLOOR_OPSET = 21


@functools.lru_cache(maxsize=1)
def runtime_limits() -> tuple[int, int]:
    """(highest IR version, highest default-domain opset) the installed ONNX Runtime loads.

    Probed once per process with one-node models (a few milliseconds): the limits move with every ONNX Runtime
    release, and a model past either is refused at load with an error naming only a file offset.
    """
    import onnx
    from onnx import defs, helper

    def loads(ir: int, opset: int) -> bool:
        x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
        y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)
        try:
            load_check(model, None)
        except Exception:  # noqa: BLE001 - onnxruntime raises its own types
            return False
        return True

    ir = next((v for v in range(onnx.IR_VERSION, 6, -1) if loads(v, 13)), 7)
    opset = next((v for v in range(defs.onnx_opset_version(), 12, -1) if loads(min(ir, 10), v)), 13)
    return ir, opset


def fit_runtime(model: Any, path: str) -> Any:
    """``model`` at an IR version the installed ONNX Runtime reads, or a clear refusal of an opset it cannot.

    The IR version is lowered (on a copy) to the lowest one the model's opsets need when the declared one is past
    what ONNX Runtime reads: the validity gate then decides whether the model uses anything of the newer IR. A
    default-domain opset past ONNX Runtime's is refused: no run (calibration, verification, the gate's load) is
    possible, and downgrading the ops themselves is not something to do silently.

    Raises:
        InvalidInputError: The model's default-domain opset is past what ONNX Runtime loads.
    """
    import onnx

    opset = default_opset(model)
    if model.ir_version <= ORT_FLOOR_IR and opset <= ORT_FLOOR_OPSET:
        return model  # (every supported onnxruntime reads it: the probe, a few one-node sessions, is not needed)
    max_ir, max_opset = runtime_limits()
    if opset > max_opset:
        import onnxruntime as ort

        raise InvalidInputError(
            format_message(
                f"ONNX model '{path}'",
                f"opset {opset} (IR version {model.ir_version})",
                f"opset {max_opset} or lower, the newest the installed onnxruntime {ort.__version__} loads",
                f"re-export the model at opset {max_opset} or lower, or install a newer onnxruntime",
            )
        )
    if model.ir_version <= max_ir:
        return model
    lowered = ir_version_for(model)
    if lowered > max_ir:
        return model  # (the gate then says why the model cannot be loaded)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.ir_version = lowered
    logger.info(
        "Model '%s' declares IR version %d; the installed ONNX Runtime reads up to %d: converted (and written) at "
        "IR version %d, the lowest its opsets need.",
        path,
        model.ir_version,
        max_ir,
        lowered,
    )
    return out
