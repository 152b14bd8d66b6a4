"""Matrix kernels: MatMul, Gemm, Einsum, Conv, ConvTranspose.

Tensor-core behaviour: inputs arrive rounded to the low dtype, products are accumulated in float32 and the
executor rounds the output once. MatMul, Gemm, Conv and ConvTranspose run in ONNX Runtime's float32 kernels
where it takes them (:func:`ortexec.float32_op`: the same model, products of rounded values are exact in
float32; the order of the float32 sums is the kernel's, as on a GPU), else in numpy: float32 BLAS, and im2col
over ``sliding_window_view`` plus one matrix product per group for convolutions.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from mpinfer.precision.emulator.kernels import ortexec
from mpinfer.precision.emulator.kernels.blas import one_thread_below
from mpinfer.precision.emulator.kernels.numerics import NodeInfo, Numerics, RejectedInput


@ortexec.first("MatMul")
def matmul(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """ONNX MatMul (numpy matmul broadcasting rules are ONNX's): ONNX Runtime's float32 kernel, else numpy's BLAS."""
    a, b = x
    with one_thread_below(a.size * b.size // max(1, a.shape[-1] if a.ndim else 1)):  # (batched: an upper bound)
        if a.ndim > 2 and b.ndim == 2:  # activations @ weights: one big GEMM instead of one per batch row
            return [(a.reshape(-1, a.shape[-1]) @ b).reshape(a.shape[:-1] + (b.shape[1],))]
        return [np.matmul(a, b)]


@ortexec.first("Gemm")
def gemm(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """ONNX Gemm: alpha * A' B' + beta * C, the epilogue in float32 (ONNX Runtime's kernel, else numpy's BLAS)."""
    a, b = x[0], x[1]
    c = x[2] if len(x) > 2 else None
    if n.get("transA", 0):
        a = a.T
    if n.get("transB", 0):
        b = b.T
    with one_thread_below(a.size * b.shape[-1]):
        y = a @ b
    alpha, beta = n.get("alpha", 1.0), n.get("beta", 1.0)
    if alpha != 1.0:
        y = y * np.asarray(alpha, y.dtype)
    if c is not None:
        y = y + (c if beta == 1.0 else c * np.asarray(beta, y.dtype))
    return [y]


def einsum(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """ONNX Einsum through numpy's optimised einsum."""
    eq = n.get("equation")
    eq = eq.decode() if isinstance(eq, bytes) else eq
    return [np.asarray(np.einsum(eq.replace(" ", ""), *x, optimize=True))]


def _conv_geometry(
    n: NodeInfo, in_sp: tuple[int, ...], kernel: tuple[int, ...]
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Strides, dilations, begin pads and end pads for Conv/pooling (auto_pad resolved)."""
    sp = len(in_sp)
    strides = list(n.get("strides") or [1] * sp)
    dil = list(n.get("dilations") or [1] * sp)
    auto_pad = n.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for i in range(sp):
            out = math.ceil(in_sp[i] / strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 - in_sp[i])
            small = total // 2
            b = small if auto_pad == "SAME_UPPER" else total - small
            begin.append(b)
            end.append(total - b)
        return strides, dil, begin, end
    if auto_pad == "VALID":
        return strides, dil, [0] * sp, [0] * sp
    pads = list(n.get("pads") or [0] * (2 * sp))
    return strides, dil, pads[:sp], pads[sp:]


def conv_windows(
    x: np.ndarray,
    kernel: tuple[int, ...],
    strides: list[int],
    dil: list[int],
    begin: list[int],
    end: list[int],
    pad_value: float = 0.0,
) -> np.ndarray:
    """Strided view (N, C, O1.., K1..) of the padded input's receptive fields (no copy beyond padding)."""
    sp = len(kernel)
    if any(begin) or any(end):
        x = np.pad(x, [(0, 0), (0, 0)] + list(zip(begin, end, strict=False)), constant_values=pad_value)
    eff = tuple((k - 1) * d + 1 for k, d in zip(kernel, dil, strict=False))
    win = sliding_window_view(x, eff, axis=tuple(range(2, 2 + sp)))
    slc = (
        (slice(None), slice(None))
        + tuple(slice(None, None, s) for s in strides)
        + tuple(slice(None, None, d) for d in dil)
    )
    return win[slc]


def _conv_channels_last(
    x: np.ndarray,
    w: np.ndarray,
    kernel: tuple[int, ...],
    strides: list[int],
    dil: list[int],
    begin: list[int],
    end: list[int],
) -> np.ndarray:
    """Ungrouped conv as one GEMM over channels-last im2col rows: (N*P, K*C) @ (K*C, M) -> (N, M, P)."""
    sp = len(kernel)
    batch, chans, m = x.shape[0], x.shape[1], w.shape[0]
    if any(begin) or any(end):
        x = np.pad(x, [(0, 0), (0, 0)] + list(zip(begin, end, strict=True)))
    xh = np.ascontiguousarray(np.moveaxis(x, 1, -1))  # N, S.., C
    eff = tuple((k - 1) * d + 1 for k, d in zip(kernel, dil, strict=True))
    win = sliding_window_view(xh, eff, axis=tuple(range(1, 1 + sp)))  # N, O.., C, E..
    win = win[
        (slice(None),)
        + tuple(slice(None, None, s) for s in strides)
        + (slice(None),)
        + tuple(slice(None, None, d) for d in dil)
    ]
    p = int(np.prod(win.shape[1 : 1 + sp]))
    kf = int(np.prod(kernel))
    perm = (0,) + tuple(range(1, 1 + sp)) + tuple(range(2 + sp, 2 + 2 * sp)) + (1 + sp,)
    cols = np.ascontiguousarray(win.transpose(perm)).reshape(batch * p, kf * chans)
    wk = w.transpose(tuple(range(2, 2 + sp)) + (1, 0)).reshape(kf * chans, m)
    return (cols @ wk).reshape(batch, p, m).transpose(0, 2, 1)  # FP32 accumulation


@ortexec.first("Conv")
def conv(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """ONNX Conv (1-D/2-D/3-D, groups, pads, strides, dilations, auto_pad) in float32."""
    xin, w = x[0], x[1]
    bias = x[2] if len(x) > 2 else None
    group = int(n.get("group", 1))
    kernel = tuple(w.shape[2:])
    sp = len(kernel)
    strides, dil, begin, end = _conv_geometry(n, xin.shape[2:], kernel)
    batch, chans = xin.shape[:2]
    out_sp = tuple(
        (xin.shape[2 + i] + begin[i] + end[i] - (kernel[i] - 1) * dil[i] - 1) // strides[i] + 1
        for i in range(sp)
    )
    if min(out_sp, default=1) < 1:  # ONNX Runtime: "Invalid input shape"
        raise RejectedInput(f"input {xin.shape[2:]} padded by {begin}/{end} is smaller than the window {kernel}")
    m = w.shape[0]
    if group == 1:
        y = _conv_channels_last(xin, w, kernel, strides, dil, begin, end)
    elif chans == group:  # depthwise (times a channel multiplier): one multiply-add per kernel tap
        win = conv_windows(xin, kernel, strides, dil, begin, end)  # N, C, O.., K.. (a view)
        mult = m // group
        y = np.zeros((batch, m) + out_sp, dtype=np.result_type(xin, w))
        tmp = np.empty_like(y)
        for tap in itertools.product(*[range(k) for k in kernel]):
            xk = win[(Ellipsis,) + tap]
            if mult > 1:
                xk = np.repeat(xk, mult, axis=1)
            np.multiply(xk, w[(slice(None), 0) + tap].reshape((1, m) + (1,) * sp), out=tmp)
            y += tmp  # FP32 accumulation
    else:  # grouped: one GEMM per group
        cg, mg = chans // group, m // group
        y = np.concatenate(
            [
                _conv_channels_last(
                    xin[:, g * cg : (g + 1) * cg], w[g * mg : (g + 1) * mg], kernel, strides, dil, begin, end
                )
                for g in range(group)
            ],
            axis=1,
        )
    y = y.reshape((batch, m) + tuple(out_sp))
    if bias is not None:
        y = y + bias.reshape((1, m) + (1,) * sp)
    return [np.ascontiguousarray(y)]


def conv_transpose(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """ONNX ConvTranspose: per-position products scattered (col2im) into the output, then cropped.

    ONNX Runtime computes it when the output size follows from the pads alone (its auto_pad and
    output_shape handling has differed from the spec across versions).
    """
    if n.get("output_shape") is None and _auto_pad(n) in ("NOTSET", "VALID"):
        fast = ortexec.kernel("ConvTranspose", n.attrs, x)
        if fast is not None:
            return [fast]
    xin, w = x[0], x[1]
    bias = x[2] if len(x) > 2 else None
    group = int(n.get("group", 1))
    in_sp = xin.shape[2:]
    kernel = tuple(w.shape[2:])
    sp = len(kernel)
    m = w.shape[1] * group
    strides = list(n.get("strides") or [1] * sp)
    dil = list(n.get("dilations") or [1] * sp)
    out_pad = list(n.get("output_padding") or [0] * sp)
    full = [strides[i] * (in_sp[i] - 1) + (kernel[i] - 1) * dil[i] + 1 + out_pad[i] for i in range(sp)]
    begin, end = _transpose_crop(n, full, in_sp, strides)
    y = _col2im(xin, w, group, strides, dil, full)
    y = _crop_spatial(y, begin, end)
    if bias is not None:
        y = y + bias.reshape((1, m) + (1,) * sp)
    return [np.ascontiguousarray(y)]


def _auto_pad(n: NodeInfo) -> str:
    """The node's auto_pad attribute as text (NOTSET when absent)."""
    auto = n.get("auto_pad", "NOTSET")
    return str(auto.decode() if isinstance(auto, bytes) else auto)


def _transpose_crop(
    n: NodeInfo, full: list[int], in_sp: tuple[int, ...], strides: list[int]
) -> tuple[list[int], list[int]]:
    """Rows to crop at the start and end of each spatial axis of the full ConvTranspose result (negative: pad)."""
    sp = len(full)
    out_shape = n.get("output_shape")
    auto_pad = _auto_pad(n)
    if out_shape is None and auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        pads = list(n.get("pads") or [0] * (2 * sp))
        return pads[:sp], pads[sp:]
    target = list(out_shape)[-sp:] if out_shape is not None else [in_sp[i] * strides[i] for i in range(sp)]
    total = [full[i] - target[i] for i in range(sp)]
    if auto_pad == "SAME_UPPER":
        begin = [t // 2 for t in total]
    else:
        begin = [t - t // 2 for t in total]
    end = [total[i] - begin[i] for i in range(sp)]
    return begin, end


def _col2im(
    xin: np.ndarray, w: np.ndarray, group: int, strides: list[int], dil: list[int], full: list[int]
) -> np.ndarray:
    """The uncropped ConvTranspose result: every input position's products scattered into the output."""
    batch, chans = xin.shape[:2]
    in_sp = xin.shape[2:]
    kernel = tuple(w.shape[2:])
    sp = len(kernel)
    cg, mg = chans // group, w.shape[1]
    xs = xin.reshape(batch, group, cg, -1)
    wg = w.reshape(group, cg, mg, -1)
    t = np.einsum("ngci,gcmk->ngmki", xs, wg, optimize=True)  # (N, G, Mg, K, I)
    t = t.reshape((batch, mg * group, int(np.prod(kernel))) + tuple(in_sp))
    y = np.zeros((batch, mg * group) + tuple(full), dtype=t.dtype)
    for ki, kpos in enumerate(itertools.product(*[range(k) for k in kernel])):
        slc = (slice(None), slice(None)) + tuple(
            slice(kpos[i] * dil[i], kpos[i] * dil[i] + strides[i] * (in_sp[i] - 1) + 1, strides[i])
            for i in range(sp)
        )
        y[slc] += t[:, :, ki]
    return y


def _crop_spatial(y: np.ndarray, begin: list[int], end: list[int]) -> np.ndarray:
    """``y`` cropped by ``begin``/``end`` rows per spatial axis; negative counts add zero rows at that edge."""
    sp = len(begin)
    if min(begin + end) < 0:  # output_shape larger than the full result: zero rows at the edges
        y = np.pad(y, [(0, 0), (0, 0)] + [(max(-b, 0), max(-e, 0)) for b, e in zip(begin, end, strict=True)])
        begin, end = [max(b, 0) for b in begin], [max(e, 0) for e in end]
    full = list(y.shape[2:])
    crop = (slice(None), slice(None)) + tuple(slice(begin[i], full[i] - end[i]) for i in range(sp))
    return y[crop]


KERNELS = {
    "MatMul": matmul,
    "Gemm": gemm,
    "Einsum": einsum,
    "Conv": conv,
    "ConvTranspose": conv_transpose,
}
