"""Budget parsing and output metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpinfer.errors import InvalidInputError
from mpinfer.precision.budget import output_metrics, parse_budget


def test_parse_budget_terms():
    b = parse_budget("cosine>=0.9999, top1>=0.999,max_abs<=1e-2,rel<=0.01,snr>=40,top5>=1")
    assert [str(t) for t in b.terms] == [
        "cosine>=0.9999",
        "top1>=0.999",
        "max_abs<=0.01",
        "rel<=0.01",
        "snr>=40",
        "top5>=1",
    ]


@pytest.mark.parametrize(
    "text, match",
    [
        ("cosin>=0.9", "Budget metric 'cosin'.*one of cosine"),
        ("cosine<=0.9", "'>='"),
        ("max_abs>=1", "'<='"),
        ("cosine=0.9", "metric>=value"),
        ("", "at least one term"),
    ],
)
def test_parse_budget_errors(text, match):
    with pytest.raises(InvalidInputError, match=match):
        parse_budget(text)


def test_metrics_values():
    ref = [{"y": np.array([[1.0, 2.0, 3.0], [3.0, 1.0, 0.0]], np.float32)}]
    same = output_metrics(ref, ref, ["y"])
    assert same["cosine"] == pytest.approx(1.0) and same["max_abs"] == 0 and same["top1"] == 1
    assert math.isinf(same["snr"])
    cand = [{"y": np.array([[1.0, 2.0, 3.0], [0.0, 1.0, 3.0]], np.float32)}]
    m = output_metrics(ref, cand, ["y"], labels=np.array([2, 2]))
    assert m["top1"] == 0.5 and m["max_abs"] == 3 and m["accuracy"] == 1.0
    nan = [{"y": np.array([[np.nan, 2.0, 3.0], [3.0, 1.0, 0.0]], np.float32)}]
    bad = output_metrics(ref, nan, ["y"])
    assert not parse_budget("cosine>=0.5").met(bad)


@pytest.mark.parametrize("seed", range(6))
def test_optimistic_metrics_bound_the_metrics_of_all_samples(seed):
    """From any subset of the samples, the bounds are never worse than the metrics of all of them (so a
    budget they break is broken), and on all samples they are those metrics."""
    from mpinfer.precision.budget import HIGHER_IS_BETTER, optimistic_metrics

    rng = np.random.default_rng(seed)
    n = 12
    ref = {"a": rng.standard_normal((n, 7)), "b": rng.standard_normal((n, 3, 5))}
    noise = 10.0 ** rng.uniform(-4, 0, size=(n, 1))  # samples differ a lot in how wrong they are
    cand = {"a": ref["a"] + noise * rng.standard_normal((n, 7)), "b": ref["b"] + 0.1 * noise[:, :, None]}
    if seed == 5:
        cand["a"][3, 2] = np.inf  # a non-finite output fails everything, from any subset holding it
    labels = rng.integers(0, 7, n)
    names = ["a", "b"]
    full = output_metrics([ref], [cand], names, labels=labels, topk=(1, 3))
    signal = {k: float((v**2).sum()) for k, v in ref.items()}
    for rows in (np.arange(n), np.array([3]), np.sort(rng.choice(n, 4, replace=False))):
        sub = optimistic_metrics(
            {k: v[rows] for k, v in ref.items()},
            {k: v[rows] for k, v in cand.items()},
            names,
            n,
            signal,
            labels=labels[rows],
            topk=(1, 3),
        )
        assert set(sub) == set(full)
        for key, value in full.items():
            higher = HIGHER_IS_BETTER.get(key, True)
            if len(rows) == n:
                assert sub[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
            elif higher:
                assert sub[key] >= value - 1e-12, (key, rows)
            else:
                assert sub[key] <= value + 1e-12, (key, rows)
    if seed == 5:
        assert math.isinf(
            optimistic_metrics(
                {k: v[[3]] for k, v in ref.items()}, {k: v[[3]] for k, v in cand.items()}, names, n, signal
            )["max_abs"]
        )


def test_topk_agreement_counts_like_a_stable_sort_of_the_candidate():
    """topK: the reference's argmax is among the candidate's first K in a stable descending sort.

    Ties go by index and NaN sorts last, on rows with every kind of tie, inf and NaN (ref kept finite
    where the candidate is not, so the rows are scored rather than failed as non-finite).
    """
    rng = np.random.default_rng(3)
    for _ in range(300):
        n, m = int(rng.integers(1, 6)), int(rng.integers(2, 9))
        ref = rng.integers(-3, 3, (n, m)).astype(np.float64)
        cand = rng.choice([-np.inf, -1.0, 0.0, -0.0, 1.0, 2.0, np.inf, np.nan], (n, m))
        top = rng.integers(0, m, n)
        cand[np.arange(n), top] = np.where(np.isfinite(cand[np.arange(n), top]), cand[np.arange(n), top], 0.5)
        ref[~np.isfinite(cand)] = np.nan  # candidate non-finite only where the reference is
        ref[np.arange(n), top] = 9.0  # a finite argmax per row
        order = np.argsort(-cand, axis=1, kind="stable")
        for k in (1, 2, 3):
            want = np.mean([t in o[:k] for t, o in zip(top, order, strict=True)])
            got = output_metrics([{"y": ref}], [{"y": cand}], ["y"], topk=(k,))[f"top{k}"]
            assert got == want, (k, ref, cand)
