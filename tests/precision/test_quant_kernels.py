"""QuantizeLinear / DequantizeLinear in the strict emulator, against ONNX Runtime (integers: equal; floats: to
float32's rounding of one product)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpinfer.precision.emulator.emulate import GraphEmulator
from tests.precision.graphs import run_ort

RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, inits, opset):
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10 if opset >= 21 else 8
    onnx.checker.check_model(model)
    return model


def _qdq(opset, zero_dtype, scale, zero, attrs=None):
    """x -> QuantizeLinear -> q (an output) -> DequantizeLinear -> y."""
    attrs = attrs or {}
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(zero_dtype))
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q", **attrs),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq", **attrs)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
                  [helper.make_tensor_value_info("q", elem, [4, 6]),
                   helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])],
                  {"s": np.asarray(scale, np.float32), "z": np.asarray(zero, zero_dtype)}, opset)


CASES = {
    "per-tensor int8 (opset 13)": (13, np.int8, 0.05, 3, None),
    "per-tensor uint8 (opset 10)": (10, np.uint8, 0.02, 128, None),
    "per-axis int8 (opset 13, axis 1)": (13, np.int8, np.linspace(0.01, 0.1, 6), np.arange(-3, 3), {"axis": 1}),
    "per-axis uint8 (opset 19, axis 0)": (19, np.uint8, np.linspace(0.02, 0.05, 4), [0, 10, 128, 255], {"axis": 0}),
    "blocked int8 (opset 21, block 2)": (21, np.int8, RNG.uniform(0.01, 0.1, (4, 3)), np.zeros((4, 3)),
                                         {"axis": 1, "block_size": 2}),
    "int16 (opset 21)": (21, np.int16, 0.001, -7, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qdq_matches_onnxruntime(case):
    opset, dtype, scale, zero, attrs = CASES[case]
    model = _qdq(opset, dtype, scale, zero, attrs)
    # values beyond the integer range (saturation) and exact halves (ties to even) included
    x = (RNG.standard_normal((4, 6)) * 8).astype(np.float32)
    x[0, :3] = np.float32(np.asarray(scale).reshape(-1)[0]) * np.array([0.5, 1.5, 2.5], np.float32)
    emu = GraphEmulator(model)
    assert emu.unsupported_ops() == set() and emu.fallback_ops() == {}
    got = emu.run({"x": x}).outputs
    want = dict(zip(["q", "y"], run_ort(model, {"x": x}), strict=True))
    assert got["q"].dtype == want["q"].dtype
    np.testing.assert_array_equal(got["q"], want["q"])
    tol = np.finfo(np.float32).eps * np.abs(want["y"])  # one product rounded to float32
    assert np.all(np.abs(got["y"] - want["y"]) <= tol)


def test_fp16_dequantize_rounds_its_one_product_to_fp16():
    # the converted form of a QDQ model at opset 19: an FP16 scale, an FP16 output
    q = RNG.integers(-128, 128, (4, 6)).astype(np.int8)
    node = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq")
    model = _model([node], [helper.make_tensor_value_info("q", TensorProto.INT8, [4, 6])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4, 6])],
                   {"s": np.asarray(0.0123, np.float16), "z": np.asarray(2, np.int8)}, 19)
    got = GraphEmulator(model, follow_input_dtypes=True).run({"q": q}).outputs["y"]
    want = run_ort(model, {"q": q})[0]
    assert got.dtype == np.float16 == want.dtype
    exact = (q.astype(np.float64) - 2) * float(np.float16(0.0123))
    tol = np.finfo(np.float16).eps * np.abs(exact)  # within half an FP16 ulp of the exact value, as ORT
    assert np.all(np.abs(got.astype(np.float64) - exact) <= tol)
    assert np.all(np.abs(want.astype(np.float64) - exact) <= tol)


def _qdq_matmul(opset: int) -> onnx.ModelProto:
    """x -> Q -> DQ, int8 weights -> DQ, MatMul, Relu: a QDQ model as a quantizer writes it."""
    w = np.round(RNG.standard_normal((8, 4)) / 0.05).astype(np.int8)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], name="dqw"),
        helper.make_node("MatMul", ["xd", "wd"], ["m"], name="mm"),
        helper.make_node("Relu", ["m"], ["y"], name="relu"),
    ]
    inits = {"s": np.asarray(0.02, np.float32), "z": np.asarray(0, np.int8), "wq": w,
             "ws": np.asarray(0.05, np.float32), "wz": np.asarray(0, np.int8)}
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits, opset)


def test_converting_a_quantized_model_says_what_it_left_and_strict_compare_runs_it(invoke, tmp_path, caplog):
    src = tmp_path / "q.onnx"
    onnx.save(_qdq_matmul(13), str(src))
    with caplog.at_level("WARNING", logger="mpinfer"):
        r = invoke("convert", src, "-o", tmp_path / "q.fp16.onnx")
    assert r.exit_code == 0, r.output
    assert ("Quantized model: 3 quantized op(s) (DequantizeLinear x2, QuantizeLinear x1) keep their integer "
            "arithmetic" in caplog.text)
    assert "3 of them stay FP32 (DequantizeLinear (opset 13) has no float16" in caplog.text
    assert "Nothing was converted" in caplog.text and "--opset 19" in caplog.text
    c = invoke("compare", src, tmp_path / "q.fp16.onnx", "--numerics", "strict", "--num-batches", "1")
    assert c.exit_code == 0, c.output  # the emulator has the QDQ ops now (it refused DequantizeLinear)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mpinfer"):
        r = invoke("convert", src, "--opset", "19", "-o", tmp_path / "q19.fp16.onnx")
    assert r.exit_code == 0, r.output
    assert "read and write fp16 (their scales rounded to fp16)" in caplog.text
    assert "Nothing was converted" not in caplog.text
