"""convert's budget and compare's checks are one computation: same strings, same definitions, same figures."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import assert_user_error

BATCH, SEQ, VOCAB, SAMPLES = 8, 16, 32, 16
# Half an FP16 ulp at 1.0 is 2**-11: a runner-up 2**-13 below the top merges with it when rounded to FP16.
TIE = 2.0**-13


def _lm_head(path):
    """An identity MatMul over [batch, 16, 32] logits (a language-model head's shape)."""
    w = numpy_helper.from_array(np.eye(VOCAB, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"], name="head")],
        "lm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", SEQ, VOCAB])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", SEQ, VOCAB])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _near_ties(path, seed=0):
    """Rows whose top two logits FP16 rounding merges (3 in 4 rows), one token per sample far above the rest.

    In FP32 the later of the two tied indices wins; in FP16 they are equal and the earlier one does, so each tied
    row's top-1 flips. The far token (row 0, a clean row) is every sample's flattened argmax in both.
    """
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 0.0, (SAMPLES, SEQ, VOCAB)).astype(np.float32)
    for n in range(SAMPLES):
        for r in range(SEQ):
            i, j = sorted(rng.choice(VOCAB, 2, replace=False))
            x[n, r, i] = 1.0
            if r % 4:
                x[n, r, j] = 1.0 + TIE
        x[n, 0, 0] = 50.0
    np.savez(path, x=x)
    return path, x


@pytest.fixture
def lm(tmp_path):
    model = _lm_head(tmp_path / "lm.onnx")
    data, x = _near_ties(tmp_path / "calib.npz")
    return model, data, x


def test_convert_budget_and_compare_check_measure_the_same_top1(lm, tmp_path):
    """The issue's case: per-row top-1 on [batch, seq, vocab] logits, in convert's plan and in compare alike."""
    from mpinfer.compare import CompareConfig, compare_models
    from mpinfer.precision import ConvertConfig, convert_precision

    model, data, x = lm
    out = tmp_path / "lm.fp16.onnx"
    res = convert_precision(
        ConvertConfig(model=model, output=out, calibration=str(data), batch_size=BATCH, budget="top1>=0.1",
                      progress=False)
    )
    planned = res.plan.summary["expected_error"]
    assert res.plan.summary["nodes_low"] == 1  # FP16 meets top1>=0.1: the head is converted
    cmp = compare_models(
        CompareConfig(str(model), (str(out),), data=str(data), batch_size=BATCH, numerics="strict",
                      checks="top1>=0.1", divergence=False, show_progress=False)
    )
    measured = cmp.candidates[0].outputs[0].values
    rows = SAMPLES * SEQ
    assert round(planned["top1"] * rows) == round(measured["top1"] * rows)  # counts of agreeing rows
    assert round(measured["top1"] * rows) == rows // 4  # every tied row flipped, every clean row kept
    # The old per-sample reading (argmax over each flattened sample) saw no change at all:
    fp16 = x.astype(np.float16).astype(np.float32)
    assert (x.reshape(SAMPLES, -1).argmax(1) == fp16.reshape(SAMPLES, -1).argmax(1)).all()
    # ... and the error figures agree to the rounding of their float64 sums.
    eps = float(np.finfo(np.float64).eps) * np.sqrt(x.size)
    assert planned["cosine"] == pytest.approx(measured["cosine"], rel=eps)
    assert planned["max_abs"] == pytest.approx(measured["max_abs"], rel=eps)


def test_a_budget_top1_on_the_lm_head_is_refused_when_fp16_breaks_it(lm, tmp_path):
    """top1>=0.999 counts every (sample, position) row: FP16 flips 3 rows in 4, so the head stays FP32."""
    from mpinfer.precision import ConvertConfig, convert_precision

    model, data, _ = lm
    res = convert_precision(
        ConvertConfig(model=model, output=tmp_path / "o.onnx", calibration=str(data), batch_size=BATCH,
                      budget="top1>=0.999", progress=False)
    )
    assert res.plan.summary["nodes_low"] == 0 and res.plan.summary["expected_error"]["top1"] == 1.0


SAME_STRINGS = [
    "cosine>=0.9999",
    "cosine_min>=0.999,nonfinite<=0",
    "logits:top1>=0.1,max_abs<=1",
    "snr>=10,rel<=0.5,mean_abs<=1",
    "top1>=0.1,top5>=0.1,top3>=0.1",
]


@pytest.mark.parametrize("text", SAME_STRINGS)
def test_convert_budget_and_compare_check_accept_the_same_strings(text, lm, tmp_path, invoke):
    model, data, _ = lm
    out = tmp_path / "o.onnx"
    r = invoke("convert", model, "-o", out, "--calibration", data, "--batch-size", BATCH, "--budget", text)
    assert r.exit_code == 0, r.output
    r = invoke("compare", model, out, "--data", data, "--batch-size", BATCH, "--check", text, "--no-divergence",
               "--quiet")
    assert "Traceback" not in r.output and "Error:" not in r.output and r.exit_code in (0, 1)


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("cosin>=0.9", r"unknown metric 'cosin'.*did you mean 'cosine'\?"),
        ("logit:top1>=0.9", r"unknown output 'logit'.*one of 'logits'"),
    ],
)
def test_unknown_metric_or_output_is_the_same_error_in_convert_and_compare(text, pattern, lm, tmp_path, invoke):
    model, data, _ = lm
    r = invoke("convert", model, "-o", tmp_path / "o.onnx", "--calibration", data, "--budget", text)
    assert_user_error(r, pattern)
    assert not (tmp_path / "o.onnx").exists()
    r = invoke("compare", model, model, "--data", data, "--check", text, "--no-divergence")
    assert_user_error(r, pattern)


def test_class_outputs_option_turns_top1_off_and_on(lm, tmp_path, invoke):
    """--class-outputs none: no class-score output, so a top1 check applies to nothing (a clear failure, not 0)."""
    model, data, _ = lm
    base = ("compare", model, model, "--data", data, "--no-divergence", "--json")
    r = invoke(*base, "--class-outputs", "none", "--check", "cosine>=0.9")
    assert r.exit_code == 0
    values = json.loads(r.stdout)["candidates"][0]["outputs"][0]["values"]
    assert values["top1"] is None and values["cosine"] == pytest.approx(1.0)
    r = invoke(*base, "--class-outputs", "none", "--check", "top1>=0.9")
    assert r.exit_code == 1 and "not applicable" in r.output
    r = invoke("convert", model, "-o", tmp_path / "o.onnx", "--calibration", data, "--class-outputs", "none",
               "--budget", "top1>=0.9")
    assert_user_error(r, r"apply to no output.*--class-outputs")
    r = invoke(*base, "--class-outputs", "logit")
    assert_user_error(r, r"--class-outputs: output 'logit'.*'logits'")


def _map_and_boxes(path):
    """x[N, 10, 6] → Sigmoid → 'activations' (a multi-label map) and MatMul W[6, 4] → 'dets' (boxes)."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Sigmoid", ["x"], ["activations"]), helper.make_node("MatMul", ["x", "w"], ["dets"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 10, 6])],
        [helper.make_tensor_value_info("activations", TensorProto.FLOAT, ["n", 10, 6]),
         helper.make_tensor_value_info("dets", TensorProto.FLOAT, ["n", 10, 4])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_no_top1_headline_for_multi_label_maps_and_box_tensors(tmp_path):
    """Neither a sigmoid map nor [N, anchors, 4] boxes are class scores: no top-1 in the plan or the report."""
    from mpinfer.compare import CompareConfig, compare_models
    from mpinfer.precision import ConvertConfig, convert_precision
    from mpinfer.report import render, tables

    model = _map_and_boxes(tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(1).standard_normal((8, 10, 6)).astype(np.float32) * 3)
    out = tmp_path / "m.fp16.onnx"
    res = convert_precision(ConvertConfig(model=model, output=out, calibration=str(tmp_path / "d.npz"),
                                          progress=False))
    expected = res.plan.summary["expected_error"]
    assert "cosine" in expected and "top1" not in expected and "top5" not in expected
    cmp = compare_models(CompareConfig(str(model), (str(out),), data=str(tmp_path / "d.npz"), divergence=False,
                                       show_progress=False))
    assert all(not o.classifier and o.values["top1"] is None for o in cmp.candidates[0].outputs)
    assert "top-1" not in tables.accuracy_headers(cmp.candidates[0])
    assert "| top-1 |" not in render(cmp, "md") and "<th>top-1</th>" not in render(cmp, "html")
    # Named class scores, they get top-1 again
    named = compare_models(CompareConfig(str(model), (str(out),), data=str(tmp_path / "d.npz"), divergence=False,
                                         class_outputs=("activations",), show_progress=False))
    assert named.candidates[0].outputs[0].values["top1"] is not None and "| top-1 |" in render(named, "md")


def test_pipeline_tables_take_class_outputs_and_the_one_grammar():
    from mpinfer.errors import InvalidInputError
    from mpinfer.pipeline_stages import default_stages

    stages = default_stages()
    stages["compare"].check({"baseline": "a.onnx", "candidates": ["b.onnx"], "class_outputs": ["logits"],
                             "checks": "logits:top1>=0.99,boxes:max_abs<=0.5"})
    stages["convert"].check({"model": "a.onnx", "class_outputs": [], "budget": "snr>=40,rel<=0.01"})
    with pytest.raises(InvalidInputError, match=r"\[compare\] checks.*unknown metric 'top1x'"):
        stages["compare"].check({"baseline": "a.onnx", "candidates": ["b.onnx"], "checks": "top1x>=1"})


def test_report_check_takes_selectors_and_refuses_unknown_outputs(lm, tmp_path, invoke):
    model, data, _ = lm
    r = invoke("compare", model, model, "--data", data, "--no-divergence", "--report", tmp_path / "rep", "--quiet")
    assert r.exit_code == 0, r.output
    assert invoke("report", tmp_path / "rep", "--check", "logits:top1>=0.999,logits:cosine_min>=0.999").exit_code == 0
    assert_user_error(invoke("report", tmp_path / "rep", "--check", "probs:top1>=0.9"), r"unknown output 'probs'")
