"""The metrics core: each definition against a one-shot numpy computation, streaming, bounds, class outputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpinfer.checks import parse_checks
from mpinfer.errors import InvalidInputError
from mpinfer.histogram import BINS_PER_DECADE, LogHistogram
from mpinfer.metrics import (
    ModelAccumulator,
    OutputAccumulator,
    guess_class_output,
    higher_is_better,
    worst_values,
)

EPS64 = float(np.finfo(np.float64).eps)


def _tol(n: int) -> float:
    """Relative tolerance of a float64 sum of ``n`` terms summed in another order (batch by batch)."""
    return 4 * EPS64 * math.sqrt(n) + EPS64


def _batches(seed=0, n=5, shape=(8, 10), noise=0.3):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        b = rng.standard_normal(shape).astype(np.float32)
        c = (b + rng.standard_normal(shape) * noise).astype(np.float16)
        yield b, c


def test_streaming_equals_one_shot_definitions():
    acc = OutputAccumulator("logits")
    bs, cs = [], []
    for b, c in _batches():
        acc.update(b, c)
        bs.append(b.astype(np.float64))
        cs.append(c.astype(np.float64))
    b, c = np.concatenate(bs), np.concatenate(cs)
    d = np.abs(c - b)
    v = acc.finalize()
    tol = _tol(b.size)
    assert v["max_abs"] == d.max()  # a max is exact in any order
    assert v["mean_abs"] == pytest.approx(d.mean(), rel=tol)
    assert v["cosine"] == pytest.approx((b * c).sum() / math.sqrt((b * b).sum() * (c * c).sum()), rel=tol)
    per_sample = (b * c).sum(1) / np.sqrt((b * b).sum(1) * (c * c).sum(1))
    assert v["cosine_min"] == pytest.approx(per_sample.min(), rel=tol)
    assert v["rel_l2"] == pytest.approx(math.sqrt((d * d).sum() / (b * b).sum()), rel=tol)
    assert v["range_err"] == d.max() / (b.max() - b.min())  # max and min are exact in any order
    assert v["snr_db"] == pytest.approx(10 * math.log10((b * b).sum() / (d * d).sum()), rel=tol)
    step = 10 ** (1 / BINS_PER_DECADE)
    for key, q in (("median_abs", 50), ("p99_abs", 99)):
        exact = np.percentile(d, q)
        assert exact / step <= v[key] <= exact * step, (key, v[key], exact)
    assert v["nan"] == v["inf"] == v["nonfinite"] == 0
    assert v["match"] is None and v["mismatch"] is None  # float output
    assert v["top1"] == np.mean(b.argmax(1) == c.argmax(1))
    top5 = np.argsort(-c, axis=1, kind="stable")[:, :5]
    assert v["top5"] == np.mean((top5 == b.argmax(1)[:, None]).any(axis=1))


def test_topk_reads_the_last_axis_every_leading_index_a_row():
    """[batch, seq, vocab]: each (batch, seq) position is a row, not each flattened sample."""
    b = np.zeros((2, 3, 6), np.float32)
    b[..., 0] = 5.0  # every row's top is class 0 ...
    c = b.copy()
    c[0, 1, 2] = 6.0  # ... except in one row of the candidate
    acc = OutputAccumulator("logits")
    acc.update(b, c)
    v = acc.finalize()
    assert v["top1"] == 5 / 6 and v["top5"] == 1.0


def test_topk_counts_like_a_stable_sort_of_the_candidate():
    """topK: the baseline's argmax among the candidate's first K in a stable descending sort (NaN last)."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        n, m = int(rng.integers(1, 6)), int(rng.integers(7, 12))
        ref = rng.integers(-3, 3, (n, m)).astype(np.float64)
        cand = rng.choice([-1.0, 0.0, -0.0, 1.0, 2.0], (n, m))
        top = rng.integers(0, m, n)
        ref[np.arange(n), top] = 9.0
        order = np.argsort(-cand, axis=1, kind="stable")
        acc = OutputAccumulator("y", classes=True, topk=(2, 3))
        acc.update(ref, cand)
        v = acc.finalize()
        for k in (1, 2, 3, 5):
            assert v[f"top{k}"] == np.mean([t in o[:k] for t, o in zip(top, order, strict=True)]), k


def test_nonfinite_candidate_makes_every_error_figure_its_worst():
    acc = OutputAccumulator("y")
    b = np.ones((4, 3), np.float32)
    c = b.copy()
    c[0, 0] = np.nan
    c[1, 1] = np.inf
    b[3, 2] = np.nan  # the baseline's own NaN is left out
    c[3, 2] = 7.0
    acc.update(b, c)
    v = acc.finalize()
    assert v["nan"] == 1 and v["inf"] == 1 and v["nonfinite"] == 2
    assert v["max_abs"] == v["mean_abs"] == v["rel_l2"] == math.inf
    assert v["cosine"] == v["cosine_min"] == -1.0 and v["snr_db"] == -math.inf


def test_nonfinite_row_is_a_topk_miss():
    b = np.array([[3.0, 1.0, 0.0], [3.0, 1.0, 0.0]], np.float32)
    c = b.copy()
    c[1, 2] = np.nan  # the argmax is still right, but the row holds a NaN where the baseline is finite
    acc = OutputAccumulator("logits", classes=True)
    acc.update(b, c)
    assert acc.finalize()["top1"] == 0.5


def test_integer_and_boolean_outputs_match_and_mismatch():
    acc = OutputAccumulator("ids")
    acc.update(np.array([[1, 2, 3, 4]], np.int64), np.array([[1, 2, 0, 4]], np.int64))
    v = acc.finalize()
    assert v["match"] == 0.75 and v["mismatch"] == 1 and v["top1"] is None and v["max_abs"] == 3
    flags = OutputAccumulator("keep")
    flags.update(np.array([True, False, True]), np.array([True, True, True]))
    assert flags.finalize()["mismatch"] == 1


def test_labels_score_class_outputs_with_one_row_per_sample():
    acc = OutputAccumulator("logits")
    b = np.eye(4, dtype=np.float32)[[0, 1, 2, 3]] * 3 - 1
    c = np.eye(4, dtype=np.float32)[[0, 1, 3, 2]] * 3 - 1
    acc.update(b, c, labels=np.array([0, 1, 2, 0]))
    v = acc.finalize()
    assert v["top1"] == 0.5 and v["top5"] is None  # 4 classes: top-5 does not apply
    assert v["baseline_accuracy"] == 0.75 and v["accuracy"] == 0.5 and v["accuracy_drop"] == 0.25


@pytest.mark.parametrize(
    "name, shape, values, expected",
    [
        ("logits", (2, 10), "normal", True),
        ("output", (2, 16, 32), "normal", True),
        ("probs", (2, 10), "softmax", True),
        ("pitch_map", (2, 50, 360), "sigmoid", False),  # multi-label probabilities (and a "pitch" name)
        ("tags", (2, 527), "sigmoid", False),  # probabilities in [0, 1] whose rows do not sum to 1
        ("pred_boxes", (2, 10), "normal", False),  # a regression word in the name
        ("dets", (2, 100, 4), "normal", False),  # [N, anchors, 4]: boxes
        ("seg", (2, 21, 8, 8), "normal", False),  # rank 4: a spatial map
        ("score", (2,), "normal", False),  # rank 1
    ],
)
def test_class_output_guess(name, shape, values, expected):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    if values == "softmax":
        x = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
    elif values == "sigmoid":
        x = 1 / (1 + np.exp(-x))
    assert guess_class_output(name, x) is expected


def test_model_accumulator_takes_the_users_class_outputs():
    rng = np.random.default_rng(1)
    out = {"logits": rng.standard_normal((4, 10)), "boxes": rng.standard_normal((4, 10))}
    acc = ModelAccumulator(["logits", "boxes"], class_outputs=["boxes"])
    acc.update(out, out)
    values = acc.finalize()
    assert values["logits"]["top1"] is None and values["boxes"]["top1"] == 1.0
    assert acc.class_outputs == ["boxes"]
    with pytest.raises(InvalidInputError, match=r"--class-outputs: output 'box'.*'logits', 'boxes'"):
        ModelAccumulator(["logits", "boxes"], class_outputs=["box"])
    with pytest.raises(InvalidInputError, match="Class-score output 'n'"):
        ModelAccumulator(["n"], class_outputs=["n"]).update({"n": np.ones(3, np.int64)}, {"n": np.ones(3, np.int64)})


def test_range_err_judges_each_output_against_its_own_spread_over_the_data():
    """One value per sample: an error riding on a large offset is material against the spread, whatever the
    cosine says; a constant output is judged against its magnitude, an all-zero one exactly."""
    z = np.random.default_rng(0).standard_normal((160, 1)).astype(np.float32)
    b = z + np.float32(1000.0)
    c = b.astype(np.float16).astype(np.float32)  # FP16 rounds 1000 + z to steps of 0.5
    acc = OutputAccumulator("score")
    for lo in range(0, 160, 16):
        acc.update(b[lo : lo + 16], c[lo : lo + 16])
    v = acc.finalize()
    d = np.abs(c.astype(np.float64) - b)
    assert v["cosine_min"] == 1.0 and v["cosine"] > 0.9999999  # the cosine of one positive value is 1
    assert v["range_err"] == d.max() / (float(b.max()) - float(b.min())) > 0.01  # 0.25 of a range of ~5
    const = OutputAccumulator("c")
    const.update(np.full((4, 2), 4.0, np.float32), np.full((4, 2), 4.5, np.float32))
    assert const.finalize()["range_err"] == 0.125  # 0.5 against |4|
    zero = OutputAccumulator("z")
    zero.update(np.zeros((4, 1), np.float32), np.zeros((4, 1), np.float32))
    assert zero.finalize()["range_err"] == 0.0
    zero.update(np.zeros((1, 1), np.float32), np.full((1, 1), 1e-30, np.float32))
    assert zero.finalize()["range_err"] == math.inf
    nan_ref = OutputAccumulator("n")  # elements where the baseline is NaN are left out of the range too
    nan_ref.update(np.array([[0.0], [np.nan], [2.0]], np.float32), np.array([[0.0], [7.0], [2.5]], np.float32))
    assert nan_ref.finalize()["range_err"] == 0.25


def test_worst_values_take_each_metrics_worst_output():
    per = {"a": {"cosine": 0.99, "max_abs": 0.1, "top1": None}, "b": {"cosine": 0.9, "max_abs": 0.01, "top1": 1.0}}
    assert worst_values(per) == {"cosine": 0.9, "max_abs": 0.1, "top1": 1.0}


@pytest.mark.parametrize("seed", range(6))
def test_optimistic_bounds_hold_for_any_outcome_on_the_other_samples(seed):
    """From a subset, the bounds are never worse than the metrics of the whole set, whatever the other samples
    hold (perfect, scaled, noisy), and on the whole set they are its metrics."""
    rng = np.random.default_rng(seed)
    n = 12
    ref = {"a": rng.standard_normal((n, 7)), "b": rng.standard_normal((n, 3, 5))}
    noise = 10.0 ** rng.uniform(-4, 0, size=(n, 1))
    cand = {"a": ref["a"] + noise * rng.standard_normal((n, 7)), "b": ref["b"] * (1 + noise[:, :, None])}
    if seed == 5:
        cand["a"][3, 2] = np.inf
    labels = rng.integers(0, 7, n)
    classes = ["a", "b"]
    full = ModelAccumulator(["a", "b"], class_outputs=classes, topk=(3,))
    full.update(ref, ref, labels)
    for rows in (np.arange(n), np.array([3]), np.sort(rng.choice(n, 4, replace=False))):
        sub = ModelAccumulator(["a", "b"], class_outputs=classes, topk=(3,))
        sub.update({k: v[rows] for k, v in ref.items()}, {k: v[rows] for k, v in cand.items()}, labels[rows])
        bound = sub.optimistic(full)
        rest = np.setdiff1d(np.arange(n), rows)
        for other in ("perfect", "scaled", "candidate"):
            whole = {k: v.copy() for k, v in cand.items()}
            for k in whole:
                fill = {"perfect": ref[k], "scaled": 3 * ref[k], "candidate": cand[k]}[other]
                whole[k][rest] = fill[rest]
            acc = ModelAccumulator(["a", "b"], class_outputs=classes, topk=(3,))
            acc.update(ref, whole, labels)
            _assert_bounds(bound, acc.finalize(), exact=len(rows) == n and other == "candidate")


def _assert_bounds(bound, values, *, exact):
    for out, vals in values.items():
        for key, v in vals.items():
            b = bound[out][key]
            if v is None or (b is None and key in ("median_abs", "p99_abs", "median_rel", "p99_rel")):
                continue
            if exact:
                assert b == pytest.approx(v, rel=_tol(1000), abs=EPS64), (out, key)
            elif higher_is_better(key):
                assert b >= v - _tol(1000) * abs(v), (out, key, b, v)
            else:
                assert b <= v + _tol(1000) * abs(v), (out, key, b, v)


def test_histogram_roundtrip_and_quantiles():
    h = LogHistogram()
    h.add(np.array([0.0, 0.0, 1e-3, 1e-2, 1e-1, 1.0, 1e20]), infinite=1)
    assert h.total == 8 and h.zeros == 2 and h.huge == 2
    h2 = LogHistogram.from_dict(h.to_dict())
    assert h2.total == h.total and np.array_equal(h2.counts, h.counts)
    assert h.quantile(0.0) == 0.0 and h.quantile(1.0) == math.inf


def test_histogram_quantiles_never_exceed_the_exact_max():
    acc = OutputAccumulator("y")
    b = np.zeros((100, 4), np.float32)
    acc.update(b, b + np.float32(0.001061))
    v = acc.finalize()
    assert v["p99_abs"] <= v["max_abs"] and v["median_abs"] <= v["max_abs"]


def test_chunked_batches_give_the_same_figures(monkeypatch):
    """A batch is converted to float64 a few samples at a time: every figure is the one-chunk figure."""
    import mpinfer.metrics as metrics

    rng = np.random.default_rng(4)
    b = rng.standard_normal((7, 3, 12)).astype(np.float32)
    c = (b + 0.01 * rng.standard_normal(b.shape)).astype(np.float16)
    c[5, 1, 2] = np.nan
    whole = OutputAccumulator("logits")
    whole.update(b, c)
    monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", 40)  # about one sample (36 values) per chunk
    chunked = OutputAccumulator("logits")
    chunked.update(b, c)
    for key, v in whole.finalize().items():
        got = chunked.finalize()[key]
        assert (v is None and got is None) or got == pytest.approx(v, rel=_tol(b.size)), key


@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0), (2, 0, 5)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
@pytest.mark.parametrize("classes", [None, False])
def test_a_zero_size_output_is_unmeasured_never_perfect(shape, dtype, classes):
    """A Split of 0 gives zero-size outputs: every error figure is None (no values), never 0 / cosine 1 / inf dB."""
    acc = ModelAccumulator(["y"], class_outputs=None if classes is None else [])
    empty = np.zeros(shape, dtype)
    acc.update({"y": empty}, {"y": empty})
    values = acc.finalize()["y"]
    for metric in ("max_abs", "mean_abs", "max_rel", "rel_l2", "range_err", "cosine", "cosine_min", "snr_db",
                   "median_abs", "p99_abs", "top1", "match", "mismatch"):
        assert values[metric] is None, (metric, values)
    checks = parse_checks("cosine>=0.999,max_abs<=1,snr_db>=40")
    assert len(checks.inapplicable(acc.finalize())) == 3  # a check on no values fails, saying why


def test_zero_size_batches_beside_full_ones_change_nothing():
    rng = np.random.default_rng(0)
    b = rng.standard_normal((4, 6)).astype(np.float32)
    c = b + np.float32(1e-3) * rng.standard_normal((4, 6)).astype(np.float32)
    alone, mixed = OutputAccumulator("y"), OutputAccumulator("y")
    alone.update(b, c)
    mixed.update(b[:0], c[:0])
    mixed.update(b, c)
    mixed.update(b[:0], c[:0])
    assert mixed.finalize() == alone.finalize()
