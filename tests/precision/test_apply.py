"""Graph rewriting from a plan: casts, initializers, patched attributes, subgraphs, IO types, validity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mpinfer.modelio import name_nodes
from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.graph.apply import apply_plan
from mpinfer.precision.graph.validate import run_checks
from mpinfer.specs import Precision
from tests.precision.graphs import embedding, fvi, init, make, mlp, rng_w, run_ort, save
from tests.tolerances import assert_onnx_outputs_close

FP16 = TensorProto.FLOAT16


def _convert(tmp_path: Path, model: onnx.ModelProto, **kw) -> tuple[onnx.ModelProto, object]:
    src = save(model, tmp_path / "m.onnx")
    kw.setdefault("calibration", "none")
    res = convert_precision(ConvertConfig(model=src, output=tmp_path / "m.fp16.onnx", **kw))
    return onnx.load(str(res.output)), res


def _types(model: onnx.ModelProto) -> dict[str, int]:
    out = {t.name: t.data_type for t in model.graph.initializer}
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        out[vi.name] = vi.type.tensor_type.elem_type
    return out


def test_mlp_casts_only_at_boundaries(tmp_path):
    out, res = _convert(tmp_path, mlp())
    casts = [n for n in out.graph.node if n.op_type == "Cast"]
    # x -> fp16 before fc1, and logits -> fp32 before Softmax (kept FP32); output stays FP32.
    assert sorted(n.name for n in casts) == ["logits__cast_to_fp32", "x__cast_to_fp16"]
    types = _types(out)
    assert types["w1"] == FP16 and types["w2"] == FP16
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert out.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert {n.name for n in out.graph.node} >= {"fc1", "add1", "relu", "fc2", "add2", "softmax"}
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    assert_onnx_outputs_close(run_ort(out, {"x": x})[0], run_ort(mlp(), {"x": x})[0], mlp(), dtype=np.float16)
    assert res.plan.summary["cast_count"] == 2


def test_shared_initializer_duplicated_only_when_consumers_disagree(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
        helper.make_node("Add", ["x2", "w"], ["b"], name="add_fp32"),
    ]
    model = make(
        nodes,
        [fvi("x", [2, 4]), fvi("x2", [4, 4])],
        [fvi("a", [2, 4]), fvi("b", [4, 4])],
        [init("w", rng_w(4, 4))],
    )
    out, _ = _convert(tmp_path, model)
    inits = {t.name: t.data_type for t in out.graph.initializer}
    assert inits == {"w": TensorProto.FLOAT, "w__fp16": FP16}
    mm = next(n for n in out.graph.node if n.name == "mm")
    assert mm.input[1] == "w__fp16"


def test_weights_out_of_fp16_range_kept_fp32_not_clamped(tmp_path):
    big = np.full((4, 4), 1e8, np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
        helper.make_node(
            "Constant",
            [],
            ["c"],
            name="const",
            value=helper.make_tensor("v", TensorProto.FLOAT, [4], [1e9, 1, 2, 3]),
        ),
        helper.make_node("MatMul", ["x", "w2"], ["z0"], name="mm2"),
        helper.make_node("Mul", ["z0", "c"], ["z"], name="mul"),
    ]
    model = make(
        nodes,
        [fvi("x", [2, 4])],
        [fvi("y", [2, 4]), fvi("z", [2, 4])],
        [init("w", big), init("w2", rng_w(4, 4))],
    )
    out, res = _convert(tmp_path, model)
    reasons = {n.name: n.reason for n in res.plan.nodes}
    assert reasons["mm"] == "weights:out-of-range" and reasons["mul"] == "weights:out-of-range"
    inits = {t.name: t for t in out.graph.initializer}
    assert inits["w"].data_type == TensorProto.FLOAT
    assert onnx.numpy_helper.to_array(inits["w"]).max() == 1e8
    const = next(n for n in out.graph.node if n.name == "const")
    assert const.attribute[0].t.data_type == TensorProto.FLOAT


def test_embedding_table_converted_integer_ids_ignored(tmp_path):
    model = embedding()
    out, res = _convert(tmp_path, model)
    assert {t.name: t.data_type for t in out.graph.initializer}["table"] == FP16
    assert res.plan.precisions()["embed"] is Precision.FP16


def test_existing_casts_and_dtype_attributes_patched(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
        helper.make_node("Cast", ["a"], ["a32"], name="cast_f", to=TensorProto.FLOAT),
        helper.make_node("Shape", ["a32"], ["shp"], name="shape"),
        helper.make_node(
            "ConstantOfShape",
            ["shp"],
            ["ones"],
            name="cos",
            value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]),
        ),
        helper.make_node(
            "RandomNormalLike", ["a32"], ["noise"], name="rnd", dtype=TensorProto.FLOAT, scale=1e-4
        ),
        helper.make_node("EyeLike", ["sq"], ["eye"], name="eye", dtype=TensorProto.FLOAT),
        helper.make_node("Add", ["a32", "ones"], ["b"], name="add"),
        helper.make_node("Add", ["b", "noise"], ["c"], name="add2"),
        helper.make_node("MatMul", ["c", "eye"], ["d"], name="mm2"),
    ]
    model = make(nodes, [fvi("x", [2, 4]), fvi("sq", [4, 4])], [fvi("d", [2, 4])], [init("w", rng_w(4, 4))])
    out, res = _convert(tmp_path, model, low_nodes=("cast_f", "cos", "rnd", "eye", "add", "add2"))
    by = {n.name: n for n in out.graph.node}
    assert helper.get_attribute_value(by["cast_f"].attribute[0]) == FP16
    assert by["cos"].attribute[0].t.data_type == FP16
    assert {a.name: a.i for a in by["rnd"].attribute}["dtype"] == FP16
    assert {a.name: a.i for a in by["eye"].attribute}["dtype"] == FP16
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    sq = np.zeros((4, 4), np.float32)
    assert_onnx_outputs_close(
        run_ort(out, {"x": x, "sq": sq})[0], run_ort(model, {"x": x, "sq": sq})[0], model, dtype=np.float16
    )


def test_resize_scales_stay_fp32(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Resize", ["c", "", "scales"], ["r"], name="resize", mode="nearest"),
        helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2"),
    ]
    model = make(
        nodes,
        [fvi("x", [1, 2, 4, 4])],
        [fvi("y", [1, 2, 8, 8])],
        [
            init("w", rng_w(2, 2, 1, 1)),
            init("scales", np.array([1, 1, 2, 2], np.float32)),
            init("w2", rng_w(2, 2, 1, 1)),
        ],
    )
    out, res = _convert(tmp_path, model)
    assert res.plan.precisions()["resize"] is Precision.FP16
    assert {t.name: t.data_type for t in out.graph.initializer}["scales"] == TensorProto.FLOAT
    assert [n.name for n in out.graph.node if n.op_type == "Cast"] == ["x__cast_to_fp16", "y__cast_to_fp32"]


def test_shape_arithmetic_feeding_reshape_is_index_like(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
        helper.make_node("Shape", ["a"], ["s"], name="shape"),
        helper.make_node("Cast", ["s"], ["sf"], name="to_float", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["sf", "half"], ["sh"], name="scale_shape"),
        helper.make_node("Cast", ["sh"], ["si"], name="to_int", to=TensorProto.INT64),
        helper.make_node("Reshape", ["a", "si"], ["y"], name="reshape"),
    ]
    model = make(
        nodes,
        [fvi("x", [2, 4])],
        [fvi("y", [4, 2])],
        [init("w", rng_w(4, 4)), init("half", np.array([2.0, 0.5], np.float32))],
    )
    out, res = _convert(tmp_path, model)
    p = {n.name: (n.precision, n.reason) for n in res.plan.nodes}
    assert p["scale_shape"] == (Precision.FP32, "rule:index-like")
    assert p["to_float"][0] is Precision.FP32


def test_if_subgraph_converted_outer_values_cast_inside(tmp_path):
    then_g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["t"], name="then_mm")], "then", [], [fvi("t", [2, 4])]
    )
    else_g = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["e"], name="else_tanh")], "else", [], [fvi("e", [2, 4])]
    )
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], name="rmax", keepdims=0),
        helper.make_node("Greater", ["m", "zero"], ["cond"], name="gt"),
        helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_g, else_branch=else_g),
    ]
    model = make(
        nodes,
        [fvi("x", [2, 4])],
        [fvi("y", [2, 4])],
        [init("w", rng_w(4, 4)), init("zero", np.array(0.0, np.float32))],
    )
    out, res = _convert(tmp_path, model)
    prec = res.plan.precisions()
    assert prec["if/then_branch/then_mm"] is Precision.FP16
    body = next(a.g for a in out.graph.node[-1].attribute if a.name == "then_branch")
    assert [n.op_type for n in body.node] == ["Cast", "MatMul", "Cast"]
    x = np.ones((2, 4), np.float32)
    assert_onnx_outputs_close(run_ort(out, {"x": x})[0], run_ort(model, {"x": x})[0], model, dtype=np.float16)
    assert not run_checks(out)


def test_loop_body_converted(tmp_path):
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "w"], ["h1"], name="mm"),
            helper.make_node("Tanh", ["h1"], ["h_out"], name="tanh"),
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="id"),
        ],
        "body",
        [fvi("i", [], TensorProto.INT64), fvi("cond_in", [], TensorProto.BOOL), fvi("h_in", [2, 4])],
        [fvi("cond_out", [], TensorProto.BOOL), fvi("h_out", [2, 4])],
    )
    nodes = [helper.make_node("Loop", ["trip", "", "x"], ["y"], name="loop", body=body)]
    model = make(
        nodes,
        [fvi("x", [2, 4])],
        [fvi("y", [2, 4])],
        [init("w", rng_w(4, 4)), init("trip", np.array(3, np.int64))],
    )
    out, res = _convert(tmp_path, model)
    assert res.plan.precisions()["loop/body/mm"] is Precision.FP16
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    assert_onnx_outputs_close(run_ort(out, {"x": x})[0], run_ort(model, {"x": x})[0], model, dtype=np.float16)


def test_stale_value_info_retyped_and_io_types(tmp_path):
    model = mlp()
    model.graph.value_info.extend([fvi("h", ["N", 16]), fvi("r", ["N", 16])])
    out, _ = _convert(tmp_path, model, keep_io_types=False)
    vis = {vi.name: vi.type.tensor_type.elem_type for vi in out.graph.value_info}
    assert vis["h"] == FP16 and vis["r"] == FP16
    assert out.graph.input[0].type.tensor_type.elem_type == FP16
    assert out.graph.output[0].type.tensor_type.elem_type == FP16
    assert not run_checks(out)


def test_bf16_raises_opset_and_keeps_metadata(tmp_path):
    model = mlp()
    model.opset_import[0].version = 11
    helper.set_model_props(model, {"charset": "abc"})
    model.doc_string = "keep me"
    out, res = _convert(tmp_path, model, precision=Precision.BF16)
    assert out.opset_import[0].version == 13
    assert {p.key: p.value for p in out.metadata_props} == {"charset": "abc"}
    assert out.doc_string == "keep me"
    assert {t.name: t.data_type for t in out.graph.initializer}["w1"] == TensorProto.BFLOAT16
    assert out.ir_version <= 10


def test_same_plan_byte_identical_and_input_untouched(tmp_path):
    src = save(mlp(), tmp_path / "m.onnx")
    before = src.read_bytes()
    a = convert_precision(ConvertConfig(model=src, output=tmp_path / "a.onnx", calibration="none"))
    b = convert_precision(ConvertConfig(model=src, output=tmp_path / "b.onnx", plan=a.plan_path))
    assert a.output.read_bytes() == b.output.read_bytes()
    assert src.read_bytes() == before


def test_apply_does_not_mutate_given_model():
    model = name_nodes(mlp())
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    info = GraphInfo(model)
    apply_plan(model, info, {"fc1": Precision.FP16}, Precision.FP16)
    assert model == copy


@pytest.mark.parametrize("keep_io", [True, False])
def test_custom_domain_kept_and_reported(tmp_path, keep_io):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
        helper.make_node("MyOp", ["a"], ["y"], name="custom", domain="my.domain"),
    ]
    graph = helper.make_graph(nodes, "g", [fvi("x", [2, 4])], [fvi("y", [2, 4])], [init("w", rng_w(4, 4))])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.domain", 1)]
    )
    model.ir_version = 8
    out, res = _convert(tmp_path, model, keep_io_types=keep_io)
    by = {n.name: n for n in res.plan.nodes}
    assert by["custom"].reason == "custom-domain" and by["custom"].precision is Precision.FP32
    assert by["mm"].precision is Precision.FP16
    assert any(n.op_type == "Cast" and n.input[0] == "a" for n in out.graph.node)


def test_external_data_model_converted_streaming(tmp_path):
    src = tmp_path / "ext" / "m.onnx"
    src.parent.mkdir()
    onnx.save_model(
        mlp(),
        str(src),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="m.onnx.data",
        size_threshold=0,
    )
    res = convert_precision(
        ConvertConfig(
            model=src, output=tmp_path / "out" / "m.fp16.onnx", calibration="none", keep_ops=("Add",)
        )
    )
    out = onnx.load(str(res.output))
    inits = {t.name: t.data_type for t in out.graph.initializer}
    assert inits["w1"] == FP16 and inits["b1"] == TensorProto.FLOAT
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    assert_onnx_outputs_close(run_ort(res.output, {"x": x})[0], run_ort(mlp(), {"x": x})[0], mlp(), dtype=np.float16)
    assert not list((tmp_path / "out").glob(".*"))  # no temp folders left behind


def _op_in_the_middle(op: str, domain: str, name: str) -> onnx.ModelProto:
    """x -> MatMul 'mm' -> <domain>::<op> -> Add 'add' (with the MatMul's output) -> MatMul 'mm2' -> y."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
        helper.make_node(op, ["a"], ["m"], name=name, domain=domain),
        helper.make_node("Add", ["m", "a"], ["s"], name="add"),
        helper.make_node("MatMul", ["s", "w"], ["y"], name="mm2"),
    ]
    graph = helper.make_graph(nodes, "g", [fvi("x", [2, 4])], [fvi("y", [2, 4])], [init("w", rng_w(4, 4))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    model.ir_version = 8
    return model


def test_custom_op_in_the_middle_keeps_unknown_types_fp32(tmp_path):
    out, res = _convert(tmp_path, _op_in_the_middle("Mystery", "acme", "custom"))
    prec = res.plan.precisions()
    assert prec["custom"] is Precision.FP32 and prec["add"] is Precision.FP32
    assert prec["mm"] is Precision.FP16  # upstream of the custom op
    # Downstream, ONNX type inference knows no types: conservatively FP32, and said so.
    assert prec["mm2"] is Precision.FP32
    assert "type is unknown" in next(n.detail for n in res.plan.nodes if n.name == "mm2")
    onnx.checker.check_model(out, full_check=False)


def test_contrib_op_types_come_from_onnx_runtime(tmp_path):
    # An ORT-optimized transformer: ONNX has no schema for com.microsoft ops, ONNX Runtime has.
    model = _op_in_the_middle("Gelu", "com.microsoft", "gelu")
    info = GraphInfo(name_nodes(model))
    assert info.types["s"] == TensorProto.FLOAT and info.shapes["s"] == (2, 4)
    assert info.flops(info.by_address["mm2"]) == 2 * 2 * 4 * 4
    out, res = _convert(tmp_path, model)
    prec = res.plan.precisions()
    assert prec["gelu"] is Precision.FP32  # custom domain: kept, reported
    assert prec["mm2"] is Precision.FP16 and prec["add"] is Precision.FP16
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    assert_onnx_outputs_close(run_ort(out, {"x": x})[0], run_ort(model, {"x": x})[0], model, dtype=np.float16)
    # Calibration runs too (ONNX Runtime computes every tensor; the emulator, which has no Gelu, is not needed).
    (tmp_path / "cal").mkdir()
    _, calibrated = _convert(tmp_path / "cal", model, calibration=None)
    assert "absmax" in next(n.stats for n in calibrated.plan.nodes if n.name == "mm2")


def test_scan_body_converted_state_stays_fp32(tmp_path):
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["x_t", "w"], ["p"], name="mm"),
            helper.make_node("Add", ["h_in", "p"], ["h_out"], name="acc"),
            helper.make_node("Identity", ["h_out"], ["y_t"], name="emit"),
        ],
        "body",
        [fvi("h_in", [1, 4]), fvi("x_t", [1, 4])],
        [fvi("h_out", [1, 4]), fvi("y_t", [1, 4])],
    )
    nodes = [helper.make_node("Scan", ["h0", "xs"], ["h", "ys"], name="scan", body=body, num_scan_inputs=1)]
    model = make(
        nodes,
        [fvi("h0", [1, 4]), fvi("xs", [3, 1, 4])],
        [fvi("h", [1, 4]), fvi("ys", [3, 1, 4])],
        [init("w", rng_w(4, 4))],
    )
    out, res = _convert(tmp_path, model)
    assert res.plan.precisions()["scan/body/mm"] is Precision.FP16
    feeds = {
        "h0": np.zeros((1, 4), np.float32),
        "xs": np.random.default_rng(0).standard_normal((3, 1, 4)).astype(np.float32),
    }
    for got, want in zip(run_ort(out, feeds), run_ort(model, feeds), strict=True):
        assert_onnx_outputs_close(got, want, model, dtype=np.float16)


def test_gate_names_the_node_of_an_invalid_rewrite():
    from mpinfer.errors import InternalError
    from mpinfer.precision.graph.validate import gate

    nodes = [
        helper.make_node("Cast", ["x"], ["h"], name="half", to=FP16),
        helper.make_node("Add", ["h", "x"], ["y"], name="bad_add"),
    ]
    graph = helper.make_graph(nodes, "g", [fvi("x", [2])], [fvi("y", [2])])
    broken = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    broken.ir_version = 8
    with pytest.raises(InternalError, match="bad_add"):
        gate(broken, stage="test")


def test_node_onnxruntime_refuses_in_bf16_kept_fp32_with_reason():
    from mpinfer.precision.convert import convert_model
    from tests.precision.conformance import float_cases

    # collect_testcases caches its first answer process-wide: always ask for all cases (op_type None).
    case = next(c for c in float_cases() if c.name == "test_attention_4d_attn_mask_3d_causal")
    res = convert_model(case.model, Precision.BF16)
    attn = next(n for n in res.nodes if n.op_type == "Attention")
    assert attn.precision is Precision.FP32 and attn.reason == "rule:keep-fp32"
    assert "ONNX Runtime refuses it in bf16" in attn.detail
    assert not run_checks(res.model)


def test_bf16_conv_blocked_by_old_opset_is_warned_with_the_opset_that_has_it(tmp_path, caplog):
    """Conv has no bfloat16 before opset 22: a BF16 CNN at opset 17 stays FP32, and the user is told why."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    g = helper.make_graph(
        nodes, "g", [fvi("x", [1, 8, 8, 8])], [fvi("y", [1, 8, 8, 8])], [init("w", rng_w(8, 8, 3, 3))]
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with caplog.at_level("WARNING"):
        _, res = _convert(tmp_path, model, precision=Precision.BF16)
    conv = next(n for n in res.plan.nodes if n.name == "conv")
    assert conv.precision is Precision.FP32
    warned = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    assert len(warned) == 1 and "Conv" in warned[0] and "opset 22" in warned[0], warned


def test_low_graph_output_also_read_by_an_fp32_node_gets_uniquely_named_casts():
    """y1 is a graph output (kept FP32) and the input of an FP32 MatMul: both need a Cast from FP16; the two
    Cast nodes must not share a name (ONNX Runtime refuses duplicate node names)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], name="mm1"),
        helper.make_node("Tanh", ["m1"], ["y1"], name="tanh1"),
        helper.make_node("MatMul", ["y1", "w2"], ["y2"], name="mm2"),
    ]
    inits = [init("w1", rng_w(8, 8, seed=1)), init("w2", rng_w(8, 4, seed=2))]
    model = make(nodes, [fvi("x", ["N", 8])], [fvi("y1", ["N", 8]), fvi("y2", ["N", 4])], inits)
    info = GraphInfo(model)
    low = {"mm1": Precision.FP16, "tanh1": Precision.FP16, "mm2": Precision.FP32}
    out = apply_plan(model, info, low, Precision.FP16).model
    names = [n.name for n in out.graph.node]
    assert len(names) == len(set(names)), names
    assert run_checks(out) == []
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    for got, want in zip(run_ort(out, {"x": x}), run_ort(model, {"x": x}), strict=True):  # y1, y2
        assert_onnx_outputs_close(got, want, model, dtype=np.float16)


def test_weights_go_to_fp16_with_the_same_bits_through_onnxruntime():
    """low_array: large float32 weights take ONNX Runtime's Cast, small ones numpy's; the bits are numpy's."""
    from mpinfer.precision.emulator.kernels import ortexec
    from mpinfer.precision.graph.apply import low_array

    rng = np.random.default_rng(3)
    large = (rng.standard_normal(ortexec.MIN_SIZE * 2) * np.exp(rng.uniform(-20, 12, ortexec.MIN_SIZE * 2)))
    large = large.astype(np.float32)
    large[:4] = [65519.0, 65520.0, 2.0**-25, -(2.0**-24) * 1.5]  # overflow edge, flush, tie to the subnormal
    assert ortexec.cast(large, "to_fp16") is not None  # this array takes the ONNX Runtime path
    with np.errstate(over="ignore"):
        for arr in (large, large[:100]):
            got = low_array(arr, Precision.FP16)
            assert got.dtype == np.float16
            want = arr.astype(np.float16)
            past = np.isinf(want) & np.isfinite(arr)  # numpy rounds past the range to inf; low_array clamps there
            assert past.any() or arr.size == 100
            want[past] = np.copysign(np.float16(65504.0), arr[past])
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    bf = low_array(large, Precision.BF16)
    assert bf.dtype.name == "bfloat16"


def _qdq_model(opset: int) -> onnx.ModelProto:
    """x -> Q -> DQ -> MatMul(DQ(int8 weights)) -> Relu -> MatMul(float weights) -> y: one quantized op."""
    wq = np.random.default_rng(0).integers(-100, 100, (4, 4)).astype(np.int8)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"], name="dq"),
        helper.make_node("DequantizeLinear", ["wq", "sw"], ["wd"], name="dqw"),
        helper.make_node("MatMul", ["xd", "wd"], ["a"], name="qmm"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w"], ["y"], name="mm"),
    ]
    inits = [
        init("sx", np.array(0.02, np.float32)),
        init("zx", np.array(0, np.int8)),
        init("wq", wq),
        init("sw", np.array(0.003, np.float32)),
        init("w", rng_w(4, 4)),
    ]
    return make(nodes, [fvi("x", [2, 4])], [fvi("y", [2, 4])], inits, opset=opset)


@pytest.mark.parametrize("opset", [17, 19])
def test_quantized_op_keeps_its_dequantize_adjacent(tmp_path, opset):
    model = _qdq_model(opset)
    out, res = _convert(tmp_path, model)
    prec = res.plan.precisions()
    assert prec["mm"] is Precision.FP16  # the float part goes low either way
    if opset == 17:  # DequantizeLinear has no float16: the op it feeds stays FP32 with it, said why
        assert prec["qmm"] is Precision.FP32
        assert next(n for n in res.plan.nodes if n.name == "qmm").reason == "rule:qdq"
    else:  # the whole QDQ pattern converts
        assert prec["qmm"] is Precision.FP16 and prec["dq"] is Precision.FP16
    producers = {o: n for n in out.graph.node for o in n.output}
    for node in out.graph.node:
        if node.op_type == "MatMul" and node.name.startswith("qmm"):
            assert {producers[i].op_type for i in node.input} == {"DequantizeLinear"}  # no Cast in between
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    assert_onnx_outputs_close(run_ort(out, {"x": x})[0], run_ort(model, {"x": x})[0], model, dtype=np.float16)


def test_the_final_apply_takes_the_search_rewrite_and_gates_it(tmp_path):
    """apply_validated takes the ApplyResult of the search's final candidate (AppliedRun) when the plan's precisions
    are its own; another plan is applied afresh, and the validity gate runs on what is taken."""
    from mpinfer.errors import InternalError
    from mpinfer.precision.core.plan import NodeDecision
    from mpinfer.precision.graph.validate import apply_validated
    from mpinfer.precision.numerics.base import AppliedRun

    info = GraphInfo(name_nodes(mlp()))
    low = {"fc1", "fc2"}
    precisions = {a: Precision.FP16 if a in low else Precision.FP32 for a in info.by_address}
    nodes = [NodeDecision(a, info.by_address[a].node.op_type, p, "rule:test", "") for a, p in precisions.items()]
    searched = apply_plan(info.model, info, precisions, Precision.FP16)
    for loaded in (False, True):
        run = AppliedRun(dict(precisions), searched, lambda: None, loaded=loaded)
        result, _ = apply_validated(info, nodes, Precision.FP16, applied=run)
        assert result.model is searched.model
    other = [NodeDecision(n.name, n.op_type, Precision.FP32, n.reason, "") if n.name == "fc2" else n for n in nodes]
    result, _ = apply_validated(info, other, Precision.FP16, applied=run)
    assert result.model is not searched.model and sum(n.op_type == "Cast" for n in result.model.graph.node) > 0
    broken = onnx.ModelProto()
    broken.CopyFrom(searched.model)
    del broken.graph.node[0]  # (a node's output is gone: the checker and type inference refuse it)
    for loaded in (False, True):
        bad = AppliedRun(dict(precisions), type(searched)(broken, searched.cast_count, searched.converted_weights),
                         lambda: None, loaded=loaded)
        with pytest.raises(InternalError):
            apply_validated(info, nodes, Precision.FP16, applied=bad)


def test_strict_convert_writes_the_rewrite_its_search_judged(tmp_path, monkeypatch):
    """The plan the search's cast graph judged is not rewritten again at apply (one rewrite for the one candidate)."""
    from mpinfer.precision.graph import validate

    calls = []
    real = validate.apply_plan
    monkeypatch.setattr(validate, "apply_plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    src = save(mlp(), tmp_path / "m.onnx")
    data = tmp_path / "cal.npz"
    np.savez(data, x=np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32))
    res = convert_precision(ConvertConfig(model=src, output=tmp_path / "o.onnx", calibration=str(data),
                                          progress=False))
    assert res.plan.summary["search"]["cast_graph_candidates"] >= 1
    assert res.plan.summary["verification"]["passed"] and calls == []
