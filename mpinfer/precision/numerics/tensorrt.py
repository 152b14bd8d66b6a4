"""TensorRT numerics (``tensorrt``): the candidate applied, built into a strongly typed engine, run on the GPU.

TensorRT and torch are imported on first use.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from mpinfer.backends.trt_runner import TrtRunner
from mpinfer.engine.config import Backend, BuildConfig, ShapeProfile
from mpinfer.engine.trt_builder import build_trt_engine
from mpinfer.errors import BackendUnavailableError, format_message
from mpinfer.gpu import cuda_device_count, gpu_info, require_gpu, tensorrt_installed
from mpinfer.modelio import save_onnx
from mpinfer.precision.numerics.base import Outputs, Runner, float32_outputs
from mpinfer.precision.numerics.ort import _AppliedEvaluator


class TensorRtEvaluator(_AppliedEvaluator):
    """TensorRT numerics: each candidate applied, built into a strongly typed engine and run on the GPU.

    The engine is built by :func:`mpinfer.engine.trt_builder.build_trt_engine` (``OnnxParser``,
    ``STRONGLY_TYPED`` networks on TensorRT 10, ``build_serialized_network``) with one optimization profile
    spanning the batches' shapes, and run by :class:`mpinfer.backends.trt_runner.TrtRunner`
    (``set_input_shape``, ``set_tensor_address``, ``execute_async_v3``). An engine build takes seconds to
    minutes, so a search costs that per verification.
    """

    name: ClassVar[str] = "tensorrt"
    supports_bf16: ClassVar[bool] = True
    device_index: ClassVar[int] = 0
    # Largest batch the engine's profile takes (the search batches and the verification's batches).
    max_rows: ClassVar[int] = 64

    @classmethod
    def check_available(cls) -> None:
        """Refuse a machine without the ``tensorrt`` package or without the GPU (:attr:`device_index`).

        Raises:
            BackendUnavailableError: No TensorRT, or no such CUDA device.
        """
        hint = "run convert on a machine with an NVIDIA GPU and TensorRT, or use --numerics strict or ort"
        if not tensorrt_installed():
            raise BackendUnavailableError(
                format_message(
                    "--numerics tensorrt", "no `tensorrt` Python package", "TensorRT 10 or 11 and an NVIDIA GPU", hint
                )
            )
        if gpu_info(cls.device_index) is None:
            raise BackendUnavailableError(
                format_message(
                    "--numerics tensorrt",
                    f"no CUDA device {cls.device_index} (this machine has {cuda_device_count()} visible GPU(s))",
                    "an NVIDIA GPU",
                    hint,
                )
            )

    @classmethod
    def session(cls, model: Any, base_dir: str = "") -> Runner:
        """A strongly typed engine of ``model`` built in a temporary folder, loaded on the GPU."""
        del base_dir  # the model is written whole (weights included) into the temporary folder
        gpu = require_gpu(f"cuda:{cls.device_index}", "TensorRT numerics")
        with tempfile.TemporaryDirectory(prefix="mpinfer-trt-eval-") as folder:
            onnx_path, engine_path = Path(folder) / "candidate.onnx", Path(folder) / "candidate.engine"
            save_onnx(model, onnx_path)
            shapes = cls._profile(model)
            cfg = BuildConfig(model=onnx_path, output=engine_path, backend=Backend.TENSORRT, shapes=shapes)
            build_trt_engine(cfg, onnx_path, engine_path, gpu)
            runner = TrtRunner(engine_path, device_index=cls.device_index, name="candidate")
            runner.activate()  # reads the engine: the folder may go

        def run(batch: Mapping[str, np.ndarray]) -> Outputs:
            out = runner.infer(batch)
            return float32_outputs(list(out), list(out.values()))

        return run

    @classmethod
    def _profile(cls, model: Any) -> tuple[Any, ...]:
        """One profile per input: every symbolic dim from 1 to :attr:`max_rows` (fixed dims as they are)."""
        out = []
        for vi in model.graph.input:
            dims = vi.type.tensor_type.shape.dim
            lo = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in dims)
            hi = tuple(d.dim_value if d.HasField("dim_value") else cls.max_rows for d in dims)
            out.append(ShapeProfile(vi.name, lo, hi, hi))
        return tuple(out)
