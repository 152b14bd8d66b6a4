"""compare --metric, mpinfer.compare(metrics=...), report --check and the reports on a user metric."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import mpinfer
from tests.conftest import assert_user_error

ROOT = Path(__file__).resolve().parents[2]
DROP = f"drop={ROOT / 'models/metrics/label_accuracy.py'}:accuracy_drop"
DECISIONS = f"agree={ROOT / 'models/metrics/decisions.py'}:decision_agreement"


def _expected(base: Path, cand: Path, data: Path) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: baseline correct - candidate correct, and the decision agreement at 0.5 (ORT, numpy)."""
    import onnxruntime as ort

    d = np.load(data)
    x, labels = d["x"], d["_labels"]
    run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    b, c = run(base), run(cand)
    drop = (b.argmax(1) == labels).astype(float) - (c.argmax(1) == labels).astype(float)
    return drop, ((b > 0.5) == (c > 0.5)).mean(axis=1)


def test_compare_metric_figures_checks_and_reports(invoke, mlp_files, tmp_path):
    rep = tmp_path / "rep"
    r = invoke("compare", mlp_files["base"], mlp_files["fp16"], "--data", mlp_files["small"], "--metric", DROP,
               "--metric", DECISIONS, "--check", "drop<=0.05,agree_min>=0.9,cosine>=0.999", "--no-divergence",
               "--report", rep)
    assert r.exit_code == 0, r.output
    report = json.loads((rep / "report.json").read_text())
    figures = report["candidates"][0]["metrics"]
    drop, agree = _expected(mlp_files["base"], mlp_files["fp16"], mlp_files["small"])
    assert figures["drop"] == pytest.approx(drop.mean(), abs=1e-12)
    assert figures["agree_min"] == pytest.approx(agree.min()) and figures["agree"] == pytest.approx(agree.mean())
    rec = report["user_metrics"]["drop"]
    assert rec["function"] == "accuracy_drop" and len(rec["sha256"]) == 64
    assert "drop<=0.05" in report["checks"]
    md = (rep / "report.md").read_text()
    assert "### Metrics of your own" in md and "| drop |" in md and rec["sha256"][:12] in md
    assert "Metrics of your own" in (rep / "index.html").read_text() and "Metrics of your own" in r.output
    # report --check re-thresholds the recorded figures; the user figures need no file there
    again = invoke("report", rep, "--check", f"agree_min>{figures['agree_min']}")
    assert again.exit_code == 1 and "agree_min>" in again.output
    assert_user_error(invoke("report", rep, "--check", "iou>=0.5"), "unknown metric 'iou'.*user metrics: agree")


def test_a_failed_user_check_is_named_as_the_users_not_as_an_output(invoke, mlp_files, tmp_path):
    rep = tmp_path / "rep"
    r = invoke("compare", mlp_files["base"], mlp_files["fp16"], "--data", mlp_files["small"], "--metric", DECISIONS,
               "--check", "agree_min>1", "--no-divergence", "--report", rep)
    assert r.exit_code == 1, r.output
    page = (rep / "index.html").read_text()
    assert "(user metrics): agree_min&gt;1" in page and "output &#x27;(user metrics)&#x27;" not in page
    assert "(user metrics): agree_min>1" in r.output and "output '(user metrics)'" not in r.output


def test_api_metrics_keyword_takes_a_callable(mlp_files):
    seen = {}

    def flips(baseline, candidate, inputs):
        seen["keys"] = sorted(inputs)
        return float((baseline["logits"].argmax(1) != candidate["logits"].argmax(1)).mean())

    result = mpinfer.compare(mlp_files["base"], mlp_files["fp16"], data=mlp_files["small"], metrics={"flips": flips},
                             check="flips<=0", divergence=False)
    assert result, result.summary()
    assert seen["keys"] == ["_labels", "x"]
    assert result.candidates[0].metrics["flips"] == 0.0 and result.candidates[0].metrics["flips_min"] is None
    assert result.user_metrics["flips"]["function"].endswith("flips")
    assert result.user_metrics["flips"]["sha256"] is not None  # this test file's


def test_compare_metric_errors_exit_1_and_write_nothing(invoke, mlp_files, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(baseline, candidate, inputs):\n    return baseline['nope']\n")
    rep = tmp_path / "rep"
    r = invoke("compare", mlp_files["base"], mlp_files["fp16"], "--data", mlp_files["small"], "--metric",
               f"m={bad}:f", "--no-divergence", "--report", rep)
    assert_user_error(r, r"Metric 'm' \(.*bad.py:f\) on batch 0: the metric's code raised")
    assert "line 2, in f" in r.output and "KeyError: 'nope'" in r.output and "mpinfer/" not in r.output
    assert not rep.exists() or not any(rep.iterdir())
    assert_user_error(invoke("compare", mlp_files["base"], mlp_files["fp16"], "--metric", f"cosine={bad}:f"),
                      "built-in metric")
    assert_user_error(invoke("compare", mlp_files["base"], mlp_files["fp16"], "--check", "m>=1"),
                      "unknown metric 'm'")
