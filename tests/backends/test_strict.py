"""StrictRunner: FP32 parity with OrtRunner, and the honest FP16 error ORT's CPU provider hides."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpinfer.backends.ort import OrtRunner
from mpinfer.errors import BackendUnavailableError, InvalidInputError
from mpinfer.modelio import save_onnx
from mpinfer.precision.emulator.runner import StrictRunner
from tests.precision.numerics_graphs import export_module
from tests.tolerances import assert_onnx_outputs_close

F, H = TensorProto.FLOAT, TensorProto.FLOAT16


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.mark.parametrize("name", ["mlp", "digits_cnn"])
def test_agrees_with_ort_on_fp32_models(tmp_path, name):
    model, feeds = export_module(name, batch=3)
    path = save_onnx(model, tmp_path / "m.onnx")
    with OrtRunner(path) as ort_runner, StrictRunner(path) as strict:
        want, got = ort_runner.infer(feeds), strict.infer(feeds)
        assert strict.describe()["numerics"] == "strict-fp32"
        assert strict.output_names() == ort_runner.output_names()
    for k in want:
        assert_onnx_outputs_close(got[k], want[k], model, err_msg=k)


def _fp16_model(scale: float):
    """x (fp32) -> Cast fp16 -> 8 x (y = y * a + b) -> square -> / 1000 -> Cast fp32: a converted model."""
    nodes = [helper.make_node("Cast", ["x"], ["h0"], name="x__cast_to_fp16", to=H)]
    for i in range(8):
        nodes.append(helper.make_node("Mul", [f"h{i}", "a"], [f"m{i}"], name=f"mul_{i}"))
        nodes.append(helper.make_node("Add", [f"m{i}", "b"], [f"h{i + 1}"], name=f"add_{i}"))
    nodes += [
        helper.make_node("Mul", ["h8", "h8"], ["sq"], name="square"),
        helper.make_node("Div", ["sq", "k"], ["q"], name="div"),
        helper.make_node("Cast", ["q"], ["y"], name="y__cast_to_fp32", to=F),
    ]
    inits = [
        numpy_helper.from_array(np.array([1.0137], np.float16), "a"),
        numpy_helper.from_array(np.array([scale * 0.0173], np.float16), "b"),
        numpy_helper.from_array(np.array([1000.0], np.float16), "k"),
    ]
    graph = helper.make_graph(
        nodes,
        "fp16",
        [helper.make_tensor_value_info("x", F, [32])],
        [helper.make_tensor_value_info("y", F, [32])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _numpy_fp16(x: np.ndarray, scale: float) -> np.ndarray:
    """The same arithmetic with numpy float16 (each op rounded to FP16): an independent oracle."""
    a, b, k = np.float16(1.0137), np.float16(scale * 0.0173), np.float16(1000.0)
    h = x.astype(np.float16)
    with np.errstate(over="ignore"):
        for _ in range(8):
            h = h * a + b
        return ((h * h) / k).astype(np.float32)


def _fp32(x: np.ndarray, scale: float) -> np.ndarray:
    h = x.astype(np.float64)
    for _ in range(8):
        h = h * 1.0137 + scale * 0.0173
    return (h * h / 1000.0).astype(np.float32)


def test_shows_the_honest_fp16_error(rng):
    x = (rng.standard_normal(32) * 3).astype(np.float32)
    model = _fp16_model(1.0)
    with StrictRunner(model, name="fp16") as strict, OrtRunner(model) as ort_runner:
        got, ort_out = strict.infer({"x": x})["y"], ort_runner.infer({"x": x})["y"]
        assert strict.describe() == {
            "runner": "StrictRunner",
            "name": "fp16",
            "backend": "mpinfer-strict",
            "device": "cpu",
            "numerics": "strict-fp16",
            "fallback_nodes": 0,
        }
    np.testing.assert_array_equal(got, _numpy_fp16(x, 1.0))
    ref = _fp32(x, 1.0)
    err_strict, err_ort = np.abs(got - ref).max(), np.abs(ort_out - ref).max()
    print(f"max |error| vs FP64 arithmetic: strict {err_strict:.3g}, ORT CPU {err_ort:.3g}")
    assert err_strict > 0
    assert err_strict > err_ort  # ORT-CPU keeps FP32 intermediates, so it can only look better


def test_fp16_overflow_that_ort_cpu_hides(rng):
    # values ~ 300: the square (9e4) overflows FP16 before the divide brings it back into range
    x = (300 + rng.standard_normal(32)).astype(np.float32)
    model = _fp16_model(1.0)
    with StrictRunner(model) as strict:
        got = strict.infer({"x": x})["y"]
    assert np.all(np.isinf(got))
    np.testing.assert_array_equal(got, _numpy_fp16(x, 1.0))
    assert np.all(np.isfinite(_fp32(x, 1.0)))


def test_bad_inputs_and_unsupported_ops_are_user_errors(tmp_path):
    model = _fp16_model(1.0)
    with StrictRunner(model) as strict, pytest.raises(InvalidInputError, match="dtype float64"):
        strict.infer({"x": np.zeros(32)})
    node = helper.make_node("Fancy", ["x"], ["y"], name="fancy", domain="com.example")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", F, [2])],
        [helper.make_tensor_value_info("y", F, [2])],
    )
    custom = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    )
    with pytest.raises(BackendUnavailableError, match="--numerics ort"):
        StrictRunner(custom).activate()


def test_runs_bf16_models_that_ort_cpu_cannot(rng):
    import ml_dtypes

    nodes = [
        helper.make_node("Cast", ["x"], ["xb"], name="cast_in", to=TensorProto.BFLOAT16),
        helper.make_node("MatMul", ["xb", "w"], ["yb"], name="matmul"),
        helper.make_node("Cast", ["yb"], ["y"], name="cast_out", to=F),
    ]
    w = rng.standard_normal((8, 4)).astype(np.float32)
    inits = [numpy_helper.from_array(w.astype(ml_dtypes.bfloat16), "w")]
    graph = helper.make_graph(
        nodes,
        "bf16",
        [helper.make_tensor_value_info("x", F, [2, 8])],
        [helper.make_tensor_value_info("y", F, [2, 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((2, 8)).astype(np.float32)
    with StrictRunner(model) as strict:
        got = strict.infer({"x": x})["y"]
        assert strict.describe()["numerics"] == "strict-bf16"
    bf = ml_dtypes.bfloat16
    want = (x.astype(bf).astype(np.float32) @ w.astype(bf).astype(np.float32)).astype(bf).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_fp16_inside_if_branches_reads_outer_scope(rng):
    """An FP16 value from the main graph used inside both branches, each branch computing in FP16."""
    then_g = helper.make_graph(
        [helper.make_node("Mul", ["h", "h"], ["t"], name="sq")],
        "then",
        [],
        [helper.make_tensor_value_info("t", H, [16])],
    )
    else_g = helper.make_graph(
        [helper.make_node("Add", ["h", "h"], ["e"], name="dbl")],
        "else",
        [],
        [helper.make_tensor_value_info("e", H, [16])],
    )
    nodes = [
        helper.make_node("Cast", ["x"], ["h"], name="x__cast_to_fp16", to=H),
        helper.make_node("If", ["c"], ["b"], name="branch", then_branch=then_g, else_branch=else_g),
        helper.make_node("Cast", ["b"], ["y"], name="y__cast_to_fp32", to=F),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", F, [16]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", F, [16])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    x = (rng.standard_normal(16) * 300).astype(np.float32)
    with StrictRunner(model) as strict:
        squared = strict.infer({"x": x, "c": np.array(True)})["y"]
        doubled = strict.infer({"x": x, "c": np.array(False)})["y"]
    h = x.astype(np.float16)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(squared, (h * h).astype(np.float32))  # overflows like FP16 does
        np.testing.assert_array_equal(doubled, (h + h).astype(np.float32))
    assert np.isinf(squared).any() and np.all(np.isfinite(doubled))


def test_runner_misuse_is_a_bug_not_a_user_error(tmp_path):
    """activate() twice, infer() before activate(): the calling code's bug (InternalError), never blamed on input."""
    from mpinfer.errors import InternalError, MpinferError

    model, feeds = export_module("mlp", batch=1)
    runner = OrtRunner(save_onnx(model, tmp_path / "m.onnx"))
    with pytest.raises(InternalError, match="infer\\(\\) before activate") as info:
        runner.infer(feeds)
    assert not isinstance(info.value, MpinferError)
    runner.activate()
    try:
        with pytest.raises(InternalError, match="called twice"):
            runner.activate()
    finally:
        runner.deactivate()
    with pytest.raises(InternalError, match="deactivate\\(\\) without activate"):
        runner.deactivate()
