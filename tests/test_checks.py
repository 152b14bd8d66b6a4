"""The one check grammar: parsing, per-output selectors, applicability, slack and error messages."""

from __future__ import annotations

import math

import pytest

from mpinfer.checks import DEFAULT_CHECKS, Check, parse_checks
from mpinfer.errors import InvalidInputError
from mpinfer.metrics import METRIC_DOCS

PER_OUTPUT = {
    "logits": {"cosine": 0.9995, "top1": 0.98, "max_abs": 0.2, "nonfinite": 0.0},
    "boxes": {"cosine": 0.99999, "top1": None, "max_abs": 0.6, "nonfinite": 0.0},
}


def test_parse_canonical_names_and_aliases():
    checks = parse_checks("cosine>=0.9999, top1>=0.999,max_abs<=0.01,snr>20,rel<=1e-2,acc>=0.9,top-5>=1,top3>=0.5")
    assert [str(c) for c in checks] == [
        "cosine>=0.9999", "top1>=0.999", "max_abs<=0.01", "snr_db>20", "rel_l2<=0.01", "accuracy>=0.9",
        "top5>=1", "top3>=0.5",
    ]  # fmt: skip
    assert checks.needs_labels and checks.topk == (1, 3, 5)
    assert [str(c) for c in parse_checks(DEFAULT_CHECKS)] == DEFAULT_CHECKS.split(",")


def test_convert_budget_strings_keep_parsing():
    """The metric names convert's --budget accepted: rel, snr, mean_abs, accuracy and any topK."""
    text = "cosine>=0.9999,top1>=0.999,max_abs<=1e-2,rel<=1e-2,snr>=40,accuracy>=0.95,mean_abs<=1,top7>=0.9"
    checks = parse_checks(text)
    assert [c.metric for c in checks] == [
        "cosine", "top1", "max_abs", "rel_l2", "snr_db", "accuracy", "mean_abs", "top7",
    ]  # fmt: skip


def test_per_output_selectors():
    checks = parse_checks("logits:top1>=0.99,boxes:max_abs<=0.5,output:0:cosine>=0.9")
    assert [(c.output, c.metric) for c in checks] == [("logits", "top1"), ("boxes", "max_abs"), ("output:0", "cosine")]
    assert str(checks.items[0]) == "logits:top1>=0.99"
    failures = checks.failures({**PER_OUTPUT, "output:0": {"cosine": 1.0}})
    assert failures == ["logits:top1>=0.99 on 'logits' (got 0.98)", "boxes:max_abs<=0.5 on 'boxes' (got 0.6)"]


def test_no_selector_applies_to_every_output_worst_wins():
    assert parse_checks("cosine>=0.999").met(PER_OUTPUT)
    assert not parse_checks("max_abs<=0.5").met(PER_OUTPUT)  # boxes is the worst
    assert parse_checks("top1>=0.9").met(PER_OUTPUT)  # top1 applies to logits alone


def test_a_class_metric_on_a_non_class_output_is_not_applicable_never_a_pass():
    checks = parse_checks("boxes:top1>=0.1")
    [failure] = checks.failures(PER_OUTPUT)
    assert "not applicable" in failure and "does not hold class scores" in failure and "--class-outputs" in failure
    assert checks.slack(PER_OUTPUT) == -math.inf and checks.inapplicable(PER_OUTPUT)
    assert "no output holds class scores" in parse_checks("top1>=0.1").failures({"boxes": PER_OUTPUT["boxes"]})[0]


def test_slack_is_relative_to_the_threshold_worst_check():
    checks = parse_checks("cosine>=0.999,max_abs<=1")
    s = checks.slack(PER_OUTPUT)
    assert s == pytest.approx(min((0.9995 - 0.999) / 0.999, (1 - 0.6) / 1), rel=1e-12)
    assert parse_checks("max_abs<=0.1").slack(PER_OUTPUT) < 0
    assert Check(None, "cosine", ">=", 0.9).slack(math.nan) == -math.inf
    assert Check(None, "cosine", ">=", 0.9).evaluate({"cosine": math.nan}) is False


@pytest.mark.parametrize("typo, meant", [("cosin", "cosine"), ("COSINE_MN", "cosine_min"), ("snrr", "snr_db"),
                                         ("tp1", "top1"), ("rangeerr", "range_err")])
def test_a_metric_typo_gets_the_closest_name(typo, meant):
    with pytest.raises(InvalidInputError, match=rf"unknown metric '{typo}'.*did you mean '{meant}'\?"):
        parse_checks(f"{typo}>=0.9")


def test_unknown_metric_lists_the_valid_ones():
    with pytest.raises(InvalidInputError, match="unknown metric 'zebra'") as info:
        parse_checks("zebra>=0.9")
    for name in METRIC_DOCS:
        assert name in str(info.value)
    assert "snr=snr_db" in str(info.value)


def test_unknown_output_lists_the_models_outputs():
    with pytest.raises(InvalidInputError, match=r"unknown output 'logit'.*'logits', 'boxes'"):
        parse_checks("logit:top1>=0.9").check_outputs(["logits", "boxes"])
    parse_checks("logits:top1>=0.9,cosine>=0.9").check_outputs(["logits", "boxes"])


@pytest.mark.parametrize(
    "text", ["cosine=>0.9", "cosine>=abc", "cosine", ",", "", ":cosine>=1", "top0>=1", "top101>=1", "cosine>=nan"]
)
def test_malformed_checks(text):
    with pytest.raises(InvalidInputError, match="Check"):
        parse_checks(text)
