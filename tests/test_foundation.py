"""specs, fileio, modelio and the CLI shell."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpinfer.errors import InvalidInputError, ModelLoadError
from mpinfer.fileio import check_output_path, write_json_atomic
from mpinfer.modelio import iter_nodes, load_onnx, name_nodes, save_onnx
from mpinfer.specs import Precision, parse_tensor_spec, specs_from_onnx
from tests.conftest import ROOT, assert_user_error


def _tiny_model(weight: np.ndarray | None = None) -> onnx.ModelProto:
    w = weight if weight is not None else np.ones((4, 4), np.float32)
    then_g = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("ReduceSum", ["y"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["z"], then_branch=then_g, else_branch=else_g)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.float32(0), "zero")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_tensor_specs_parse_and_print():
    s = parse_tensor_spec("ids:batchxseq=8:int64:0..1000")
    assert s.shape == ("batch", "seq") and s.dtype == np.int64 and s.value_range == (0, 1000)
    assert s.concrete_shape({"batch": 3}) == (3, 8)
    assert str(s) == "ids:batchxseq:int64:0..1000"
    assert parse_tensor_spec("x:max_len,4:float32").shape == ("max_len", 4)
    assert Precision.parse("float16") is Precision.FP16 and Precision.BF16.numpy_dtype.name == "bfloat16"
    with pytest.raises(InvalidInputError, match="Precision"):
        Precision.parse("fp8")


def test_specs_from_onnx_reads_symbols_and_ranges():
    m = _tiny_model()
    m.metadata_props.append(onnx.StringStringEntryProto(key="mpinfer.input_ranges", value='{"x": [0, 2]}'))
    (spec,) = specs_from_onnx(m)
    assert spec.shape == ("n", 4) and spec.value_range == (0, 2)


def test_check_output_path(tmp_path):
    src = tmp_path / "a.onnx"
    src.write_bytes(b"x")
    with pytest.raises(InvalidInputError, match="same path as an input"):
        check_output_path(src, [src], force=True)
    with pytest.raises(InvalidInputError, match="--force"):
        check_output_path(src, [])
    assert check_output_path(src, [], force=True) == src.resolve()
    with pytest.raises(InvalidInputError, match="folder"):
        check_output_path(tmp_path, [])


def test_atomic_write_leaves_nothing_behind_on_failure(tmp_path):
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "o.json", {"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_name_nodes_and_addresses_are_stable():
    m = name_nodes(_tiny_model())
    addrs = [r.address for r in iter_nodes(m.graph)]
    assert addrs == ["MatMul_0", "ReduceSum_1", "Greater_2", "If_3", "If_3/else_branch/Neg_0",
                     "If_3/then_branch/Relu_0"]  # bodies in attribute order
    assert [r.address for r in iter_nodes(name_nodes(m).graph)] == addrs


def test_save_sets_loadable_ir_and_is_deterministic(tmp_path):
    m = _tiny_model()
    m.ir_version = 99
    a = save_onnx(m, tmp_path / "a.onnx")
    b = save_onnx(m, tmp_path / "b.onnx")
    assert a.read_bytes() == b.read_bytes()
    assert onnx.load(str(a)).ir_version == 8  # opset 17 needs IR 8
    assert m.ir_version == 99  # the caller's proto is not modified
    import onnxruntime as ort

    ort.InferenceSession(str(a), providers=["CPUExecutionProvider"])


def test_external_data_roundtrip_and_guards(tmp_path):
    m = _tiny_model(np.arange(4096, dtype=np.float32).reshape(64, 64)[:4, :4].copy())
    big = _tiny_model(np.ones((4, 4), np.float32))
    path = save_onnx(big, tmp_path / "m.onnx", external_data=True)
    loaded = load_onnx(path)
    assert loaded.graph.initializer[0].name == "w"
    del m
    # a tensor whose external data path leaves the model's folder is refused before anything is read
    evil = _tiny_model()
    t = evil.graph.initializer[0]
    t.ClearField("raw_data")
    t.ClearField("float_data")
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value="../../etc/passwd")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "evil.onnx").write_bytes(evil.SerializeToString())
    with pytest.raises(ModelLoadError, match="outside the model's folder"):
        load_onnx(tmp_path / "sub" / "evil.onnx")
    t.external_data[0].value = "missing.bin"
    (tmp_path / "sub" / "missing.onnx").write_bytes(evil.SerializeToString())
    with pytest.raises(ModelLoadError, match="missing file"):
        load_onnx(tmp_path / "sub" / "missing.onnx")
    # a truncated data file is named, not left to onnx's ValueError deep inside a conversion
    m = _tiny_model()
    m.graph.initializer.append(numpy_helper.from_array(np.zeros(70_000, np.float32), "big"))
    path = save_onnx(m, tmp_path / "t.onnx", external_data=True)
    data = tmp_path / "t.onnx.data"
    data.write_bytes(data.read_bytes()[:10])
    for external in (True, False):
        with pytest.raises(ModelLoadError, match=r"a file of 10 bytes, expected at least \d+ bytes.*truncated"):
            load_onnx(path, load_external_data=external)


def test_external_data_is_written_for_big_tensors(tmp_path):
    m = _tiny_model()
    m.graph.initializer.append(numpy_helper.from_array(np.zeros(70_000, np.float32), "big"))
    path = save_onnx(m, tmp_path / "m.onnx", external_data=True)
    assert (tmp_path / "m.onnx.data").stat().st_size >= 280_000
    assert path.stat().st_size < 10_000
    assert load_onnx(path).graph.initializer[-1].dims == [70_000]


def test_not_onnx_and_truncated_files(tmp_path):
    (tmp_path / "text.onnx").write_text("hello, I am not a model")
    with pytest.raises(ModelLoadError, match="ONNX model"):
        load_onnx(tmp_path / "text.onnx")
    data = _tiny_model().SerializeToString()
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_onnx(tmp_path / "cut.onnx")


def test_import_and_help_do_not_import_torch_or_tensorrt():
    code = ("import sys, mpinfer, mpinfer.cli\n"
            "from click.testing import CliRunner\n"
            "r = CliRunner().invoke(mpinfer.cli.main, ['--help'])\n"
            "assert r.exit_code == 0 and 'export' in r.output, r.output\n"
            "bad = [m for m in ('torch', 'tensorrt', 'onnxruntime') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_python_dash_m_and_version():
    out = subprocess.run([sys.executable, "-m", "mpinfer", "--version"], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert "mpinfer" in out.stdout


def test_doctor_reports_machine(invoke):
    r = invoke("doctor", "--json")
    assert r.exit_code == 0
    import json

    checks = {c["name"]: c for c in json.loads(r.output)}
    assert checks["onnxruntime"]["ok"] and checks["torch"]["ok"]
    if not checks["tensorrt"]["ok"]:
        assert "pip install tensorrt" in checks["tensorrt"]["hint"]


def test_unknown_command_is_a_usage_error(invoke):
    r = invoke("frobnicate")
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_mpinfer_error_becomes_one_error_line(invoke, tmp_path):
    r = invoke("export", "nope.py", "-o", tmp_path / "x.onnx")
    assert_user_error(r, "no such file")


def test_a_bug_says_it_is_a_bug_with_what_to_report(invoke, monkeypatch):
    """Anything but a user error: its traceback, one 'Internal error' line naming it a bug and what to report, exit 70
    (a user error is exit 1 and no traceback: test_mpinfer_error_becomes_one_error_line)."""
    import mpinfer.commands.doctor as doctor_cmd
    from mpinfer.cli import BUG_EXIT_CODE

    def broken() -> None:
        raise ZeroDivisionError("a bug stands here")

    monkeypatch.setattr(doctor_cmd, "collect_checks", broken)  # the bug: the command's own step raising
    r = invoke("doctor")
    assert r.exit_code == BUG_EXIT_CODE == 70
    assert "Traceback" in r.output and "ZeroDivisionError: a bug stands here" in r.output
    (line,) = [line for line in r.output.splitlines() if line.startswith("Internal error:")]
    assert "This is a bug in mpinfer" in line and "mpinfer doctor" in line
    assert not any(line.startswith("Error:") for line in r.output.splitlines())  # not worded as the user's mistake
    monkeypatch.setenv("MPINFER_DEBUG", "1")  # --debug: the exception as it is
    assert isinstance(invoke("doctor").exception, ZeroDivisionError)


def test_every_public_name_resolves():
    import mpinfer

    for name in mpinfer._LAZY:
        assert getattr(mpinfer, name) is not None, name
    with pytest.raises(AttributeError):
        mpinfer.no_such_name  # noqa: B018


def test_doctor_sees_tensorrt_as_build_engine_does(invoke, tmp_path, monkeypatch):
    """doctor's TensorRT line is mpinfer.gpu.probe_tensorrt's verdict: a `tensorrt` package without the bindings
    (the registry's placeholder) is installed but not usable, with the reason, not a version that works."""
    import json

    from mpinfer.gpu import probe_tensorrt

    if probe_tensorrt().version is not None:
        pytest.skip("a working TensorRT is installed here")
    (tmp_path / "tensorrt").mkdir()
    (tmp_path / "tensorrt" / "__init__.py").write_text('__version__ = "10.0.0"\n')  # no Builder: a placeholder
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        checks = {c["name"]: c for c in json.loads(invoke("doctor", "--json").output)}
    finally:
        sys.modules.pop("tensorrt", None)  # the placeholder imported by the probe must not outlive the test
    trt = checks["tensorrt"]
    assert not trt["ok"] and trt["detail"] == "installed but not usable"
    assert "placeholder" in trt["hint"] and "pip install tensorrt" in trt["hint"]
