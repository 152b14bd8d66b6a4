"""Format limits of FP16 and BF16, which graph outputs are float, float32 energy sums: what every stage shares."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpinfer.specs import Precision

# Largest finite FP16 value: magnitudes above it overflow to inf when stored in FP16.
FP16_MAX = 65504.0
# Smallest FP16 subnormal: non-zero magnitudes below it flush to zero in FP16.
FP16_MIN_SUBNORMAL = 2.0**-24
# Smallest FP16 normal: below it FP16 keeps fewer than 11 significant bits (gradual underflow).
FP16_MIN_NORMAL = 2.0**-14
# Smallest BF16 normal (same exponent range as FP32, ~1.18e-38): below it BF16 loses range; GPUs often flush.
BF16_MIN_NORMAL = 2.0**-126
# BF16's lowest finite value (0xFF7F), exactly representable in float32.
BF16_LOWEST = float(np.frombuffer(np.array([0xFF7F0000], dtype=np.uint32).tobytes(), dtype=np.float32)[0])
# The largest finite value of each low format: a finite FP32 weight past it is clamped there, never rounded to inf
# (ModelOpt AutoCast's rule; the planner warns, naming the weight, when a user forces such a node low).
LOW_MAX = {Precision.FP16: FP16_MAX, Precision.BF16: -BF16_LOWEST}


def clampable(arr: np.ndarray) -> np.ndarray:
    """Finite values short of float32's own extremes (``finfo.max``/``min`` stand for infinity: mask constants)."""
    with np.errstate(invalid="ignore"):
        return np.isfinite(arr) & (np.abs(arr) < np.finfo(np.float32).max)


def out_of_range(arr: np.ndarray, low: Precision) -> float:
    """The largest magnitude ``low_array`` clamps in ``arr`` when it is past the low format's range, else 0."""
    if arr.size == 0 or arr.dtype.kind != "f":
        return 0.0
    finite = np.abs(arr[clampable(arr)])
    peak = float(finite.max()) if finite.size else 0.0
    return peak if peak > LOW_MAX[low] else 0.0


FLOAT_TYPES = (1, 10, 11, 16)  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


def float_outputs(model: Any) -> list[Any]:
    """The graph outputs of ``model`` declared float (FLOAT, FLOAT16, DOUBLE, BFLOAT16)."""
    return [o for o in model.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES]


def sum_of_squares(v: np.ndarray) -> float:
    """Sum of squares of finite float32 values: one float32 BLAS dot, float64 only when it overflows."""
    with np.errstate(over="ignore"):
        sq = float(np.dot(v, v))
    return sq if math.isfinite(sq) else float(np.dot(v.astype(np.float64), v.astype(np.float64)))
