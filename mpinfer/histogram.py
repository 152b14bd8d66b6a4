"""Bounded log-spaced histograms: the streaming median and p99 of the metrics core (:mod:`mpinfer.metrics`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Histogram resolution: 40 bins per decade bounds a quantile's relative error by 10**(1/40) - 1 ≈ 5.9 %.
BINS_PER_DECADE = 40
# Histogram range in decades: errors below 1e-12 are "tiny" (below FP32 resolution of O(1) values), errors
# above 1e12 are "huge" (overflowed or diverged).
LO_DECADE, HI_DECADE = -12, 12


def bin_positions(values: np.ndarray) -> np.ndarray:
    """Each positive value's bin, as float64: below 0 tiny, from the bin count on huge (one formula for every caller).

    :meth:`LogHistogram.add` and the metrics core's table of bins (:mod:`mpinfer.errorsums`) both bin with it.
    """
    return np.floor((np.log10(values) - LO_DECADE) * BINS_PER_DECADE)


@dataclass
class LogHistogram:
    """Counts of non-negative values in log-spaced bins, plus zero, tiny, huge and infinite buckets."""

    counts: np.ndarray = field(
        default_factory=lambda: np.zeros((HI_DECADE - LO_DECADE) * BINS_PER_DECADE, np.int64)
    )
    zeros: int = 0
    tiny: int = 0
    huge: int = 0

    def add(self, values: np.ndarray, infinite: int = 0) -> None:
        """Add finite non-negative values, and ``infinite`` extra values counted as huge."""
        v = values.ravel()
        nz = v[v > 0]
        self.zeros += int(v.size - nz.size)
        self.huge += int(infinite)
        if nz.size == 0:
            return
        idx = bin_positions(nz).astype(np.int64)
        self.tiny += int(np.count_nonzero(idx < 0))
        self.huge += int(np.count_nonzero(idx >= self.counts.size))
        idx = idx[(idx >= 0) & (idx < self.counts.size)]
        self.counts += np.bincount(idx, minlength=self.counts.size)

    def add_counts(self, counts: np.ndarray, zeros: int, tiny: int, huge: int) -> None:
        """Add counts made elsewhere with :meth:`add`'s bins (:mod:`mpinfer.errorsums`)."""
        self.counts += counts
        self.zeros += int(zeros)
        self.tiny += int(tiny)
        self.huge += int(huge)

    @property
    def total(self) -> int:
        """Number of values added."""
        return int(self.zeros + self.tiny + self.huge + self.counts.sum())

    def quantile(self, q: float) -> float:
        """Estimate the q-quantile (0 <= q <= 1), interpolating log-linearly inside a bin."""
        n = self.total
        if n == 0:
            return float("nan")
        rank = q * (n - 1)
        if rank < self.zeros:
            return 0.0
        seen = self.zeros + self.tiny
        if rank < seen:
            return 10.0**LO_DECADE
        cum = np.cumsum(self.counts)
        i = int(np.searchsorted(cum, rank - seen, side="right"))
        if i >= self.counts.size:
            return float("inf")
        before = seen + (cum[i - 1] if i > 0 else 0)
        frac = (rank - before + 0.5) / max(int(self.counts[i]), 1)
        return float(10.0 ** (LO_DECADE + (i + min(max(frac, 0.0), 1.0)) / BINS_PER_DECADE))

    def with_zeros(self, extra: int) -> LogHistogram:
        """A copy with ``extra`` more zeros (the error of samples assumed perfect)."""
        return LogHistogram(self.counts.copy(), self.zeros + int(extra), self.tiny, self.huge)

    def to_dict(self) -> dict[str, Any]:
        """Sparse JSON form."""
        nz = np.nonzero(self.counts)[0]
        return {
            "lo_decade": LO_DECADE,
            "bins_per_decade": BINS_PER_DECADE,
            "zeros": self.zeros,
            "tiny": self.tiny,
            "huge": self.huge,
            "bins": [[int(i), int(self.counts[i])] for i in nz],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LogHistogram:
        """Inverse of :meth:`to_dict`."""
        h = cls(zeros=int(d.get("zeros", 0)), tiny=int(d.get("tiny", 0)), huge=int(d.get("huge", 0)))
        for i, c in d.get("bins", []):
            if 0 <= int(i) < h.counts.size:
                h.counts[int(i)] = int(c)
        return h

    def edges(self) -> np.ndarray:
        """Bin edges (values), for plotting."""
        return 10.0 ** (LO_DECADE + np.arange(self.counts.size + 1) / BINS_PER_DECADE)
