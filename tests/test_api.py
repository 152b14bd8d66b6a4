"""The Python API reads like the CLI: mpinfer.convert / compare / export take the CLI's options as keywords."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mpinfer
from mpinfer.errors import InvalidInputError


def _mlp(path):
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((8, 16)) / 4).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((16, 4)) / 4).astype(np.float32), "w2")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture
def mlp(tmp_path):
    model = _mlp(tmp_path / "mlp.onnx")
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(1).standard_normal((32, 8)).astype(np.float32))
    return model, tmp_path / "calib.npz"


def test_convert_and_compare_read_like_the_cli(mlp, tmp_path):
    model, calib = mlp
    out = tmp_path / "mlp.fp16.onnx"
    result = mpinfer.convert(model, out, calibration=str(calib), budget="cosine>=0.999", keep_op="Relu")
    assert result.output == out and out.is_file() and result.plan_path.is_file()
    plan = json.loads(result.plan_path.read_text())
    relu = [n for n in plan["nodes"] if n["name"] == "relu"]
    assert relu and relu[0]["precision"] == "fp32" and relu[0]["reason"] == "user:keep-op"  # keep_op = --keep-op
    verdict = mpinfer.compare(model, out, data=str(calib), check="cosine>=0.999")
    assert verdict, verdict.failed_checks()
    # a check that cannot hold: the result says so (bool False), it does not raise or exit
    strict = mpinfer.compare(model, out, data=str(calib), check="max_abs<=0", divergence=False)
    assert not strict and strict.failed_checks()


def test_packages_stay_packages():
    from mpinfer.compare import CompareConfig
    from mpinfer.export import ExportConfig

    assert callable(mpinfer.compare) and callable(mpinfer.export)
    assert mpinfer.compare.CompareConfig is CompareConfig and mpinfer.export.ExportConfig is ExportConfig


def test_options_are_resolved_like_the_cli(mlp, tmp_path):
    model, _calib = mlp
    with pytest.raises(InvalidInputError, match=r"keyword 'budgte'.*did you mean 'budget'"):
        mpinfer.convert(model, tmp_path / "a.onnx", budgte="cosine>=0.99")
    with pytest.raises(InvalidInputError, match=r"--precision.*fp8"):  # click's Choice, as on the command line
        mpinfer.convert(model, tmp_path / "b.onnx", precision="fp8")
    with pytest.raises(InvalidInputError, match=r"Budget|budget|Check|metric"):  # the one check grammar
        mpinfer.convert(model, tmp_path / "c.onnx", calibration="random:8", budget="cosin>=0.99")
    assert not (tmp_path / "a.onnx").exists() and not (tmp_path / "c.onnx").exists()


def test_dims_as_a_mapping_and_defaults(mlp, tmp_path):
    model, _calib = mlp
    out = tmp_path / "d.onnx"
    result = mpinfer.convert(model, out, calibration="random:8", dim={"batch": 4}, budget="none")
    assert result.plan.precision.value == "fp16"  # the CLI's default precision
    assert out.is_file()


def test_every_cli_option_is_a_config_field():
    """convert and compare build their config from click's parameters by name: an option without a field of its
    name (or a mapped one) would fail only when used, as a TypeError; this says which at once."""
    from dataclasses import fields

    from mpinfer.commands import compare as compare_cmd
    from mpinfer.commands import convert as convert_cmd
    from mpinfer.compare import CompareConfig
    from mpinfer.precision import ConvertConfig

    convert_fields = {f.name for f in fields(ConvertConfig)}
    assert {p.name for p in convert_cmd.convert.params} <= convert_fields
    compare_fields = {f.name for f in fields(CompareConfig)}
    mapped = {compare_cmd.CONFIG_NAMES.get(p.name, p.name) for p in compare_cmd.compare.params
              if p.name not in compare_cmd.OUTPUT_OPTIONS}
    assert mapped <= compare_fields, mapped - compare_fields
