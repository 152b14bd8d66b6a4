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
