from __future__ import annotations

import math

import numpy as np
import pytest

from mpinfer.compare.checks import DEFAULT_CHECKS, Check, parse_checks
from mpinfer.compare.metrics import BINS_PER_DECADE, METRIC_DOCS, LogHistogram, OutputAccumulator
from mpinfer.errors import InvalidInputError


def _batches(seed=0, n=5, shape=(8, 10), noise=0.3):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        b = rng.standard_normal(shape).astype(np.float32)
        c = (b + rng.standard_normal(shape) * noise).astype(np.float16)
        yield b, c


def test_streaming_equals_one_shot():
    acc = OutputAccumulator("y")
    bs, cs = [], []
    for b, c in _batches():
        acc.update(b, c)
        bs.append(b.astype(np.float64))
        cs.append(c.astype(np.float64))
    b, c = np.concatenate(bs), np.concatenate(cs)
    d = np.abs(c - b)
    v = acc.finalize()
    assert v["max_abs"] == pytest.approx(d.max(), rel=1e-12)
    assert v["mean_abs"] == pytest.approx(d.mean(), rel=1e-9)
    cos = (b * c).sum() / math.sqrt((b * b).sum() * (c * c).sum())
    assert v["cosine"] == pytest.approx(cos, rel=1e-12)
    assert v["snr_db"] == pytest.approx(10 * math.log10((b * b).sum() / (d * d).sum()), rel=1e-9)
    tol = 10 ** (1 / BINS_PER_DECADE)
    for key, q in (("median_abs", 50), ("p99_abs", 99)):
        exact = np.percentile(d, q)
        assert exact / tol <= v[key] <= exact * tol, (key, v[key], exact)
    assert v["nan"] == v["inf"] == v["nonfinite"] == 0
    assert v["top1"] == pytest.approx(np.mean(b.argmax(1) == c.argmax(1)))
    top5 = np.argsort(-c, axis=1)[:, :5]
    assert v["top5"] == pytest.approx(np.mean((top5 == b.argmax(1)[:, None]).any(axis=1)))
    assert 0.0 <= v["top1"] <= v["top5"] <= 1.0


def test_histogram_quantiles_never_exceed_the_exact_max():
    # One error value sits inside a histogram bin whose upper edge is above it: p99 once read the edge.
    acc = OutputAccumulator("y")
    b = np.zeros((100, 4), np.float32)
    acc.update(b, b + np.float32(0.001061))
    v = acc.finalize()
    assert v["p99_abs"] <= v["max_abs"] and v["median_abs"] <= v["max_abs"]
    assert v["max_abs"] == pytest.approx(0.001061, rel=1e-6)


def test_top1_detects_swapped_classes_and_labels():
    acc = OutputAccumulator("logits")
    b = np.eye(4, dtype=np.float32)[[0, 1, 2, 3]]
    c = np.eye(4, dtype=np.float32)[[0, 1, 3, 2]]
    acc.update(b, c, labels=np.array([0, 1, 2, 0]))
    v = acc.finalize()
    assert v["top1"] == 0.5
    assert v["top5"] is None  # 4 classes: top-5 does not apply
    assert v["baseline_accuracy"] == 0.75 and v["accuracy"] == 0.5
    assert v["accuracy_drop"] == pytest.approx(0.25)


def test_nonfinite_candidate_fails_everything():
    acc = OutputAccumulator("y")
    b = np.ones((4, 3), np.float32)
    c = b.copy()
    c[0, 0] = np.nan
    c[1, 1] = np.inf
    acc.update(b, c)
    v = acc.finalize()
    assert v["nan"] == 1 and v["inf"] == 1 and v["nonfinite"] == 2
    assert v["max_abs"] == math.inf and math.isnan(v["cosine"]) and v["snr_db"] == -math.inf
    assert Check("cosine", ">=", 0.5).evaluate(v) is False


def test_non_classifier_has_no_topk():
    acc = OutputAccumulator("y")
    acc.update(np.ones((2, 3, 4, 5), np.float32), np.ones((2, 3, 4, 5), np.float32))
    v = acc.finalize()
    assert v["top1"] is None and v["cosine"] == 1.0 and v["max_abs"] == 0.0 and v["snr_db"] == math.inf
    assert Check("top1", ">=", 0.99).evaluate(v) is None


def test_histogram_roundtrip_and_quantiles():
    h = LogHistogram()
    values = np.array([0.0, 0.0, 1e-3, 1e-2, 1e-1, 1.0, 1e20])
    h.add(values, infinite=1)
    assert h.total == 8 and h.zeros == 2 and h.huge == 2
    h2 = LogHistogram.from_dict(h.to_dict())
    assert h2.total == h.total and np.array_equal(h2.counts, h.counts)
    assert h.quantile(0.0) == 0.0
    assert h.quantile(1.0) == math.inf


def test_parse_checks():
    checks = parse_checks("cosine>=0.9999, top1>=0.999,max_abs<=0.01,snr>20")
    assert [str(c) for c in checks] == ["cosine>=0.9999", "top1>=0.999", "max_abs<=0.01", "snr_db>20"]
    assert [str(c) for c in parse_checks(None)] == DEFAULT_CHECKS.split(",")


def test_unknown_check_lists_valid_names():
    with pytest.raises(InvalidInputError, match="unknown metric 'cosin'") as info:
        parse_checks("cosin>=0.9")
    for name in METRIC_DOCS:
        assert name in str(info.value)


@pytest.mark.parametrize("text", ["cosine=>0.9", "cosine>=abc", "cosine", ","])
def test_malformed_check(text):
    with pytest.raises(InvalidInputError, match="Check"):
        parse_checks(text)


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

    from mpinfer.compare.divergence import TensorAcc

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
    assert acc.error == pytest.approx(err, rel=1e-5) and acc.max_abs == pytest.approx(top, rel=1e-6)

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
