"""A model that takes only some batch sizes is compared at the sizes it takes (never at mpinfer's own one row).

An EEG classifier's graph accepted only a multiple of 4 rows; compare ended in an internal error (exit 70)
because the per-layer divergence probed one sample to size its chunks.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

F = 8


def _grouped_rows(path):
    """x [batch, F] -> MatMul -> Reshape [-1, 4, F] -> Softmax over the group -> Reshape [-1, F]: batch % 4 == 0."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((F, F)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array([-1, 4, F], np.int64), "grouped"),
             numpy_helper.from_array(np.array([-1, F], np.int64), "rows")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Reshape", ["h", "grouped"], ["g"], name="group"),
             helper.make_node("Softmax", ["g"], ["p"], axis=1, name="soft"),
             helper.make_node("Reshape", ["p", "rows"], ["y"], name="ungroup")]
    graph = helper.make_graph(nodes, "grouped", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", F])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", F])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


@pytest.fixture
def grouped(tmp_path, invoke):
    base = _grouped_rows(tmp_path / "m.onnx")
    cand = tmp_path / "m.fp16.onnx"
    r = invoke("convert", base, "--calibration", "none", "-o", cand)
    assert r.exit_code == 0, r.output
    data = tmp_path / "rows.npz"
    np.savez(data, x=np.random.default_rng(1).standard_normal((32, F)).astype(np.float32))
    return base, cand, data


@pytest.mark.parametrize("numerics", ["ort", "strict"])
def test_compare_runs_the_divergence_at_the_batches_the_model_takes(grouped, invoke, numerics):
    base, cand, data = grouped
    r = invoke("compare", base, cand, "--data", data, "--numerics", numerics)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    text = " ".join(r.output.split())
    assert "Intermediate tensors compared: 4 on 2 batch(es)" in text, text


def test_the_divergence_probe_falls_back_to_the_users_batch(grouped):
    """tensor_bytes sizes the tensors on the user's batch when one sample is refused (and sizes them right)."""
    from mpinfer.compare.divergence import tensor_bytes

    base, _, _ = grouped
    model = onnx.load(str(base))
    batch = {"x": np.zeros((16, F), np.float32)}
    sizes = tensor_bytes(model, ["h", "g", "y"], [batch], ["CPUExecutionProvider"])
    assert sizes == [16 * F * 4] * 3
