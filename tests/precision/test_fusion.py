"""Decomposed RMSNorm chains fused into RMSNormalization (opset 23, float32 stash): which chains, and what changes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper

from mpinfer.modelio import name_nodes
from mpinfer.precision.graph.fusion import FUSED_LN_SUFFIX, FUSED_SUFFIX, find_norm_chains, fuse_norm_chains, fuse_norms
from mpinfer.precision.graph.normalize import ensure_opset
from mpinfer.specs import Precision
from tests.precision.graphs import fvi, init, make, rng_w, run_ort
from tests.tolerances import assert_reorder_close

H = 32


def _rms_model(*, square="pow", inverse="div1", exponent=2.0, axes=(-1,), keepdims=1, extra_output=False,
               weight="init", opset=17, eps=1e-6):
    """inp[N,T,H] -> MatMul -> x -> RMSNorm written out as an exporter writes it -> MatMul -> y (with variants
    to refuse)."""
    nodes = [helper.make_node("MatMul", ["inp", "w0"], ["x"]),
             helper.make_node("Constant", [], ["two"], value=helper.make_tensor("", 1, [], [exponent])),
             helper.make_node("Constant", [], ["eps"], value=helper.make_tensor("", 1, [], [eps])),
             helper.make_node("Constant", [], ["one"], value=helper.make_tensor("", 1, [], [1.0]))]
    nodes.append(helper.make_node("Pow", ["x", "two"], ["sq"]) if square == "pow" else
                 helper.make_node("Mul", ["x", "x"], ["sq"]))
    if opset >= 18:
        nodes.append(helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("", 7, [len(axes)], axes)))
        nodes.append(helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=keepdims))
    else:
        nodes.append(helper.make_node("ReduceMean", ["sq"], ["ms"], axes=list(axes), keepdims=keepdims))
    nodes += [helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rms"])]
    if inverse == "div1":
        nodes += [helper.make_node("Div", ["one", "rms"], ["inv"]), helper.make_node("Mul", ["x", "inv"], ["n"])]
    elif inverse == "reciprocal":
        nodes += [helper.make_node("Reciprocal", ["rms"], ["inv"]), helper.make_node("Mul", ["inv", "x"], ["n"])]
    else:
        nodes.append(helper.make_node("Div", ["x", "rms"], ["n"]))
    inits = [init("w", rng_w(H, H, seed=2)), init("w0", rng_w(H, H, seed=3))]
    inputs = [fvi("inp", ["N", "T", H])]
    if weight == "init":
        inits.append(init("g", 1.0 + rng_w(H, seed=1)))
    elif weight == "shared":  # one initializer read through an Identity, as exporters share equal weights
        inits.append(init("g0", np.ones(H, np.float32)))
        nodes.append(helper.make_node("Identity", ["g0"], ["g"]))
    else:  # a runtime input: not a constant, no fusion
        inputs.append(fvi("g", [H]))
    nodes += [helper.make_node("Mul", ["g", "n"], ["normed"]), helper.make_node("MatMul", ["normed", "w"], ["y"])]
    outputs = [fvi("y", ["N", "T", H])] + ([fvi("ms", ["N", "T", 1])] if extra_output else [])
    return name_nodes(make(nodes, inputs, outputs, inits, opset=opset))


def _feeds(model):
    rng = np.random.default_rng(0)
    feeds = {"inp": (rng.standard_normal((3, 5, H)) * 40).astype(np.float32)}
    if any(i.name == "g" for i in model.graph.input):
        feeds["g"] = rng.standard_normal(H).astype(np.float32)
    return feeds


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("square,inverse,weight", [("pow", "div1", "init"), ("mul", "reciprocal", "init"),
                                                    ("pow", "divx", "shared")])
def test_each_exported_form_fuses_into_one_node_with_the_same_outputs(square, inverse, weight, opset):
    model = _rms_model(square=square, inverse=inverse, weight=weight, opset=opset)
    upgraded = ensure_opset(model, Precision.FP16, opset=23)
    (chain,) = fuse_norms(upgraded)
    assert chain.scale == ("g0" if weight == "shared" else "g") and chain.epsilon == pytest.approx(1e-6)
    _assert_one_fused_node_computes_the_chain(model, upgraded, "RMSNormalization", FUSED_SUFFIX, stages=3)


def _assert_one_fused_node_computes_the_chain(model, upgraded, op, suffix, *, stages):
    """MatMul, the fused ``op`` (float32 stash), MatMul, with the chain's outputs (the chain's Constants and
    Identity copies gone with it)."""
    ops = [n.op_type for n in upgraded.graph.node]
    assert ops == ["MatMul", op, "MatMul"], ops
    fused = upgraded.graph.node[1]
    assert fused.name.endswith(suffix)
    assert {a.name: helper.get_attribute_value(a) for a in fused.attribute}["stash_type"] == 1
    onnx.checker.check_model(upgraded, full_check=True)
    feeds = _feeds(model)
    (want,), (got,) = run_ort(model, feeds), run_ort(upgraded, feeds)
    # the chain's rounding against the fused kernel's: a few float32 roundings before an H-term MatMul whose
    # inputs are O(1) after the norm (|normed| <= sqrt(H) |g|), so the worst case is the MatMul's own bound
    magnitude = np.abs(want).max() + H * np.abs(rng_w(H, H, seed=2)).max() * 4 * np.sqrt(H)
    assert_reorder_close(got, want, n=H, magnitude=magnitude, stages=stages)


@pytest.mark.parametrize("variant", [{"exponent": 3.0}, {"axes": (-2, -1)}, {"axes": (2,)}, {"keepdims": 0},
                                     {"extra_output": True}, {"weight": "input"}])
def test_chains_that_are_not_exactly_rms_normalization_stay_as_they_are(variant):
    model = ensure_opset(_rms_model(**variant), Precision.FP16, opset=23)
    before = [n.name for n in model.graph.node]
    assert fuse_norm_chains(model) == [] and [n.name for n in model.graph.node] == before


def test_below_opset_23_nothing_changes_and_the_hint_names_the_option(caplog):
    model = _rms_model()
    assert len(find_norm_chains(model.graph)) == 1
    before = model.SerializeToString()
    with caplog.at_level("WARNING", logger="mpinfer.precision.graph.fusion"):
        assert fuse_norms(model) == []
    assert model.SerializeToString() == before
    assert "1 decomposed RMSNorm chain(s) stay FP32 islands" in caplog.text and "`--opset 23`" in caplog.text


def test_convert_at_opset_23_runs_the_fused_norm_low_without_casts(tmp_path, invoke, caplog):
    """The same model and data: pinned at opset 17 the norm is an FP32 island behind two Casts; with no --opset
    convert upgrades the model to 23 itself (one line says so) and the norm is one RMSNormalization node in FP16
    (its statistics in float32) with none, within the same budget."""
    src = tmp_path / "m.onnx"
    src.write_bytes(_rms_model().SerializeToString())
    np.savez(tmp_path / "cal.npz", inp=(np.random.default_rng(1).standard_normal((32, 5, H)) * 40).astype(np.float32))
    casts = {}
    for opset in (17, 23):
        out = tmp_path / f"m{opset}.onnx"
        args = ["convert", src, "-o", out, "--calibration", tmp_path / "cal.npz", "--budget", "cosine>=0.999"]
        caplog.clear()
        r = invoke(*args, *(["--opset", "17"] if opset == 17 else []))
        assert r.exit_code == 0, r.output
        said = [m for m in caplog.messages if "upgraded from opset" in m]
        assert said == ([] if opset == 17 else [
            "The model was upgraded from opset 17 to 23 (so that its 1 RMSNorm chain(s) fuse into RMSNormalization: "
            "float32 statistics, no FP32 island behind Casts; --opset 17 keeps its opset)."])
        converted = onnx.load(str(out))
        casts[opset] = sum(n.op_type == "Cast" for n in converted.graph.node)
        if opset == 23:
            (norm,) = [n for n in converted.graph.node if n.op_type == "RMSNormalization"]
            inits = {t.name: t.data_type for t in converted.graph.initializer}
            assert inits.get(norm.input[1]) == onnx.TensorProto.FLOAT16  # its weight converted: the node runs low
            assert "Pow" not in {n.op_type for n in converted.graph.node}
    # inp in and y out stay FP32 (keep-io-types): 2 Casts; the FP32 island between the MatMuls adds 2
    assert casts == {17: 4, 23: 2}, casts


def test_a_plan_made_at_opset_23_reapplies_the_fusion_to_the_same_bytes(tmp_path, invoke):
    src = tmp_path / "m.onnx"
    src.write_bytes(_rms_model().SerializeToString())
    np.savez(tmp_path / "cal.npz", inp=(np.random.default_rng(1).standard_normal((16, 5, H)) * 40).astype(np.float32))
    first = tmp_path / "a.onnx"
    r = invoke("convert", src, "-o", first, "--calibration", tmp_path / "cal.npz", "--opset", "23")
    assert r.exit_code == 0, r.output
    plan = first.with_name("a.plan.json")
    nodes = json.loads(plan.read_text())["nodes"]
    assert any(n["name"].endswith(FUSED_SUFFIX) and n["precision"] == "fp16" for n in nodes)
    again = tmp_path / "b.onnx"
    r = invoke("convert", src, "--plan", plan, "-o", again)  # the plan's opset: upgraded and fused again
    assert r.exit_code == 0, r.output
    assert again.read_bytes() == first.read_bytes()


def _ln_model(*, bias=True, inverse="divx", opset=16, centre_read_elsewhere=False, eps=1e-5):
    """inp -> MatMul -> x -> LayerNorm written out as the TorchScript exporter writes it below opset 17 -> MatMul."""
    nodes = [helper.make_node("MatMul", ["inp", "w0"], ["x"]),
             helper.make_node("Constant", [], ["two"], value=helper.make_tensor("", 1, [], [2.0])),
             helper.make_node("Constant", [], ["eps"], value=helper.make_tensor("", 1, [], [eps])),
             helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]),
             helper.make_node("Sub", ["x", "mean"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["std"])]
    if inverse == "divx":
        nodes.append(helper.make_node("Div", ["d", "std"], ["n"]))
    else:
        nodes += [helper.make_node("Reciprocal", ["std"], ["inv"]), helper.make_node("Mul", ["d", "inv"], ["n"])]
    nodes.append(helper.make_node("Mul", ["n", "g"], ["scaled"]))
    last = "scaled"
    if bias:
        nodes.append(helper.make_node("Add", ["scaled", "b"], ["normed"]))
        last = "normed"
    head = "dd" if centre_read_elsewhere else last
    if centre_read_elsewhere:  # the centred tensor also feeds the output: no fusion
        nodes.append(helper.make_node("Add", [last, "d"], ["dd"]))
    nodes.append(helper.make_node("MatMul", [head, "w"], ["y"]))
    inits = [init("w", rng_w(H, H, seed=2)), init("w0", rng_w(H, H, seed=3)), init("g", 1.0 + rng_w(H, seed=1)),
             init("b", rng_w(H, seed=4))]
    return name_nodes(make(nodes, [fvi("inp", ["N", "T", H])], [fvi("y", ["N", "T", H])], inits, opset=opset))


@pytest.mark.parametrize("bias,inverse", [(True, "divx"), (False, "reciprocal")])
def test_a_decomposed_layer_norm_fuses_at_opset_17_with_the_same_outputs(bias, inverse):
    model = _ln_model(bias=bias, inverse=inverse)
    assert fuse_norms(model) == []  # opset 16: not yet
    upgraded = ensure_opset(model, Precision.FP16, opset=17)
    (chain,) = fuse_norms(upgraded)
    assert chain.op == "LayerNormalization" and chain.x == "x" and chain.bias == ("b" if bias else "")
    assert list(upgraded.graph.node[1].input) == ["x", "g"] + (["b"] if bias else [])
    _assert_one_fused_node_computes_the_chain(model, upgraded, "LayerNormalization", FUSED_LN_SUFFIX, stages=4)


def test_a_layer_norm_whose_centred_tensor_is_read_elsewhere_stays():
    model = ensure_opset(_ln_model(centre_read_elsewhere=True), Precision.FP16, opset=17)
    before = [n.name for n in model.graph.node]
    assert fuse_norms(model) == [] and [n.name for n in model.graph.node] == before


def test_below_opset_17_the_warning_names_opset_17_for_layer_norms(caplog):
    with caplog.at_level("WARNING", logger="mpinfer.precision.graph.fusion"):
        assert fuse_norms(_ln_model()) == []
    assert "1 decomposed LayerNorm chain(s) stay FP32 islands" in caplog.text and "`--opset 17`" in caplog.text


def test_convert_fuses_a_layer_norm_by_default_at_opset_17(tmp_path, invoke):
    """LayerNormalization runs in ONNX Runtime and every TensorRT mpinfer builds with: fused without asking."""
    src = tmp_path / "m.onnx"
    src.write_bytes(_ln_model(opset=17).SerializeToString())
    np.savez(tmp_path / "cal.npz", inp=(np.random.default_rng(1).standard_normal((16, 5, H)) * 40).astype(np.float32))
    out = tmp_path / "m16.onnx"
    r = invoke("convert", src, "-o", out, "--calibration", tmp_path / "cal.npz", "--budget", "cosine>=0.999")
    assert r.exit_code == 0, r.output
    converted = onnx.load(str(out))
    (norm,) = [n for n in converted.graph.node if n.op_type == "LayerNormalization"]
    inits = {t.name: t.data_type for t in converted.graph.initializer}
    assert inits[norm.input[1]] == inits[norm.input[2]] == onnx.TensorProto.FLOAT16  # runs low
    assert sum(n.op_type == "Cast" for n in converted.graph.node) == 2  # the I/O's alone


def test_a_keep_op_for_a_fused_op_type_names_the_fused_op(tmp_path, invoke):
    src = tmp_path / "m.onnx"
    src.write_bytes(_rms_model().SerializeToString())
    r = invoke("convert", src, "-o", tmp_path / "o.onnx", "--calibration", "none", "--opset", "23", "--keep-op", "Pow")
    assert r.exit_code == 0, r.output
    assert ("--keep-op Pow: the model has no Pow node, so it changes nothing (its normalization chains were fused "
            "into RMSNormalization: name that op instead)") in " ".join(r.output.split())


def test_a_plan_made_before_fusion_is_applied_to_the_chain_as_it_is(tmp_path, invoke, monkeypatch):
    """A plan written by an mpinfer that did not fuse names the chain's nodes: re-applied, the chain stays."""
    import mpinfer.precision.convert as convert_mod

    src = tmp_path / "m.onnx"
    src.write_bytes(_ln_model(opset=17).SerializeToString())
    np.savez(tmp_path / "cal.npz", inp=(np.random.default_rng(1).standard_normal((16, 5, H)) * 40).astype(np.float32))
    old = tmp_path / "old.onnx"
    with monkeypatch.context() as m:
        m.setattr(convert_mod, "fuse_norms", lambda model: [])  # an earlier mpinfer
        r = invoke("convert", src, "-o", old, "--calibration", tmp_path / "cal.npz")
    assert r.exit_code == 0, r.output
    assert "LayerNormalization" not in {n.op_type for n in onnx.load(str(old)).graph.node}
    again = tmp_path / "again.onnx"
    r = invoke("convert", src, "--plan", old.with_name("old.plan.json"), "-o", again)
    assert r.exit_code == 0, r.output
    assert again.read_bytes() == old.read_bytes()
