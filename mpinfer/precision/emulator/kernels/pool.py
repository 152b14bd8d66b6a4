"""Pooling and Resize kernels.

Average pools sum in float32 and round once; Resize (nearest, linear) is separable, one axis at a time,
each linear axis step rounded.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpinfer.precision.emulator.kernels import ortexec
from mpinfer.precision.emulator.kernels.linalg import _conv_geometry, conv_windows
from mpinfer.precision.emulator.kernels.numerics import NodeInfo, Numerics, UnsupportedVariant


def _pool_geometry(
    n: NodeInfo, v: np.ndarray
) -> tuple[tuple[int, ...], list[int], list[int], list[int], list[int], list[int], tuple[int, ...]]:
    """Kernel, strides, dilations, begin pads, end pads, the extra end pad and the output's spatial size.

    The output size is ONNX Runtime's: ``span / stride`` truncated toward zero, plus one (ceil_mode: rounded up,
    a window starting in the end padding dropped), where ``span`` = padded input - window. A window that
    overhangs the padded input (a map smaller than the window, where the spec's floor would give no output)
    sees only the values that are there, as in ONNX Runtime: the extra end pad holds the fill value and
    never counts in an average.
    """
    kernel = tuple(n.get("kernel_shape"))
    in_sp = v.shape[2:]
    strides, dil, begin, end = _conv_geometry(n, in_sp, kernel)
    extra = [0] * len(kernel)
    outs = []
    for i, k in enumerate(kernel):
        eff = (k - 1) * dil[i] + 1
        padded = in_sp[i] + begin[i] + end[i]
        span = padded - eff
        if n.get("ceil_mode", 0):
            out = math.ceil(span / strides[i]) + 1
            if out > 0 and (out - 1) * strides[i] >= in_sp[i] + begin[i]:  # a window starting in the end pad
                out -= 1
        else:
            out = (span // strides[i] if span >= 0 else -(-span // strides[i])) + 1  # C's division: toward 0
        out = max(out, 0)
        outs.append(out)
        if out:
            extra[i] = max(0, (out - 1) * strides[i] + eff - padded)
    return kernel, strides, dil, begin, end, extra, tuple(outs)


def _empty_pool(v: np.ndarray, outs: tuple[int, ...]) -> list[np.ndarray] | None:
    """The empty output of a pool whose window fits nowhere (ONNX Runtime returns one), else None."""
    return [np.zeros(v.shape[:2] + outs, v.dtype)] if 0 in outs else None


def max_pool(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """MaxPool (pads, strides, dilations, ceil_mode, auto_pad); the Indices output falls back.

    ONNX Runtime's float32 kernel where it runs the node (a window's NaN is dropped there, as cuDNN's default
    pooling drops it; the cast graph computes it so too), else numpy's max (which keeps a NaN).
    """
    if len(n.node.output) > 1 and n.node.output[1]:
        raise UnsupportedVariant("MaxPool with Indices output")
    v = x[0]
    fast = ortexec.kernel("MaxPool", n.attrs, [v])
    if fast is not None:
        return [fast]
    kernel, strides, dil, begin, end, extra, outs = _pool_geometry(n, v)
    empty = _empty_pool(v, outs)
    if empty is not None:
        return empty
    fill = -np.inf if v.dtype.kind == "f" else np.iinfo(v.dtype).min
    win = conv_windows(
        v, kernel, strides, dil, begin, [e + x_ for e, x_ in zip(end, extra, strict=False)], fill
    )
    sp = len(kernel)
    return [np.ascontiguousarray(win.max(axis=tuple(range(-sp, 0))))]


@ortexec.first("AveragePool")
def average_pool(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """AveragePool; the divisor counts padding only with count_include_pad, never the ceil_mode extra.

    ONNX Runtime's float32 kernel where it takes the node (the sum order is the kernel's, as on a GPU; the cast
    graph computes it so too), else numpy.
    """
    v = x[0]
    kernel, strides, dil, begin, end, extra, outs = _pool_geometry(n, v)
    empty = _empty_pool(v, outs)
    if empty is not None:
        return empty
    sp = len(kernel)
    axes = tuple(range(-sp, 0))
    ends = [e + x_ for e, x_ in zip(end, extra, strict=False)]
    total = conv_windows(v, kernel, strides, dil, begin, ends).sum(axis=axes, dtype=np.float32)
    if not any(begin) and not any(ends):
        count = np.float32(np.prod(kernel))
    else:
        mask = np.ones((1, 1) + v.shape[2:], np.float32)
        if n.get("count_include_pad", 0):
            mask = np.pad(mask, [(0, 0), (0, 0)] + list(zip(begin, end, strict=False)), constant_values=1.0)
            count = conv_windows(mask, kernel, strides, dil, [0] * sp, extra).sum(axis=axes)
        else:
            count = conv_windows(mask, kernel, strides, dil, begin, ends).sum(axis=axes)
    return [(total / count).astype(v.dtype, copy=False)]


@ortexec.first("GlobalAveragePool", attrs=False)
def global_average_pool(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """GlobalAveragePool (float32 accumulation): ONNX Runtime's float32 kernel where it runs, else numpy."""
    v = x[0]
    return [np.mean(v, axis=tuple(range(2, v.ndim)), keepdims=True, dtype=np.float32).astype(v.dtype, copy=False)]


def global_max_pool(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """GlobalMaxPool."""
    v = x[0]
    return [np.max(v, axis=tuple(range(2, v.ndim)), keepdims=True)]


def _source_coords(mode: str, out: int, length: int, scale: float) -> np.ndarray:
    """Input coordinate of each output index, as ONNX Runtime computes it (align_corners: integer sizes)."""
    j = np.arange(out, dtype=np.float64)
    if mode == "half_pixel":
        return (j + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (j + 0.5) / scale - 0.5 if out > 1 else np.zeros(out)
    if mode == "align_corners":
        return j * (length - 1) / (out - 1) if out > 1 else np.zeros(out)
    if mode == "asymmetric":
        return j / scale
    if mode == "tf_half_pixel_for_nn":
        return (j + 0.5) / scale
    raise UnsupportedVariant(f"coordinate_transformation_mode={mode}")


def _nearest_index(c: np.ndarray, mode: str, length: int) -> np.ndarray:
    if mode == "floor":
        idx = np.floor(c)
    elif mode == "ceil":
        idx = np.ceil(c)
    elif mode == "round_prefer_ceil":
        idx = np.floor(c + 0.5)
    else:  # round_prefer_floor (default)
        idx = np.ceil(c - 0.5)
    return np.clip(idx, 0, length - 1).astype(np.int64)


def _text(v: Any, default: str) -> str:
    if v is None:
        return default
    return v.decode() if isinstance(v, bytes) else str(v)


def resize(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Resize/Upsample, modes nearest and linear (any rank; separable); other variants fall back."""
    v = x[0]
    mode = _resize_mode(n)
    scales, sizes, coord, nearest_mode = _resize_settings(n, x)
    out = v
    for ax in range(v.ndim):
        length = v.shape[ax]
        if sizes is not None:
            size = int(sizes[ax])
            scale = size / length
        else:
            scale = float(scales[ax])
            size = int(math.floor(length * scale))
        if size == length and scale == 1.0:
            continue
        c = _source_coords(coord, size, length, scale)
        if mode == "nearest":
            out = np.take(out, _nearest_index(c, nearest_mode, length), axis=ax)
        else:
            out = _linear_axis(out, c, ax, length, num).astype(v.dtype, copy=False)
    return [np.ascontiguousarray(out)]


def _resize_mode(n: NodeInfo) -> str:
    """The Resize node's interpolation mode; variants the kernel does not compute raise UnsupportedVariant."""
    mode = _text(n.get("mode"), "nearest")
    if (
        mode not in ("nearest", "linear", "bilinear", "trilinear")
        or n.get("antialias", 0)
        or n.get("axes") is not None
        or _text(n.get("keep_aspect_ratio_policy"), "stretch") != "stretch"
    ):
        raise UnsupportedVariant(f"Resize mode={mode}")
    return mode


def _resize_settings(n: NodeInfo, x: list[Any]) -> tuple[Any, Any, str, str]:
    """Scales, sizes (either may be None), coordinate transformation and nearest rounding of a Resize/Upsample."""
    if n.op_type == "Upsample" or n.opset < 11:  # Upsample/Resize-10 nearest is asymmetric + floor
        scales = x[1] if len(x) > 1 else np.asarray(n.get("scales"))
        return scales, None, "asymmetric", "floor"
    scales = x[2] if len(x) > 2 and x[2] is not None and x[2].size else None
    sizes = x[3] if len(x) > 3 and x[3] is not None and x[3].size else None
    coord = _text(n.get("coordinate_transformation_mode"), "half_pixel")
    return scales, sizes, coord, _text(n.get("nearest_mode"), "round_prefer_floor")


def _linear_axis(out: np.ndarray, c: np.ndarray, ax: int, length: int, num: Numerics) -> np.ndarray:
    """``out`` linearly interpolated along ``ax`` at source coordinates ``c``, rounded to the node's precision."""
    size = len(c)
    c = np.clip(c, 0, length - 1)
    i0 = np.floor(c).astype(np.int64)
    i1 = np.minimum(i0 + 1, length - 1)
    shape = [1] * out.ndim
    shape[ax] = size
    w1 = (c - i0).astype(np.float32).reshape(shape)
    a, b = np.take(out, i0, axis=ax), np.take(out, i1, axis=ax)
    return num.r(a * (np.float32(1.0) - w1) + b * w1)


KERNELS = {
    "MaxPool": max_pool,
    "AveragePool": average_pool,
    "GlobalAveragePool": global_average_pool,
    "GlobalMaxPool": global_max_pool,
    "Resize": resize,
    "Upsample": resize,
}
