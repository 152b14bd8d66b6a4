"""Rounding rules of the emulated precisions and the static facts of one compiled node.

Arithmetic is carried out in float32 numpy arrays whose values are rounded to the node's precision after
every elementary step (:meth:`Numerics.r`). For a single +, -, *, / or sqrt, computing in float32 and
rounding once to FP16/BF16 gives the correctly rounded low-precision result (float32 carries more than
twice the bits of either), so this is the arithmetic of a device that computes in that dtype, including
overflow to ``inf`` above 65504 in FP16 and flushing to zero below its subnormals.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpinfer.precision.emulator.kernels import ortexec
from mpinfer.specs import Precision, is_float_dtype

# Float dtypes the emulator treats as "float tensors" (rounded by low-precision nodes). float64 is left as
# it is: models rarely use it and it is never converted to a low precision.
LOW_KINDS = ("float16", "bfloat16")
# Smallest normal FP16 magnitude; below it FP16 values are multiples of 2**-24.
FP16_MIN_NORMAL = 2.0**-14


class UnsupportedVariant(Exception):
    """Raised by a kernel for an attribute combination it does not implement (the caller falls back)."""


class RejectedInput(ValueError):
    """Raised by a kernel for inputs the op cannot take (shapes ONNX Runtime refuses too).

    E.g. a map smaller than a convolution's window: the data is wrong for the model, not the emulator (the
    caller names the node).
    """


def is_float(x: Any) -> bool:
    """True for float32/float16/bfloat16/float64 arrays."""
    return isinstance(x, np.ndarray) and is_float_dtype(x.dtype)


def is_low_float(x: Any) -> bool:
    """True for float16 and bfloat16 arrays."""
    return isinstance(x, np.ndarray) and x.dtype.name in LOW_KINDS


class Numerics:
    """How one node computes: FP32, or rounding every elementary step to FP16/BF16.

    Attributes:
        precision: The node's precision.
        low: True for FP16/BF16.
        dtype: Storage dtype of the node's float outputs.
    """

    def __init__(self, precision: Precision) -> None:
        self.precision = precision
        self.low = precision.is_low
        self.dtype = precision.numpy_dtype

    def r(self, x: Any) -> Any:
        """Round ``x`` (float32 values) to this precision; returns float32 holding the rounded values."""
        if not self.low:
            return x
        arr = np.asarray(x, dtype=np.float32)
        if self.precision is Precision.FP16:
            out = round_to_fp16(arr)
        else:
            fast = ortexec.cast(arr, "round_bf16")
            out = fast if fast is not None else arr.astype(self.dtype).astype(np.float32)
        return out if isinstance(x, np.ndarray) else out[()]

    def load(self, x: np.ndarray) -> np.ndarray:
        """A float input as this node reads it: rounded to the low dtype (held in float32), or float32."""
        if x.dtype == np.float16:
            x = fp16_to_float32(x)
            return x if self.precision is not Precision.BF16 else self.r(x)
        if self.low:
            if x.dtype == self.dtype:
                return x.astype(np.float32)
            return self.r(x.astype(np.float32, copy=False))
        if x.dtype.name in LOW_KINDS:
            return x.astype(np.float32)
        return x

    def store(self, x: np.ndarray) -> np.ndarray:
        """A float output as this node writes it (the low dtype, or float32)."""
        if self.low:
            if x.dtype == self.dtype:
                return x
            fast = ortexec.cast(x, "to_fp16") if self.precision is Precision.FP16 else None
            return fast if fast is not None else x.astype(self.dtype)
        if x.dtype == np.float16:
            return fp16_to_float32(x)
        if x.dtype.name in LOW_KINDS:
            return x.astype(np.float32)
        return x

    def __repr__(self) -> str:
        return f"Numerics({self.precision.value})"


@dataclass
class NodeInfo:
    """Static facts about one node, computed once when the graph is compiled.

    Attributes:
        address: Qualified node address (``If_3/then_branch/Add_1``).
        op_type: ONNX op type.
        domain: Op domain ("" for ai.onnx).
        opset: Opset version of that domain in the model.
        attrs: Attribute name -> Python value (tensors as numpy arrays, graphs as GraphProto).
        node: The NodeProto.
        cache: Per-node scratch space for kernels (e.g. a fallback evaluator).
    """

    address: str
    op_type: str
    domain: str
    opset: int
    attrs: dict[str, Any]
    node: Any
    cache: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """Attribute ``key`` or ``default``."""
        return self.attrs.get(key, default)


@functools.lru_cache(maxsize=1)
def _fp16_table() -> np.ndarray:
    """float32 value of every FP16 bit pattern (256 KB, built on first use)."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def fp16_to_float32(h: np.ndarray) -> np.ndarray:
    """FP16 -> float32: ONNX Runtime's Cast for large arrays, else a table lookup (5x numpy's loop)."""
    fast = ortexec.cast(h, "from_fp16")
    return fast if fast is not None else np.take(_fp16_table(), h.view(np.uint16))


def round_to_fp16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest FP16 value (ties to even), kept in float32.

    Bit-exact with ``x.astype(float16).astype(float32)`` (overflow to inf at 65520, FP16 subnormals,
    NaN kept): ONNX Runtime's Cast pair for large arrays (checked bit for bit on first use, see
    :mod:`ortexec`), else :func:`round_to_fp16_numpy`.
    """
    x = np.asarray(x, dtype=np.float32)
    fast = ortexec.cast(x, "round_fp16")
    return fast if fast is not None else round_to_fp16_numpy(x)


def round_to_fp16_numpy(x: np.ndarray) -> np.ndarray:
    """:func:`round_to_fp16` in numpy (3x faster than ``astype``, 15x slower than ONNX Runtime's Cast).

    The mantissa is rounded at bit 13 with integer arithmetic, and values below FP16's normal range are
    quantised to multiples of 2**-24.
    """
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = (u + (np.uint32(0x0FFF) + ((u >> np.uint32(13)) & np.uint32(1)))) & np.uint32(0xFFFFE000)
    y = rounded.view(np.float32)
    a = np.abs(x)
    y = np.where(a >= np.float32(65520.0), np.copysign(np.float32(np.inf), x), y)
    small = a < np.float32(FP16_MIN_NORMAL)
    if small.any():
        y = np.where(small, np.rint(x * np.float32(2.0**24)) * np.float32(2.0**-24), y)
    if np.isnan(a.max(initial=0.0)):
        y = np.where(np.isnan(x), x, y)
    return y.astype(np.float32, copy=False)


# Chebyshev fit of erfc (Numerical Recipes erfcc), fractional error < 1.2e-7 everywhere: coefficients of
# the polynomial in t = 1 / (1 + |x| / 2), highest power first; erfc(|x|) = t * exp(-x^2 + poly(t)).
_ERFC_FIT = (
    0.17087277,
    -0.82215223,
    1.48851587,
    -1.13520398,
    0.27886807,
    -0.18628806,
    0.09678418,
    0.37409196,
    1.00002368,
    -1.26551223,
)


def erf(x: np.ndarray) -> np.ndarray:
    """Vectorised error function: ONNX Runtime's float32 Erf for large float32 arrays, else :func:`erf_numpy`.

    ONNX Runtime's is the more accurate of the two (largest error 5.8e-8 against ``math.erf`` on 3M
    points in [-6, 6], numpy's fit 8.5e-8) and 25x faster.
    """
    if isinstance(x, np.ndarray) and x.dtype == np.float32:
        fast = ortexec.float32_op("Erf", {}, [x])
        if fast is not None:
            return fast
    return erf_numpy(x)


def erf_numpy(x: np.ndarray) -> np.ndarray:
    """Vectorised error function (|error| < 1.2e-7), computed in float64 with in-place Horner steps."""
    z = np.asarray(x, dtype=np.float64)
    shape = z.shape
    z = z.reshape(-1)  # 1-d: 0-d inputs would turn the in-place steps into scalars
    a = np.abs(z)
    t = 0.5 * a
    t += 1.0
    np.reciprocal(t, out=t)
    poly = np.full_like(t, _ERFC_FIT[0])
    for c in _ERFC_FIT[1:]:
        poly *= t
        poly += c
    a *= a
    poly -= a
    np.exp(poly, out=poly)
    poly *= t  # erfc(|x|)
    np.subtract(1.0, poly, out=poly)  # erf(|x|)
    np.copysign(poly, z, out=poly)  # erf is odd
    return poly.reshape(shape).astype(x.dtype if isinstance(x, np.ndarray) and x.dtype.kind == "f" else np.float32)


SQRT_HALF = 1.0 / math.sqrt(2.0)
