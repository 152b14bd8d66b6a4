"""PrecisionPlan JSON: stable, editable, re-appliable; plans for other models refused."""

from __future__ import annotations

import json

import onnx
import pytest

from mpinfer.errors import InvalidInputError, MpinferError
from mpinfer.precision import ConvertConfig, PrecisionPlan, convert_precision
from mpinfer.precision.core.plan import REASON_CODES
from mpinfer.specs import Precision
from tests.precision.graphs import mlp, save


@pytest.fixture
def converted(tmp_path):
    src = save(mlp(), tmp_path / "m.onnx")
    return src, convert_precision(
        ConvertConfig(model=src, output=tmp_path / "out" / "m.fp16.onnx", calibration="none")
    )


def test_plan_file_layout(converted):
    src, res = converted
    assert res.plan_path.name == "m.fp16.plan.json"
    data = json.loads(res.plan_path.read_text())
    assert data["schema_version"] == 1 and data["precision"] == "fp16" and data["numerics"] == "strict"
    assert data["source"]["path"] == str(src) and len(data["source"]["sha256"]) == 64
    assert [n["name"] for n in data["nodes"]] == ["fc1", "add1", "relu", "fc2", "add2", "softmax"]
    assert {n["reason"] for n in data["nodes"]} <= REASON_CODES
    s = data["summary"]
    for key in (
        "nodes_total",
        "nodes_low",
        "low_share_nodes",
        "low_share_flops",
        "low_share_weight_bytes",
        "cast_count",
        "expected_error",
    ):
        assert key in s
    assert s["nodes_low"] == 5 and 0.9 < s["low_share_flops"] < 1.0
    assert PrecisionPlan.load(res.plan_path).to_json() == res.plan_path.read_text()


def test_edited_plan_reapplied(converted, tmp_path):
    src, res = converted
    data = json.loads(res.plan_path.read_text())
    for n in data["nodes"]:
        if n["name"] == "fc2":
            n["precision"] = "fp32"
    edited = tmp_path / "edited.plan.json"
    edited.write_text(json.dumps(data))
    out = convert_precision(ConvertConfig(model=src, output=tmp_path / "re.onnx", plan=edited))
    assert out.plan.precisions()["fc2"] is Precision.FP32
    m = onnx.load(str(out.output))
    fc2 = next(n for n in m.graph.node if n.name == "fc2")
    assert fc2.input[0].endswith("__cast_to_fp32")
    # The edit is said: fc2's reason (rule:fp16-safe) no longer fits it, and the plan's numbers were for the
    # plan as written, so they are not carried into the re-applied plan.
    entry = next(n for n in out.plan.nodes if n.name == "fc2")
    assert entry.reason == "user:plan"
    assert entry.detail.startswith("set to fp32 in the plan file (was rule:fp16-safe")
    assert out.plan.summary["expected_error"] == {} and "search" not in out.plan.summary
    again = json.loads(out.plan_path.read_text())
    assert next(n for n in again["nodes"] if n["name"] == "fc2")["reason"] == "user:plan"
    # An unedited plan keeps its reasons and numbers.
    same = convert_precision(ConvertConfig(model=src, output=tmp_path / "same.onnx", plan=res.plan_path))
    assert [n.reason for n in same.plan.nodes] == [n.reason for n in res.plan.nodes]
    assert same.plan.summary["expected_error"] == res.plan.summary["expected_error"]
    assert "user:plan" not in same.plan.reasons()


def test_malformed_plan_entries_are_named(converted, tmp_path):
    src, res = converted
    data = json.loads(res.plan_path.read_text())
    bad = tmp_path / "bad.plan.json"
    for change, pattern in (
        (lambda d: d["nodes"].append(dict(d["nodes"][0], precision="fp32")), r"node 'fc1'.*two entries"),
        (lambda d: d["nodes"][1].update(precision="fp8"), r"Plan '.*bad.plan.json': node 'add1'.*'fp8'"),
        (lambda d: d.update(nodes="abc"), r"'nodes' is not a list of node entries"),
    ):
        copy = json.loads(json.dumps(data))
        change(copy)
        bad.write_text(json.dumps(copy))
        with pytest.raises(InvalidInputError, match=pattern):
            convert_precision(ConvertConfig(model=src, output=tmp_path / "x.onnx", plan=bad))
        assert not (tmp_path / "x.onnx").exists()


def test_plan_for_other_model_refused(converted, tmp_path):
    _, res = converted
    data = json.loads(res.plan_path.read_text())
    data["nodes"][0]["name"] = "not_a_node"
    bad = tmp_path / "bad.plan.json"
    bad.write_text(json.dumps(data))
    other = tmp_path / "other.onnx"
    save(mlp(hidden=8), other)
    with pytest.raises(InvalidInputError, match="plan for another model"):
        convert_precision(ConvertConfig(model=other, output=tmp_path / "x.onnx", plan=bad))
    with pytest.raises(InvalidInputError, match="sha256"):
        convert_precision(ConvertConfig(model=other, output=tmp_path / "x.onnx", plan=res.plan_path))
    assert not (tmp_path / "x.onnx").exists()


def test_plan_with_impossible_precision_refused(converted, tmp_path):
    src, res = converted
    data = json.loads(res.plan_path.read_text())
    data["nodes"][0]["precision"] = "bf16"
    bad = tmp_path / "bad.plan.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(MpinferError, match="fp16 or fp32"):
        convert_precision(ConvertConfig(model=src, output=tmp_path / "x.onnx", plan=bad))
    bad.write_text("{not json")
    with pytest.raises(MpinferError, match="non-JSON"):
        convert_precision(ConvertConfig(model=src, output=tmp_path / "x.onnx", plan=bad))


def test_bf16_plan_reapplied_with_its_own_precision(tmp_path):
    src = save(mlp(), tmp_path / "m.onnx")
    first = convert_precision(
        ConvertConfig(model=src, output=tmp_path / "a.onnx", calibration="none", precision=Precision.BF16)
    )
    again = convert_precision(ConvertConfig(model=src, output=tmp_path / "b.onnx", plan=first.plan_path))
    assert again.plan.precision is Precision.BF16
    assert first.output.read_bytes() == again.output.read_bytes()


def test_plan_text_is_what_json_dumps_writes(converted):
    """The plan's writer (core/jsontext.py) gives json.dumps(indent=1)'s very bytes, odd values included."""
    import enum
    from pathlib import Path

    import numpy as np

    from mpinfer.precision.core.jsontext import dumps_indented
    from mpinfer.precision.core.plan import _default

    class Level(enum.IntEnum):
        LOW = 2

    plan = PrecisionPlan.load(converted[1].plan_path)
    odd = {"s": "é\n\"q\"\\", "i": -3, "big": 2**70, "f": 1e-320, "g": 0.1, "t": True, "n": None, "e": [], "d": {},
           "nest": [[1, [2.5, {}]], ({"a": ()},)], 1: "int key", 2.5: "float key", False: "bool key", None: "null key",
           "np": [np.float32(0.5), np.int64(7), np.float64(2.0)], "path": Path("a/b"), "enum": Level.LOW,
           "prec": Precision.FP16, "sub": True}
    for obj in (plan.to_dict(), odd, [], {}, "x", 3.0):
        want = json.dumps(obj, indent=1, sort_keys=False, allow_nan=False, default=_default)
        assert dumps_indented(obj, 1, _default) == want
    for bad in (float("nan"), {"x": [float("inf")]}, {float("-inf"): 1}):
        with pytest.raises(ValueError, match="Out of range float values"):
            dumps_indented(bad, 1, _default)
    with pytest.raises(TypeError):
        dumps_indented({"x": object()}, 1, _default)
    with pytest.raises(TypeError):
        dumps_indented({(1, 2): 1}, 1, _default)
