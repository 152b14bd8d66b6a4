"""Tiny ONNX models built in the test (no checked-in binaries)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def make_mixed_model(path: Path, *, low: str = "fp16", dynamic: bool = True, width: int = 8) -> Path:
    """x (float32, [batch, width]) -> Cast(low) -> MatMul(W low) -> Relu -> Cast(float32) -> y [batch, 4]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from mpinfer.modelio import save_onnx

    rng = np.random.default_rng(0)
    w = rng.standard_normal((width, 4)).astype(np.float32)
    if low == "fp16":
        elem, init = TensorProto.FLOAT16, numpy_helper.from_array(w.astype(np.float16), "W")
    elif low == "bf16":
        elem = TensorProto.BFLOAT16
        init = helper.make_tensor("W", TensorProto.BFLOAT16, w.shape, w.flatten().tolist())
    else:
        elem, init = TensorProto.FLOAT, numpy_helper.from_array(w, "W")
    nodes = [
        helper.make_node("Cast", ["x"], ["xl"], to=elem, name="Cast_0"),
        helper.make_node("MatMul", ["xl", "W"], ["m"], name="MatMul_1"),
        helper.make_node("Relu", ["m"], ["r"], name="Relu_2"),
        helper.make_node("Cast", ["r"], ["y"], to=TensorProto.FLOAT, name="Cast_3"),
    ]
    batch = "batch" if dynamic else 2
    graph = helper.make_graph(
        nodes,
        "mixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])],
        [init],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return save_onnx(model, path)


@pytest.fixture
def fp16_model(tmp_path: Path) -> Path:
    return make_mixed_model(tmp_path / "model.fp16.onnx")


@pytest.fixture
def feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)}
