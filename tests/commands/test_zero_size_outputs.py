"""Zero-size tensors through the metrics core: ONNX's ``test_split_zero_size_splits`` cases, end to end.

Their inputs split an empty tensor into three empty outputs. convert with those inputs as calibration data ended
in an internal error (exit 70: the metrics core reshaped a size-0 array); compare refused the data. An output
with no values is unmeasured: its figures are none (never a perfect 0), and a check on no values fails saying so.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest

CASES = {"test_split_zero_size_splits_opset13": 13, "test_split_zero_size_splits_opset18": 18}


def _split_zero_size(opset: int):
    """ONNX's case, as its ``Split.export_zero_size_splits_opset*`` writes it: Split([] float, split=[0, 0, 0])."""
    from onnx import TensorProto, helper

    node = helper.make_node("Split", ["input", "split"], ["output_1", "output_2", "output_3"])
    graph = helper.make_graph(
        [node], f"test_split_zero_size_splits_opset{opset}",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [0]),
         helper.make_tensor_value_info("split", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info(f"output_{i}", TensorProto.FLOAT, [0]) for i in (1, 2, 3)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7 if opset == 13 else 8
    return model, {"input": np.array([], np.float32), "split": np.array([0, 0, 0], np.int64)}


def _case(name: str, tmp_path):
    model, feeds = _split_zero_size(CASES[name])
    path, data = tmp_path / "m.onnx", tmp_path / "data.npz"
    onnx.save(model, path)
    np.savez(data, **feeds)
    return path, data


@pytest.mark.slow  # onnx's collect_testcases builds every node case (~40 s)
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_models_here_are_onnxs_own_cases(name):
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        case = next(c for c in collect_testcases(None) if c.name == name)
    model, feeds = _split_zero_size(CASES[name])
    assert onnx.printer.to_text(model.graph) == onnx.printer.to_text(case.model.graph)
    assert model.opset_import == case.model.opset_import
    inputs, _ = case.data_sets[0]
    for (key, want), got in zip(feeds.items(), inputs):
        np.testing.assert_array_equal(want, got, err_msg=key)
        assert want.dtype == got.dtype


@pytest.mark.parametrize("name", sorted(CASES))
def test_zero_size_outputs_through_convert_compare_and_report(name, tmp_path, invoke):
    model, data = _case(name, tmp_path)
    out = tmp_path / "m.fp16.onnx"
    r = invoke("convert", model, "--calibration", data, "-o", out)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    plan = json.loads((tmp_path / "m.fp16.plan.json").read_text())
    for figures in plan["summary"].get("verification", {}).get("figures", {}).values():
        assert figures.get("cosine") is None and figures.get("max_abs") is None, figures  # not "perfect"

    for numerics in ("ort", "strict"):
        rep = tmp_path / f"rep-{numerics}"
        r = invoke("compare", model, out, "--data", data, "--numerics", numerics, "--report", rep)
        assert "Traceback" not in r.output and "Internal error" not in r.output, r.output
        assert r.exit_code == 1, r.output  # the default cosine check has no values to judge: it fails, saying so
        assert "no output has values to compute it on" in r.output
        outputs = json.loads((rep / "report.json").read_text())["candidates"][0]["outputs"]
        assert [o["shape"][0] for o in outputs] == [0, 0, 0]
        assert all(o["values"]["cosine"] is None and o["values"]["max_abs"] is None for o in outputs)
    r = invoke("compare", model, out, "--data", data, "--check", "nonfinite<=0")
    assert r.exit_code == 0, r.output
    r = invoke("report", tmp_path / "rep-ort", "--check", "nonfinite<=0")
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
