"""The divergence pass's tensor accumulator against a float64 reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.tolerances import gamma


def _reference_error(pairs):
    """Relative L2 error and max abs of finite pairs in float64, as TensorAcc's masked path computes them."""
    d2 = b2 = top = 0.0
    bad = 0
    for b, c in pairs:
        b64, c64 = np.asarray(b, np.float64).ravel(), np.asarray(c, np.float64).ravel()
        both = np.isfinite(b64) & np.isfinite(c64)
        bad += int(np.count_nonzero(np.isfinite(b64) & ~np.isfinite(c64)))
        d = c64[both] - b64[both]
        d2, b2, top = d2 + float(d @ d), b2 + float(b64[both] @ b64[both]), max(top, float(np.abs(d).max(initial=0.0)))
    return (math.inf if bad else math.sqrt(d2 / b2)), top


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_divergence_accumulator_float32_path_matches_float64(dtype):
    """Finite tensors take the float32 passes; the numbers are float64's to float32 precision, and a NaN/inf
    (or a huge value whose square overflows float32) goes through the masked float64 path."""
    import ml_dtypes

    from mpinfer.compare.tensoracc import TensorAcc

    rng = np.random.default_rng(0)
    low = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    pairs = []
    for scale in (1.0, 3e20, 1e-30):
        b = (rng.standard_normal(10_000) * scale).astype(np.float32)
        with np.errstate(over="ignore"):  # 3e20 is inf in FP16: that candidate goes the masked way
            pairs.append((b, b.astype(low)))
    acc = TensorAcc()
    for b, c in pairs:
        acc.update(b, c)
    err, top = _reference_error(pairs)
    # sums of squares are float32 BLAS dots of 10,000 positive terms, in the order the CPU's kernel picks: each
    # within gamma_n of float64's, and so is the square root of their ratio (a dropped pair moves it by O(1))
    assert acc.error == pytest.approx(err, rel=gamma(10_000)) and acc.max_abs == pytest.approx(top, rel=1e-6)

    b = rng.standard_normal(100).astype(np.float32)
    c = b.copy()
    c[3] = np.nan
    acc = TensorAcc()
    acc.update(b, c)
    assert acc.error == math.inf and acc.nonfinite == 1
    c = b.astype(np.float32)
    c[5] += 0.5
    b[7] = np.inf  # the baseline's own inf is skipped, not counted against the candidate
    c[7] = np.inf
    acc = TensorAcc()
    acc.update(b, c)
    assert acc.nonfinite == 0 and acc.max_abs == pytest.approx(0.5)
