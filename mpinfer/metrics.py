"""The metrics core: one definition of every accuracy figure, for convert, compare, report and the pipeline.

A candidate's output is compared with the baseline's (the FP32 reference) on the same feeds, batch by batch
(:class:`OutputAccumulator` for one output, :class:`ModelAccumulator` for all of a model's). Nothing is kept
but float64 running sums, a few counters and two bounded histograms, so memory does not grow with the data.
docs/compare.md holds the table of definitions; :data:`METRIC_DOCS` is its one-line form.

Terms used below:

* **element**: one value of an output; **sample**: one index along axis 0 of an output (a rank-0 output is
  one sample per batch); **row**: one index of every axis but the last (top-k reads the last axis).
* **global** figures pool every element of every sample; **per-sample** figures are computed on each sample
  and reduced to the worst one (``cosine_min``).
* **non-finite**: an element where the baseline is finite and the candidate NaN or ±Inf; it is counted in
  ``nonfinite`` and makes the output's error figures their worst value (``max_abs`` ... ``rel_l2`` inf,
  ``snr_db`` -inf, ``cosine`` and ``cosine_min`` -1) and its top-k row a miss; the quantiles count it as an
  infinite error. Elements where the baseline itself is NaN/Inf are left out of every error figure.
* **integer and boolean outputs** get ``match`` (share of elements exactly equal) and ``mismatch`` (count of
  elements that differ) besides the error figures, computed on their values as numbers; never top-k.
* **class scores**: top-k and label accuracy exist only for outputs that hold class scores on their last
  axis: the outputs the user names (``--class-outputs``), else the ones :func:`guess_class_output` accepts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.errorsums import FAST_DTYPES, ErrorSums, cosines, error_sums
from mpinfer.histogram import LogHistogram
from mpinfer.userfigures import UserMetricAccumulator

# Added to |baseline| in the relative error so exact zeros in the baseline do not divide by zero.
REL_EPS = 1e-6
# An output is guessed to hold class scores when its last dim has between 2 and this many classes (a large
# vocabulary fits; a flattened feature map of more values does not).
MAX_CLASSES = 262_144
# The largest K of a topK metric: ranks are counted up to here (top-100 of a vocabulary is already generous).
MAX_TOPK = 100
# Values converted to float64 at a time (whole samples): bounds the metrics' temporaries to some 100 MB.
CHUNK_ELEMENTS = 1 << 20
# The top-k figures every class-score output reports (any other K up to MAX_TOPK when a check names it).
DEFAULT_TOPK = (1, 5)
# A row of softmax probabilities sums to 1 within this (float32 rounding of up to MAX_CLASSES terms stays
# far below it); rows of probabilities in [0, 1] that miss it are independent (multi-label, sigmoid) scores.
SOFTMAX_SUM_TOL = 1e-3
# Words (or word starts) in an output's name that mark coordinates, regression values or features, never class
# scores: "pred_boxes", "bbox_regression", "landmarks", "pitch_map", "last_hidden_state", "embeddings".
NOT_CLASS_WORDS = (
    "box", "bbox", "coord", "loc", "reg", "offset", "delta", "landmark", "keypoint", "kpt", "pose", "mask",
    "depth", "flow", "embed", "feat", "hidden", "pitch", "anchor", "point", "disp", "center", "xy", "wh",
)  # fmt: skip

# Every metric, its one-line definition (docs/compare.md has the full table) and whether higher is better.
METRIC_DOCS: dict[str, str] = {
    "max_abs": "largest |candidate - baseline| over all elements (global)",
    "mean_abs": "mean |candidate - baseline| over all elements (global)",
    "median_abs": "median |candidate - baseline| (global, histogram estimate)",
    "p99_abs": "99th percentile |candidate - baseline| (global, histogram estimate)",
    "max_rel": f"largest |candidate - baseline| / (|baseline| + {REL_EPS:g}) (global)",
    "mean_rel": "mean relative error (global)",
    "median_rel": "median relative error (global, histogram estimate)",
    "p99_rel": "99th percentile relative error (global, histogram estimate)",
    "rel_l2": "relative L2 error sqrt(sum (c-b)^2 / sum b^2) over all elements (global; alias rel)",
    "cosine": "cosine similarity of the output flattened over all samples (global)",
    "cosine_min": "cosine similarity of each sample (axis 0) flattened, worst sample (per sample, min; of a "
    "sample with one value: its sign)",
    "range_err": "largest |candidate - baseline| as a share of the baseline's range (max - min) over all the "
    "data; of a constant output, of its magnitude (global; the default floor's figure)",
    "snr_db": "signal-to-noise ratio 10*log10(sum b^2 / sum (c-b)^2) in dB (global; alias snr)",
    "top1": "share of rows (every index but the last axis) whose baseline argmax is the candidate's (class scores)",
    "top5": "share of rows whose baseline argmax is in the candidate's top 5 (class scores; any topK, K<=100)",
    "nan": "NaN count in the candidate output",
    "inf": "Inf count in the candidate output",
    "nonfinite": "elements finite in the baseline but NaN/Inf in the candidate",
    "match": "share of elements exactly equal (integer and boolean outputs)",
    "mismatch": "count of elements that differ (integer and boolean outputs)",
    "accuracy": "candidate top-1 accuracy against the data's _labels (class scores, one row per sample)",
    "baseline_accuracy": "baseline top-1 accuracy against the data's _labels",
    "accuracy_drop": "baseline accuracy - candidate accuracy",
    # Generation figures (compare --generate N, convert --budget on a KV-cache decoder with prompts): one value
    # per model, not per output; the check selector for them is GENERATION_OUTPUT ("generate:") or none.
    "token_agreement": "share of (prompt, step) where the candidate's next token, fed the baseline's greedy "
    "continuation (teacher forcing), is the baseline's (generation; pooled over prompts)",
    "first_divergence": "index of the first generated token where the candidate's own greedy continuation "
    "differs from the baseline's (N if none), mean over prompts (generation)",
    "first_divergence_min": "first_divergence of the worst prompt (generation; min over prompts)",
    "step_cosine_min": "cosine of the two models' next-token logits per step (teacher-forced), mean over "
    "prompts, worst step (generation)",
    "step_cosine_mean": "the per-step logits cosine averaged over steps and prompts (generation)",
    "ppl_baseline": "the baseline's perplexity on its own greedy continuation (generation; pooled over prompts)",
    "ppl_candidate": "the candidate's perplexity on the baseline's greedy continuation (generation; pooled)",
    "ppl_ratio": "ppl_candidate / ppl_baseline (generation; 1 is the same)",
}
# The figures of greedy generation: model-level, one value per candidate (see GENERATION_OUTPUT).
GENERATION_METRICS = frozenset({
    "token_agreement", "first_divergence", "first_divergence_min", "step_cosine_min", "step_cosine_mean",
    "ppl_baseline", "ppl_candidate", "ppl_ratio",
})  # fmt: skip
# The name generation figures go by where checks read per-output values: ``generate:token_agreement>=0.95``
# selects them explicitly; a check without a selector (``token_agreement>=0.95``) finds them there too.
GENERATION_OUTPUT = "generate"
# The name the figures of the user's own metrics (``--metric NAME=FILE.py:FUNCTION``, :mod:`mpinfer.usermetric`)
# go by where checks read per-output values: model-level, like generation figures; checks name them plain.
USER_OUTPUT = "(user metrics)"
HIGHER_IS_BETTER: dict[str, bool] = {
    **dict.fromkeys(METRIC_DOCS, False),
    **dict.fromkeys(("cosine", "cosine_min", "snr_db", "top1", "top5", "match", "accuracy", "baseline_accuracy"), True),
    **dict.fromkeys(
        ("token_agreement", "first_divergence", "first_divergence_min", "step_cosine_min", "step_cosine_mean"), True
    ),
}
# Metrics measured against the data's ``_labels``: they need labelled data.
LABEL_METRICS = frozenset({"accuracy", "baseline_accuracy", "accuracy_drop"})
# Metrics that exist only for class-score outputs (with any topK).
CLASS_METRICS = frozenset({"top1", "top5", *LABEL_METRICS})
# Metrics read from the histograms (not computed when an accumulator is built with quantiles=False).
QUANTILE_METRICS = frozenset({"median_abs", "p99_abs", "median_rel", "p99_rel"})
_TOPK = re.compile(r"^top(\d+)$")
_SUMS = (
    "n", "elements", "sum_abs", "max_abs", "sum_rel", "max_rel", "sum_d2", "sum_b2", "sum_c2", "sum_bc",
    "nan", "inf", "nonfinite", "equal", "samples", "rows", "labeled", "correct_b", "correct_c",
)  # fmt: skip
# The baseline's extremes over the data (range_err's scale), kept beside the sums: they start empty.
_EXTREMES = {"b_min": math.inf, "b_max": -math.inf}


def topk_of(metric: str) -> int | None:
    """K of a ``topK`` metric name (``top3`` → 3), else None."""
    m = _TOPK.match(metric)
    return int(m.group(1)) if m else None


def is_metric(name: str) -> bool:
    """True for a canonical metric name: one of :data:`METRIC_DOCS` or ``topK`` with 1 <= K <= MAX_TOPK."""
    k = topk_of(name)
    return name in METRIC_DOCS or (k is not None and 1 <= k <= MAX_TOPK)


def higher_is_better(metric: str) -> bool:
    """True when a larger value of ``metric`` is better (cosine, snr_db, topK, match, accuracy)."""
    return topk_of(metric) is not None or HIGHER_IS_BETTER.get(metric, False)


def is_class_metric(metric: str) -> bool:
    """True for the metrics that exist only on class-score outputs (topK, accuracy)."""
    return metric in CLASS_METRICS or topk_of(metric) is not None


def is_generation_metric(metric: str) -> bool:
    """True for the figures of greedy generation (:data:`GENERATION_METRICS`), model-level."""
    return metric in GENERATION_METRICS


def with_generation(
    per_output: Mapping[str, Mapping[str, float | None]], generation: Mapping[str, float] | None
) -> dict[str, Mapping[str, float | None]]:
    """Per-output values plus the generation figures under :data:`GENERATION_OUTPUT` (as checks read them)."""
    out = dict(per_output)
    if generation:
        out[GENERATION_OUTPUT] = dict(generation)
    return out


def with_user(
    per_output: Mapping[str, Mapping[str, float | None]], figures: Mapping[str, float | None] | None
) -> dict[str, Mapping[str, float | None]]:
    """Per-output values plus the user metrics' figures under :data:`USER_OUTPUT` (as checks read them)."""
    out = dict(per_output)
    if figures:
        out[USER_OUTPUT] = dict(figures)
    return out


def model_level(name: str) -> bool:
    """True for the keys of per-output values that are not outputs (generation and user-metric figures)."""
    return name in (GENERATION_OUTPUT, USER_OUTPUT)


def json_number(v: Any) -> Any:
    """A figure for a JSON record: a non-finite float as a string (``"inf"``, ``"nan"``), anything else as it is."""
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def relative_l2(noise: float, signal: float) -> float:
    """sqrt(noise / signal) from sums of squares: 0 for no error at all, inf for error on a zero signal."""
    if signal > 0:
        return math.sqrt(noise / signal)
    return 0.0 if noise == 0 else math.inf


def range_error(max_abs: float, low: float, high: float) -> float:
    """``range_err``: the largest error as a share of the baseline's range ``high - low`` over the data.

    An output that does not vary over the data (``high == low``) carries no spread to judge against: its
    error is judged against its magnitude instead (a relative error), and an all-zero one is 0 without error
    and inf with any.
    """
    spread = high - low
    if spread > 0:
        return max_abs / spread
    magnitude = max(abs(low), abs(high))
    if magnitude > 0:
        return max_abs / magnitude
    return 0.0 if max_abs == 0 else math.inf


def name_words(name: str) -> list[str]:
    """The lower-case words of an output name: split at non-letters and camelCase humps."""
    spaced = re.sub(r"([a-z])([A-Z])", r"\1 \2", name)
    return [w.lower() for w in re.split(r"[^A-Za-z]+", spaced) if w]


def guess_class_output(name: str, baseline: np.ndarray) -> bool:
    """The default guess whether an output holds class scores on its last axis (top-k applies).

    Yes when all of: a float output of rank 2 or 3 (``[N, C]`` or ``[N, T, C]``: rank 4 and more are spatial
    maps whose last axis is a width); 2 to ``MAX_CLASSES`` values on the last axis, and more than 4 at rank 3
    (``[N, anchors, 4]`` are boxes); a name without a coordinate/regression word (``NOT_CLASS_WORDS``: box,
    offset, mask, pitch, ...); and not independent probabilities: values all in [0, 1] whose rows do not
    sum to 1 (``SOFTMAX_SUM_TOL``) are multi-label (sigmoid) maps. Judged on the first batch the accumulator
    sees. ``--class-outputs`` replaces the guess.
    """
    b = np.asarray(baseline)
    if b.dtype.kind != "f" or b.ndim not in (2, 3) or not 2 <= b.shape[-1] <= MAX_CLASSES:
        return False
    if b.ndim == 3 and b.shape[-1] <= 4:
        return False
    if any(w.startswith(NOT_CLASS_WORDS) for w in name_words(name)):
        return False
    if b.size and float(b.min()) >= 0.0 and float(b.max()) <= 1.0:  # NaN compares false: not probabilities
        sums = np.nansum(b.reshape(-1, b.shape[-1]).astype(np.float64), axis=1)
        return bool(np.all(np.abs(sums - 1.0) <= SOFTMAX_SUM_TOL))
    return True


def _as_samples(a: np.ndarray) -> np.ndarray:
    """An output as ``[samples, values]`` (a rank-0 output is one sample)."""
    return a.reshape(1, -1) if a.ndim == 0 else a.reshape(a.shape[0], -1)


def _comparable(a: np.ndarray) -> np.ndarray:
    """Class scores in a dtype numpy compares natively (bfloat16 and other extension floats as float32)."""
    return a if a.dtype.kind == "f" else a.astype(np.float32)


def _argmax(rows: np.ndarray) -> np.ndarray:
    """Per row, the index of the first largest value; NaN is never the largest."""
    nan = np.isnan(rows)
    return (np.where(nan, -np.inf, rows) if nan.any() else rows).argmax(axis=1)


def rank_of_reference_top(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Per row (``[rows, classes]``), the rank of the baseline's top class in the candidate's descending order.

    The baseline's top class is its first largest value (NaN never is). The rank counts the candidate's values
    above it and its equals at lower indices (a stable descending sort; a NaN candidate value ranks last), so
    rank 0 is exactly ``argmax(candidate) == argmax(baseline)`` and ``rank < K`` is a top-K hit. Compared in
    the arrays' own dtype (exact); ties are looked at only in the rows that have any.
    """
    top = _argmax(ref)
    c = np.where(np.isnan(cand), -np.inf, cand) if np.isnan(cand).any() else cand
    value = c[np.arange(len(c)), top][:, None]
    rank = np.count_nonzero(c > value, axis=1)
    tied = np.nonzero(np.count_nonzero(c == value, axis=1) > 1)[0]
    if tied.size:
        before = np.arange(c.shape[1]) < top[tied, None]
        rank[tied] += np.count_nonzero((c[tied] == value[tied]) & before, axis=1)
    return rank


class OutputAccumulator:
    """The error of one output of one candidate, accumulated batch by batch (see the module docstring).

    Args:
        name: Output name.
        classes: True when the output holds class scores on its last axis (top-k and label accuracy apply),
            False when not, None to guess from the first batch (:func:`guess_class_output`).
        topk: The K of the topK figures reported for class scores (:data:`DEFAULT_TOPK` always are).
        quantiles: Keep the histograms of the median/p99 figures (the budget search leaves them out when no
            check reads them).
    """

    def __init__(
        self, name: str, *, classes: bool | None = None, topk: Iterable[int] = (), quantiles: bool = True
    ) -> None:
        self.name = name
        self.classes = classes
        self.topk = sorted({*DEFAULT_TOPK, *topk})
        self.quantiles = quantiles
        self.shape: tuple[int, ...] | None = None
        self.baseline_dtype = ""
        self.candidate_dtype = ""
        self.integer = False
        self.s: dict[str, float] = {**dict.fromkeys(_SUMS, 0.0), **_EXTREMES}
        self.cosine_min = 1.0
        self.rank_counts = np.zeros(MAX_TOPK + 1, np.int64)  # rows by the rank of the baseline's top (capped)
        self.hist_abs = LogHistogram()
        self.hist_rel = LogHistogram()
        # the last batch's float64 sum of squared errors and of squared baseline values, when it took the chunked
        # path (every value finite); None when it did not
        self.batch_sums: tuple[float, float] | None = None

    def _first(self, b: np.ndarray, c: np.ndarray) -> None:
        self.shape = tuple(c.shape)
        self.baseline_dtype, self.candidate_dtype = str(b.dtype), str(c.dtype)
        self.integer = b.dtype.kind in "biu"
        if self.classes is None:
            self.classes = guess_class_output(self.name, b)
        elif self.classes and (b.dtype.kind != "f" or b.ndim < 2 or b.shape[-1] < 2):

            raise InvalidInputError(
                format_message(
                    f"Class-score output '{self.name}'",
                    f"dtype {b.dtype}, shape {tuple(b.shape)}",
                    "a float output of rank 2 or more with at least 2 classes on its last axis",
                    "leave it out of --class-outputs",
                )
            )

    def update(self, baseline: np.ndarray, candidate: np.ndarray, labels: np.ndarray | None = None) -> None:
        """Add one batch (same shape in both); ``labels`` are the batch's class labels (one per sample), if any."""
        b_in, c_in = np.asarray(baseline), np.asarray(candidate)
        self.batch_sums = None
        if self.shape is None:
            self._first(b_in, c_in)
        if b_in.size == 0 and c_in.size == 0:  # a zero-size output (a Split of 0): no values to measure
            return
        self.s["elements"] += b_in.size
        if self.integer:
            self.s["equal"] += int(np.count_nonzero(b_in == c_in))
        if self.classes:
            self._update_classes(b_in, c_in, labels)
        if b_in.ndim == 0:
            self._update_chunk(b_in, c_in)
            return
        if b_in.dtype in FAST_DTYPES and c_in.dtype in FAST_DTYPES:  # float32/float16: in cache-sized chunks
            sums = error_sums(_as_samples(b_in), _as_samples(c_in), REL_EPS, self.quantiles)
            if sums is not None:  # (None: NaN/Inf in the batch, which the general path below handles)
                self._add_sums(sums, b_in.size)
                self.batch_sums = sums.sum_d2, sums.sum_b2
                return
        # whole samples at a time, about CHUNK_ELEMENTS values: the float64 temporaries stay small
        step = max(1, CHUNK_ELEMENTS // max(1, b_in.size // max(1, len(b_in))))
        for lo in range(0, len(b_in), step):
            self._update_chunk(b_in[lo : lo + step], c_in[lo : lo + step])

    def _update_chunk(self, b_in: np.ndarray, c_in: np.ndarray) -> None:
        b, c = b_in.astype(np.float64, copy=False), c_in.astype(np.float64, copy=False)
        fin_b, fin_c = np.isfinite(b), np.isfinite(c)
        bad = ok = None
        if not (fin_b.all() and fin_c.all()):
            self.s["nan"] += int(np.count_nonzero(np.isnan(c)))
            self.s["inf"] += int(np.count_nonzero(np.isinf(c)))
            bad, ok = fin_b & ~fin_c, fin_b & fin_c
            b, c = np.where(ok, b, 0.0), np.where(ok, c, 0.0)
        self._update_sums(b, c, bad, ok)

    def _update_sums(self, b: np.ndarray, c: np.ndarray, bad: np.ndarray | None, ok: np.ndarray | None) -> None:
        s = self.s
        d = c - b
        bs, cs, ds = _as_samples(b), _as_samples(c), _as_samples(d)
        b2, c2 = np.einsum("ij,ij->i", bs, bs), np.einsum("ij,ij->i", cs, cs)
        bc, d2 = np.einsum("ij,ij->i", bs, cs), np.einsum("ij,ij->i", ds, ds)
        cos = cosines(bc, b2, c2)
        nonfinite = 0
        if bad is not None:
            bad_samples = _as_samples(bad).any(axis=1)
            cos = np.where(bad_samples, -1.0, cos)
            nonfinite = int(np.count_nonzero(bad))
        s["samples"] += len(cos)
        if len(cos):
            self.cosine_min = min(self.cosine_min, float(cos.min()))
        s["sum_b2"] += float(b2.sum())
        s["sum_c2"] += float(c2.sum())
        s["sum_bc"] += float(bc.sum())
        s["sum_d2"] += float(d2.sum())
        s["nonfinite"] += nonfinite
        a = np.abs(d) if ok is None else np.abs(d[ok])
        rel = a / (np.abs(b if ok is None else b[ok]) + REL_EPS)
        s["n"] += a.size
        s["sum_abs"] += float(a.sum())
        s["sum_rel"] += float(rel.sum())
        if a.size:
            s["max_abs"] = max(s["max_abs"], float(a.max()))
            s["max_rel"] = max(s["max_rel"], float(rel.max()))
            seen = b if ok is None else b[ok]
            s["b_min"], s["b_max"] = min(s["b_min"], float(seen.min())), max(s["b_max"], float(seen.max()))
        if self.quantiles:
            self.hist_abs.add(a, infinite=nonfinite)
            self.hist_rel.add(rel, infinite=nonfinite)

    def _add_sums(self, e: ErrorSums, size: int) -> None:
        """Add a batch's figures from :func:`mpinfer.errorsums.error_sums` (``size`` values, all finite)."""
        s = self.s
        cos = np.concatenate(e.cos) if e.cos else np.ones(0)
        s["samples"] += len(cos)
        if len(cos):
            self.cosine_min = min(self.cosine_min, float(cos.min()))
        for key in ("sum_b2", "sum_c2", "sum_bc", "sum_d2", "sum_abs", "sum_rel"):
            s[key] += getattr(e, key)
        s["n"] += size
        if size:
            s["max_abs"], s["max_rel"] = max(s["max_abs"], e.max_abs), max(s["max_rel"], e.max_rel)
            s["b_min"], s["b_max"] = min(s["b_min"], e.b_min), max(s["b_max"], e.b_max)
        if self.quantiles and e.hist_abs is not None and e.hist_rel is not None:
            self.hist_abs.add_counts(e.hist_abs.counts, e.hist_abs.zeros, e.hist_abs.tiny, e.hist_abs.huge)
            self.hist_rel.add_counts(e.hist_rel.counts, e.hist_rel.zeros, e.hist_rel.tiny, e.hist_rel.huge)

    def _update_classes(self, b_in: np.ndarray, c_in: np.ndarray, labels: np.ndarray | None) -> None:
        classes = b_in.shape[-1]
        b, c = _comparable(b_in).reshape(-1, classes), _comparable(c_in).reshape(-1, classes)
        rank = np.minimum(rank_of_reference_top(b, c), MAX_TOPK)
        if not np.isfinite(c).all():  # a row with NaN/Inf where the baseline is finite is a miss
            rank = np.where((np.isfinite(b) & ~np.isfinite(c)).any(axis=1), MAX_TOPK, rank)
        self.rank_counts += np.bincount(rank, minlength=MAX_TOPK + 1)
        self.s["rows"] += len(rank)
        if labels is None or b_in.ndim != 2 or len(labels) != b_in.shape[0]:
            return
        lab = np.asarray(labels).reshape(-1).astype(np.int64)
        self.s["labeled"] += lab.size
        self.s["correct_b"] += int(np.count_nonzero(_argmax(b) == lab))
        self.s["correct_c"] += int(np.count_nonzero(_argmax(c) == lab))

    def finalize(self) -> dict[str, float | None]:
        """The metric values (see :data:`METRIC_DOCS`); None where a metric does not apply to this output."""
        return self._values(self.s, self.rank_counts, self.cosine_min, self.hist_abs, self.hist_rel)

    def optimistic(self, full: OutputAccumulator) -> dict[str, float | None]:
        """The best values this output can still reach on a whole sample set of which it saw a subset.

        ``self`` accumulated the candidate on some samples; ``full`` accumulated the baseline against itself
        on all of them (so it holds the reference's sums over the whole set). Whatever the candidate gives on
        the samples not run, its metrics over the whole set are no better than these bounds, so a check the
        bounds fail, the whole set fails too (the budget search rejects candidates on a few samples so):

        * ``max_*``, ``cosine_min``, ``nan``/``inf``/``nonfinite``, ``mismatch``: the subset's own value (the
          other samples could be perfect);
        * ``range_err``: the subset's largest error against the whole set's range;
        * ``mean_*``, median, p99: the subset's errors with a zero error on every other element;
        * ``rel_l2``, ``snr_db``: the subset's error energy against the whole set's signal energy;
        * ``cosine``: the supremum over every possible candidate on the other samples,
          ``sqrt((bc^2/cc + R) / (bb + R))`` from the subset's sums ``bc``, ``bb``, ``cc`` and the other
          samples' signal energy ``R`` (reached by the other samples' reference scaled by ``R·cc/bc``; not by
          a perfect copy of it, which can be worse);
        * ``topK``, ``match``, ``accuracy``: every other row (element, labelled sample) a hit.
        """
        s, f = dict(self.s), full.s
        rest_n, rest_rows = f["n"] - s["n"] - s["nonfinite"], f["rows"] - s["rows"]
        cos = _cosine_bound(s["sum_bc"], s["sum_b2"], s["sum_c2"], f["sum_b2"] - s["sum_b2"])
        s.update(n=f["n"], sum_b2=f["sum_b2"], elements=f["elements"], rows=f["rows"])
        s.update(b_min=f["b_min"], b_max=f["b_max"])  # range_err: the whole set's range
        s["equal"] += f["elements"] - self.s["elements"]
        s["correct_c"] += f["labeled"] - self.s["labeled"]
        s.update(labeled=f["labeled"], correct_b=f["correct_b"])
        ranks = self.rank_counts.copy()
        ranks[0] += int(rest_rows)
        hists = (self.hist_abs.with_zeros(int(rest_n)), self.hist_rel.with_zeros(int(rest_n)))
        out = self._values(s, ranks, self.cosine_min, *hists)
        if out["cosine"] is not None and s["nonfinite"] == 0:
            out["cosine"] = cos
        return out

    def _values(
        self, s: Mapping[str, float], ranks: np.ndarray, cosine_min: float, h_abs: LogHistogram, h_rel: LogHistogram
    ) -> dict[str, float | None]:
        bad = s["nonfinite"] > 0
        n = s["n"]
        # an output with no values compared (zero-size, or no finite baseline value) measured nothing: its figures
        # are None (unmeasured), never the perfect 0 / 1 / inf the sums of nothing would give
        measured = n > 0 or bad

        def worst(value: float | None, poisoned: float) -> float | None:
            return poisoned if bad else value

        def quantile(hist: LogHistogram, q: float, top: float) -> float | None:
            if not self.quantiles or hist.total == 0:
                return None
            v = hist.quantile(q)
            return v if bad else min(v, top)  # a bin's edge never above the exact max

        out: dict[str, float | None] = {
            "max_abs": worst(s["max_abs"] if n else None, math.inf),
            "mean_abs": worst(s["sum_abs"] / n if n else None, math.inf),
            "median_abs": quantile(h_abs, 0.5, s["max_abs"]),
            "p99_abs": quantile(h_abs, 0.99, s["max_abs"]),
            "max_rel": worst(s["max_rel"] if n else None, math.inf),
            "mean_rel": worst(s["sum_rel"] / n if n else None, math.inf),
            "median_rel": quantile(h_rel, 0.5, s["max_rel"]),
            "p99_rel": quantile(h_rel, 0.99, s["max_rel"]),
            "rel_l2": worst(relative_l2(s["sum_d2"], s["sum_b2"]) if measured else None, math.inf),
            "range_err": worst(range_error(s["max_abs"], s["b_min"], s["b_max"]) if n else None, math.inf),
            "cosine": worst(_cosine(s["sum_bc"], s["sum_b2"], s["sum_c2"]) if measured else None, -1.0),
            "cosine_min": worst(cosine_min if s["samples"] and measured else None, -1.0),
            "snr_db": worst(_snr_db(s["sum_b2"], s["sum_d2"]) if measured else None, -math.inf),
            "nan": s["nan"],
            "inf": s["inf"],
            "nonfinite": s["nonfinite"],
            "match": s["equal"] / s["elements"] if self.integer and s["elements"] else None,
            "mismatch": s["elements"] - s["equal"] if self.integer and s["elements"] else None,
        }
        classes = self.shape[-1] if self.shape else 0
        for k in self.topk:
            have = self.classes and s["rows"] and k < classes
            out[f"top{k}"] = float(ranks[:k].sum()) / s["rows"] if have else None
        if self.classes and s["labeled"]:
            acc_b, acc_c = s["correct_b"] / s["labeled"], s["correct_c"] / s["labeled"]
            out.update(baseline_accuracy=acc_b, accuracy=acc_c, accuracy_drop=acc_b - acc_c)
        return out


class ModelAccumulator:
    """The error of every output of one candidate, batch by batch: one :class:`OutputAccumulator` per output.

    Args:
        names: The outputs compared.
        class_outputs: The outputs that hold class scores (top-k applies to them alone); None guesses each
            (:func:`guess_class_output`).
        topk: Extra K of topK figures (``top1``/``top5`` always).
        quantiles: Keep the median/p99 histograms.
        user_metrics: The user's own metrics (:class:`mpinfer.usermetric.UserMetric`): each batch's ``inputs``
            must then be given to :meth:`update`.

    Raises:
        InvalidInputError: ``class_outputs`` names an output not in ``names``.
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        class_outputs: Collection[str] | None = None,
        topk: Iterable[int] = (),
        quantiles: bool = True,
        user_metrics: Sequence[Any] = (),
    ) -> None:
        if class_outputs is not None:
            check_output_names(class_outputs, names, "--class-outputs")
        ks = tuple(topk)
        self.outputs = {
            n: OutputAccumulator(
                n, classes=None if class_outputs is None else n in class_outputs, topk=ks, quantiles=quantiles
            )
            for n in names
        }
        self.user = {m.name: UserMetricAccumulator(m) for m in user_metrics}

    def update(
        self,
        baseline: Mapping[str, np.ndarray],
        candidate: Mapping[str, np.ndarray],
        labels: np.ndarray | None = None,
        inputs: Mapping[str, Any] | None = None,
    ) -> None:
        """Add one batch of every output; ``labels`` are the batch's class labels (one per sample), if any.

        ``inputs``: the batch's feeds, which the user metrics read (with ``_labels`` added from ``labels``).
        """
        for name, acc in self.outputs.items():
            acc.update(baseline[name], candidate[name], labels)
        self.update_user(baseline, candidate, inputs, labels)

    def update_user(
        self,
        baseline: Mapping[str, np.ndarray],
        candidate: Mapping[str, np.ndarray],
        inputs: Mapping[str, Any] | None,
        labels: np.ndarray | None = None,
    ) -> None:
        """Add one batch to the user metrics alone (the per-output figures are added elsewhere)."""
        if not self.user:
            return
        if inputs is None:
            raise ValueError("user metrics need each batch's inputs")
        feeds = dict(inputs)
        if labels is not None:
            feeds["_labels"] = np.asarray(labels)
        for acc in self.user.values():
            acc.update(baseline, candidate, feeds)

    def user_figures(self) -> dict[str, float | None]:
        """The user metrics' figures (``NAME``, ``NAME_min``, ``NAME_max`` of each)."""
        return {k: v for acc in self.user.values() for k, v in acc.finalize().items()}

    def finalize(self) -> dict[str, dict[str, float | None]]:
        """Output name → metric → value (None where a metric does not apply to the output).

        With user metrics, their figures are under :data:`USER_OUTPUT`.
        """
        out = {name: acc.finalize() for name, acc in self.outputs.items()}
        if self.user:
            out[USER_OUTPUT] = self.user_figures()
        return out

    def optimistic(
        self, full: ModelAccumulator, targets: Mapping[str, float] | None = None
    ) -> dict[str, dict[str, float | None]]:
        """Per output, :meth:`OutputAccumulator.optimistic` against ``full`` (the reference on every sample).

        User metrics: :meth:`UserMetricAccumulator.optimistic` towards ``targets`` (figure → the value the
        budget would like best: :meth:`mpinfer.checks.Checks.targets`).
        """
        per_output = {name: acc.optimistic(full.outputs[name]) for name, acc in self.outputs.items()}
        figures = {
            k: v
            for name, acc in self.user.items()
            for k, v in acc.optimistic(full.user[name].samples, targets or {}).items()
        }
        if self.user:
            per_output[USER_OUTPUT] = figures
        return per_output

    @property
    def class_outputs(self) -> list[str]:
        """The outputs treated as class scores (known once a batch was added, or when given)."""
        return [n for n, a in self.outputs.items() if a.classes]


def check_output_names(given: Iterable[str], names: Sequence[str], what: str) -> None:
    """Refuse output names a model does not have, listing the ones it has.

    Raises:
        InvalidInputError: For the first unknown name.
    """
    for name in given:
        if name not in names:
            raise InvalidInputError(
                format_message(
                    f"{what}: output '{name}'",
                    "a name the model does not have",
                    "one of " + ", ".join(f"'{n}'" for n in names),
                    "output names are case-sensitive; `mpinfer compare --help` shows the check grammar",
                )
            )


def parse_class_outputs(text: str | None) -> tuple[str, ...] | None:
    """``--class-outputs``: comma-separated output names; ``none`` (or empty) for none; None: not given (guess)."""
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    return () if names in ((), ("none",)) else names


def worst_values(per_output: Mapping[str, Mapping[str, float | None]]) -> dict[str, float]:
    """Each metric's worst value over the outputs it applies to (None values skipped, absent when none has one).

    The plan summary's figures: a model's headline is its worst output. NaN counts as the worst.
    """
    out: dict[str, float] = {}
    for values in per_output.values():
        for key, value in values.items():
            if value is None:
                continue
            v = float(value)
            if key not in out or math.isnan(v):
                out[key] = v
            elif not math.isnan(out[key]):
                out[key] = min(out[key], v) if higher_is_better(key) else max(out[key], v)
    return out


def _cosine(bc: float, b2: float, c2: float) -> float:
    if b2 == 0 and c2 == 0:
        return 1.0
    if b2 == 0 or c2 == 0:
        return 0.0
    return float(bc / math.sqrt(b2 * c2))


def _cosine_bound(bc: float, bb: float, cc: float, rest: float) -> float:
    """The largest global cosine reachable when the samples not seen hold reference energy ``rest``."""
    if bb + rest <= 0:  # an all-zero reference: 1 only if the candidate is zero too
        return 1.0 if cc == 0 else 0.0
    if bc > 0 and cc > 0:
        return min(1.0, math.sqrt((bc * bc / cc + rest) / (bb + rest)))
    return math.sqrt(max(rest, 0.0) / (bb + rest))


def _snr_db(b2: float, d2: float) -> float:
    if d2 == 0:
        return math.inf
    if b2 == 0:
        return -math.inf
    return 10.0 * math.log10(b2 / d2)
