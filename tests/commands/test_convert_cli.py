"""`mpinfer convert` CLI: happy paths and every bad input of the issue (exit 1, one Error: line)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import assert_user_error
from tests.precision.graphs import fvi, init, make, mlp, rng_w, save


@pytest.fixture
def model_path(tmp_path):
    return save(mlp(), tmp_path / "m.onnx")


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


def test_convert_writes_model_and_plan(invoke, model_path, tmp_path):
    out = tmp_path / "out" / "m.fp16.onnx"
    data = _npz(tmp_path / "cal.npz", x=np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32))
    r = invoke(
        "convert",
        model_path,
        "--precision",
        "fp16",
        "--calibration",
        data,
        "--budget",
        "cosine>=0.999,top1>=0.9",
        "-o",
        out,
    )
    assert r.exit_code == 0, r.output
    assert out.exists() and (tmp_path / "out" / "m.fp16.plan.json").exists()
    assert "nodes low" in r.output
    plan = json.loads((tmp_path / "out" / "m.fp16.plan.json").read_text())
    assert plan["budget"] == "cosine>=0.999,top1>=0.9" and plan["summary"]["search"]["node_evaluations"] > 0
    again = invoke(
        "convert", model_path, "--plan", tmp_path / "out" / "m.fp16.plan.json", "-o", tmp_path / "re.onnx"
    )
    assert again.exit_code == 0, again.output
    assert (tmp_path / "re.onnx").read_bytes() == out.read_bytes()
    # re-applied in place (the plan is the one beside the output): applied, not rewritten, and said so
    before = (tmp_path / "out" / "m.fp16.plan.json").read_bytes()
    inplace = invoke("convert", model_path, "--plan", tmp_path / "out" / "m.fp16.plan.json", "-o", out, "--force")
    assert inplace.exit_code == 0, inplace.output
    assert "applied as it is, not rewritten" in " ".join(inplace.output.split())
    assert (tmp_path / "out" / "m.fp16.plan.json").read_bytes() == before


def test_overrides(invoke, model_path, tmp_path):
    out = tmp_path / "m.bf16.onnx"
    r = invoke(
        "convert",
        model_path,
        "--precision",
        "bf16",
        "--keep-op",
        "Relu",
        "--keep-node",
        "fc2",
        "--low-op",
        "Softmax",
        "--calibration",
        "none",
        "-o",
        out,
    )
    assert r.exit_code == 0, r.output
    nodes = {n["name"]: n for n in json.loads((tmp_path / "m.bf16.plan.json").read_text())["nodes"]}
    assert nodes["relu"]["reason"] == "user:keep-op" and nodes["relu"]["precision"] == "fp32"
    assert nodes["fc2"]["reason"] == "user:keep-node" and nodes["fc2"]["precision"] == "fp32"
    assert nodes["softmax"]["reason"] == "user:low-op" and nodes["softmax"]["precision"] == "bf16"


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (("--keep-op", "Softmx"), r"--keep-op: received 'Softmx', expected an ONNX op type.*did you mean 'Softmax'"),
        (("--low-op", "relu"), r"--low-op: received 'relu'.*did you mean 'Relu'"),
        (("--keep-op", "Relu", "--low-op", "Relu"), r"--keep-op and --low-op: received the op type 'Relu' in both"),
        (("--keep-node", "fc.*", "--low-node", "fc.*"), r"--keep-node and --low-node: received .*'fc\.\*' in both"),
    ],
)
def test_overrides_that_contradict_or_name_no_op_are_refused(invoke, model_path, tmp_path, args, pattern):
    r = invoke("convert", model_path, *args, "--calibration", "none", "-o", tmp_path / "o.onnx")
    assert_user_error(r, pattern)
    assert not (tmp_path / "o.onnx").exists()


def test_overrides_that_match_nothing_are_named(invoke, model_path, tmp_path, caplog):
    # valid, but absent from this model: a silent no-op before (the README's --keep-op Softmax on digits)
    r = invoke("convert", model_path, "--keep-op", "Conv", "--keep-node", "head/.*", "--calibration", "none",
               "-o", tmp_path / "o.onnx")
    assert r.exit_code == 0, r.output
    text = caplog.text + r.output
    assert "--keep-op Conv: the model has no Conv node, so it changes nothing" in text
    assert "--keep-node 'head/.*' matches no node, so it changes nothing" in text


def test_a_forced_low_plan_that_overflows_is_said(invoke, model_path, tmp_path, caplog):
    x = (np.random.default_rng(0).standard_normal((16, 8)) * 1e6).astype(np.float32)
    cal = _npz(tmp_path / "big.npz", x=x)
    # the default floor: forced low nodes break it on the calibration data, nothing can repair that: refused
    r = invoke("convert", model_path, "--calibration", cal, "--low-op", "MatMul", "-o", tmp_path / "o.onnx")
    assert_user_error(r, "default floor")
    assert "--budget none" in r.output and not (tmp_path / "o.onnx").exists()
    # without a budget: the user asked for it: written, and said loudly
    r = invoke("convert", model_path, "--calibration", cal, "--low-op", "MatMul", "--budget", "none",
               "-o", tmp_path / "o.onnx")
    assert r.exit_code == 0, r.output
    text = caplog.text + r.output
    assert "The converted model is broken on the calibration data" in text
    assert "nodes forced low by --low-op/--low-node overflow, e.g. fc1" in text


def test_a_folder_of_images_calibrates_with_its_preprocessing(invoke, tmp_path):
    from PIL import Image

    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])]
    model = make(nodes, [fvi("x", ["N", 1, 8, 8])], [fvi("y", ["N", 2, 8, 8])], [init("w", rng_w(2, 1, 3, 3))])
    src = save(model, tmp_path / "m.onnx")
    (tmp_path / "imgs").mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), mode="L").save(tmp_path / "imgs" / f"{i}.png")
    r = invoke("convert", src, "--calibration", tmp_path / "imgs", "--image-preprocess", "mode=L,scale=255",
               "-o", tmp_path / "o.onnx")
    assert r.exit_code == 0, r.output
    plan = json.loads((tmp_path / "o.plan.json").read_text())
    assert plan["calibration"]["kind"] == "images" and plan["calibration"]["samples"] == 6
    assert_user_error(invoke("convert", src, "--calibration", tmp_path / "imgs", "--image-preprocess", "colour=L",
                             "-o", tmp_path / "p.onnx"), "colour")


def test_output_must_be_an_onnx_file(invoke, model_path, tmp_path):
    r = invoke("convert", model_path, "--calibration", "none", "-o", tmp_path / "x.txt")
    assert_user_error(r, r"Output '.*x.txt': received suffix '.txt', expected '.onnx'")
    assert not list(tmp_path.glob("x.*"))


def test_not_onnx(invoke, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_text("hello, not a model")
    r = invoke("convert", bad, "-o", tmp_path / "o.onnx")
    assert_user_error(r, "ONNX")
    assert not (tmp_path / "o.onnx").exists()


def test_truncated(invoke, model_path, tmp_path):
    data = model_path.read_bytes()
    trunc = tmp_path / "trunc.onnx"
    trunc.write_bytes(data[: len(data) // 2])
    r = invoke("convert", trunc, "-o", tmp_path / "o.onnx")
    assert_user_error(r, "truncated|parse")
    assert not (tmp_path / "o.onnx").exists()


def _external(tmp_path, location):
    w = numpy_helper.from_array(rng_w(8, 4), "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    w.external_data.add(key="location", value=location)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [fvi("x", [2, 8])],
        [fvi("y", [2, 4])],
        [w],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    p = tmp_path / "ext.onnx"
    p.write_bytes(m.SerializeToString())
    return p


def test_missing_external_data(invoke, tmp_path):
    r = invoke("convert", _external(tmp_path, "weights.bin"), "-o", tmp_path / "o.onnx")
    assert_user_error(r, "external data")
    assert not (tmp_path / "o.onnx").exists()


def test_external_data_escaping_folder(invoke, tmp_path):
    r = invoke("convert", _external(tmp_path, "../../etc/passwd"), "-o", tmp_path / "o.onnx")
    assert_user_error(r, "outside the model's folder")
    assert not (tmp_path / "o.onnx").exists()


def test_already_fp16(invoke, model_path, tmp_path):
    first = tmp_path / "a.onnx"
    assert invoke("convert", model_path, "--calibration", "none", "-o", first).exit_code == 0
    r = invoke("convert", first, "--calibration", "none", "-o", tmp_path / "b.onnx")
    assert_user_error(r, "already mixed precision.*--force")
    assert not (tmp_path / "b.onnx").exists()
    forced = invoke("convert", first, "--calibration", "none", "--force", "-o", tmp_path / "b.onnx")
    assert forced.exit_code == 0, forced.output
    # Re-planned from FP32: the first conversion's Casts are gone, not retargeted into Casts of Casts, and
    # the plan counts the model's own nodes, with the Casts it sets (the same ones as the first time).
    a, b = onnx.load(str(first)), onnx.load(str(tmp_path / "b.onnx"))
    assert [n.op_type for n in b.graph.node] == [n.op_type for n in a.graph.node]
    plan = json.loads((tmp_path / "b.plan.json").read_text())
    assert [n["name"] for n in plan["nodes"]] == [n.name for n in mlp().graph.node]
    assert plan["summary"]["cast_count"] == sum(n.op_type == "Cast" for n in b.graph.node)


@pytest.mark.parametrize(
    "arrays, match",
    [
        ({"inp": np.zeros((4, 8), np.float32)}, "missing: x"),
        ({"x": np.zeros((4, 8), np.float64)}, "dtype float64"),
        ({"x": np.zeros((4, 7), np.float32)}, "shape"),
        ({"x": np.full((4, 8), np.nan, np.float32)}, "NaN"),
    ],
)
def test_bad_calibration_data(invoke, model_path, tmp_path, arrays, match):
    data = _npz(tmp_path / "cal.npz", **arrays)
    r = invoke("convert", model_path, "--calibration", data, "-o", tmp_path / "o.onnx")
    assert_user_error(r, match)
    assert not (tmp_path / "o.onnx").exists()


def test_unmeetable_budget(invoke, model_path, tmp_path):
    rng = np.random.default_rng(0)
    data = _npz(
        tmp_path / "cal.npz",
        x=rng.standard_normal((64, 8)).astype(np.float32),
        _labels=rng.integers(0, 4, 64),
    )
    r = invoke(
        "convert", model_path, "--calibration", data, "--budget", "accuracy>=0.99", "-o", tmp_path / "o.onnx"
    )
    assert_user_error(r, "even with every node in FP32")
    assert not (tmp_path / "o.onnx").exists()


def test_unknown_budget_metric(invoke, model_path, tmp_path):
    r = invoke("convert", model_path, "--budget", "psnr>=40", "-o", tmp_path / "o.onnx")
    assert_user_error(r, "Check 'psnr>=40': received unknown metric 'psnr'")


def test_output_exists_needs_force(invoke, model_path, tmp_path):
    out = tmp_path / "o.onnx"
    out.write_bytes(b"keep")
    r = invoke("convert", model_path, "--calibration", "none", "-o", out)
    assert_user_error(r, "--force")
    assert out.read_bytes() == b"keep"
    assert_user_error(invoke("convert", model_path, "-o", model_path), "same path as an input")


def test_bf16_with_ort_numerics_refused(invoke, model_path, tmp_path):
    r = invoke(
        "convert",
        model_path,
        "--precision",
        "bf16",
        "--numerics",
        "ort",
        "--budget",
        "cosine>=0.99",
        "-o",
        tmp_path / "o.onnx",
    )
    assert_user_error(r, "strict")


def test_unknown_ops_kept_and_reported(invoke, tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
        helper.make_node("Frobnicate", ["a"], ["y"], name="frob", domain="acme"),
    ]
    g = helper.make_graph(nodes, "g", [fvi("x", [2, 4])], [fvi("y", [2, 4])], [init("w", rng_w(4, 4))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme", 1)])
    src = save(m, tmp_path / "c.onnx")
    r = invoke("convert", src, "--calibration", "none", "-o", tmp_path / "c.fp16.onnx")
    assert r.exit_code == 0, r.output
    assert "custom-domain: 1" in r.output
    plan = json.loads((tmp_path / "c.fp16.plan.json").read_text())
    assert {n["name"]: n["reason"] for n in plan["nodes"]}["frob"] == "custom-domain"
    assert onnx.load(str(tmp_path / "c.fp16.onnx")).graph.node


def test_make_helper_checks():
    assert make([helper.make_node("Relu", ["x"], ["y"], name="r")], [fvi("x", [1])], [fvi("y", [1])])


def test_nodes_low_share_matches_the_count_it_is_printed_next_to(invoke, tmp_path):
    """Index-like nodes are out of the share's denominator; the printed count must say so (was '2/4 (100%)')."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Reshape", ["x", "s"], ["r"], name="reshape"),
        helper.make_node("MatMul", ["r", "w"], ["m"], name="mm"),
        helper.make_node("Relu", ["m"], ["y"], name="relu"),
    ]
    model = make(nodes, [fvi("x", [2, 8])], [fvi("y", [2, 8])], [init("w", rng_w(8, 8))])
    src = save(model, tmp_path / "m.onnx")
    r = invoke("convert", src, "--calibration", "none", "-o", tmp_path / "m.fp16.onnx")
    assert r.exit_code == 0, r.output
    plan = json.loads((tmp_path / "m.fp16.plan.json").read_text())["summary"]
    low, share = plan["nodes_low"], plan["low_share_nodes"]
    line = next(ln for ln in r.output.splitlines() if "nodes low" in ln)
    assert f"{low}/{round(low / share)} " in line and f"({share:.1%})" in line, line


def _conv1d(tmp_path):
    """x: batch x 1 x len (len unknown), a width-5 convolution: lengths below 5 are not data for it."""
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", kernel_shape=[5])
    model = make([node], [fvi("x", ["batch", 1, "len"])], [fvi("y", ["batch", 4, "out"])], [init("w", rng_w(4, 1, 5))])
    return save(model, tmp_path / "conv.onnx")


def test_random_data_at_guessed_sizes_the_model_rejects_says_to_pass_dim(invoke, tmp_path):
    # mpinfer's own random data rejected: convert stops (issue 35), naming the node and the guessed dim
    src = _conv1d(tmp_path)
    r = invoke("convert", src, "-o", tmp_path / "r.onnx")
    assert_user_error(r, r"random data.*rejects it at node 'conv' \(Conv\).*--dim NAME=N.*'len' \(input 'x'\) set "
                         r"to 2.*--calibration FILE")
    assert not (tmp_path / "r.onnx").exists() and not (tmp_path / "r.plan.json").exists()
    ok = invoke("convert", src, "--dim", "len=32", "--batch-size", "3", "-o", tmp_path / "o.onnx")
    assert ok.exit_code == 0, ok.output
    plan = json.loads((tmp_path / "o.plan.json").read_text())
    assert plan["calibration"]["samples"] == 3 * 8  # 8 random batches of --batch-size 3
    assert_user_error(invoke("convert", src, "--dim", "len", "-o", tmp_path / "p.onnx"), "name=N")


def _conv_model(opset: int) -> onnx.ModelProto:
    """x[N,2,6,6] -> Conv -> Relu -> MaxPool -> y: Conv/MaxPool take bfloat16 only from opset 22."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["y"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
    ]
    return make(
        nodes, [fvi("x", ["N", 2, 6, 6])], [fvi("y", ["N", 4, 3, 3])], [init("w", rng_w(4, 2, 3, 3))], opset=opset
    )


def test_opset_upgrade_for_bf16_is_recorded_in_the_plan(invoke, tmp_path, caplog):
    src = save(_conv_model(17), tmp_path / "m.onnx")
    r = invoke("convert", src, "--precision", "bf16", "-o", tmp_path / "a.onnx")
    assert r.exit_code == 0, r.output
    assert "Hint: opset 22 has it: convert with `--opset 22`" in caplog.text + r.output
    assert json.loads((tmp_path / "a.plan.json").read_text())["opset"] == 17
    r = invoke("convert", src, "--precision", "bf16", "--opset", "22", "-o", tmp_path / "b.onnx")
    assert r.exit_code == 0, r.output
    plan = json.loads((tmp_path / "b.plan.json").read_text())
    assert plan["opset"] == 22
    assert {n["name"]: n["precision"] for n in plan["nodes"]}["conv"] == "bf16"
    out = onnx.load(str(tmp_path / "b.onnx"))
    assert next(i.version for i in out.opset_import if i.domain == "") == 22
    # Re-applying the plan to the original model upgrades it the same way: the same bytes.
    r = invoke("convert", src, "--plan", tmp_path / "b.plan.json", "-o", tmp_path / "c.onnx")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "c.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert onnx.load(str(src)).opset_import[0].version == 17  # the input is never modified


def test_opset_hint_never_names_an_opset_the_cli_refuses(invoke, tmp_path, caplog):
    # Range takes float16 only from opset 27, above MAX_OPSET: no "--opset 27" hint (the CLI would refuse it).
    from mpinfer.modelio import MAX_OPSET

    assert MAX_OPSET < 27
    nodes = [
        helper.make_node("Range", ["s", "l", "d"], ["r"], name="range"),
        helper.make_node("Add", ["x", "r"], ["y"], name="add"),
    ]
    scalars = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("s", 0), ("l", 4), ("d", 1))]
    src = save(make(nodes, [fvi("x", ["N", 4])], [fvi("y", ["N", 4])], scalars, opset=17), tmp_path / "m.onnx")
    r = invoke("-v", "convert", src, "-o", tmp_path / "a.onnx")
    assert r.exit_code == 0, r.output
    text = caplog.text + r.output
    assert "--opset 27" not in text and "Hint: opset" not in text
    assert f"Range stay FP32: ONNX gives them float16 only from opset 27, above the highest opset mpinfer writes " \
        f"({MAX_OPSET})" in text
    assert invoke("convert", src, "--opset", "27", "-o", tmp_path / "b.onnx").exit_code == 2


def test_flops_count_the_sizes_the_data_has(invoke, tmp_path):
    # A Paddle-style export: batch stored as dim_value -1, image sides symbolic. FLOPs once went negative (-1
    # multiplied in) and ignored --dim (unknown sides counted as 1): they come from calibration's shapes now.
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("MatMul", ["f", "w2"], ["y"], name="mm"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 2, "h", "w"])
    model = make(nodes, [x], [fvi("y", [-1, 3])], [init("w", rng_w(4, 2, 3, 3)), init("w2", rng_w(4, 3))])
    src = save(model, tmp_path / "m.onnx")
    r = invoke("convert", src, "--dim", "h=32", "--dim", "w=16", "-o", tmp_path / "a.onnx")
    assert r.exit_code == 0, r.output
    flops = {n["name"]: n["stats"]["flops"] for n in json.loads((tmp_path / "a.plan.json").read_text())["nodes"]}
    assert flops["conv"] == 2 * (4 * 32 * 16) * (2 * 3 * 3)  # per sample: 2 x outputs x (C_in x kH x kW)
    assert flops["mm"] == 2 * 3 * 4
    assert all(v >= 0 for v in flops.values()), flops


def test_opset_below_the_models_is_refused(invoke, tmp_path):
    src = save(_conv_model(17), tmp_path / "m.onnx")
    r = invoke("convert", src, "--opset", "13", "-o", tmp_path / "a.onnx")
    assert_user_error(r, r"--opset: received 13, below the model's opset 17")
    assert not (tmp_path / "a.onnx").exists() and not (tmp_path / "a.plan.json").exists()
    plan = tmp_path / "bad.plan.json"
    r = invoke("convert", src, "-o", tmp_path / "p.onnx")
    data = json.loads((tmp_path / "p.plan.json").read_text())
    data["opset"] = "22"
    plan.write_text(json.dumps(data))
    assert_user_error(invoke("convert", src, "--plan", plan, "-o", tmp_path / "q.onnx"), r"opset '22' is not")
