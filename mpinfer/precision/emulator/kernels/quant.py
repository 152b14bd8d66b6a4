"""QuantizeLinear / DequantizeLinear: the QDQ pair of a quantized model (ONNX opsets 10 to 23).

``DequantizeLinear``: ``y = (x - zero_point) * scale``. ``x - zero_point`` is an exact integer; the product is
one elementary step, computed in float32 and rounded once to the node's precision by the executor (the scale
arrives rounded to it, as a GPU's FP16 dequantize reads it).

``QuantizeLinear``: ``y = saturate(round_half_even(x / scale) + zero_point)`` in the integer type of the zero
point (or ``output_dtype``; uint8 without either), the division in float32 on the (rounded) inputs, as ONNX
Runtime computes it. Scales are per tensor, per axis (1-D scale along ``axis``) or blocked (``block_size``).
8-bit, 16-bit and 32-bit integers are handled here; 4-bit and float8 types go to the reference fallback.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpinfer.precision.emulator.kernels.numerics import NodeInfo, Numerics, UnsupportedVariant

# TensorProto element types this module writes: INT8, UINT8, INT16, UINT16, INT32, UINT32 (ONNX numbering)
_INT_TYPES = {3: np.int8, 2: np.uint8, 5: np.int16, 4: np.uint16, 6: np.int32, 12: np.uint32}


def _broadcast(param: np.ndarray, x: np.ndarray, n: NodeInfo) -> np.ndarray:
    """A scale or zero point shaped to broadcast against ``x``: per tensor, per axis or blocked."""
    param = np.asarray(param)
    block = int(n.get("block_size", 0) or 0)
    if param.ndim == 0 or (param.ndim == 1 and param.size == 1 and not block):
        return param.reshape(())  # per tensor (opset 10 writes it as a 1-element vector too)
    axis = int(n.get("axis", 1))
    axis = axis + x.ndim if axis < 0 else axis
    if not 0 <= axis < x.ndim:
        raise UnsupportedVariant(f"axis {n.get('axis')} for a rank-{x.ndim} input")
    if block > 0:  # blocked: the scale has x's rank, axis holding ceil(len / block) blocks
        if param.ndim != x.ndim:
            raise UnsupportedVariant("a blocked scale whose rank differs from the input's")
        return np.repeat(param, block, axis=axis).take(np.arange(x.shape[axis]), axis=axis)
    if param.ndim != 1:
        raise UnsupportedVariant(f"a {param.ndim}-D scale without block_size")
    shape = [1] * x.ndim
    shape[axis] = param.shape[0]
    return param.reshape(shape)


def dequantize_linear(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """``(x - zero_point) * scale``, in the scale's float type."""
    q, scale = x[0], x[1]
    zero = x[2] if len(x) > 2 and x[2] is not None else None
    if q.dtype.kind not in "iu":
        raise UnsupportedVariant(f"input dtype {q.dtype} (float8 and 4-bit types: reference)")
    centred = q.astype(np.float64 if q.dtype.itemsize >= 4 else np.float32)
    if zero is not None:
        centred = centred - _broadcast(zero, q, n).astype(centred.dtype)
    out = centred.astype(np.float32) * _broadcast(scale, q, n).astype(np.float32)
    return [out.astype(np.float32, copy=False)]


def _output_type(n: NodeInfo, zero: np.ndarray | None) -> Any:
    if zero is not None:
        if zero.dtype.kind not in "iu" or zero.dtype.itemsize > 4:
            raise UnsupportedVariant(f"zero point dtype {zero.dtype}")
        return zero.dtype.type
    code = int(n.get("output_dtype", 0) or 0)
    if code == 0:
        return np.uint8
    if code not in _INT_TYPES:
        raise UnsupportedVariant(f"output_dtype {code}")
    return _INT_TYPES[code]


def quantize_linear(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """``saturate(round_half_even(x / scale) + zero_point)`` in the zero point's integer type."""
    v, scale = x[0], x[1]
    zero = x[2] if len(x) > 2 and x[2] is not None else None
    dtype = _output_type(n, zero)
    scaled = np.asarray(v, np.float32) / _broadcast(scale, v, n).astype(np.float32)
    q = np.rint(scaled).astype(np.float64)
    if zero is not None:
        q = q + _broadcast(zero, v, n).astype(np.float64)
    info = np.iinfo(dtype)
    q = np.nan_to_num(q, nan=0.0, posinf=info.max, neginf=info.min)
    return [np.clip(q, info.min, info.max).astype(dtype)]


KERNELS = {"DequantizeLinear": dequantize_linear, "QuantizeLinear": quantize_linear}
