from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from tests.conftest import assert_user_error


def _out(result):
    return result.output  # click >= 8.2: stdout and stderr interleaved


def test_compare_pass_writes_reports(invoke, mlp_files, tmp_path):
    rep = tmp_path / "rep"
    r = invoke(
        "compare",
        mlp_files["base"],
        mlp_files["fp16"],
        "--data",
        mlp_files["small"],
        "--check",
        "cosine>=0.9999,top1>=0.9",
        "--latency",
        "--iterations",
        "3",
        "--warmup",
        "1",
        "--report",
        rep,
    )
    assert r.exit_code == 0, _out(r)
    assert "Accuracy vs baseline" in r.output and "Latency" in r.output and "PASS" in r.output
    assert sorted(p.name for p in rep.iterdir()) == ["index.html", "report.json", "report.md"]
    again = invoke("compare", mlp_files["base"], mlp_files["fp16"], "--num-batches", "1", "--report", rep)
    assert_user_error(again, "exists|existing file")


def test_compare_failed_check_exit_1_and_json(invoke, mlp_files):
    r = invoke(
        "compare",
        mlp_files["base"],
        mlp_files["fp16"],
        mlp_files["broken"],
        "--data",
        mlp_files["big"],
        "--check",
        "cosine>=0.9999",
        "--json",
    )
    assert r.exit_code == 1
    out = _out(r)
    assert "Traceback" not in out and "Error:" not in out
    assert (
        "FAIL: 1 check(s) failed" in out
        and "mlp.lnfp16.onnx: output 'logits': cosine>=0.9999 (got -1)" in out
    )
    data = json.loads(r.stdout)
    assert data["schema_version"] == 1
    jump = data["candidates"][1]["divergence"]["first_jump"]
    assert jump["op_type"] == "LayerNormalization" and jump["reason"] == "user:low-node"


def test_compare_quiet(invoke, mlp_files):
    r = invoke("compare", mlp_files["base"], mlp_files["fp16"], "--num-batches", "1", "--quiet")
    assert (
        r.exit_code == 0 and r.output.strip().startswith("PASS") and len(r.output.strip().splitlines()) == 1
    )


def _variant(src, dst, edit):
    m = onnx.load(str(src))
    edit(m)
    onnx.save(m, str(dst))
    return dst


def _rename_input(m):
    old = m.graph.input[0].name
    m.graph.input[0].name = "features"
    for n in m.graph.node:
        for i, x in enumerate(n.input):
            if x == old:
                n.input[i] = "features"


def _fp16_input(m):
    m.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    cast = next(n for n in m.graph.node if n.op_type == "Cast" and n.input[0] == m.graph.input[0].name)
    cast.op_type = "Identity"
    del cast.attribute[:]


def _rename_output(m):
    m.graph.output[0].name = "probs"
    m.graph.node[-1].output[0] = "probs"


@pytest.mark.parametrize(
    "edit,pattern",
    [
        (
            _rename_input,
            r"Candidate '.*variant.onnx': input names: received \['features'\], "
            r"expected the baseline's \['x'\]",
        ),
        (
            _fp16_input,
            r"Candidate '.*variant.onnx': input 'x': received dtype float16, "
            r"expected float32 .*--keep-io-types",
        ),
        (
            _rename_output,
            r"Candidate '.*variant.onnx': output names: received \['probs'\].*missing \['logits'\]",
        ),
    ],
)
def test_mismatched_models(invoke, mlp_files, tmp_path, edit, pattern):
    cand = _variant(mlp_files["fp16"], tmp_path / "variant.onnx", edit)
    r = invoke("compare", mlp_files["base"], cand, "--report", tmp_path / "rep")
    assert_user_error(r, pattern)
    assert not (tmp_path / "rep").exists()


def _relu_model(path, dims):
    from onnx import helper

    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_mismatched_shapes(invoke, tmp_path):
    base = _relu_model(tmp_path / "base.onnx", ["batch", 4])
    cand = _relu_model(tmp_path / "cand.onnx", ["batch", 5])
    r = invoke("compare", base, cand)
    assert_user_error(
        r,
        r"Candidate '.*cand.onnx': input 'x': received shape \('batch', 5\), "
        r"expected \('batch', 4\) as in baseline '.*base.onnx'",
    )


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize(
    "arrays,pattern",
    [
        ({"inp": np.zeros((4, 64), np.float32)}, r"Data '.*': received arrays \['inp'\].*missing: x"),
        ({"x": np.zeros((4, 64), np.float64)}, r"input 'x': received dtype float64, expected float32"),
        ({"x": np.zeros((4, 63), np.float32)}, r"input 'x': received shape \(4, 63\)"),
        ({"x": np.zeros((0, 64), np.float32)}, r"input 'x': received an empty array"),
        ({"x": np.full((4, 64), np.nan, np.float32)}, r"input 'x': received 256 NaN values"),
    ],
)
def test_bad_data(invoke, mlp_files, tmp_path, arrays, pattern):
    data = _npz(tmp_path / "d.npz", **arrays)
    r = invoke("compare", mlp_files["base"], mlp_files["fp16"], "--data", data, "--report", tmp_path / "rep")
    assert_user_error(r, pattern)
    assert not (tmp_path / "rep").exists()


def test_candidate_fails_to_load(invoke, mlp_files, tmp_path):
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(mlp_files["fp16"].read_bytes()[:200])
    r = invoke("compare", mlp_files["base"], bad, "--report", tmp_path / "rep")
    assert_user_error(r, r"Candidate '.*truncated.onnx' could not be loaded: .*does not parse as ONNX")
    assert not (tmp_path / "rep").exists()
    r = invoke("compare", mlp_files["base"], tmp_path / "missing.onnx")
    assert_user_error(r, r"Candidate '.*missing.onnx' could not be loaded: .*no such file")


def test_unknown_check(invoke, mlp_files, tmp_path):
    r = invoke(
        "compare",
        mlp_files["base"],
        mlp_files["fp16"],
        "--check",
        "cosine>=0.9,acuracy>=0.9",
        "--report",
        tmp_path / "rep",
    )
    assert_user_error(r, r"Check 'acuracy>=0.9': received unknown metric 'acuracy'.*did you mean 'accuracy'\?")
    assert not (tmp_path / "rep").exists()


def test_fixed_batch_latency_sizes(invoke, mlp_files, tmp_path):
    r = invoke("compare", mlp_files["base"], mlp_files["fp16"], "--batch-sizes", "1,x")
    assert r.exit_code == 2 and "comma-separated integers" in _out(r)


def test_candidate_fails_to_run(invoke, tmp_path):
    """A model that loads but fails at run time (Reshape to an impossible shape) is named."""
    from onnx import helper, numpy_helper

    base = _relu_model(tmp_path / "base.onnx", ["batch", 4])
    shape = numpy_helper.from_array(np.array([3, 5], np.int64), "shape")
    g = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
            helper.make_node("Relu", ["r"], ["y"], name="relu"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [shape],
    )
    cand = tmp_path / "cand.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(cand))
    r = invoke("compare", base, cand, "--report", tmp_path / "rep")
    assert_user_error(r, r"Candidate '.*cand.onnx' failed to run on batch 0: .*Reshape")
    assert not (tmp_path / "rep").exists()


def test_torch_baseline_and_strict_numerics(invoke, mlp_files):
    pytest.importorskip("mpinfer.precision.emulator.runner", reason="strict numerics not in this build")
    r = invoke(
        "compare",
        "models/mlp.py:build",
        mlp_files["fp16"],
        "--data",
        mlp_files["small"],
        "--numerics",
        "strict",
        "--num-batches",
        "1",
        "--json",
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["baseline"]["runner"]["backend"] == "torch"
    assert data["candidates"][0]["runner"]["numerics"] == "strict-fp16"


def test_output_shape_mismatch_at_run_time(invoke, tmp_path):
    from onnx import helper

    base = _relu_model(tmp_path / "base.onnx", ["batch", 4])
    g = helper.make_graph(
        [helper.make_node("Concat", ["x", "x"], ["y"], name="concat", axis=1)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
    )
    cand = tmp_path / "cand.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(cand))
    r = invoke("compare", base, cand, "--batch-size", "3")
    assert_user_error(r, r"Candidate '.*cand.onnx': output 'y': received shape \(3, 8\), expected \(3, 4\)")


def test_image_folder_data_with_preprocessing(invoke, tmp_path):
    from PIL import Image

    from tests.precision.graphs import fvi, init, make, rng_w, save

    nodes = [onnx.helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])]
    model = make(nodes, [fvi("x", ["N", 3, 8, 8])], [fvi("y", ["N", 2, 8, 8])], [init("w", rng_w(2, 3, 3, 3))])
    src = save(model, tmp_path / "m.onnx")
    (tmp_path / "imgs").mkdir()
    for i in range(4):
        Image.fromarray(np.full((12, 12, 3), 40 * i, np.uint8)).save(tmp_path / "imgs" / f"{i}.png")
    r = invoke("compare", src, src, "--data", tmp_path / "imgs", "--image-preprocess", "size=8x8,mode=BGR",
               "--json", "--no-divergence")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["data"]["kind"] == "images"


def test_baseline_as_its_own_candidate_is_warned_about(invoke, mlp_files, tmp_path):
    """compare BASE BASE passed without a word: it measures the runners, not a conversion."""
    import shutil

    copy = tmp_path / "copy.onnx"
    shutil.copyfile(mlp_files["base"], copy)
    r = invoke("compare", mlp_files["base"], mlp_files["base"], copy, mlp_files["fp16"], "--data", mlp_files["small"],
               "--no-divergence", "--report", tmp_path / "rep")
    assert r.exit_code == 0, _out(r)
    out = " ".join(_out(r).split())
    assert "is the baseline itself (the same file)" in out
    assert f"Candidate '{copy}' is the baseline itself (a byte-identical copy)" in out
    assert f"Candidate '{mlp_files['fp16']}' is the baseline" not in out
    notes = json.loads((tmp_path / "rep" / "report.json").read_text())["notes"]
    assert sum("is the baseline itself" in n for n in notes) == 2
