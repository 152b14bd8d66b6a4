"""Reductions, softmax and normalisations, rounded after each elementary step in low precision.

Sums accumulate in float32 and are rounded once (the accumulator of a GPU reduction is float32; its result is
stored in the low dtype). Element-wise sub-steps (x - mean, the square, + eps, sqrt, the divide, the scale
and shift) are each rounded, so a ReduceSumSquare over values near 300 overflows FP16 exactly as a FP16
kernel storing those intermediates would. LayerNormalization and RMSNormalization honour ``stash_type``: with
the default 1 their statistics and the normalized value are float32 (as the ONNX definition and the fused GPU
kernels compute them) and only the normalized value, the scale and the shift are rounded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpinfer.precision.emulator.kernels import ortexec
from mpinfer.precision.emulator.kernels.numerics import NodeInfo, Numerics, UnsupportedVariant
from mpinfer.specs import Precision


def _axes(n: NodeInfo, x: list[Any], ndim: int) -> tuple[int, ...] | None:
    """Reduction axes from the attribute or the second input; None means "no-op" (noop_with_empty_axes)."""
    axes = None
    if len(x) > 1 and x[1] is not None and x[1].size:
        axes = [int(a) for a in np.asarray(x[1]).ravel()]
    elif n.get("axes") is not None:
        axes = list(n.get("axes"))
    if not axes:
        if n.get("noop_with_empty_axes", 0):
            return None
        return tuple(range(ndim))
    return tuple(sorted(a % ndim for a in axes)) if ndim else ()


def _reduce(
    step: Callable[[np.ndarray, tuple[int, ...], Numerics], np.ndarray],
) -> Callable[..., list[np.ndarray]]:
    def k(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
        v = x[0]
        axes = _axes(n, x, v.ndim)
        if axes is None:
            return [v]
        if v.size == 0:
            raise UnsupportedVariant("reduction over an empty tensor")
        keep = bool(n.get("keepdims", 1))
        out = step(v, axes, num)
        if not keep:
            out = np.squeeze(out, axis=axes) if axes else out
        return [np.asarray(out)]

    return k


def _sum(v: np.ndarray, axes: tuple[int, ...], num: Numerics) -> np.ndarray:
    return np.sum(v, axis=axes, keepdims=True)


def _mean(v: np.ndarray, axes: tuple[int, ...], num: Numerics) -> np.ndarray:
    return (
        np.mean(v, axis=axes, keepdims=True).astype(v.dtype, copy=False)
        if v.dtype.kind == "f"
        else (np.sum(v, axis=axes, keepdims=True) // max(1, int(np.prod([v.shape[a] for a in axes]))))
    )


def _extreme(op: str, fallback: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """ReduceMax/ReduceMin: the largest/smallest value, NaN when the reduced values hold one.

    ONNX Runtime's float32 kernel where it runs (a NaN it drops is put back), so that the cast graph
    (:mod:`castgraph`), which computes it so too, gives the same bits: the values are numpy's, and so is every
    NaN; only the sign of a zero result, when the reduced values hold both zeros, is ONNX Runtime's choice (numpy's
    depends on its SIMD width and the length's remainder).
    """

    def step(v: np.ndarray, axes: tuple[int, ...], num: Numerics) -> np.ndarray:
        fast = ortexec.kernel(op, {"axes": list(axes), "keepdims": 1}, [v]) if v.dtype == np.float32 else None
        if fast is None:
            return fallback(v, axis=axes, keepdims=True)
        nan = np.isnan(v).any(axis=axes, keepdims=True)
        return np.where(nan, np.float32(np.nan), fast) if nan.any() else fast

    return step


def _prod(v: np.ndarray, axes: tuple[int, ...], num: Numerics) -> np.ndarray:
    return np.prod(v, axis=axes, keepdims=True)


def _sum_square(v: np.ndarray, axes: tuple[int, ...], num: Numerics) -> np.ndarray:
    return np.sum(num.r(v * v), axis=axes, keepdims=True)


def _l1(v: np.ndarray, axes: tuple[int, ...], num: Numerics) -> np.ndarray:
    return np.sum(np.abs(v), axis=axes, keepdims=True)


def _l2(v: np.ndarray, axes: tuple[int, ...], num: Numerics) -> np.ndarray:
    return np.sqrt(num.r(_sum_square(v, axes, num)))


def _log_sum(v: np.ndarray, axes: tuple[int, ...], num: Numerics) -> np.ndarray:
    return np.log(num.r(np.sum(v, axis=axes, keepdims=True)))


def _log_sum_exp(v: np.ndarray, axes: tuple[int, ...], num: Numerics) -> np.ndarray:
    m = np.max(v, axis=axes, keepdims=True)
    m = np.where(np.isfinite(m), m, 0).astype(v.dtype, copy=False)
    s = num.r(np.sum(num.r(np.exp(num.r(v - m))), axis=axes, keepdims=True))
    return num.r(np.log(s)) + m


def _softmax_axes(n: NodeInfo, v: np.ndarray) -> tuple[np.ndarray, tuple[int, ...], tuple[int, ...]]:
    """(2-D view for opset < 13 coercion or the array itself, reduction axes, original shape)."""
    if n.opset >= 13:
        return v, (int(n.get("axis", -1)) % v.ndim,), v.shape
    axis = int(n.get("axis", 1)) % max(v.ndim, 1)
    lead = int(np.prod(v.shape[:axis]))
    return v.reshape(lead, -1), (1,), v.shape


def softmax(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """Softmax: max, x - max, exp, sum, divide; each step rounded.

    The max, the exp and the sum are ONNX Runtime's float32 kernels (ReduceMax, Exp, ReduceL1 of the non-negative
    exponentials) where it runs them, so the cast graph (:mod:`castgraph`) writes the same steps and gets the
    same bits; numpy's where it does not.
    """
    v, axes, shape = _softmax_axes(n, x[0])
    r = num.r
    reduce = {"axes": list(axes), "keepdims": 1}
    top = ortexec.kernel("ReduceMax", reduce, [v])
    d = r(v - (np.max(v, axis=axes, keepdims=True) if top is None else top))
    exp = ortexec.kernel("Exp", {}, [d])
    e = r(np.exp(d) if exp is None else exp)
    total = ortexec.kernel("ReduceL1", reduce, [e])
    s = r(np.sum(e, axis=axes, keepdims=True) if total is None else total)
    return [(e / s).reshape(shape)]


def log_softmax(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """LogSoftmax: x - max - log(sum(exp(x - max))), each step rounded."""
    v, axes, shape = _softmax_axes(n, x[0])
    r = num.r
    d = r(v - np.max(v, axis=axes, keepdims=True))
    s = r(np.sum(r(np.exp(d)), axis=axes, keepdims=True))
    return [(d - r(np.log(s))).reshape(shape)]


def _normalize(v: np.ndarray, axes: tuple[int, ...], eps: float, num: Numerics) -> tuple[np.ndarray, ...]:
    """(x - mean) / sqrt(var + eps) in rounded steps; returns (normalised, mean, 1/std)."""
    r = num.r
    mean = r(np.mean(v, axis=axes, keepdims=True, dtype=np.float32))
    d = r(v - mean)
    var = r(np.mean(r(d * d), axis=axes, keepdims=True, dtype=np.float32))
    std = r(np.sqrt(r(var + np.float32(eps))))
    return r(d / std), mean, r(np.float32(1.0) / std)


def _stash(n: NodeInfo, num: Numerics) -> Numerics:
    """The numerics of a normalization's statistics: float32 when ``stash_type`` is 1 (the default), else the node's.

    ONNX's LayerNormalization and RMSNormalization cast the input to ``stash_type`` and compute the mean, the
    variance, the inverse deviation and the normalized value in it; only that result is cast back to the input
    type (then scaled and shifted in it).
    """
    return Numerics(Precision.FP32) if num.low and int(n.get("stash_type", 1)) == 1 else num


def layer_norm(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """LayerNormalization over axes [axis, rank): statistics in ``stash_type``, scale and shift in the node's type."""
    v = x[0]
    axis = int(n.get("axis", -1)) % v.ndim
    axes = tuple(range(axis, v.ndim))
    y, mean, inv = _normalize(v, axes, n.get("epsilon", 1e-5), _stash(n, num))
    y = num.r(y)
    if len(x) > 1 and x[1] is not None:
        y = num.r(y * x[1])
    if len(x) > 2 and x[2] is not None:
        y = y + x[2]
    return [y.astype(v.dtype, copy=False), mean, inv]


def rms_norm(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """RMSNormalization (opset 23): x / sqrt(mean(x^2) + eps) in ``stash_type``, then * scale in the node's type."""
    v = x[0]
    axis = int(n.get("axis", -1)) % v.ndim
    r = _stash(n, num).r
    ms = r(np.mean(r(v * v), axis=tuple(range(axis, v.ndim)), keepdims=True, dtype=np.float32))
    rms = r(np.sqrt(r(ms + np.float32(n.get("epsilon", 1e-5)))))
    return [num.r(num.r(r(v / rms)) * x[1]).astype(v.dtype, copy=False)]


def skip_layer_norm(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """com.microsoft SkipLayerNormalization: s = input + skip (+ bias), then LayerNorm(s) over the last axis.

    The sum is rounded (it is also the optional 4th output); mean and variance are float32 as in ONNX Runtime's
    kernels. Outputs: y, mean, inverse standard deviation, the sum.
    """
    v, skip, gamma = x[0], x[1], x[2]
    beta = x[3] if len(x) > 3 else None
    bias = x[4] if len(x) > 4 else None
    total = num.r(v + skip)
    if bias is not None:
        total = num.r(total + bias)
    stats = Numerics(Precision.FP32) if num.low else num
    y, mean, inv = _normalize(total, (total.ndim - 1,), n.get("epsilon", 1e-12), stats)
    y = num.r(num.r(y) * gamma)
    if beta is not None:
        y = y + beta
    return [y.astype(v.dtype, copy=False), mean, inv, total.astype(v.dtype, copy=False)]


def fold_batch_norm(
    scale: np.ndarray, bias: np.ndarray, mean: np.ndarray, var: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """BatchNorm's scale and shift folded in float32: ``a = scale / sqrt(var + eps)``, ``b = bias - mean * a``."""
    f = np.float32
    a = scale.astype(f) / np.sqrt(var.astype(f) + f(eps))
    return a, bias.astype(f) - mean.astype(f) * a


def batch_norm(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """BatchNormalization (inference): folded to y = x * a + b, a and b computed in FP32, then rounded."""
    if n.get("training_mode", 0) or len(n.node.output) > 1:
        raise UnsupportedVariant("BatchNormalization in training mode")
    v, scale, bias, mean, var = x[:5]
    a, b = fold_batch_norm(scale, bias, mean, var, n.get("epsilon", 1e-5))
    shape = (1, -1) + (1,) * (v.ndim - 2)
    a, b = num.r(a.reshape(shape)), num.r(b.reshape(shape))
    return [(num.r(v * a) + b).astype(v.dtype, copy=False)]


def instance_norm(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """InstanceNormalization over the spatial axes of each (sample, channel)."""
    v, scale, bias = x
    shape = (1, -1) + (1,) * (v.ndim - 2)
    y, _, _ = _normalize(v, tuple(range(2, v.ndim)), n.get("epsilon", 1e-5), num)
    return [(num.r(y * scale.reshape(shape)) + bias.reshape(shape)).astype(v.dtype, copy=False)]


def group_norm(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """GroupNormalization (opset 18 per-group or opset 21 per-channel scale and bias)."""
    v, scale, bias = x
    groups = int(n.get("num_groups"))
    batch, chans = v.shape[:2]
    g = v.reshape(batch, groups, -1)
    y, _, _ = _normalize(g, (2,), n.get("epsilon", 1e-5), num)
    y = y.reshape(v.shape)
    if scale.size != chans:  # opset 18: one scale per group
        scale = np.repeat(scale, chans // groups)
        bias = np.repeat(bias, chans // groups)
    shape = (1, -1) + (1,) * (v.ndim - 2)
    return [(num.r(y * scale.reshape(shape)) + bias.reshape(shape)).astype(v.dtype, copy=False)]


def mean_variance_norm(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """MeanVarianceNormalization: (x - mean) / sqrt(var + 1e-9) over ``axes`` (default N, H, W)."""
    v = x[0]
    axes = tuple(a % v.ndim for a in (n.get("axes") or (0, 2, 3)))
    y, _, _ = _normalize(v, axes, 1e-9, num)
    return [y.astype(v.dtype, copy=False)]


def cumsum(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    """CumSum with exclusive/reverse; float32 accumulation."""
    v = x[0]
    axis = int(np.asarray(x[1]).ravel()[0]) % v.ndim
    if n.get("reverse", 0):
        v = np.flip(v, axis)
    out = np.cumsum(v, axis=axis, dtype=v.dtype)
    if n.get("exclusive", 0):
        out = np.concatenate(
            [
                np.zeros_like(np.take(out, [0], axis=axis)),
                np.take(out, range(out.shape[axis] - 1), axis=axis),
            ],
            axis=axis,
        )
    if n.get("reverse", 0):
        out = np.flip(out, axis)
    return [np.ascontiguousarray(out)]


KERNELS = {
    "ReduceSum": _reduce(_sum),
    "ReduceMean": _reduce(_mean),
    "ReduceMax": _reduce(_extreme("ReduceMax", np.max)),
    "ReduceMin": _reduce(_extreme("ReduceMin", np.min)),
    "ReduceProd": _reduce(_prod),
    "ReduceSumSquare": _reduce(_sum_square),
    "ReduceL1": _reduce(_l1),
    "ReduceL2": _reduce(_l2),
    "ReduceLogSum": _reduce(_log_sum),
    "ReduceLogSumExp": _reduce(_log_sum_exp),
    "Softmax": softmax,
    "LogSoftmax": log_softmax,
    "LayerNormalization": layer_norm,
    "com.microsoft::SkipLayerNormalization": skip_layer_norm,
    "RMSNormalization": rms_norm,
    "BatchNormalization": batch_norm,
    "InstanceNormalization": instance_norm,
    "GroupNormalization": group_norm,
    "CumSum": cumsum,
    "MeanVarianceNormalization": mean_variance_norm,
}
