"""The metrics core's chunked path for float32/float16 outputs (mpinfer.errorsums) against float64 references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpinfer import errorsums
from mpinfer.histogram import BINS_PER_DECADE, HI_DECADE, LO_DECADE, LogHistogram
from mpinfer.metrics import REL_EPS, OutputAccumulator
from tests.tolerances import gamma

# Shapes that cut the data every way the chunks do: many samples per chunk, a chunk ending inside the samples,
# samples longer than a chunk (their sums add up over chunks), a rank-1 output (one value per sample).
SHAPES = [(7, 3, 5), (6, errorsums.CHUNK // 4 + 3), (2, 2 * errorsums.CHUNK + 11), (9,)]


def _pair(shape: tuple[int, ...], seed: int, dtype: type = np.float32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    b = (rng.standard_normal(shape) * 3).astype(dtype)
    c = (b + rng.standard_normal(shape) * 0.01).astype(dtype)
    b.flat[::13] = 0  # exact zeros in the baseline (relative error's REL_EPS) and equal values (zero errors)
    c.flat[::17] = b.flat[::17]
    return b, c


def _cosine(x: np.ndarray, y: np.ndarray) -> float:
    """Cosine of two vectors: 1 when both are zero, 0 when one is (docs/compare.md)."""
    xx, yy = float(np.dot(x, x)), float(np.dot(y, y))
    if xx == 0 or yy == 0:
        return 1.0 if xx == yy == 0 else 0.0
    return float(np.dot(x, y)) / math.sqrt(xx * yy)


def _reference(bs: list[np.ndarray], cs: list[np.ndarray]) -> dict[str, float]:
    """The figures of docs/compare.md straight from their definitions, in float64 over all batches at once."""
    b = np.concatenate([x.astype(np.float64).reshape(len(x), -1) for x in bs])
    c = np.concatenate([x.astype(np.float64).reshape(len(x), -1) for x in cs])
    d = c - b
    a, rel = np.abs(d), np.abs(d) / (np.abs(b) + REL_EPS)
    per = [_cosine(x, y) for x, y in zip(b, c, strict=True)]
    return {
        "max_abs": float(a.max()), "mean_abs": float(a.mean()), "max_rel": float(rel.max()),
        "mean_rel": float(rel.mean()), "rel_l2": math.sqrt(float((d * d).sum()) / float((b * b).sum())),
        "cosine": float((b * c).sum() / math.sqrt(float((b * b).sum()) * float((c * c).sum()))),
        "cosine_min": min(per), "range_err": float(a.max()) / float(b.max() - b.min()),
        "snr_db": 10 * math.log10(float((b * b).sum()) / float((d * d).sum())),
    }  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_figures_match_float64_definitions(shape):
    acc = OutputAccumulator("y")
    bs, cs = zip(*[_pair(shape, seed) for seed in range(3)], strict=True)
    for b, c in zip(bs, cs, strict=True):
        acc.update(b, c)
    got, want = acc.finalize(), _reference(list(bs), list(cs))
    n = sum(x.size for x in bs)
    # Every figure is a ratio of float64 sums of non-negative terms (or of the per-sample dots, whose terms
    # b*c are mostly positive here: c is b plus 0.3 % noise), each within gamma_n of the exact sum whichever
    # order adds it: a few gamma_n relative, far above float64 noise and far below any float32 difference.
    rtol = 8 * gamma(n, np.float64)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rtol, abs=1e-300), key
    assert got["nonfinite"] == 0 and got["nan"] == 0 and got["inf"] == 0


@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_histograms_are_the_general_paths(shape):
    """The median/p99 histograms bin every error as LogHistogram.add does on the float64 errors."""
    acc = OutputAccumulator("y")
    h_abs, h_rel = LogHistogram(), LogHistogram()
    for seed in range(2):
        b, c = _pair(shape, seed)
        if seed:  # magnitudes from 1e-14 to 1e14: errors in the tiny and huge buckets too
            scale = (10.0 ** np.random.default_rng(seed).uniform(-14, 14, b.shape)).astype(np.float32)
            b, c = b * scale, c * scale
        acc.update(b, c)
        d = np.abs(c.astype(np.float64) - b.astype(np.float64))
        h_abs.add(d)
        h_rel.add(d / (np.abs(b.astype(np.float64)) + REL_EPS))
    for got, want in ((acc.hist_abs, h_abs), (acc.hist_rel, h_rel)):
        assert (got.zeros, got.tiny, got.huge) == (want.zeros, want.tiny, want.huge)
        assert np.array_equal(got.counts, want.counts)
    assert acc.hist_abs.zeros > 0  # (the equal values)
    if len(shape) > 1 and shape[-1] > 100:  # (enough values to reach both ends)
        assert acc.hist_abs.tiny > 0 and acc.hist_abs.huge > 0


def test_error_sums_refuses_nonfinite_and_accumulator_falls_back():
    b, c = _pair((4, 50), 0)
    c[1, 3], c[2, 0] = np.nan, np.inf
    assert errorsums.error_sums(b.reshape(4, -1), c.reshape(4, -1), REL_EPS, True) is None
    fast, general = OutputAccumulator("y"), OutputAccumulator("y")
    fast.update(b, c)
    general.update(b.astype(np.float64), c.astype(np.float64))  # float64: the general path
    got, want = fast.finalize(), general.finalize()
    assert got["nonfinite"] == want["nonfinite"] == 2
    assert got["nan"] == 1 and got["inf"] == 1
    assert got["cosine_min"] == -1.0 and got["max_abs"] == math.inf
    assert got == want


def test_float16_candidate_and_empty_samples():
    b, c = _pair((5, 40), 1)
    acc, ref = OutputAccumulator("y"), OutputAccumulator("y")
    acc.update(b, c.astype(np.float16))
    ref.update(b.astype(np.float64), c.astype(np.float16).astype(np.float64))
    got, want = acc.finalize(), ref.finalize()
    for key in ("max_abs", "max_rel", "range_err", "mean_abs", "cosine", "cosine_min", "rel_l2"):
        assert got[key] == pytest.approx(want[key], rel=8 * gamma(b.size, np.float64)), key
    empty = OutputAccumulator("e")
    empty.update(np.zeros((3, 0), np.float32), np.zeros((3, 0), np.float32))
    assert empty.finalize()["cosine_min"] is None and empty.finalize()["max_abs"] is None  # unmeasured, not 1


def test_the_bin_table_bins_each_side_of_every_edge_as_the_formula_does():
    """The histograms' table lookup (errorsums._count) against LogHistogram.add on the values where a table can err.

    Each bin edge 10**(k/40 - 12), the float64 values either side of it, both ends of the range and beyond it
    (zero, a subnormal, the largest float64), and values spread over 32 decades.
    """
    k = np.arange(-3, (HI_DECADE - LO_DECADE) * BINS_PER_DECADE + 4)
    edges = 10.0 ** (LO_DECADE + k / BINS_PER_DECADE)
    special = [0.0, 5e-324, 1e-300, 1e-13, 1e13, 1e300, np.finfo(np.float64).max]
    spread = np.abs(np.random.default_rng(0).standard_normal(50_000) * 10.0 ** np.linspace(-16, 16, 50_000))
    for values in (np.concatenate([edges, np.nextafter(edges, 0), np.nextafter(edges, np.inf), special]), spread):
        got, want = errorsums.HistCounts(), LogHistogram()
        errorsums._count(np.ascontiguousarray(values), got, errorsums._Buffers(values.size))
        want.add(values)
        assert (got.zeros, got.tiny, got.huge) == (want.zeros, want.tiny, want.huge)
        assert np.array_equal(got.counts, want.counts)
    unsure = np.count_nonzero(errorsums._bin_table() == errorsums._UNSURE)
    assert unsure <= 2 * edges.size  # about one slice at each edge takes the formula: the rest, the table
