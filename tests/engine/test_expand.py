"""RMSNormalization expanded for a TensorRT parser older than 10.15: the chain computes what the fused op does."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpinfer.engine.expand import EXPANDED_SUFFIX, expand_ops
from mpinfer.engine.machine import tensorrt_ops_to_expand
from mpinfer.errors import BackendUnavailableError
from mpinfer.modelio import default_opset, ir_version_for, ort_session
from tests.tolerances import assert_reorder_close, eps

WIDTH = 64


def _rms_model(elem: int, axis: int = -1, opset: int = 23) -> onnx.ModelProto:
    """x [2, 3, WIDTH] -> Mul(x, 1) -> RMSNormalization(scale, stash_type=1) -> y, all in ``elem``.

    The Mul makes the normalized tensor an intermediate without value_info (its type is inferred).
    """
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    scale = np.random.default_rng(2).uniform(0.5, 1.5, [3, WIDTH][axis:] if axis < 0 else [3, WIDTH])
    nodes = [helper.make_node("Mul", ["x", "one"], ["h"], name="pre"),
             helper.make_node("RMSNormalization", ["h", "scale"], ["y"], name="norm", axis=axis, epsilon=1e-5,
                              stash_type=1)]
    graph = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("x", elem, [2, 3, WIDTH])],
                              [helper.make_tensor_value_info("y", elem, [2, 3, WIDTH])],
                              [numpy_helper.from_array(scale.astype(dtype), "scale"),
                               numpy_helper.from_array(np.array(1, dtype), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version_for(model)
    onnx.checker.check_model(model, full_check=True)
    return model


def _x(dtype: type) -> np.ndarray:
    """Random activations with a few of 300: their squares (9e4) overflow FP16, the float32 stash holds them."""
    x = np.random.default_rng(1).standard_normal((2, 3, WIDTH)) * 4
    x[0, 0, :8] = 300
    return x.astype(dtype)


@pytest.mark.parametrize(("elem", "axis"), [(TensorProto.FLOAT16, -1), (TensorProto.FLOAT16, 2),
                                            (TensorProto.FLOAT16, -2), (TensorProto.FLOAT, -1)])
def test_the_expanded_chain_computes_the_fused_op_on_onnx_runtime(elem, axis):
    fused = _rms_model(elem, axis)
    expanded, count = expand_ops(fused)
    assert count == 1
    ops = [n.op_type for n in expanded.graph.node]
    assert "RMSNormalization" not in ops and expanded.graph.node[0].name == "pre"
    assert {"Pow", "ReduceMean", "Add", "Sqrt", "Reciprocal"} <= set(ops) and ops.count("Mul") == 3
    assert all(n.name.startswith("norm" + EXPANDED_SUFFIX) for n in expanded.graph.node[1:])
    casts = [helper.get_attribute_value(n.attribute[0]) for n in expanded.graph.node if n.op_type == "Cast"]
    # float32 statistics as stash_type=1 says: x and the scale cast up, the result cast back to the node's type
    assert casts == ([] if elem == TensorProto.FLOAT else [TensorProto.FLOAT, TensorProto.FLOAT, elem])
    assert default_opset(expanded) == 22 and default_opset(fused) == 23  # (no opset-23 op left; input unchanged)
    onnx.checker.check_model(expanded, full_check=True)
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    x = _x(dtype)
    want = ort_session(fused).run(None, {"x": x})[0]
    got = ort_session(expanded).run(None, {"x": x})[0]
    assert got.dtype == want.dtype == dtype and np.isfinite(got).all()
    n = WIDTH * (3 if axis in (-2, 1) else 1)
    # both compute in float32 (a mean over n terms in any order), then round to the node's type: FP16's rounding
    # of the normalized value and of its product with the scale (the op's definition) against one rounding
    assert_reorder_close(got, want, np.float32, n=n, rtol=eps(dtype) if elem != TensorProto.FLOAT else 0.0,
                         err_msg=f"elem {elem} axis {axis}")


def test_a_model_without_the_op_is_copied_unchanged():
    model = _rms_model(TensorProto.FLOAT)
    del model.graph.node[1]
    model.graph.output[0].name = "h"
    out, count = expand_ops(model)
    assert count == 0 and out == model and out is not model


def test_only_float32_stash_is_expanded():
    model = _rms_model(TensorProto.FLOAT16)
    model.graph.node[1].attribute[-1].i = TensorProto.FLOAT16
    with pytest.raises(ValueError, match="stash_type=1"):
        expand_ops(model)


@pytest.mark.parametrize("version", ["10.0.1", "10.8.0.43", "10.14.1"])
def test_tensorrt_before_10_15_expands_rms_normalization(version):
    assert tensorrt_ops_to_expand(version, {"RMSNormalization", "MatMul"}) == {"RMSNormalization"}
    assert tensorrt_ops_to_expand(version, {"MatMul", "LayerNormalization"}) == set()
    with pytest.raises(BackendUnavailableError, match=f"version {version}, whose ONNX parser cannot import"):
        tensorrt_ops_to_expand(version, {"RMSNormalization"}, expandable=frozenset())


@pytest.mark.parametrize("version", ["10.15.1", "10.16.0", "11.0.0", "11.5.0.9"])
def test_tensorrt_from_10_15_parses_rms_normalization_itself(version):
    assert tensorrt_ops_to_expand(version, {"RMSNormalization", "MatMul"}) == set()
