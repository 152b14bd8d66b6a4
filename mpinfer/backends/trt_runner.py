"""TensorRT runner: deserializes an engine and runs it with device buffers held as torch CUDA tensors.

Uses the name-based tensor API of TensorRT 10/11: ``num_io_tensors`` / ``get_tensor_name`` /
``get_tensor_mode`` / ``get_tensor_dtype`` to discover I/O, ``set_input_shape`` per call (dynamic shapes
within the engine's optimization profile), ``set_tensor_address`` for every I/O tensor and
``execute_async_v3`` on a torch CUDA stream. TensorRT and torch are imported on activation only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.backends.base import Runner
from mpinfer.errors import InvalidInputError, ModelLoadError, format_message
from mpinfer.gpu import import_tensorrt, require_gpu
from mpinfer.specs import TensorSpec, unnamed_dim

logger = logging.getLogger(__name__)

# tensorrt.DataType member name -> (numpy dtype name, torch dtype name). bf16 travels through numpy as
# ml_dtypes.bfloat16 and through torch as torch.bfloat16 (copied bitwise via int16 views).
TRT_DTYPES = {
    "FLOAT": ("float32", "float32"),
    "HALF": ("float16", "float16"),
    "BF16": ("bfloat16", "bfloat16"),
    "INT8": ("int8", "int8"),
    "UINT8": ("uint8", "uint8"),
    "INT32": ("int32", "int32"),
    "INT64": ("int64", "int64"),
    "BOOL": ("bool", "bool"),
}


def numpy_dtype(name: str) -> np.dtype:
    """Numpy dtype for a numpy dtype name, bf16 included."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def trt_dtype_names(dtype: Any) -> tuple[str, str]:
    """(numpy name, torch name) for a ``tensorrt.DataType``.

    Raises:
        ModelLoadError: A type the runner cannot feed or fetch (e.g. FP8, INT4 at the engine I/O).
    """
    key = getattr(dtype, "name", str(dtype).rsplit(".", 1)[-1])
    if key not in TRT_DTYPES:
        raise ModelLoadError(
            format_message("TensorRT engine I/O tensor", f"dtype {key}", f"one of {', '.join(TRT_DTYPES)}")
        )
    return TRT_DTYPES[key]


class TrtRunner(Runner):
    """Runs a serialized TensorRT engine on one GPU.

    Args:
        path: The engine (plan) file.
        device_index: CUDA device to run on.
        profile_index: Optimization profile to use (mpinfer builds one, index 0).
        name: Display name (defaults to the file name).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device_index: int = 0,
        profile_index: int = 0,
        name: str | None = None,
    ) -> None:
        super().__init__(name or os.path.basename(str(path)))
        self.path = Path(path)
        self.device_index = device_index
        self.profile_index = profile_index
        self._trt: Any = None
        self._engine: Any = None
        self._context: Any = None
        self._stream: Any = None
        self._inputs: list[str] = []
        self._outputs: list[str] = []
        self._dtypes: dict[str, tuple[str, str]] = {}
        self._profiles: dict[str, tuple[tuple[int, ...], ...]] = {}
        self._specs: list[TensorSpec] = []

    def _activate(self) -> None:
        import torch

        require_gpu(f"cuda:{self.device_index}", "TensorRT runner")
        trt: Any = import_tensorrt()
        self._trt = trt
        with torch.cuda.device(self.device_index):
            runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            engine = runtime.deserialize_cuda_engine(self.path.read_bytes())
            if engine is None:
                raise ModelLoadError(
                    format_message(
                        f"TensorRT engine '{self.path}'",
                        f"a plan TensorRT {trt.__version__} cannot deserialize",
                        "an engine built by this TensorRT version on this GPU model",
                        "rebuild it here with mpinfer build-engine --force",
                    )
                )
            self._engine = engine
            self._context = engine.create_execution_context()
            self._stream = torch.cuda.Stream(device=self.device_index)
            if engine.num_optimization_profiles > 1:
                self._context.set_optimization_profile_async(self.profile_index, self._stream.cuda_stream)
        self._read_io()

    def _read_io(self) -> None:
        trt, engine = self._trt, self._engine
        self._inputs, self._outputs, self._specs = [], [], []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            self._dtypes[name] = trt_dtype_names(engine.get_tensor_dtype(name))
            if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                self._inputs.append(name)
                shape = tuple(int(d) for d in engine.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    lo, opt, hi = engine.get_tensor_profile_shape(name, self.profile_index)
                    self._profiles[name] = (tuple(lo), tuple(opt), tuple(hi))
                dims = tuple(d if d >= 0 else unnamed_dim(name, k) for k, d in enumerate(shape))
                self._specs.append(TensorSpec(name, dims, numpy_dtype(self._dtypes[name][0])))
            else:
                self._outputs.append(name)

    def input_specs(self) -> list[TensorSpec]:
        """The engine's inputs (dynamic dims as ``<input>.dim<i>``)."""
        return list(self._specs)

    def output_names(self) -> list[str]:
        """The engine's outputs, in engine order."""
        return list(self._outputs)

    def _check_profile(self, name: str, shape: tuple[int, ...]) -> None:
        prof = self._profiles.get(name)
        if prof is None:
            return
        lo, _opt, hi = prof
        if len(shape) != len(lo) or not all(a <= s <= b for a, s, b in zip(lo, shape, hi, strict=False)):
            raise InvalidInputError(
                format_message(
                    f"Input '{name}' for TensorRT engine '{self.name}'",
                    f"shape {shape}",
                    f"a shape between min {lo} and max {hi} (the engine's optimization profile)",
                    "rebuild with a wider --shapes profile, or feed smaller batches",
                )
            )

    def _infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        ctx = self._context
        keep: list[Any] = []
        with torch.cuda.device(self.device_index):
            for name in self._inputs:
                arr = np.ascontiguousarray(feeds[name])
                self._check_profile(name, tuple(arr.shape))
                tensor = _to_device(arr, self._dtypes[name][1], self.device_index)
                keep.append(tensor)
                ctx.set_input_shape(name, tuple(arr.shape))
                ctx.set_tensor_address(name, tensor.data_ptr())
            outputs: dict[str, Any] = {}
            for name in self._outputs:
                shape = tuple(int(d) for d in ctx.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise InvalidInputError(
                        format_message(
                            f"Output '{name}' of TensorRT engine '{self.name}'",
                            f"data-dependent shape {shape}",
                            "a shape known from the input shapes",
                            "compare this model with the ONNX Runtime engine (--backend onnxruntime)",
                        )
                    )
                out = torch.empty(
                    shape, dtype=getattr(torch, self._dtypes[name][1]), device=f"cuda:{self.device_index}"
                )
                outputs[name] = out
                ctx.set_tensor_address(name, out.data_ptr())
            # Inputs were copied on the default stream; make the engine's stream wait for them.
            self._stream.wait_stream(torch.cuda.current_stream(self.device_index))
            if not ctx.execute_async_v3(self._stream.cuda_stream):
                raise ModelLoadError(
                    format_message(
                        f"TensorRT engine '{self.name}'",
                        "a failed execute_async_v3",
                        "a successful run",
                        "rerun with -v for TensorRT's log",
                    )
                )
            self._stream.synchronize()
        return {name: _to_numpy(t, self._dtypes[name][0]) for name, t in outputs.items()}

    def _deactivate(self) -> None:
        self._context = None
        self._engine = None
        self._stream = None

    def describe(self) -> dict[str, Any]:
        """Backend facts for reports."""
        info = super().describe()
        version = getattr(self._trt, "__version__", None)
        info.update(
            {
                "backend": "tensorrt",
                "tensorrt_version": version,
                "engine": str(self.path),
                "device": f"cuda:{self.device_index}",
                "numerics": "tensorrt",
            }
        )
        return info


def _to_device(arr: np.ndarray, torch_dtype: str, index: int) -> Any:
    import torch

    if torch_dtype == "bfloat16":
        host = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    else:
        host = torch.from_numpy(arr)
    return host.to(f"cuda:{index}", dtype=getattr(torch, torch_dtype))


def _to_numpy(tensor: Any, numpy_name: str) -> np.ndarray:
    import torch

    host = tensor.cpu()
    if numpy_name == "bfloat16":
        return host.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return host.numpy()
