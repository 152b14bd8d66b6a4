"""How a candidate runs: the Evaluator protocol and registry (strict, ONNX Runtime CPU/CUDA, TensorRT), the probe."""

from __future__ import annotations

from mpinfer.precision.numerics.base import (
    AppliedRun,
    Candidate,
    Evaluator,
    Outputs,
    Runner,
    float32_outputs,
    has_all_outputs,
)
from mpinfer.precision.numerics.ort import OrtCudaEvaluator, OrtEvaluator
from mpinfer.precision.numerics.probe import PREFIX, ProbeResult, build_probe, group_submodel, probe_errors
from mpinfer.precision.numerics.registry import EVALUATORS, check_numerics, evaluator_class
from mpinfer.precision.numerics.strict import STRICT_SCREEN_MIN_VALUES, StrictEvaluator, local_error, open_emulator
from mpinfer.precision.numerics.tensorrt import TensorRtEvaluator

__all__ = [
    "AppliedRun",
    "Candidate",
    "EVALUATORS",
    "Evaluator",
    "OrtCudaEvaluator",
    "OrtEvaluator",
    "Outputs",
    "PREFIX",
    "ProbeResult",
    "Runner",
    "STRICT_SCREEN_MIN_VALUES",
    "StrictEvaluator",
    "TensorRtEvaluator",
    "build_probe",
    "check_numerics",
    "evaluator_class",
    "float32_outputs",
    "group_submodel",
    "has_all_outputs",
    "local_error",
    "open_emulator",
    "probe_errors",
]
