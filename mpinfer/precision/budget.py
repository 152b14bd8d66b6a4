"""Accuracy budgets: ``cosine>=0.9999,top1>=0.999,max_abs<=1e-2`` parsed and checked on model outputs.

Metrics compare a candidate's outputs with the FP32 reference on the same feeds (worst output wins):

* ``cosine``: cosine similarity of each output, flattened per sample, mean over samples (higher is better);
* ``top1`` / ``top5`` (any ``topK``): share of samples whose reference arg-max is in the candidate's top K
  along the last axis (higher is better);
* ``max_abs``: largest absolute error; ``mean_abs``: mean absolute error (lower is better);
* ``rel``: relative L2 error ``||y - ref|| / ||ref||`` (lower is better);
* ``snr``: signal-to-noise ratio in dB, ``10 log10(sum ref^2 / sum (y - ref)^2)`` (higher is better);
* ``accuracy``: top-1 accuracy against the data's ``_labels`` (higher is better; needs labels).

Any NaN/Inf in a candidate output where the reference is finite fails every metric.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mpinfer.errors import InvalidInputError, format_message

HIGHER_IS_BETTER = {
    "cosine": True,
    "max_abs": False,
    "mean_abs": False,
    "rel": False,
    "snr": True,
    "accuracy": True,
}
_TOPK = re.compile(r"^top(\d+)$")
_TERM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=)\s*([-+0-9.eE]+|inf)\s*$")
_EXAMPLE = "cosine>=0.9999,top1>=0.999,max_abs<=1e-2,rel<=1e-2,snr>=40,accuracy>=0.95"


@dataclass(frozen=True)
class BudgetTerm:
    """One ``metric op threshold`` term."""

    metric: str
    op: str
    threshold: float

    def holds(self, value: float) -> bool:
        """True when ``value`` meets the term (NaN never does)."""
        if math.isnan(value):
            return False
        return value >= self.threshold if self.op == ">=" else value <= self.threshold

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"


@dataclass(frozen=True)
class Budget:
    """A conjunction of terms."""

    terms: tuple[BudgetTerm, ...]
    text: str

    @property
    def needs_labels(self) -> bool:
        """True if a term is measured against labels."""
        return any(t.metric == "accuracy" for t in self.terms)

    def failures(self, metrics: Mapping[str, float]) -> list[str]:
        """The terms ``metrics`` break, as readable strings."""
        return [
            f"{t} (got {metrics.get(t.metric, float('nan')):.6g})"
            for t in self.terms
            if not t.holds(metrics.get(t.metric, float("nan")))
        ]

    def met(self, metrics: Mapping[str, float]) -> bool:
        """True when every term holds."""
        return not self.failures(metrics)

    def slack(self, metrics: Mapping[str, float]) -> float:
        """How far inside the budget (>0) or outside (<0), relative to each threshold; the worst term."""
        worst = math.inf
        for t in self.terms:
            v = metrics.get(t.metric, float("nan"))
            if math.isnan(v):
                return -math.inf
            scale = max(abs(t.threshold), 1e-12)
            s = (v - t.threshold) / scale if t.op == ">=" else (t.threshold - v) / scale
            worst = min(worst, s)
        return worst


def _is_metric(name: str) -> bool:
    return name in HIGHER_IS_BETTER or bool(_TOPK.match(name))


def parse_budget(text: str) -> Budget:
    """Parse ``metric>=x,metric<=y,...``.

    Raises:
        InvalidInputError: Empty, malformed terms, unknown metrics or a wrong direction, naming the term.
    """
    terms = []
    known = ", ".join([*HIGHER_IS_BETTER, "topK"])
    for raw in [p for p in (text or "").split(",") if p.strip()]:
        m = _TERM.match(raw)
        if not m:
            raise InvalidInputError(
                format_message(
                    f"Budget term '{raw.strip()}'", None, "metric>=value or metric<=value", f"e.g. {_EXAMPLE}"
                )
            )
        metric, op, value = m.group(1).lower(), m.group(2), m.group(3)
        if not _is_metric(metric):
            raise InvalidInputError(
                format_message(f"Budget metric '{metric}'", None, f"one of {known}", f"e.g. {_EXAMPLE}")
            )
        higher = HIGHER_IS_BETTER.get(metric, True)
        if (op == ">=") != higher:
            want = ">=" if higher else "<="
            raise InvalidInputError(
                format_message(
                    f"Budget term '{raw.strip()}'",
                    f"'{op}'",
                    f"'{want}' ({metric} is {'higher' if higher else 'lower'} is better)",
                    f"write {metric}{want}{value}",
                )
            )
        try:
            threshold = float(value)
        except ValueError as err:
            raise InvalidInputError(
                format_message(f"Budget term '{raw.strip()}'", f"value '{value}'", "a number")
            ) from err
        terms.append(BudgetTerm(metric, op, threshold))
    if not terms:
        raise InvalidInputError(format_message("Budget", repr(text), "at least one term", f"e.g. {_EXAMPLE}"))
    return Budget(tuple(terms), text)


def output_metrics(
    reference: Sequence[Mapping[str, np.ndarray]],
    candidate: Sequence[Mapping[str, np.ndarray]],
    names: Sequence[str],
    *,
    labels: np.ndarray | None = None,
    topk: Sequence[int] = (1,),
) -> dict[str, float]:
    """Worst-output metrics of ``candidate`` against ``reference`` over batches.

    Args:
        reference: Per batch, output name → FP32 reference array.
        candidate: Per batch, output name → candidate array.
        names: Float outputs to compare.
        labels: Labels for ``accuracy`` (aligned with the concatenated samples), or None.
        topk: The K of the topK metrics wanted.

    Returns:
        Metric name → value.
    """
    out: dict[str, float] = {"cosine": 1.0, "max_abs": 0.0, "mean_abs": 0.0, "rel": 0.0, "snr": math.inf}
    for k in topk:
        out[f"top{k}"] = 1.0
    for name in names:
        if all(np.size(b[name]) == 0 for b in reference):
            continue  # an empty output (a zero-size split) has nothing to differ in
        ref = np.concatenate(
            [np.asarray(b[name], np.float64).reshape(ref_rows(b[name]), -1) for b in reference]
        )
        cand = np.concatenate(
            [np.asarray(b[name], np.float64).reshape(ref_rows(b[name]), -1) for b in candidate]
        )
        _merge(out, _metrics_one(ref, cand, topk))
    if labels is not None and names:
        scored = _accuracy(np.concatenate([np.asarray(b[names[0]], np.float64) for b in candidate]), labels)
        if scored is not None:
            out["accuracy"] = scored[0]
    return out


def _accuracy(cand: np.ndarray, labels: np.ndarray) -> tuple[float, int] | None:
    """Top-1 accuracy of the candidate's rows against ``labels`` and the rows scored; None when none can be."""
    n = min(len(labels), len(cand))
    if cand.ndim < 2 or not n:
        return None
    return float(np.mean(cand[:n].reshape(n, -1).argmax(-1) == np.asarray(labels[:n]))), n


def optimistic_metrics(
    reference: Mapping[str, np.ndarray],
    candidate: Mapping[str, np.ndarray],
    names: Sequence[str],
    total_rows: int,
    signal: Mapping[str, float],
    *,
    labels: np.ndarray | None = None,
    topk: Sequence[int] = (1,),
) -> dict[str, float]:
    """The best metrics a candidate can still reach on all ``total_rows`` samples, from a few of them.

    ``reference`` / ``candidate`` hold the outputs of some of the samples (rows); the others are assumed
    perfect: cosine, topK and accuracy 1 on them, no error. So when these bounds break the budget, the
    metrics of all samples (:func:`output_metrics`) break it too, whatever the other samples give:
    ``max_abs`` over all samples is at least the subset's; ``mean_abs`` at least the subset's error sum over
    all values; ``rel`` and ``snr`` use the subset's error energy against ``signal``, each output's sum of
    squares over all samples (the reference is known for all of them).

    Args:
        reference: Output name → FP32 reference rows of the subset.
        candidate: Output name → candidate rows of the subset.
        names: Float outputs to compare.
        total_rows: Samples in the whole set.
        signal: Output name → sum of squares of its finite reference values over the whole set.
        labels: Labels of the subset's samples (``accuracy``), or None.
        topk: The K of the topK metrics wanted.
    """
    out: dict[str, float] = {"cosine": 1.0, "max_abs": 0.0, "mean_abs": 0.0, "rel": 0.0, "snr": math.inf}
    for k in topk:
        out[f"top{k}"] = 1.0

    def share(mean_over_subset: float, rows: int) -> float:  # a mean over the subset → bound over all rows
        return (mean_over_subset * rows + (total_rows - rows)) / total_rows

    for name in names:
        ref = np.asarray(reference[name], np.float64)
        rows = ref_rows(ref)
        ref = ref.reshape(rows, -1)
        cand = np.asarray(candidate[name], np.float64).reshape(rows, -1)
        one = _metrics_one(ref, cand, topk)
        if math.isinf(one["max_abs"]):
            _merge(out, one)
            continue
        ok = np.isfinite(ref)
        noise = float((np.where(ok, cand - ref, 0.0) ** 2).sum())
        sig = float(signal[name])
        bound = {
            "cosine": share(one["cosine"], rows),
            "max_abs": one["max_abs"],
            "mean_abs": one["mean_abs"] * rows / total_rows,
            "rel": relative_l2(noise, sig),
            "snr": 10 * math.log10(sig / noise) if noise > 0 else math.inf,
        }
        bound.update({f"top{k}": share(one[f"top{k}"], rows) for k in topk if f"top{k}" in one})
        _merge(out, bound)
    if labels is not None and names:
        scored = _accuracy(np.asarray(candidate[names[0]], np.float64), labels)
        if scored is not None:
            out["accuracy"] = share(*scored)
    return out


def relative_l2(noise: float, signal: float) -> float:
    """sqrt(noise / signal) from sums of squares: 0 for no error at all, inf for error on a zero signal."""
    if signal > 0:
        return math.sqrt(noise / signal)
    return 0.0 if noise == 0 else math.inf


def ref_rows(arr: np.ndarray) -> int:
    """Rows (samples) of an output array (a scalar is one row)."""
    return len(arr) if np.ndim(arr) else 1


def _metrics_one(ref: np.ndarray, cand: np.ndarray, topk: Sequence[int]) -> dict[str, float]:
    cand_finite = np.isfinite(cand)
    ok = np.isfinite(ref)
    if not cand_finite.all() and (~cand_finite & ok).any():
        res = {"cosine": -1.0, "max_abs": math.inf, "mean_abs": math.inf, "rel": math.inf, "snr": -math.inf}
        res.update({f"top{k}": 0.0 for k in topk})
        return res
    if ok.all():  # the usual case: no masking, no copies
        r, c = ref, cand
    else:
        r, c = np.where(ok, ref, 0.0), np.where(ok, cand, 0.0)
    diff = c - r
    num = np.einsum("ij,ij->i", r, c)
    den = np.sqrt(np.einsum("ij,ij->i", r, r)) * np.sqrt(np.einsum("ij,ij->i", c, c))
    absdiff = np.abs(diff)
    cos = np.where(den > 0, num / np.maximum(den, 1e-300), np.where(absdiff.sum(axis=1) == 0, 1.0, 0.0))
    sig, noise = float(np.einsum("ij,ij->", r, r)), float(np.einsum("ij,ij->", diff, diff))
    res = {
        "cosine": float(cos.mean()) if cos.size else 1.0,
        "max_abs": float(absdiff.max()) if diff.size else 0.0,
        "mean_abs": float(absdiff.mean()) if diff.size else 0.0,
        "rel": relative_l2(noise, sig),
        "snr": 10 * math.log10(sig / noise) if noise > 0 else math.inf,
    }
    if ref.shape[1] > 1:
        ranks = _rank_of_reference_top(ref, cand)
        for k in topk:
            res[f"top{k}"] = float(np.mean(ranks < k))
    return res


def _rank_of_reference_top(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Per row, the position of the reference's argmax (NaN aside) in the candidate's descending order.

    The order is that of a stable sort of ``-cand`` (ties by index, NaN last), counted in one pass over
    the row instead of sorting it. The candidate is finite wherever the reference is (the caller checks).
    """
    ref_nan = np.isnan(ref)
    top = (np.where(ref_nan, -np.inf, ref) if ref_nan.any() else ref).argmax(axis=1)  # NaN is never the top
    value = cand[np.arange(len(ref)), top][:, None]
    before = np.arange(cand.shape[1]) < top[:, None]
    # NaN compares false: the top is preceded by the larger values and by its equals at lower indices.
    return (cand > value).sum(axis=1) + ((cand == value) & before).sum(axis=1)


def _merge(acc: dict[str, float], new: Mapping[str, float]) -> None:
    for key, value in new.items():
        worse = min if HIGHER_IS_BETTER.get(key, True) else max
        acc[key] = worse(acc.get(key, value), value)
