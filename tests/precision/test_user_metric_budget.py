"""A budget in the user's own metric (--metric): it drives the search both ways, is verified on every sample,
recorded in the plan with the file's sha256, reproduced by compare, and checked when a plan is re-applied."""

from __future__ import annotations

import hashlib
import json
import logging

import numpy as np
import pytest

import mpinfer
from mpinfer.compare import CompareConfig, compare_models
from mpinfer.metrics import USER_OUTPUT
from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.report.plan_check import plan_check
from tests.conftest import assert_user_error
from tests.precision.graphs import save, score_data, score_mlp

# The worst sample's error of the offset model's output (Add(z, 1000): FP16 rounds it to steps of 0.5, so the
# default floor keeps the Add FP32), and a per-sample "near" decision at 3e-4 that FP16 anywhere breaks.
METRICS = """
import numpy as np

def err(baseline, candidate, inputs):
    d = np.abs(baseline["y"] - candidate["y"])
    return d.reshape(len(d), -1).max(axis=1)

def near(baseline, candidate, inputs):
    return (err(baseline, candidate, inputs) <= 3e-4).astype(float)

def labelled(baseline, candidate, inputs):
    return (inputs["_labels"] == (inputs["x"][:, 0] > 0)).astype(float)  # each sample's label beside its feed

def broken(baseline, candidate, inputs):
    return baseline["y"] / candidate["missing"]
"""


@pytest.fixture
def offset(tmp_path):
    (tmp_path / "metrics.py").write_text(METRICS)
    return save(score_mlp("offset"), tmp_path / "m.onnx"), score_data(tmp_path / "cal.npz"), tmp_path / "metrics.py"


def _convert(src, data, out, **kw):
    return convert_precision(ConvertConfig(model=src, output=out, calibration=str(data), progress=False, **kw))


def _low(res) -> set[str]:
    return {n.name for n in res.plan.nodes if n.precision.is_low}


def test_a_metric_budget_moves_nodes_both_ways_against_the_default_floor(offset, tmp_path):
    src, data, metrics = offset
    floor = _low(_convert(src, data, tmp_path / "floor.onnx"))
    assert "offset" not in floor and {"fc1", "fc2"} <= floor  # the floor keeps the Add on 1000 in FP32
    loose = _convert(src, data, tmp_path / "loose.onnx", budget="err_max<=1", metrics=[f"err={metrics}:err"])
    assert _low(loose) > floor and "offset" in _low(loose)  # within 1 of FP32 per sample: the Add goes FP16 too
    tight = _convert(src, data, tmp_path / "tight.onnx", budget="near_min>=1", metrics=[f"near={metrics}:near"])
    assert _low(tight) < floor  # every sample within 3e-4: more stays FP32 than the floor keeps
    for res, name in ((loose, "err"), (tight, "near")):
        ver = res.plan.summary["verification"]
        assert ver["passed"] and ver["samples"] == 160  # verified on every calibration sample
        rec = ver["metrics"][name]
        assert rec["sha256"] == hashlib.sha256(metrics.read_bytes()).hexdigest() and rec["function"] == name
        assert rec["figures"] == ver["figures"][USER_OUTPUT] and set(rec["figures"]) == {name, f"{name}_min",
                                                                                           f"{name}_max"}
    assert loose.plan.summary["verification"]["metrics"]["err"]["figures"]["err_max"] <= 1
    assert tight.plan.summary["verification"]["metrics"]["near"]["figures"]["near_min"] == 1


def test_compare_reproduces_the_plans_metric_and_says_when_the_file_differs(offset, tmp_path):
    src, data, metrics = offset
    res = _convert(src, data, tmp_path / "o.onnx", budget="err_max<=1", metrics=[f"err={metrics}:err"])

    def compare(path):
        return compare_models(CompareConfig(baseline=str(src), candidates=(str(res.output),), data=str(data),
                                            checks="err_max<=1", numerics="strict", divergence=False,
                                            show_progress=False, metrics=[f"err={path}:err"]))

    result = compare(metrics)
    notes, rows = plan_check(result, result.candidates[0])
    user = [r for r in rows if r[0] == USER_OUTPUT]
    assert {r[1] for r in user} == {"err", "err_min", "err_max"} and all(r[-1] == "match" for r in user), rows
    said = res.plan.summary["verification"]["metrics"]["err"]["figures"]["err_max"]
    assert result.candidates[0].metrics["err_max"] == pytest.approx(said, rel=1e-6)
    other = tmp_path / "other.py"
    other.write_text(METRICS.replace("d.reshape(len(d), -1).max(axis=1)", "d.reshape(len(d), -1).mean(axis=1)"))
    notes, rows = plan_check(compare(other), result.candidates[0])
    assert any("not the file the plan was verified with" in n for n in notes)
    assert {r[-1] for r in rows if r[0] == USER_OUTPUT} == {"other metric file"}


def test_a_plan_reapplied_with_another_file_says_so(offset, tmp_path, caplog):
    src, data, metrics = offset
    res = _convert(src, data, tmp_path / "o.onnx", budget="err_max<=1", metrics=[f"err={metrics}:err"])
    other = tmp_path / "other.py"
    other.write_text(METRICS + "\n# edited\n")
    with caplog.at_level(logging.WARNING, logger="mpinfer"):
        again = convert_precision(ConvertConfig(model=src, output=tmp_path / "again.onnx", plan=res.plan_path,
                                                progress=False, metrics=[f"err={other}:err"]))
    assert _low(again) == _low(res)
    said = [r.getMessage() for r in caplog.records if "--metric err" in r.getMessage()]
    assert said and "are not this file's" in said[0]
    assert hashlib.sha256(metrics.read_bytes()).hexdigest()[:12] in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mpinfer"):
        convert_precision(ConvertConfig(model=src, output=tmp_path / "same.onnx", plan=res.plan_path,
                                        progress=False, metrics=[f"err={metrics}:err"]))
    assert not [r for r in caplog.records if "--metric err" in r.getMessage()]


def test_labels_reach_the_metric_and_the_api_takes_a_callable(tmp_path):
    src = save(score_mlp("relu"), tmp_path / "m.onnx")
    x = np.load(score_data(tmp_path / "cal.npz", n=48))["x"]
    np.savez(tmp_path / "lab.npz", x=x, _labels=(x[:, 0] > 0).astype(np.int64))
    (tmp_path / "metrics.py").write_text(METRICS)
    res = mpinfer.convert(src, tmp_path / "o.onnx", calibration=tmp_path / "lab.npz", budget="lab_min>=1",
                          metrics={"lab": f"{tmp_path / 'metrics.py'}:labelled"})
    assert res.plan.summary["verification"]["metrics"]["lab"]["figures"]["lab"] == 1.0

    def worst(baseline, candidate, inputs):
        return np.abs(baseline["y"] - candidate["y"]).reshape(len(inputs["x"]), -1).max(axis=1)

    res = mpinfer.convert(src, tmp_path / "c.onnx", calibration=tmp_path / "lab.npz", budget="worst_max<=0.5",
                          metrics={"worst": worst})
    rec = res.plan.summary["verification"]["metrics"]["worst"]
    assert rec["function"].endswith("worst") and rec["file"] == __file__ and rec["figures"]["worst_max"] <= 0.5


def test_errors_in_the_users_code_stop_convert_and_write_nothing(offset, tmp_path, invoke):
    src, data, metrics = offset
    out = tmp_path / "o.onnx"
    r = invoke("convert", src, "--calibration", data, "--metric", f"b={metrics}:broken", "--budget", "b<=1",
               "-o", out)
    assert_user_error(r, rf"Metric 'b' \({metrics}:broken\) on batch 0: the metric's code raised")
    assert "KeyError: 'missing'" in r.output and "mpinfer/" not in r.output
    assert not out.exists() and not (tmp_path / "o.plan.json").exists()
    r = invoke("convert", src, "--calibration", data, "--metric", f"cosine={metrics}:err", "-o", out)
    assert_user_error(r, "'cosine' is a built-in metric")
    r = invoke("convert", src, "--calibration", data, "--budget", "err<=1", "-o", out)
    assert_user_error(r, "unknown metric 'err'")
    assert not out.exists()
    # a metric without a budget term is measured and recorded beside the default floor
    r = invoke("convert", src, "--calibration", data, "--metric", f"err={metrics}:err", "-o", out)
    assert r.exit_code == 0, r.output
    plan = json.loads((tmp_path / "o.plan.json").read_text())
    assert "err_max" in plan["summary"]["verification"]["metrics"]["err"]["figures"]
