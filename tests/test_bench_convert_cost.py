"""bench/convert_cost.py's fit of convert and floor to fixed + per-sample cost (``--samples 192,576,1920``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
convert_cost = pytest.importorskip("convert_cost")


def _points(c0: float, c1: float, f0: float, f1: float, ns: list[int]) -> list[tuple[int, float, float]]:
    return [(n, c0 + c1 * n, f0 + f1 * n) for n in ns]


def test_the_fit_recovers_fixed_and_per_sample_costs_and_the_count_past_which_convert_is_within_2x() -> None:
    # convert 0.8 s + 2 ms a sample, floor 0.1 s + 1.25 ms a sample: 1.6x as N grows, and
    # 0.8 + 0.002 N <= 2 (0.1 + 0.00125 N)  <=>  N >= 0.6 / 0.0005 = 1200
    fit = convert_cost.scaling(_points(0.8, 0.002, 0.1, 0.00125, [192, 576, 1920]))
    assert fit["convert_fixed_s"] == pytest.approx(0.8)
    assert fit["convert_ms_per_sample"] == pytest.approx(2.0)
    assert fit["floor_fixed_s"] == pytest.approx(0.1)
    assert fit["floor_ms_per_sample"] == pytest.approx(1.25)
    assert fit["ratio_limit"] == pytest.approx(1.6)
    assert fit["within_2x_from"] == pytest.approx(1200)
    c = 0.8 + 0.002 * 1200
    assert c == pytest.approx(2 * (0.1 + 0.00125 * 1200))  # the named count is where the lines cross 2x


def test_no_count_is_named_when_convert_costs_twice_the_floor_a_sample_or_more() -> None:
    fit = convert_cost.scaling(_points(0.8, 2.5e-3, 0.1, 1.1e-3, [192, 1920]))
    assert fit["ratio_limit"] == pytest.approx(2.5e-3 / 1.1e-3)
    assert fit["within_2x_from"] is None


def test_a_convert_within_2x_at_every_count_is_named_from_zero() -> None:
    fit = convert_cost.scaling(_points(0.1, 1e-3, 0.2, 1e-3, [10, 20]))
    assert fit["within_2x_from"] == 0.0


def test_least_squares_through_noisy_points() -> None:
    intercept, slope = convert_cost.fit_line([1.0, 2.0, 3.0], [1.0, 2.0, 4.0])
    assert slope == pytest.approx(1.5)
    assert intercept == pytest.approx(7 / 3 - 1.5 * 2)


@pytest.mark.parametrize("text", ["", "0", "192,x", "-5"])
def test_sample_counts_refuse_what_is_not_a_positive_count(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="positive sample counts"):
        convert_cost.sample_counts(text)


def test_sample_counts_read_one_or_several() -> None:
    assert convert_cost.sample_counts("192") == [192]
    assert convert_cost.sample_counts("192,576, 1920") == [192, 576, 1920]
    assert convert_cost.case_name("deep", 192) == "deep"
    assert convert_cost.case_name("deep", 1920) == "deep@1920"
