"""Streaming error metrics between a baseline output and a candidate output.

:class:`OutputAccumulator` takes one batch at a time and never keeps outputs: max, mean, SNR, cosine, NaN/Inf
counts, top-k agreement and label accuracy are exact running sums (float64); the median and p99 of the
absolute and relative error come from bounded log-spaced histograms (:class:`LogHistogram`,
``BINS_PER_DECADE`` bins per decade, so a quantile is within a factor ``10**(1/BINS_PER_DECADE)`` ≈ 6 %).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Histogram resolution: 40 bins per decade bounds a quantile's relative error by 10**(1/40) - 1 ≈ 5.9 %.
BINS_PER_DECADE = 40
# Histogram range in decades: errors below 1e-12 are "tiny" (below FP32 resolution of O(1) values), errors
# above 1e12 are "huge" (overflowed or diverged).
LO_DECADE, HI_DECADE = -12, 12
# Added to |baseline| in the relative error so exact zeros in the baseline do not divide by zero.
REL_EPS = 1e-6
# An output is classifier-like (top-k, accuracy) when its last dim has between 2 and this many classes.
MAX_CLASSES = 100_000
# k values of the top-k agreement (baseline top-1 among the candidate's top-k); top-1 is exact argmax match.
TOPK = (1, 5)

METRIC_DOCS: dict[str, str] = {
    "max_abs": "largest |candidate - baseline|",
    "mean_abs": "mean |candidate - baseline|",
    "median_abs": "median |candidate - baseline| (histogram estimate)",
    "p99_abs": "99th percentile |candidate - baseline| (histogram estimate)",
    "max_rel": f"largest |candidate - baseline| / (|baseline| + {REL_EPS:g})",
    "mean_rel": "mean relative error",
    "median_rel": "median relative error (histogram estimate)",
    "p99_rel": "99th percentile relative error (histogram estimate)",
    "cosine": "cosine similarity of the flattened outputs over all samples",
    "snr_db": "signal-to-noise ratio 10*log10(sum b^2 / sum (c-b)^2), dB",
    "top1": "fraction of rows whose argmax (last dim) agrees (classifier-like outputs)",
    "top5": "fraction of rows whose baseline top-1 is in the candidate top-5 (classifier-like outputs)",
    "nan": "NaN count in the candidate output",
    "inf": "Inf count in the candidate output",
    "nonfinite": "elements finite in the baseline but NaN/Inf in the candidate",
    "accuracy": "candidate accuracy against the data's _labels (classifier-like outputs)",
    "baseline_accuracy": "baseline accuracy against the data's _labels",
    "accuracy_drop": "baseline accuracy - candidate accuracy",
}


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
        idx = np.floor((np.log10(nz) - LO_DECADE) * BINS_PER_DECADE).astype(np.int64)
        self.tiny += int(np.count_nonzero(idx < 0))
        self.huge += int(np.count_nonzero(idx >= self.counts.size))
        idx = idx[(idx >= 0) & (idx < self.counts.size)]
        self.counts += np.bincount(idx, minlength=self.counts.size)

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


def is_classifier_like(shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """True for float outputs of rank 2 or 3 whose last dim looks like classes."""
    return np.dtype(dtype).kind == "f" and len(shape) in (2, 3) and 2 <= shape[-1] <= MAX_CLASSES


class OutputAccumulator:
    """Accumulates the error of one output of one candidate, batch by batch.

    Args:
        name: Output name.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.shape: tuple[int, ...] | None = None
        self.baseline_dtype = ""
        self.candidate_dtype = ""
        self.classifier: bool | None = None
        self.s: dict[str, float] = dict.fromkeys(
            (
                "n",
                "sum_abs",
                "max_abs",
                "sum_rel",
                "max_rel",
                "sum_d2",
                "sum_b2",
                "sum_c2",
                "sum_bc",
                "nan",
                "inf",
                "nonfinite",
                "rows",
                "labeled",
                "correct_b",
                "correct_c",
            ),
            0.0,
        )
        self.topk: dict[int, float] = dict.fromkeys(TOPK, 0.0)
        self.hist_abs = LogHistogram()
        self.hist_rel = LogHistogram()

    def update(self, baseline: np.ndarray, candidate: np.ndarray, labels: np.ndarray | None = None) -> None:
        """Add one batch of outputs (same shape); ``labels`` are the batch's class labels, if any."""
        if self.shape is None:
            self.shape = tuple(candidate.shape)
            self.baseline_dtype, self.candidate_dtype = str(baseline.dtype), str(candidate.dtype)
            self.classifier = is_classifier_like(self.shape, candidate.dtype)
        b = np.asarray(baseline, dtype=np.float64)
        c = np.asarray(candidate, dtype=np.float64)
        s = self.s
        s["nan"] += int(np.isnan(c).sum())
        s["inf"] += int(np.isinf(c).sum())
        fin_b, fin_c = np.isfinite(b), np.isfinite(c)
        bad = int(np.count_nonzero(fin_b & ~fin_c))
        s["nonfinite"] += bad
        both = fin_b & fin_c
        bb, cc = b[both], c[both]
        d = np.abs(cc - bb)
        rel = d / (np.abs(bb) + REL_EPS)
        s["n"] += d.size
        s["sum_abs"] += float(d.sum())
        s["sum_rel"] += float(rel.sum())
        if d.size:
            s["max_abs"] = max(s["max_abs"], float(d.max()))
            s["max_rel"] = max(s["max_rel"], float(rel.max()))
        s["sum_d2"] += float(np.dot(cc - bb, cc - bb))
        s["sum_b2"] += float(np.dot(bb, bb))
        s["sum_c2"] += float(np.dot(cc, cc))
        s["sum_bc"] += float(np.dot(bb, cc))
        self.hist_abs.add(d, infinite=bad)
        self.hist_rel.add(rel, infinite=bad)
        if self.classifier and baseline.ndim >= 2:
            self._update_classes(b, c, labels)

    def _update_classes(self, b: np.ndarray, c: np.ndarray, labels: np.ndarray | None) -> None:
        classes = b.shape[-1]
        b2, c2 = b.reshape(-1, classes), np.nan_to_num(c.reshape(-1, classes), nan=-np.inf)
        top_b = np.argmax(b2, axis=1)
        top_c = np.argmax(c2, axis=1)
        self.s["rows"] += b2.shape[0]
        for k in TOPK:
            if k == 1:
                self.topk[1] += float(np.count_nonzero(top_c == top_b))
            elif classes > k:  # the candidate's k largest (unordered): O(classes) per row, not a full sort
                best = np.argpartition(-c2, k - 1, axis=1)[:, :k]
                self.topk[k] += float(np.count_nonzero((best == top_b[:, None]).any(axis=1)))
        if labels is not None and b.ndim == 2 and labels.shape[0] == b.shape[0]:
            lab = labels.reshape(-1).astype(np.int64)
            self.s["labeled"] += lab.size
            self.s["correct_b"] += float(np.count_nonzero(top_b == lab))
            self.s["correct_c"] += float(np.count_nonzero(top_c == lab))

    def finalize(self) -> dict[str, float | None]:
        """The metric values (see :data:`METRIC_DOCS`); None where a metric does not apply."""
        s = self.s
        bad = s["nonfinite"] > 0
        n = s["n"]

        def quantile(hist: Any, q: float, top: float) -> float | None:  # a bin's edge never above the exact max
            v = hist.quantile(q)
            return v if v is None or bad else min(v, top)

        out: dict[str, float | None] = {
            "max_abs": math.inf if bad else s["max_abs"],
            "mean_abs": s["sum_abs"] / n if n else None,
            "median_abs": quantile(self.hist_abs, 0.5, s["max_abs"]),
            "p99_abs": quantile(self.hist_abs, 0.99, s["max_abs"]),
            "max_rel": math.inf if bad else s["max_rel"],
            "mean_rel": s["sum_rel"] / n if n else None,
            "median_rel": quantile(self.hist_rel, 0.5, s["max_rel"]),
            "p99_rel": quantile(self.hist_rel, 0.99, s["max_rel"]),
            "cosine": math.nan if bad else _cosine(s["sum_bc"], s["sum_b2"], s["sum_c2"]),
            "snr_db": -math.inf if bad else _snr_db(s["sum_b2"], s["sum_d2"]),
            "nan": s["nan"],
            "inf": s["inf"],
            "nonfinite": s["nonfinite"],
        }
        for k in TOPK:
            have = (
                self.classifier and s["rows"] and (k == 1 or (self.shape is not None and self.shape[-1] > k))
            )
            out[f"top{k}"] = self.topk[k] / s["rows"] if have else None
        if s["labeled"]:
            acc_b, acc_c = s["correct_b"] / s["labeled"], s["correct_c"] / s["labeled"]
            out.update(baseline_accuracy=acc_b, accuracy=acc_c, accuracy_drop=acc_b - acc_c)
        return out


def _cosine(bc: float, b2: float, c2: float) -> float:
    if b2 == 0 and c2 == 0:
        return 1.0
    if b2 == 0 or c2 == 0:
        return 0.0
    return float(bc / math.sqrt(b2 * c2))


def _snr_db(b2: float, d2: float) -> float:
    if d2 == 0:
        return math.inf
    if b2 == 0:
        return -math.inf
    return 10.0 * math.log10(b2 / d2)
