"""The user's own metric in the metrics core: loading, figures, checks, errors (mpinfer.usermetric)."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest

from mpinfer.checks import parse_checks
from mpinfer.errors import InvalidInputError
from mpinfer.metrics import USER_OUTPUT, ModelAccumulator
from mpinfer.usermetric import UserMetricError, as_metrics, from_callable, parse_metric

METRICS = textwrap.dedent(
    """
    import numpy as np

    def agree(baseline, candidate, inputs):
        b, c = baseline["y"], candidate["y"]
        return ((b > 0) == (c > 0)).reshape(len(b), -1).mean(axis=1)

    def mean_err(baseline, candidate, inputs):
        return float(np.abs(baseline["y"] - candidate["y"]).mean())

    def right(baseline, candidate, inputs):
        return (candidate["y"].argmax(axis=1) == inputs["_labels"]).astype(float)

    def boom(baseline, candidate, inputs):
        return helper(baseline)

    def helper(baseline):
        raise ValueError("no boxes in this batch")

    def nan(baseline, candidate, inputs):
        out = np.zeros(len(baseline["y"]))
        out[1] = np.nan
        return out

    def square(baseline, candidate, inputs):
        return np.zeros((len(baseline["y"]), 2))

    def short(baseline, candidate, inputs):
        return np.zeros(1)

    def text(baseline, candidate, inputs):
        return "good"
    """
)


@pytest.fixture
def metric_file(tmp_path):
    path = tmp_path / "mymetrics.py"
    path.write_text(METRICS)
    return path


def _batches(n=3, rows=4, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        b = rng.standard_normal((rows, 5)).astype(np.float32)
        c = b + (0.3 * rng.standard_normal(b.shape)).astype(np.float32)
        yield {"x": b}, {"y": b}, {"y": c}, rng.integers(0, 5, rows)


def _run(metrics, labels=False):
    acc = ModelAccumulator(["y"], user_metrics=metrics)
    for feeds, b, c, lab in _batches():
        acc.update(b, c, lab if labels else None, inputs=feeds)
    return acc


def test_per_sample_and_scalar_figures(metric_file):
    metrics = as_metrics([f"agree={metric_file}:agree", f"err={metric_file}:mean_err"])
    figures = _run(metrics).finalize()[USER_OUTPUT]
    per_sample = np.concatenate([((b["y"] > 0) == (c["y"] > 0)).mean(axis=1) for _f, b, c, _l in _batches()])
    assert figures["agree"] == pytest.approx(per_sample.mean())
    assert figures["agree_min"] == per_sample.min() and figures["agree_max"] == per_sample.max()
    errs = [np.abs(b["y"] - c["y"]).mean() for _f, b, c, _l in _batches()]
    assert figures["err"] == pytest.approx(np.mean(errs))  # equal batches: the mean of the batch means
    assert figures["err_min"] is None and figures["err_max"] is None  # a float per batch: no worst sample


def test_labels_reach_the_metric(metric_file):
    metrics = as_metrics({"right": f"{metric_file}:right"})
    figures = _run(metrics, labels=True).finalize()[USER_OUTPUT]
    want = np.concatenate([(c["y"].argmax(1) == lab) for _f, _b, c, lab in _batches()]).mean()
    assert figures["right"] == pytest.approx(want)
    with pytest.raises(UserMetricError, match=r"(?s)Metric 'right' .*:right\) on batch 0.*KeyError: '_labels'"):
        _run(metrics, labels=False)


def test_checks_read_the_figures_and_take_direction_from_the_operator(metric_file):
    metrics = as_metrics([f"agree={metric_file}:agree"])
    per_output = _run(metrics).finalize()
    worst = per_output[USER_OUTPUT]["agree_min"]
    checks = parse_checks(f"agree_min>={worst},agree<=1,cosine>=0.5", ["agree"])
    assert checks.met(per_output) and str(checks) == f"agree_min>={worst:.10g},agree<=1,cosine>=0.5"
    assert parse_checks(f"agree_min>{worst}", ["agree"]).failures(per_output) == [
        f"agree_min>{worst:.10g} (got {worst:.6g})"
    ]
    assert parse_checks("agree>=0.5,agree_max<=1,agree_min==0.7", ["agree"]).targets() == {
        "agree": math.inf, "agree_max": -math.inf, "agree_min": 0.7,
    }
    with pytest.raises(InvalidInputError, match="unknown metric 'agree'.*--metric NAME=FILE.py:FUNCTION"):
        parse_checks("agree>=0.5")
    with pytest.raises(InvalidInputError, match="output selector 'y:' on the user metric"):
        parse_checks("y:agree>=0.5", ["agree"])


def test_optimistic_bounds_follow_the_budget(metric_file):
    metrics = as_metrics([f"agree={metric_file}:agree"])
    full = _run(metrics)  # 12 samples
    sub = ModelAccumulator(["y"], user_metrics=metrics)
    feeds, b, c, _ = next(_batches())
    sub.update(b, c, None, inputs=feeds)
    seen = sub.finalize()[USER_OUTPUT]
    up = parse_checks("agree>=0.9,agree_min>=0.9,agree_max>=0.9", ["agree"]).targets()
    bound = sub.optimistic(full, up)[USER_OUTPUT]
    # the unseen samples may lift the mean and the max anywhere, never the min above the seen samples' min
    assert bound == {"agree": math.inf, "agree_min": seen["agree_min"], "agree_max": math.inf}
    down = parse_checks("agree<=0.1,agree_max<=0.1", ["agree"]).targets()
    bound = sub.optimistic(full, down)[USER_OUTPUT]
    assert bound["agree"] == -math.inf and bound["agree_max"] == seen["agree_max"]
    assert full.optimistic(full, up)[USER_OUTPUT] == full.finalize()[USER_OUTPUT]  # every sample seen: exact


@pytest.mark.parametrize(
    ("function", "pattern"),
    [
        ("boom", r"(?s)on batch 0: the metric's code raised .*line 15, in boom\n.*line 18, in helper\n.*"
                 r"ValueError: no boxes in this batch$"),
        ("nan", r"on batch 0: received NaN for sample\(s\) 1 of the batch"),
        ("square", r"on batch 0: received an array of shape \(4, 2\), expected a float or a 1-D array of 4 values"),
        ("short", r"received an array of shape \(1,\), expected a float or a 1-D array of 4 values"),
        ("text", r"received a return value of type str"),
    ],
)
def test_errors_in_the_users_code_name_file_function_and_batch(metric_file, function, pattern):
    metrics = as_metrics([f"m={metric_file}:{function}"])
    with pytest.raises(UserMetricError, match=pattern) as info:
        _run(metrics)
    message = str(info.value)
    assert f"Metric 'm' ({metric_file.resolve()}:{function})" in message
    assert "mpinfer/" not in message  # the user's frames only


def test_names_and_specs_refused(metric_file, tmp_path):
    for name, clash in (("cosine", "cosine"), ("snr", "snr"), ("step_cosine", "step_cosine_min"), ("top3", "top3")):
        with pytest.raises(InvalidInputError, match=f"whose figure '{clash}' is a built-in metric"):
            parse_metric(f"{name}={metric_file}:agree")
    with pytest.raises(InvalidInputError, match="lower-case letters"):
        parse_metric(f"IoU={metric_file}:agree")
    with pytest.raises(InvalidInputError, match="both give the figure 'a_min'"):
        as_metrics([f"a={metric_file}:agree", f"a_min={metric_file}:agree"])
    with pytest.raises(InvalidInputError, match="no function 'nope'.*functions there: agree, boom"):
        parse_metric(f"a={metric_file}:nope")
    with pytest.raises(InvalidInputError, match="which is not a file"):
        parse_metric(f"a={tmp_path / 'missing.py'}:agree")
    with pytest.raises(InvalidInputError, match="NAME=PATH.py:FUNCTION"):
        parse_metric(f"{metric_file}:agree")
    broken = tmp_path / "broken.py"
    broken.write_text("import numpy\nraise RuntimeError('missing weights file')\n")
    with pytest.raises(UserMetricError, match=r"(?s)loading .*broken.py' raised.*line 2.*RuntimeError: missing"):
        parse_metric(f"a={broken}:f")


def test_callable_and_file_record_the_sha256(metric_file):
    import hashlib

    (m,) = as_metrics([f"agree={metric_file}:agree"])
    assert m.record() == {
        "file": str(metric_file.resolve()), "function": "agree",
        "sha256": hashlib.sha256(metric_file.read_bytes()).hexdigest(),
    }
    fn = from_callable("mine", test_callable_and_file_record_the_sha256)
    assert fn.function_name == "test_callable_and_file_record_the_sha256" and fn.sha256 == hashlib.sha256(
        open(__file__, "rb").read()).hexdigest()
    assert from_callable("anon", np.mean).path is None  # no source file: no sha256
