"""pipeline.toml ``metrics = { NAME = "PATH.py:FUNCTION" }`` under [compare] and [convert]: loaded, hashed, checked."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpinfer.errors import InvalidInputError
from mpinfer.pipeline import run_pipeline
from tests.engine.conftest import make_mixed_model

METRIC = (
    "import numpy as np\n\ndef err(baseline, candidate, inputs):\n"
    "    return np.abs(baseline['y'] - candidate['y']).reshape(len(baseline['y']), -1).max(axis=1)\n"
)


def _project(tmp_path, checks="err_max<=1"):
    make_mixed_model(tmp_path / "m.onnx", low="fp32")
    make_mixed_model(tmp_path / "m.fp16.onnx")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "metric.py").write_text(METRIC)
    toml = tmp_path / "p.toml"
    toml.write_text(
        '[pipeline]\nwork_dir = "w"\n[compare]\nbaseline = "m.onnx"\ncandidates = ["m.fp16.onnx"]\n'
        f'data = "random:8"\ndivergence = false\nchecks = "{checks}"\nmetrics = {{ err = "mine/metric.py:err" }}\n'
    )
    return toml


def test_compare_stage_reads_metrics_relative_to_the_toml_and_reruns_when_the_file_changes(tmp_path):
    toml = _project(tmp_path)
    first = run_pipeline(toml)
    assert first.passed, [r.summary for r in first.stages]
    report = json.loads(first.artefacts["comparison"].read_text())
    assert report["user_metrics"]["err"]["file"] == str((tmp_path / "mine" / "metric.py").resolve())
    assert 0 < report["candidates"][0]["metrics"]["err_max"] <= 1
    assert [r.status for r in run_pipeline(toml).stages] == ["skipped"]
    (tmp_path / "mine" / "metric.py").write_text(METRIC.replace(".max(axis=1)", ".mean(axis=1)"))
    assert [r.status for r in run_pipeline(toml).stages] == ["ran"]  # the metric's file is an input of the stage


def test_convert_stage_takes_metrics_into_its_budget(tmp_path):
    make_mixed_model(tmp_path / "m.onnx", low="fp32")
    (tmp_path / "metric.py").write_text(METRIC)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cal.npz", x=rng.standard_normal((16, 8)).astype(np.float32))
    toml = tmp_path / "p.toml"
    toml.write_text('[pipeline]\nwork_dir = "w"\n[convert]\nmodel = "m.onnx"\ncalibration = "cal.npz"\n'
                    'budget = "err_max<=0.5"\nmetrics = { err = "metric.py:err" }\n')
    result = run_pipeline(toml)
    plan = json.loads(result.artefacts["plan"].read_text())
    rec = plan["summary"]["verification"]["metrics"]["err"]
    assert rec["file"] == str((tmp_path / "metric.py").resolve()) and rec["figures"]["err_max"] <= 0.5


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ('metrics = { cosine = "mine/metric.py:err" }\n', r"\[compare\] metrics: .*'cosine'.* built-in metric"),
        ('metrics = ["mine/metric.py:err"]\n', r"\[compare\] metrics: received .*expected a table"),
        ('checks = "iou>=0.5"\n', r"checks = 'iou>=0.5'.*unknown metric 'iou'"),
    ],
)
def test_bad_metric_tables_are_refused_before_any_stage_runs(tmp_path, table, match):
    (tmp_path / "p.toml").write_text(f'[pipeline]\nwork_dir = "w"\n[train]\nmodel = "nope.py"\n[compare]\n{table}')
    with pytest.raises(InvalidInputError, match=match):
        run_pipeline(tmp_path / "p.toml")
