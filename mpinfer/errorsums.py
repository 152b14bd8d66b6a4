"""The metrics core's per-batch sums of a float32 (or float16) output, in chunks that stay in cache.

:class:`mpinfer.metrics.OutputAccumulator` compares a candidate's output with the baseline's. Its general path
converts chunks of a million values to float64 and makes some 30 whole-array passes over them (each a fresh
8 MB temporary, out of cache): ~30 ns a value, more than ONNX Runtime takes to compute a Conv's output. Here the
same float64 figures come from chunks of :data:`CHUNK` values converted into reused buffers, with the fewest
passes: the four per-sample dot products, the absolute and relative errors with their sums and maxima, the
baseline's extremes, and the two log histograms (the same bin formula as :meth:`LogHistogram.add`). The sums
are float64 as before, only added in another order (differences at float64 rounding).

Finite values only: a chunk holding NaN or Inf in either array makes :func:`error_sums` return None, and the
caller takes its general path for those samples (NaN/Inf show in the float64 sums of squares, which cannot
overflow for float32 values: no separate finiteness pass).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from mpinfer.histogram import BINS_PER_DECADE, HI_DECADE, LO_DECADE, LogHistogram, bin_positions

# Values per chunk: eight float64 buffers of 512 KB (about 4 MB, in L2/L3 cache) and ~25 numpy calls per chunk,
# whose fixed cost (~1 us each) stays below a tenth of the work.
CHUNK = 1 << 16
# The dtypes this path takes (exactly representable in float64, squares far from float64's overflow).
FAST_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
_BINS = (HI_DECADE - LO_DECADE) * BINS_PER_DECADE
# The histograms' bins come from a table looked up by a float64 value's top bits (its exponent and the first
# _SLICE_BITS of its mantissa): 1,024 slices an octave, each 0.07 % wide, against bins 5.9 % wide, so all but ~1 %
# of the slices lie inside one bin. The values of a slice holding a bin's edge (_UNSURE) take the bin formula
# itself. log10 over every value was 70 % of the histograms' cost (~20 ns a value; the table: ~5).
_SLICE_BITS = 10
_UNSURE = 0xFFFF
# A slice is sure when no bin edge lies within this relative distance of it: far more than log10's error (an ulp or
# two), so the formula gives every value in it the slice's bin whatever libm computes log10 with.
_EDGE_MARGIN = 1e-9


@dataclass
class HistCounts:
    """One batch's additions to a :class:`mpinfer.histogram.LogHistogram` (added when the batch is whole)."""

    counts: np.ndarray = field(default_factory=lambda: np.zeros(_BINS, np.int64))
    zeros: int = 0
    tiny: int = 0
    huge: int = 0


@dataclass
class ErrorSums:
    """The float64 figures of a batch (finite values only): what ``OutputAccumulator`` adds to its sums."""

    cos: list[np.ndarray] = field(default_factory=list)  # per-sample cosines (chunks of samples)
    sum_b2: float = 0.0
    sum_c2: float = 0.0
    sum_bc: float = 0.0
    sum_d2: float = 0.0
    sum_abs: float = 0.0
    max_abs: float = 0.0
    sum_rel: float = 0.0
    max_rel: float = 0.0
    b_min: float = math.inf
    b_max: float = -math.inf
    hist_abs: HistCounts | None = None
    hist_rel: HistCounts | None = None


class _Buffers:
    """Reused float64 work arrays of one chunk (a fresh array per pass would fault in new pages each time)."""

    def __init__(self, size: int) -> None:
        self.b, self.c, self.d, self.a, self.r = (np.empty(size) for _ in range(5))
        self.idx = np.empty(size, np.int64)
        self.bins = np.empty(size, np.uint16)


def cosines(bc: np.ndarray, b2: np.ndarray, c2: np.ndarray) -> np.ndarray:
    """Cosines from dot products and squared norms: 1 when both are zero, 0 when one is."""
    den = np.sqrt(b2 * c2)
    safe = np.where(den > 0, den, 1.0)
    return np.where(den > 0, bc / safe, np.where((b2 == 0) & (c2 == 0), 1.0, 0.0))


def error_sums(b: np.ndarray, c: np.ndarray, rel_eps: float, quantiles: bool) -> ErrorSums | None:
    """The figures of ``b`` (baseline) and ``c`` (candidate), both ``[samples, values]`` of a dtype in FAST_DTYPES.

    Args:
        b: The baseline, one row per sample.
        c: The candidate, the same shape.
        rel_eps: Added to ``|b|`` in the relative error.
        quantiles: Count the errors into histograms too.

    Returns:
        The sums, or None when either array holds NaN or Inf.
    """
    rows, per = b.shape
    out = ErrorSums()
    if quantiles:
        out.hist_abs, out.hist_rel = HistCounts(), HistCounts()
    if rows == 0 or per == 0:
        out.cos.append(np.ones(rows))
        return out
    buf = _Buffers(min(CHUNK, rows * per) if per <= CHUNK else CHUNK)
    if per <= CHUNK:  # whole samples per chunk: the per-sample sums are einsums over rows
        step = CHUNK // per
        for lo in range(0, rows, step):
            sums = _chunk(b[lo : lo + step], c[lo : lo + step], buf, out, rel_eps)
            if sums is None:
                return None
            out.cos.append(cosines(sums[2], sums[0], sums[1]))
        return out
    for row in range(rows):  # a sample longer than a chunk: its sums add up over its chunks
        b2 = c2 = bc = 0.0
        for lo in range(0, per, CHUNK):
            sums = _chunk(b[row : row + 1, lo : lo + CHUNK], c[row : row + 1, lo : lo + CHUNK], buf, out, rel_eps)
            if sums is None:
                return None
            b2, c2, bc = b2 + float(sums[0][0]), c2 + float(sums[1][0]), bc + float(sums[2][0])
        out.cos.append(cosines(np.array([bc]), np.array([b2]), np.array([c2])))
    return out


def _chunk(
    b_in: np.ndarray, c_in: np.ndarray, buf: _Buffers, out: ErrorSums, rel_eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Add one chunk (``[rows, width]``) to ``out``; its per-row b·b, c·c, b·c, or None on NaN/Inf."""
    shape, n = b_in.shape, b_in.size
    b, c = buf.b[:n].reshape(shape), buf.c[:n].reshape(shape)
    np.copyto(b, b_in)
    np.copyto(c, c_in)
    d = np.subtract(c, b, out=buf.d[:n].reshape(shape))
    b2, c2 = np.einsum("ij,ij->i", b, b), np.einsum("ij,ij->i", c, c)
    s_b2, s_c2 = float(b2.sum()), float(c2.sum())
    if not (math.isfinite(s_b2) and math.isfinite(s_c2)):  # NaN/Inf in b or c: squares of finite ones never overflow
        return None
    bc = np.einsum("ij,ij->i", b, c)
    out.sum_b2 += s_b2
    out.sum_c2 += s_c2
    out.sum_bc += float(bc.sum())
    out.sum_d2 += float(np.einsum("ij,ij->", d, d))
    a = np.abs(d.reshape(-1), out=buf.a[:n])
    out.sum_abs += float(a.sum())
    out.max_abs = max(out.max_abs, float(a.max()))
    flat_b = b.reshape(-1)
    out.b_min, out.b_max = min(out.b_min, float(flat_b.min())), max(out.b_max, float(flat_b.max()))
    rel = np.abs(flat_b, out=buf.r[:n])
    rel += rel_eps
    np.divide(a, rel, out=rel)
    out.sum_rel += float(rel.sum())
    out.max_rel = max(out.max_rel, float(rel.max()))
    if out.hist_abs is not None and out.hist_rel is not None:
        _count(a, out.hist_abs, buf)
        _count(rel, out.hist_rel, buf)
    return b2, c2, bc


def _count(v: np.ndarray, h: HistCounts, buf: _Buffers) -> None:
    """:meth:`LogHistogram.add` of non-negative finite ``v`` (contiguous float64) into ``h``: each value's very bin.

    One bincount over every value's table bin (:func:`_bin_table`; shifted by one: 0 is tiny, ``_BINS + 1`` huge),
    zeros included (binned as tiny) and counted apart. Picking the non-zero errors out (a ReLU output's are half
    zeros) cost more than the rest together.
    """
    zeros = int(np.count_nonzero(v == 0))
    idx = buf.idx[: v.size]
    np.right_shift(v.view(np.int64), 52 - _SLICE_BITS, out=idx)  # (sign bit clear: the exponent and the slice)
    bins = _bin_table().take(idx, out=buf.bins[: v.size], mode="clip")  # ("clip": no buffered bounds check)
    unsure = np.flatnonzero(bins == _UNSURE)
    if unsure.size:
        bins[unsure] = _bins(v[unsure])
    counts = np.bincount(bins, minlength=_BINS + 2)
    h.counts += counts[1:-1]
    h.zeros += zeros
    h.tiny += int(counts[0]) - zeros
    h.huge += int(counts[-1])


def _bins(x: np.ndarray) -> np.ndarray:
    """:meth:`LogHistogram.add`'s bins of positive ``x`` (:func:`bin_positions`), clipped to tiny and huge, plus one."""
    return np.clip(bin_positions(x), -1, _BINS) + 1


@functools.cache
def _bin_table() -> np.ndarray:
    """Every non-negative float64's bin (as :func:`_bins`) by its top bits, or ``_UNSURE`` near a bin's edge (4 MiB).

    Slices below the histogram's lowest octave are tiny (0: zero, subnormals), those above its highest huge; the
    octaves between are binned at both ends of each slice (built once a process: ~20 ms).
    """
    table = np.empty(1 << (11 + _SLICE_BITS), np.uint16)
    lo_exp = math.floor(LO_DECADE * math.log2(10)) - 1  # (an octave below the lowest edge: all tiny)
    hi_exp = math.ceil(HI_DECADE * math.log2(10)) + 1
    first, last = (lo_exp + 1023) << _SLICE_BITS, (hi_exp + 1023) << _SLICE_BITS
    table[:first], table[last:] = 0, _BINS + 1
    top = np.arange(first, last, dtype=np.int64) << (52 - _SLICE_BITS)
    lo = top.view(np.float64)
    hi = (top | ((1 << (52 - _SLICE_BITS)) - 1)).view(np.float64)  # (the slice's largest value)
    edges = LogHistogram().edges()  # (its _BINS + 1 bin edges)
    nearest = np.minimum(np.searchsorted(edges, lo * (1 - _EDGE_MARGIN)), _BINS)
    clear = (edges[nearest] > hi * (1 + _EDGE_MARGIN)) | (lo * (1 - _EDGE_MARGIN) > edges[-1])
    at_lo = _bins(lo)
    table[first:last] = np.where(clear & (at_lo == _bins(hi)), at_lo, _UNSURE)
    table.flags.writeable = False
    return table
