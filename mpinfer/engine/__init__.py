"""Engines: TensorRT 10/11 (strongly typed) or an ONNX Runtime engine where TensorRT is absent.

Public API::

    from mpinfer.engine import BuildConfig, build_engine, load_engine_runner

    cfg = BuildConfig(model=Path("out/model.fp16.onnx"), shapes=parse_shapes("x:1x3,8x3,32x3"))
    result = build_engine(cfg)
    with load_engine_runner(result.path) as runner:
        outputs = runner.infer({"x": x})

TensorRT, onnxruntime and torch are imported only when a function needs them.
"""

from __future__ import annotations

from mpinfer.engine.build import build_engine, select_backend
from mpinfer.engine.config import (
    Backend,
    BuildConfig,
    BuildResult,
    ShapeProfile,
    parse_shape_profile,
    parse_shapes,
    parse_size,
)
from mpinfer.engine.load import is_engine_artifact, load_engine_runner
from mpinfer.engine.sidecar import read_sidecar, sidecar_path
from mpinfer.gpu import probe_tensorrt

__all__ = [
    "Backend",
    "BuildConfig",
    "BuildResult",
    "ShapeProfile",
    "build_engine",
    "is_engine_artifact",
    "load_engine_runner",
    "parse_shape_profile",
    "parse_shapes",
    "parse_size",
    "probe_tensorrt",
    "read_sidecar",
    "select_backend",
    "sidecar_path",
]
