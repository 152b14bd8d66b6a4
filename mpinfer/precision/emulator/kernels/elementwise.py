"""Elementwise kernels: arithmetic, activations, comparisons and logic.

A single elementwise op is one elementary step: inputs arrive rounded, the function is evaluated in
float32 and the output is rounded once (what a GPU kernel that loads and stores FP16 does). Composite
activations (Gelu, HardSwish, Softplus, Mish, ...) round each of their sub-steps, so they behave like the
same function exported as separate nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpinfer.precision.emulator.kernels import ortexec
from mpinfer.precision.emulator.kernels.numerics import SQRT_HALF, NodeInfo, Numerics, erf

Kernel = Callable[[NodeInfo, Numerics, list[Any]], list[np.ndarray]]


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Kernel:
    def k(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
        return [np.asarray(fn(x[0], x[1]))]

    return k


def _unary(fn: Callable[[np.ndarray], np.ndarray]) -> Kernel:
    def k(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
        v = x[0]
        out = np.asarray(fn(v))
        if out.dtype.kind == "f" and v.dtype.kind == "f" and out.dtype != v.dtype:
            out = out.astype(v.dtype, copy=False)
        return [out]

    return k


def _ort_unary(op: str, fn: Callable[[np.ndarray], np.ndarray]) -> Kernel:
    """A unary function evaluated by ONNX Runtime's float32 kernel (an accurate float32 value, like numpy's).

    The cast graph (:mod:`castgraph`) then computes the emulator's bits; numpy's ``fn`` where ONNX Runtime cannot.
    """
    return ortexec.first(op, attrs=False)(_unary(fn))


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "iu":
        q = np.trunc(np.true_divide(a, b))  # ONNX integer Div truncates toward zero
        return q.astype(np.result_type(a, b))
    return np.true_divide(a, b)


def _pow(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    a, b = x
    if a.dtype.kind == "f":
        return [np.power(a, b.astype(a.dtype, copy=False)).astype(a.dtype, copy=False)]
    return [np.power(a.astype(np.float64), b).astype(a.dtype, copy=False)]


def _mod(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    if n.get("fmod", 0):
        return [np.fmod(x[0], x[1])]
    return [np.mod(x[0], x[1])]


def _variadic(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Kernel:
    def k(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
        acc = x[0]
        for y in x[1:]:
            acc = num.r(fn(acc, y))
        return [np.asarray(acc)]

    return k


def _mean(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    acc = x[0]
    for y in x[1:]:
        acc = num.r(acc + y)
    return [np.asarray(acc / np.asarray(len(x), dtype=acc.dtype))]


def _sigmoid(v: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(v))
    return np.where(v >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(v.dtype, copy=False)


def _leaky(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    v, alpha = x[0], n.get("alpha", 0.01)
    return [np.where(v >= 0, v, v * np.asarray(num.r(alpha), v.dtype))]


def _prelu(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    v, slope = x
    return [np.where(v >= 0, v, v * slope).astype(v.dtype, copy=False)]


def _elu(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    v, alpha = x[0], n.get("alpha", 1.0)
    return [np.where(v > 0, v, num.r(alpha * num.r(np.expm1(v)))).astype(v.dtype, copy=False)]


def _selu(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    v = x[0]
    alpha, gamma = n.get("alpha", 1.67326319217681884765625), n.get("gamma", 1.05070102214813232421875)
    inner = np.where(v > 0, v, num.r(alpha * num.r(np.expm1(v))))
    return [(gamma * inner).astype(v.dtype, copy=False)]


def _clip(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    v = x[0]
    if n.opset < 11:
        lo, hi = n.get("min", None), n.get("max", None)
    else:
        lo = x[1] if len(x) > 1 and x[1] is not None else None
        hi = x[2] if len(x) > 2 and x[2] is not None else None
    if lo is not None:
        v = np.maximum(v, np.asarray(lo, dtype=v.dtype))
    if hi is not None:
        v = np.minimum(v, np.asarray(hi, dtype=v.dtype))
    return [v]


def _hard_sigmoid(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    alpha, beta = n.get("alpha", 0.2), n.get("beta", 0.5)
    v = num.r(num.r(x[0] * np.float32(alpha)) + np.float32(beta))
    return [np.clip(v, 0, 1).astype(x[0].dtype, copy=False)]


def _hard_swish(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    v = x[0]
    hs = np.clip(num.r(num.r(v * np.float32(1.0 / 6.0)) + np.float32(0.5)), 0, 1)
    return [(v * hs).astype(v.dtype, copy=False)]


def _gelu(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    v = x[0]
    r = num.r
    if n.get("approximate", "none") == "tanh":
        cube = r(r(v * v) * v)
        inner = r(r(v + r(np.float32(0.044715) * cube)) * np.float32(np.sqrt(2.0 / np.pi)))
        one_plus = r(np.float32(1.0) + r(np.tanh(inner)))
    else:
        one_plus = r(np.float32(1.0) + r(erf(r(v * np.float32(SQRT_HALF)))))
    return [(r(v * np.float32(0.5)) * one_plus).astype(v.dtype, copy=False)]


def _swish(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    v = x[0]
    gate = num.r(_sigmoid(num.r(v * np.float32(n.get("alpha", 1.0)))))
    return [(v * gate).astype(v.dtype, copy=False)]


def _softplus(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    v = x[0]
    # Stable form max(x, 0) + log1p(exp(-|x|)): no intermediate overflow, as a real kernel would do it.
    tail = num.r(np.log1p(num.r(np.exp(-np.abs(v)))))
    return [(np.maximum(v, 0) + tail).astype(v.dtype, copy=False)]


def _mish(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    sp = _softplus(n, num, x)[0]
    return [(x[0] * num.r(np.tanh(sp))).astype(x[0].dtype, copy=False)]


def _softsign(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    v = x[0]
    return [(v / num.r(1 + np.abs(v))).astype(v.dtype, copy=False)]


def _thresholded_relu(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    v = x[0]
    return [np.where(v > n.get("alpha", 1.0), v, 0).astype(v.dtype, copy=False)]


def _where(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    return [np.where(x[0], x[1], x[2])]


def _not(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    return [np.logical_not(x[0])]


def _isinf(n: NodeInfo, num: Numerics, x: list[Any]) -> list[np.ndarray]:
    v = x[0]
    pos, neg = n.get("detect_positive", 1), n.get("detect_negative", 1)
    return [
        np.isinf(v)
        & (
            (v > 0)
            if pos and not neg
            else (v < 0)
            if neg and not pos
            else np.ones_like(v, bool)
            if pos and neg
            else np.zeros_like(v, bool)
        )
    ]


def _round(v: np.ndarray) -> np.ndarray:
    return np.round(v)  # numpy rounds half to even, as ONNX Round does


KERNELS: dict[str, Kernel] = {
    "Add": _binary(np.add),
    "Sub": _binary(np.subtract),
    "Mul": _binary(np.multiply),
    "Div": _binary(_div),
    "Pow": _pow,
    "Mod": _mod,
    "Max": _variadic(np.maximum),
    "Min": _variadic(np.minimum),
    "Sum": _variadic(np.add),
    "Mean": _mean,
    "Sqrt": _unary(np.sqrt),
    "Exp": _unary(np.exp),
    "Log": _unary(np.log),
    "Erf": _unary(erf),
    "Tanh": _ort_unary("Tanh", np.tanh),
    "Sigmoid": _ort_unary("Sigmoid", _sigmoid),
    "Relu": _unary(lambda v: np.maximum(v, 0)),
    "Neg": _unary(np.negative),
    "Abs": _unary(np.abs),
    "Reciprocal": _unary(np.reciprocal),
    "Floor": _unary(np.floor),
    "Ceil": _unary(np.ceil),
    "Round": _unary(_round),
    "Sign": _unary(np.sign),
    "Sin": _unary(np.sin),
    "Cos": _unary(np.cos),
    "Tan": _unary(np.tan),
    "Atan": _unary(np.arctan),
    "Asin": _unary(np.arcsin),
    "Acos": _unary(np.arccos),
    "Sinh": _unary(np.sinh),
    "Cosh": _unary(np.cosh),
    "LeakyRelu": _leaky,
    "PRelu": _prelu,
    "Elu": _elu,
    "Selu": _selu,
    "Clip": _clip,
    "HardSigmoid": _hard_sigmoid,
    "HardSwish": _hard_swish,
    "Gelu": _gelu,
    "Softplus": _softplus,
    "Swish": _swish,
    "Softsign": _softsign,
    "Mish": _mish,
    "ThresholdedRelu": _thresholded_relu,
    "Where": _where,
    "Equal": _binary(np.equal),
    "Less": _binary(np.less),
    "LessOrEqual": _binary(np.less_equal),
    "Greater": _binary(np.greater),
    "GreaterOrEqual": _binary(np.greater_equal),
    "And": _binary(np.logical_and),
    "Or": _binary(np.logical_or),
    "Xor": _binary(np.logical_xor),
    "Not": _not,
    "IsNaN": _unary(lambda v: np.isnan(v)),
    "IsInf": _isinf,
    "BitwiseAnd": _binary(np.bitwise_and),
    "BitwiseOr": _binary(np.bitwise_or),
    "BitwiseXor": _binary(np.bitwise_xor),
}
