"""Tolerances derived from the floating-point format, for values that kernels may compute in another order.

Two correct float computations of the same value need not agree bit for bit: onnxruntime, torch and BLAS
split sums across threads, pick kernels by CPU features and shapes, block and vectorise reductions, and fuse
multiply-adds. A test comparing such values must allow what rounding allows, and no more, or it flakes (or
hides bugs). The bound used here (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1
and §4.2): with unit roundoff ``u = eps / 2`` of the format (``eps`` from ``finfo``: 2**-23 for float32), a sum
of ``n`` terms ``t_i`` evaluated in *any* order, products included (a dot product, one output of a MatMul or a
Conv, with or without FMA), satisfies

    |fl(sum t_i) - sum t_i| <= gamma_n * sum |t_i|,     gamma_n = n u / (1 - n u).

Two evaluations (two thread counts, two libraries) are each within that of the exact value, so they differ by
at most ``2 gamma_n sum|t_i|``: the ulp of the format, at the magnitude of the terms, times the reduction
length. ``magnitude`` is ``sum|t_i|`` (or a bound on it); where the terms do not cancel (all of one sign) it is
simply ``|value|``. A computation of ``stages`` such reductions in a chain (layers of a network whose
activations stay at about ``magnitude`` and whose other steps are 1-Lipschitz: ReLU, GELU, softmax, a
LayerNorm whose inputs are not a large common offset plus a small spread) adds the stages' bounds.

This is a worst-case bound, so a test using it cannot flake on arithmetic order; rounding errors usually
partly cancel (typically ``sqrt(n) u`` rather than ``n u``), so the bound is looser than what is observed. A
test should keep the bound small against the change it exists to detect (say so next to the assert).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np


def eps(dtype: Any = np.float32) -> float:
    """Machine epsilon of ``dtype`` (the gap from 1.0 to the next value): 2**-23 float32, 2**-10 float16."""
    return float(ml_dtypes.finfo(np.dtype(dtype)).eps)


def gamma(n: int, dtype: Any = np.float32) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative bound of an ``n``-term sum in ``dtype``."""
    nu = max(int(n), 1) * eps(dtype) / 2
    assert nu < 1, f"a {n}-term sum in {np.dtype(dtype)} has no error bound (n u >= 1)"
    return nu / (1 - nu)


def reorder_atol(dtype: Any = np.float32, *, n: int = 1, magnitude: float = 1.0, stages: int = 1) -> float:
    """Largest difference two evaluation orders can make to a value (see the module docstring).

    Args:
        dtype: The format the arithmetic runs in (float32 for FP32 kernels, float16 for FP16 ones).
        n: The reduction length (the inner dimension of a MatMul, ``C_in * kH * kW`` of a Conv, the axis
            length of a ReduceSum or LayerNorm); 1 for elementwise results, which differ only by their own
            final rounding.
        magnitude: ``sum |t_i|`` of the reduction, or a bound on it (``|value|`` when terms do not cancel).
        stages: How many such reductions are chained (their bounds add).

    Returns:
        The absolute tolerance: ``stages * (2 gamma_n + eps) * magnitude`` (``eps``: each side's final
        rounding to ``dtype``, half an ulp each).
    """
    return stages * (2 * gamma(n, dtype) + eps(dtype)) * float(magnitude)


def assert_reorder_close(
    actual: Any, desired: Any, dtype: Any = np.float32, *, n: int = 1, magnitude: float | None = None,
    stages: int = 1, err_msg: str = "",
) -> float:
    """``assert_allclose`` with :func:`reorder_atol` as the tolerance; returns the tolerance used.

    ``magnitude`` defaults to the largest ``|desired|`` (right when the reduction's terms do not cancel).
    """
    want = np.asarray(desired, np.float64)
    if magnitude is None:
        finite = np.abs(want[np.isfinite(want)])
        magnitude = float(finite.max()) if finite.size else 0.0
    atol = reorder_atol(dtype, n=n, magnitude=magnitude, stages=stages)
    np.testing.assert_allclose(np.asarray(actual, np.float64), want, rtol=0, atol=atol, err_msg=err_msg)
    return atol
