"""The default floor on outputs with one value per sample (issue 27): each output judged against its own
spread over the data, and the floor's zero at the evaluator's own noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import helper

from mpinfer.checks import Check, parse_checks
from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.precision.budget.noisefloor import relative_floor, widened_threshold
from mpinfer.precision.emulator.runner import StrictRunner
from mpinfer.precision.options import DEFAULT_BUDGET, FLOOR_OUTPUTS, floor_budget
from tests.precision.graphs import fvi, init, make, rng_w, save, score_data, score_mlp

# The calibration data of the sigmoid repro: with it the all-FP16 probability's worst sample moves by 0.004
# (the issue's own model: 0.0055) and one sample FP32 gives as 3e-8 comes out 0, so cosine_min is 0.
SIGMOID_SEED = 8


def _convert(tmp_path, model, data, out="o.onnx", **kw):
    src = save(model, tmp_path / "m.onnx")
    res = convert_precision(ConvertConfig(model=src, output=tmp_path / out, calibration=str(data),
                                          progress=False, **kw))
    return src, res, res.plan.to_dict()


def _low(plan) -> set[str]:
    return {n["name"] for n in plan["nodes"] if n["precision"] != "fp32"}


def test_a_saturating_probability_converts_low(tmp_path):
    """The old floor's per-sample cosine of one value is its sign: 0 where FP32 gives 3e-8 and FP16 0, so it
    sent every node back to FP32. range_err sees a probability that FP16 moves by 0.4% of its range."""
    data = score_data(tmp_path / "cal.npz", seed=SIGMOID_SEED)
    _, res, plan = _convert(tmp_path, score_mlp("sigmoid"), data)
    ver = plan["summary"]["verification"]
    assert plan["budget"] == FLOOR_OUTPUTS and ver["passed"]  # no cosine term on a [N, 1] output
    assert {"fc1", "fc2", "fc3"} <= _low(plan)
    assert ver["figures"]["y"]["range_err"] <= 0.01


def test_a_score_on_a_large_offset_is_caught(tmp_path):
    """Add(z, 1000) in FP16 rounds to steps of 0.5: cosine_min is 1, the error 0.25 on a range of ~6. The floor
    keeps the sum FP32 and the written model meets it on every calibration sample."""
    data = score_data(tmp_path / "cal.npz")
    src, res, plan = _convert(tmp_path, score_mlp("offset"), data, "all_low.onnx", budget="none")
    x = np.load(data)["x"]
    ref = StrictRunner(str(src))
    all_low = StrictRunner(str(res.output))
    with ref, all_low:
        b, c = ref.infer({"x": x})["y"], all_low.infer({"x": x})["y"]
    assert np.abs(c - b).max() / np.ptp(b) > 2 * 0.01  # the all-FP16 model breaks the floor, by far
    _, res, plan = _convert(tmp_path, score_mlp("offset"), data)
    ver = plan["summary"]["verification"]
    assert ver["passed"] and "offset" not in _low(plan) and {"fc1", "fc2"} <= _low(plan)
    assert ver["figures"]["y"]["range_err"] <= 0.01
    written = StrictRunner(str(res.output))
    with written:  # the verified figure holds for the model as written
        got = written.infer({"x": x})["y"]
    assert np.abs(got - b).max() / np.ptp(b) <= 0.01


def test_a_relud_score_where_fp16_is_fine_stays_all_low(tmp_path):
    data = score_data(tmp_path / "cal.npz")
    _, _, plan = _convert(tmp_path, score_mlp("relu"), data)
    assert plan["summary"]["verification"]["passed"] and _low(plan) == {n["name"] for n in plan["nodes"]}


def _noisy_model():
    """feat[N, 8]: an MLP FP16 serves well; noise[N, 1]: (x·w by MatMul - x·w by ReduceSum) * 1e6, pure summation
    order, which the strict emulator (numpy's ReduceSum) and ONNX Runtime compute differently even in FP32. The
    LeakyRelu (low, and not on the cast graph's lists) keeps the verification on the emulator: the cast graph
    computes FP32 nodes in ONNX Runtime and has no such noise."""
    w = rng_w(32, 1, seed=3)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("LeakyRelu", ["h"], ["r"], name="relu", alpha=0.01),
        helper.make_node("MatMul", ["r", "w2"], ["feat"], name="fc2"),
        helper.make_node("MatMul", ["x", "w"], ["a"], name="dot_mm"),
        helper.make_node("Mul", ["x", "wt"], ["p"], name="dot_mul"),
        helper.make_node("ReduceSum", ["p", "axes"], ["s"], name="dot_sum", keepdims=1),
        helper.make_node("Sub", ["a", "s"], ["d"], name="diff"),
        helper.make_node("Mul", ["d", "gain"], ["noise"], name="amplify"),
    ]
    inits = [
        init("w1", rng_w(32, 64, seed=1, scale=0.2)), init("w2", rng_w(64, 8, seed=2, scale=0.2)),
        init("w", w), init("wt", w.reshape(1, 32)), init("axes", np.array([1], np.int64)),
        init("gain", np.array(1e6, np.float32)),
    ]
    return make(nodes, [fvi("x", ["N", 32])], [fvi("feat", ["N", 8]), fvi("noise", ["N", 1])], inits)


def test_the_floor_starts_from_the_evaluators_own_noise(tmp_path):
    """The all-FP32 model under strict numerics already misses range_err<=0.01 on 'noise' against FP32 ONNX
    Runtime; that must not send every node back to FP32: the floor widens by the noise on that output alone."""
    x = (np.random.default_rng(0).standard_normal((96, 32)) * 3).astype(np.float32)
    np.savez(tmp_path / "cal.npz", x=x)
    _, _, plan = _convert(tmp_path, _noisy_model(), tmp_path / "cal.npz")
    ver = plan["summary"]["verification"]
    noise = ver["noise"]
    assert ver["passed"] and {"fc1", "fc2"} <= _low(plan)
    assert noise["figures"]["noise"]["range_err"] > 0.01 and noise["samples"] == 96
    widened = {(c.output, c.metric): c.value for c in parse_checks(noise["budget"])}
    assert widened[("noise", "range_err")] == pytest.approx(0.01 + noise["figures"]["noise"]["range_err"], rel=1e-9)
    assert 0.01 <= widened[("feat", "range_err")] < 0.011  # feat's own noise is float32 rounding: its floor stays
    assert ver["figures"]["noise"]["range_err"] <= widened[("noise", "range_err")]


def test_floor_terms_widen_by_the_noise_as_a_triangle_inequality():
    assert widened_threshold(Check(None, "range_err", "<=", 0.01), 0.005) == pytest.approx(0.015)
    assert widened_threshold(Check(None, "nonfinite", "<=", 0), 3) == 3
    assert widened_threshold(Check(None, "range_err", "<=", 0.01), 0.0) == 0.01
    assert widened_threshold(Check(None, "range_err", "<=", 0.01), None) == 0.01
    cos = widened_threshold(Check(None, "cosine_min", ">=", 0.999), 0.999)
    assert cos == pytest.approx(math.cos(2 * math.acos(0.999)))
    assert widened_threshold(Check(None, "cosine_min", ">=", 0.999), 1.0) == 0.999
    assert widened_threshold(Check(None, "top1", ">=", 0.99), 0.995) == pytest.approx(0.985)
    per_output = {"a": {"range_err": 0.0, "nonfinite": 0.0}, "b": {"range_err": 0.02, "nonfinite": 0.0}}
    assert relative_floor("range_err<=0.01,nonfinite<=0", {"a": per_output["a"]}) is None
    widened = relative_floor("range_err<=0.01,nonfinite<=0", per_output)
    assert widened == "a:range_err<=0.01,b:range_err<=0.03,nonfinite<=0"


def test_the_floor_reads_cosine_min_only_on_outputs_with_more_than_one_value_per_sample():
    def model(shapes):
        outs = [helper.make_node("Identity", ["x"], [n], name=f"id_{n}") for n in shapes]
        graph = helper.make_graph(outs, "g", [fvi("x", ["N", 1])], [fvi(n, s) for n, s in shapes.items()])
        return helper.make_model(graph)

    assert floor_budget(model({"a": ["N", 4], "b": None})) == DEFAULT_BUDGET  # unknown shape: as many values
    assert floor_budget(model({"p": ["N", 1], "q": ["N"], "r": [1, 1, 1]})) == FLOOR_OUTPUTS
    assert floor_budget(model({"p": ["N", 1], "logits": ["N", 10]})) == f"logits:cosine_min>=0.999,{FLOOR_OUTPUTS}"
    assert floor_budget(model({"p": ["N", 1], "a,b": ["N", 10]})) == DEFAULT_BUDGET  # a comma: no selector
    with_classes = floor_budget(model({"p": ["N", 1], "logits": ["N", 10]}), class_outputs=("logits",))
    assert with_classes == "logits:cosine_min>=0.999,p:range_err<=0.01,logits:top1>=0.99,nonfinite<=0"


def test_class_score_outputs_are_judged_by_their_decisions(tmp_path):
    """A softmax over classes: cosine_min there (top1 too when the user names it), range_err elsewhere."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["logits"], name="fc2"),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
        helper.make_node("ReduceMax", ["logits"], ["score"], name="score", keepdims=1, axes=[1]),
    ]
    inits = [init("w1", rng_w(32, 64, seed=1, scale=0.2)), init("w2", rng_w(64, 10, seed=2, scale=0.5))]
    model = make(nodes, [fvi("x", ["N", 32])], [fvi("probs", ["N", 10]), fvi("score", ["N", 1])], inits)
    x = (np.random.default_rng(0).standard_normal((64, 32)) * 3).astype(np.float32)
    np.savez(tmp_path / "cal.npz", x=x)
    _, _, plan = _convert(tmp_path, model, tmp_path / "cal.npz")
    # guessed softmax rows: cosine_min per sample (a guess is not trusted with decisions); range_err elsewhere
    assert plan["budget"] == "probs:cosine_min>=0.999,score:range_err<=0.01,nonfinite<=0"
    _, _, plan = _convert(tmp_path, model, tmp_path / "cal.npz", "named.onnx", class_outputs=("probs",))
    assert plan["budget"] == "probs:cosine_min>=0.999,probs:top1>=0.99,score:range_err<=0.01,nonfinite<=0"
    figures = plan["summary"]["verification"]["figures"]
    assert plan["summary"]["verification"]["passed"] and figures["probs"]["top1"] >= 0.99
    assert figures["score"]["top1"] is None and figures["score"]["range_err"] <= 0.01


def _empty_output_model(with_score: bool):
    """x [N, 8] -> MatMul -> Relu -> y; Slice(y, 2:2 on axis 1) -> empty [N, 0] (found by issue 28's sweep)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
        helper.make_node("Slice", ["y", "s", "s", "ax"], ["empty"], name="cut"),
    ]
    outputs = [fvi("empty", ["N", 0])] + ([fvi("y", ["N", 8])] if with_score else [])
    inits = [init("w", rng_w(8, 8)), init("s", np.array([2], np.int64)), init("ax", np.array([1], np.int64))]
    return make(nodes, [fvi("x", ["N", 8])], outputs, inits)


@pytest.mark.parametrize("with_score", [False, True], ids=["only-empty", "empty-and-y"])
def test_the_floor_skips_outputs_with_no_values(tmp_path, with_score):
    """An output with no elements on the data has nothing to measure: the floor leaves it out instead of refusing
    the model ("checks that apply to no output"), and skips itself when no output is left."""
    data = tmp_path / "cal.npz"
    np.savez(data, x=np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32))
    _, res, plan = _convert(tmp_path, _empty_output_model(with_score), data)
    assert {"mm", "relu"} <= _low(plan)
    if with_score:
        assert plan["budget"] and "empty" not in plan["budget"] and plan["summary"]["verification"]["passed"]
        assert plan["summary"]["verification"]["figures"]["y"]["range_err"] <= 0.01
    else:
        assert not plan["budget"]
