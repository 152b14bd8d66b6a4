"""Issue 35: the default path does no harm.

Every convert with data to judge by (the user's, or mpinfer's own seeded random data) applies the default floor;
random data the model cannot run stops convert (it never falls back to an unmeasured plan on its own); rules only
is ``--calibration none`` and says so; an output with no values is reported as unmeasured, not as a perfect 0;
a plan that buys nothing says what keeps the heavy ops FP32 and the flag that changes it; a model that takes only
some batch sizes is calibrated and verified at the sizes it takes.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import helper

from mpinfer.data.feeds import DEFAULT_BATCH_SIZE
from mpinfer.metrics import range_error
from mpinfer.precision.emulator.runner import StrictRunner
from tests.conftest import assert_user_error
from tests.precision.graphs import fvi, init, make, rng_w, save

# The floor's range term (options.FLOOR_RANGE): the worst error at most 1% of the output's range.
FLOOR_RANGE_ERR = 0.01
WIDTH = 8


def _offset_norm() -> onnx.ModelProto:
    """The issue's repro: x + 3000 -> LayerNormalization -> MatMul. FP16's spacing at 3000 is 2, so an FP16 Add
    leaves the normalization nothing but rounding noise (x is random in [0, 1))."""
    nodes = [
        helper.make_node("Add", ["x", "c"], ["s"], name="add"),
        helper.make_node("LayerNormalization", ["s", "g", "b"], ["n"], name="ln", axis=-1),
        helper.make_node("MatMul", ["n", "w"], ["y"], name="mm"),
    ]
    inits = [
        init("c", np.full([WIDTH], 3000.0, np.float32)),
        init("g", np.ones(WIDTH, np.float32)),
        init("b", np.zeros(WIDTH, np.float32)),
        init("w", rng_w(WIDTH, 4)),
    ]
    return make(nodes, [fvi("x", ["N", WIDTH])], [fvi("y", ["N", 4])], inits)


def _plan(out) -> dict:
    return json.loads(out.with_name(out.name[: -len(".onnx")] + ".plan.json").read_text())


def _low(plan: dict) -> set[str]:
    return {n["name"] for n in plan["nodes"] if n["precision"] != "fp32"}


def _range_err(src, out, x: np.ndarray) -> float:
    with StrictRunner(str(src)) as ref, StrictRunner(str(out)) as cand:
        b, c = ref.infer({"x": x})["y"], cand.infer({"x": x})["y"]
    return range_error(float(np.abs(c - b).max()), float(b.min()), float(b.max()))


def test_the_default_convert_without_data_meets_the_floor_on_its_random_data(invoke, tmp_path):
    src = save(_offset_norm(), tmp_path / "m.onnx")
    out = tmp_path / "m.fp16.onnx"
    r = invoke("convert", src, "-o", out)
    assert r.exit_code == 0, r.output
    plan = _plan(out)
    ver = plan["summary"]["verification"]
    assert ver["passed"] and ver["default_budget"] and ver["data"] == "random"
    assert "add" not in _low(plan) and "mm" in _low(plan)  # the sum stays FP32, the rest goes low
    assert ver["figures"]["y"]["range_err"] <= FLOOR_RANGE_ERR
    assert "random inputs" in " ".join(r.output.split())  # the console says what the floor was judged on
    # other inputs drawn the same way: the written model keeps the floor there too
    x = np.random.default_rng(123).uniform(0, 1, (64, WIDTH)).astype(np.float32)
    assert _range_err(src, out, x) <= FLOOR_RANGE_ERR


def test_budget_none_is_how_a_user_asks_for_the_rules_alone(invoke, tmp_path):
    src = save(_offset_norm(), tmp_path / "m.onnx")
    out = tmp_path / "all.fp16.onnx"
    r = invoke("convert", src, "--budget", "none", "-o", out)
    assert r.exit_code == 0, r.output
    plan = _plan(out)
    assert {"add", "ln", "mm"} <= _low(plan) and "verification" not in plan["summary"]
    x = np.random.default_rng(123).uniform(0, 1, (64, WIDTH)).astype(np.float32)
    assert _range_err(src, out, x) > 10 * FLOOR_RANGE_ERR  # what the floor protects a default convert from


def test_calibration_none_says_nothing_was_measured(invoke, tmp_path):
    src = save(_offset_norm(), tmp_path / "m.onnx")
    out = tmp_path / "rules.fp16.onnx"
    r = invoke("convert", src, "--calibration", "none", "-o", out)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "nothing was measured: --calibration none" in text
    plan = _plan(out)
    assert plan["summary"]["expected_error"] == {} and "verification" not in plan["summary"]


def _conv1d(tmp_path):
    """x: batch x 1 x len (len unknown), a width-5 convolution: random data at the guessed length 2 cannot run."""
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", kernel_shape=[5])
    model = make([node], [fvi("x", ["batch", 1, "len"])], [fvi("y", ["batch", 4, "out"])],
                 [init("w", rng_w(4, 1, 5))])
    return save(model, tmp_path / "conv.onnx")


def test_random_data_the_model_rejects_stops_convert_naming_what_it_needs(invoke, tmp_path):
    src = _conv1d(tmp_path)
    r = invoke("convert", src, "-o", tmp_path / "r.onnx")
    assert_user_error(r, r"random data.*--dim len=N.*--calibration FILE.*--calibration none")
    assert not (tmp_path / "r.onnx").exists() and not (tmp_path / "r.plan.json").exists()
    ok = invoke("convert", src, "--dim", "len=32", "-o", tmp_path / "o.onnx")
    assert ok.exit_code == 0, ok.output
    assert _plan(tmp_path / "o.onnx")["summary"]["verification"]["passed"]


def _silent(with_score: bool) -> onnx.ModelProto:
    """y = Relu(-x - 1): all zero for x in [0, 1) (mpinfer's random data); optionally a real score beside it."""
    nodes = [
        helper.make_node("Neg", ["x"], ["nx"], name="neg"),
        helper.make_node("Sub", ["nx", "one"], ["d"], name="sub"),
        helper.make_node("Relu", ["d"], ["y"], name="relu"),
        helper.make_node("MatMul", ["x", "w"], ["score"], name="mm"),
    ]
    outputs = [fvi("y", ["N", WIDTH])] + ([fvi("score", ["N", 4])] if with_score else [])
    if not with_score:
        nodes = nodes[:3]
    inits = [init("one", np.ones([1], np.float32))] + ([init("w", rng_w(WIDTH, 4))] if with_score else [])
    return make(nodes, [fvi("x", ["N", WIDTH])], outputs, inits)


def test_random_data_that_gives_no_output_a_value_stops_convert(invoke, tmp_path):
    src = save(_silent(False), tmp_path / "m.onnx")
    assert_user_error(invoke("convert", src, "-o", tmp_path / "o.onnx"), r"no values.*--calibration FILE")
    assert not (tmp_path / "o.onnx").exists()


def test_an_output_with_no_values_is_reported_unmeasured_not_perfect(invoke, tmp_path):
    src = save(_silent(True), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    r = invoke("convert", src, "-o", out)
    assert r.exit_code == 0, r.output
    summary = _plan(out)["summary"]
    assert summary["unmeasured_outputs"] == ["y"]
    assert "unmeasured: output(s) 'y'" in " ".join(r.output.split())
    # with the user's data that gives no output a value: written (the user's data), every figure unmeasured
    data = tmp_path / "cal.npz"
    np.savez(data, x=np.random.default_rng(0).uniform(0, 1, (16, WIDTH)).astype(np.float32))
    only = save(_silent(False), tmp_path / "only.onnx")
    r = invoke("convert", only, "--calibration", data, "-o", tmp_path / "only.fp16.onnx")
    assert r.exit_code == 0, r.output
    summary = _plan(tmp_path / "only.fp16.onnx")["summary"]
    assert summary["unmeasured_outputs"] == ["y"] and summary["expected_error"] == {}
    assert "snr_db=inf" not in r.output and "unmeasured: output(s) 'y'" in " ".join(r.output.split())


def _qdq(opset: int) -> onnx.ModelProto:
    """A quantized (QDQ) layer: x -> Q -> DQ, int8 weight -> DQ, MatMul, a float scale on its output; beside it a
    small float layer on x's first 8 values (0.2% of the FLOPs), which converts."""
    k = 64
    w = np.random.default_rng(0).integers(-127, 128, (k, k)).astype(np.int8)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"], name="qx"),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"], name="dqx"),
        helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["wd"], name="dqw"),
        helper.make_node("MatMul", ["xd", "wd"], ["m"], name="mm"),
        helper.make_node("Mul", ["m", "scale"], ["y"], name="mul"),
        helper.make_node("Slice", ["x", "s0", "s8", "ax1"], ["xs"], name="head"),
        helper.make_node("MatMul", ["xs", "w2"], ["z"], name="probe"),  # a small float layer beside it
    ]
    inits = [
        init("sx", np.array(0.01, np.float32)), init("zx", np.array(0, np.int8)),
        init("wq", w), init("sw", np.array(0.002, np.float32)), init("zw", np.array(0, np.int8)),
        init("scale", np.array([0.5], np.float32)), init("w2", rng_w(8, 2)),
        init("s0", np.array([0], np.int64)), init("s8", np.array([8], np.int64)), init("ax1", np.array([1], np.int64)),
    ]
    return make(nodes, [fvi("x", ["N", k])], [fvi("y", ["N", k]), fvi("z", ["N", 2])], inits, opset=opset)


def test_a_plan_that_buys_nothing_says_what_keeps_the_heavy_ops_fp32(invoke, tmp_path):
    src = save(_qdq(13), tmp_path / "q.onnx")
    out = tmp_path / "q.fp16.onnx"
    r = invoke("convert", src, "-o", out)
    assert r.exit_code == 0, r.output
    summary = _plan(out)["summary"]
    assert summary["low_share_flops"] < 0.05
    note = summary["low_gain"]
    assert "rule:qdq" in note and "--opset 19" in note and "mm" in note
    assert "--opset 19" in " ".join(r.output.split())
    # the flag it names does what it says
    r = invoke("convert", src, "--opset", "19", "-o", tmp_path / "q19.fp16.onnx")
    assert r.exit_code == 0, r.output
    summary = _plan(tmp_path / "q19.fp16.onnx")["summary"]
    assert summary["low_share_flops"] > 0.5 and "low_gain" not in summary


def _groups_of_four() -> onnx.ModelProto:
    """x [N, 8] -> Reshape [-1, 4, 8] -> Softmax over each group of 4 rows -> Reshape [-1, 8] -> MatMul -> y [N, 4].

    ONNX Runtime runs it on any multiple of 4 rows and rejects every other count (at the first Reshape).
    """
    nodes = [
        helper.make_node("Reshape", ["x", "grouped"], ["g"], name="group"),
        helper.make_node("Softmax", ["g"], ["p"], name="softmax", axis=1),
        helper.make_node("Reshape", ["p", "flat"], ["f"], name="ungroup"),
        helper.make_node("MatMul", ["f", "w"], ["y"], name="mm"),
    ]
    inits = [
        init("grouped", np.array([-1, 4, WIDTH], np.int64)),
        init("flat", np.array([-1, WIDTH], np.int64)),
        init("w", rng_w(WIDTH, 4)),
    ]
    return make(nodes, [fvi("x", ["N", WIDTH])], [fvi("y", ["N", 4])], inits)


def test_a_model_that_takes_only_multiples_of_four_rows_is_calibrated_and_verified_at_them(invoke, tmp_path):
    src = save(_groups_of_four(), tmp_path / "m.onnx")
    data = tmp_path / "cal.npz"
    np.savez(data, x=np.random.default_rng(0).standard_normal((32, WIDTH)).astype(np.float32))
    out = tmp_path / "m.fp16.onnx"
    r = invoke("convert", src, "--calibration", data, "-o", out)
    assert r.exit_code == 0, r.output
    ver = _plan(out)["summary"]["verification"]
    assert ver["passed"] and ver["samples"] == 32
    # a search on fewer samples than a batch, and a verification of some of them: cut at a multiple of 4
    r = invoke("convert", src, "--calibration", data, "--search-samples", "6", "--verify-samples", "10",
               "-o", tmp_path / "cut.onnx")
    assert r.exit_code == 0, r.output
    ver = _plan(tmp_path / "cut.onnx")["summary"]["verification"]
    assert ver["passed"] and ver["samples"] == 12 and ver["searched_samples"] == 8  # 10 and 6, rounded up to 4s
    # a search that probes and screens subsets of its samples (40 of them, a budget FP16 cannot meet): never here, a
    # sample's outputs depend on its group (it used to run 10 of them: an internal error at the Reshape)
    np.savez(data, x=np.random.default_rng(1).standard_normal((40, WIDTH)).astype(np.float32))
    r = invoke("convert", src, "--calibration", data, "--search-samples", "40", "--budget", "cosine_min>=0.9999999",
               "-o", tmp_path / "tight.onnx")
    assert r.exit_code == 0, r.output
    assert _plan(tmp_path / "tight.onnx")["summary"]["verification"]["passed"]
    # mpinfer's own random data (batches of 16): the default convert runs and is verified too
    r = invoke("convert", src, "-o", tmp_path / "random.onnx")
    assert r.exit_code == 0, r.output
    ver = _plan(tmp_path / "random.onnx")["summary"]["verification"]
    assert ver["passed"] and ver["data"] == "random" and ver["samples"] % DEFAULT_BATCH_SIZE == 0

