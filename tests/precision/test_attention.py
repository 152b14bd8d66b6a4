"""Attention that converts: mask rewrite, normalizations in low precision, RMSNorm as one FP32 group, hints."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mpinfer.modelio import name_nodes
from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.precision.core.formats import BF16_LOWEST
from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.emulator.emulate import GraphEmulator
from mpinfer.precision.graph.masks import FP16_MASK_LOWEST, find_mask_sites
from mpinfer.precision.rules.planner import RuleOptions, rule_plan
from mpinfer.specs import Precision
from tests.precision.graphs import fvi, init, make, rng_w, run_ort, save

B, S, D = 2, 8, 16
F32_LOWEST = float(np.finfo(np.float32).min)
FP16_EPS = 2.0**-10  # FP16's spacing at 1 (10 stored mantissa bits)


def _attention(mask: str = "where", lowest: float = F32_LOWEST) -> onnx.ModelProto:
    """x[B,S,D] -> q, k, v -> softmax((q / 4) k^T + mask) v -> out, probs (a graph output too).

    ``mask``: "where" builds Where(keep, 0, lowest) from a bool input; "mul" builds (1 - m) * lowest from a
    float input (the older Hugging Face export).
    """
    if mask == "where":
        mask_nodes = [helper.make_node("Where", ["keep", "zero", "lowest"], ["mask"], name="mask_where")]
        mask_in = fvi("keep", ["batch", 1, S], TensorProto.BOOL)
    else:
        mask_nodes = [
            helper.make_node("Sub", ["one", "m"], ["inv"], name="mask_sub"),
            helper.make_node("Mul", ["inv", "lowest"], ["mask"], name="mask_mul"),
        ]
        mask_in = fvi("m", ["batch", 1, S])
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["x", "wk"], ["k"], name="k_proj"),
        helper.make_node("MatMul", ["x", "wv"], ["v"], name="v_proj"),
        helper.make_node("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 2, 1]),
        helper.make_node("Mul", ["q", "scale"], ["qs"], name="scale_mul"),
        helper.make_node("MatMul", ["qs", "kt"], ["scores"], name="qk"),
        *mask_nodes,
        helper.make_node("Add", ["scores", "mask"], ["masked"], name="mask_add"),
        helper.make_node("Softmax", ["masked"], ["probs"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["out"], name="pv"),
    ]
    inits = [
        init("wq", rng_w(D, D, seed=1)),
        init("wk", rng_w(D, D, seed=2)),
        init("wv", rng_w(D, D, seed=3)),
        init("scale", np.array(0.25, np.float32)),
        init("zero", np.array(0.0, np.float32)),
        init("one", np.array(1.0, np.float32)),
        init("lowest", np.array(lowest, np.float32)),
    ]
    outputs = [fvi("out", ["batch", S, D]), fvi("probs", ["batch", S, S])]
    return make(nodes, [fvi("x", ["batch", S, D]), mask_in], outputs, inits)


def _feeds(mask: str, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    keep = rng.random((n, 1, S)) < 0.6
    keep[..., 0] = True  # no row is masked everywhere
    x = rng.standard_normal((n, S, D)).astype(np.float32)
    return {"x": x, "keep": keep} if mask == "where" else {"x": x, "m": keep.astype(np.float32)}


def _convert(tmp_path, model, feeds, precision=Precision.FP16, **kw):
    src = save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "cal.npz", **feeds)
    res = convert_precision(
        ConvertConfig(
            model=src,
            output=tmp_path / "m.low.onnx",
            calibration=str(tmp_path / "cal.npz"),
            precision=precision,
            progress=False,
            **kw,
        )
    )
    plan = {n.name: n for n in res.plan.nodes}
    return src, res, plan


@pytest.mark.parametrize("mask", ["where", "mul"])
def test_mask_rewrite_runs_attention_low_and_masked_probabilities_stay_zero(tmp_path, mask):
    feeds = _feeds(mask, 8)
    src, res, plan = _convert(tmp_path, _attention(mask), feeds)
    site = "mask_where" if mask == "where" else "mask_mul"
    assert plan[site].reason == "rewrite:mask" and plan[site].precision is Precision.FP16
    assert plan[site].stats["mask_value"] == FP16_MASK_LOWEST
    for name in ("qk", "scale_mul", "mask_add", "softmax", "pv"):
        assert plan[name].precision is Precision.FP16, (name, plan[name].reason)
    assert plan["softmax"].reason == "rule:fp32-accumulate"
    # casts only at the FP32 interface: x (and a float mask) in, out and probs out
    assert res.plan.summary["cast_count"] == (3 if mask == "where" else 4)
    converted = onnx.load(str(res.output))
    lowest = {t.name: t for t in converted.graph.initializer}["lowest"]
    assert lowest.data_type == TensorProto.FLOAT16
    assert float(onnx.numpy_helper.to_array(lowest)) == FP16_MASK_LOWEST
    check = _feeds(mask, 4, seed=1)
    masked = ~np.broadcast_to(check["keep"] if mask == "where" else check["m"] > 0, (4, S, S))
    ref_out, ref_probs = run_ort(src, check)
    for out, probs in (run_ort(res.output, check), _strict(res.output, check)):
        assert np.all(np.isfinite(out)) and np.all(np.isfinite(probs))
        assert np.all(probs[masked] == 0.0)  # exactly 0, as float32's lowest gave
        assert np.all(ref_probs[masked] == 0.0)
        # FP16 rounding of q, k, the scores (|s| <~ 8: spacing 8 * eps) and the probabilities
        np.testing.assert_allclose(probs, ref_probs, atol=8 * FP16_EPS * 2)
        np.testing.assert_allclose(out, ref_out, atol=4 * FP16_EPS * np.sqrt(S) * np.abs(ref_out).max())


def _strict(path, feeds):
    emu = GraphEmulator(onnx.load(str(path)), follow_input_dtypes=True)
    outs = emu.run(feeds).outputs
    return outs["out"], outs["probs"]


def test_mask_rewrite_bf16_uses_its_own_lowest(tmp_path):
    _, res, plan = _convert(tmp_path, _attention(), _feeds("where", 8), precision=Precision.BF16)
    assert plan["mask_where"].reason == "rewrite:mask" and plan["mask_where"].stats["mask_value"] == BF16_LOWEST
    assert plan["mask_add"].precision is Precision.BF16
    check = _feeds("where", 4, seed=2)
    _, probs = _strict(res.output, check)  # ONNX Runtime's CPU provider has no BF16 MatMul
    assert np.all(np.isfinite(probs))
    assert np.all(probs[~np.broadcast_to(check["keep"], (4, S, S))] == 0.0)


def test_without_rewrite_the_mask_would_overflow_and_the_old_plan_kept_attention_fp32():
    """The constant does not fit FP16 (so a plain cast gives -inf), and -1e4 style masks need no rewrite."""
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(F32_LOWEST))
    info = GraphInfo(name_nodes(_attention()))
    assert [s.node for s in find_mask_sites(info, Precision.FP16)] == ["mask_where"]
    assert find_mask_sites(GraphInfo(name_nodes(_attention(lowest=-1e4))), Precision.FP16) == []
    # -40000 fits FP16, but mask + score could overflow: rewritten to the safe lowest
    assert len(find_mask_sites(GraphInfo(name_nodes(_attention(lowest=-4e4))), Precision.FP16)) == 1


def test_mask_not_rewritten_when_scores_leave_no_gap():
    """Scores near FP16's safe lowest would let masked positions through: the mask stays as it is."""
    info = GraphInfo(name_nodes(_attention()))
    stats = {"scores": {"absmax": 20000.0}}
    assert find_mask_sites(info, Precision.FP16, stats) == []
    assert len(find_mask_sites(info, Precision.FP16, {"scores": {"absmax": 30.0}})) == 1


def test_plan_reapplied_gives_the_same_bytes_and_can_drop_the_rewrite(tmp_path):
    src, res, _ = _convert(tmp_path, _attention(), _feeds("where", 8))
    again = convert_precision(
        ConvertConfig(model=src, output=tmp_path / "again.onnx", plan=res.plan_path, progress=False)
    )
    assert again.output.read_bytes() == res.output.read_bytes()
    edited = json.loads(res.plan_path.read_text())
    for n in edited["nodes"]:
        n["stats"].pop("mask_value", None)
    plan2 = tmp_path / "edited.plan.json"
    plan2.write_text(json.dumps(edited))
    third = convert_precision(
        ConvertConfig(model=src, output=tmp_path / "third.onnx", plan=plan2, progress=False, force=True)
    )
    lowest = {t.name: t for t in onnx.load(str(third.output)).graph.initializer}["lowest"]
    assert np.isinf(onnx.numpy_helper.to_array(lowest))  # the original value, now out of FP16's range


# -- normalizations -----------------------------------------------------------------------------------
def _layer_norm(stash_type: int = 1, opset: int = 17) -> onnx.ModelProto:
    node = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], name="ln", axis=-1, stash_type=stash_type)
    inits = [init("g", 1 + rng_w(64, seed=4)), init("b", rng_w(64, seed=5))]
    return make([node], [fvi("x", [4, 64])], [fvi("y", [4, 64])], inits, opset=opset)


def _ln64(x, g, b, eps=1e-5):
    x = x.astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * g + b


def test_layer_norm_stash_type_keeps_statistics_in_float32(rng):
    """Large mean, small spread: FP16 statistics would lose it all; float32 statistics keep it.

    Against a float64 reference on the FP16-rounded input, the error is the FP16 rounding of the normalized
    value, of the scale product and of the sum (each half a spacing of a value of magnitude |y|).
    """
    x = (300 + rng.standard_normal((4, 64))).astype(np.float32)
    model = _layer_norm()
    g = onnx.numpy_helper.to_array(model.graph.initializer[0])
    b = onnx.numpy_helper.to_array(model.graph.initializer[1])
    ref = _ln64(x.astype(np.float16), g.astype(np.float16), b.astype(np.float16))
    run = GraphEmulator(model).run({"x": x}, {"ln": Precision.FP16}, keep=True)
    y = run.tensors["y"]
    assert y.dtype == np.float16
    mag = np.abs(ref) + np.abs(g.astype(np.float16)) + 1
    assert np.all(np.abs(y.astype(np.float64) - ref) <= 1.5 * FP16_EPS * mag)
    # every step rounded to FP16 instead (what stash_type=1 rules out): the mean alone is off by up to 0.125
    f16 = np.float16
    h = x.astype(f16)
    d = h - h.astype(np.float32).mean(-1, keepdims=True).astype(f16)
    var = (d * d).astype(np.float32).mean(-1, keepdims=True).astype(f16)
    stepwise = (d / np.sqrt(var + f16(1e-5))).astype(f16) * g.astype(f16) + b.astype(f16)
    err = np.abs(stepwise.astype(np.float64) - ref).max()
    assert err > 10 * np.abs(y.astype(np.float64) - ref).max()


def test_rms_norm_stash_type_in_emulator(rng):
    x = (rng.standard_normal((4, 64)) * 8).astype(np.float32)
    node = helper.make_node("RMSNormalization", ["x", "g"], ["y"], name="rms", axis=-1)
    g = 1 + rng_w(64, seed=6)
    model = make([node], [fvi("x", [4, 64])], [fvi("y", [4, 64])], [init("g", g)], opset=23)
    h = x.astype(np.float16).astype(np.float64)
    ref = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5) * g.astype(np.float16)
    y = GraphEmulator(model).run({"x": x}, {"rms": Precision.FP16}, keep=True).tensors["y"]
    assert np.all(np.abs(y.astype(np.float64) - ref) <= FP16_EPS * (np.abs(ref) + np.abs(g)))


def test_layer_norm_goes_low_with_calibration_and_stays_fp32_without_or_out_of_range():
    info = GraphInfo(name_nodes(_layer_norm()))
    ok = {"x": {"absmax": 4.0}, "y": {"absmax": 3.0}}
    _, nodes = rule_plan(info, Precision.FP16, RuleOptions(), stats=ok)
    assert (nodes[0].precision, nodes[0].reason) == (Precision.FP16, "rule:fp32-accumulate")
    _, nodes = rule_plan(info, Precision.FP16, RuleOptions(), stats=None)
    assert (nodes[0].precision, nodes[0].reason) == (Precision.FP32, "rule:keep-fp32")
    big = {"x": {"absmax": 5e4}, "y": {"absmax": 3.0}}
    _, nodes = rule_plan(info, Precision.FP16, RuleOptions(), stats=big)
    assert (nodes[0].precision, nodes[0].reason) == (Precision.FP32, "range:overflow")
    # stash_type other than float32: the statistics would be low too, so the keep rule stands
    info16 = GraphInfo(name_nodes(_layer_norm(stash_type=16)))
    _, nodes = rule_plan(info16, Precision.FP16, RuleOptions(), stats=ok)
    assert nodes[0].precision is Precision.FP32


def _rms_chain() -> onnx.ModelProto:
    """x @ w -> Pow/ReduceMean/Add/Sqrt/Reciprocal (the exported RMSNorm) -> * h -> * g -> @ w2."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="up"),
        helper.make_node("Pow", ["h", "two"], ["sq"], name="pow"),
        helper.make_node("ReduceMean", ["sq"], ["ms"], name="mean", axes=[-1], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"], name="add_eps"),
        helper.make_node("Sqrt", ["mse"], ["rms"], name="sqrt"),
        helper.make_node("Reciprocal", ["rms"], ["inv"], name="rsqrt"),
        helper.make_node("Mul", ["h", "inv"], ["normed"], name="scale_by_rms"),
        helper.make_node("Mul", ["normed", "g"], ["weighted"], name="weight"),
        helper.make_node("MatMul", ["weighted", "w2"], ["y"], name="down"),
    ]
    inits = [
        init("w", rng_w(D, D, seed=7)),
        init("w2", rng_w(D, D, seed=8)),
        init("two", np.array(2.0, np.float32)),
        init("eps", np.array(1e-6, np.float32)),
        init("g", 1 + rng_w(D, seed=9)),
    ]
    return make(nodes, [fvi("x", ["batch", S, D])], [fvi("y", ["batch", S, D])], inits)


def test_rms_norm_chain_stays_fp32_as_one_group(tmp_path):
    """Pinned at its opset (17: no RMSNormalization to fuse into), the chain is one FP32 group."""
    x = np.random.default_rng(3).standard_normal((8, S, D)).astype(np.float32)
    _, res, plan = _convert(tmp_path, _rms_chain(), {"x": x}, opset=17)
    chain = ("pow", "mean", "add_eps", "sqrt", "rsqrt")
    assert all(plan[n].precision is Precision.FP32 for n in chain)
    assert plan["up"].precision is Precision.FP16 and plan["down"].precision is Precision.FP16
    converted = onnx.load(str(res.output))
    producer = {o: n.name for n in converted.graph.node for o in n.output}
    consumers = {}
    for n in converted.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n.name)
    casts = [n for n in converted.graph.node if n.op_type == "Cast"]
    inside = [c.name for c in casts if producer.get(c.input[0]) in chain and set(consumers[c.output[0]]) & set(chain)]
    assert inside == []
    # x in, h into the group, the group's 1/rms out, y out
    assert res.plan.summary["cast_count"] == 4


# -- speed hints ----------------------------------------------------------------------------------------
def test_hints_never_keep_the_qk_matmul_fp32_for_a_mask_add(tmp_path):
    from mpinfer.compare.hints import speed_hints
    from mpinfer.precision.convert import convert_model

    model = _attention()
    # after the rewrite: no cast between the QK MatMul and the mask-add, so no hint about them
    _, res, plan = _convert(tmp_path, model, _feeds("where", 8))
    entries = {n.name: {"reason": n.reason, "detail": n.detail} for n in plan.values()}
    hints = speed_hints(onnx.load(str(res.output)), entries)
    assert not [h for h in hints if "qk" in h.fix or h.node in ("qk", "mask_add")]
    # a model converted the old way (mask-add kept FP32 by hand): the hint says to convert again, not to keep qk
    old = convert_model(model, keep_nodes=("mask_add",), keep_ops=("Softmax",))
    split = [h for h in speed_hints(old.model, {n.name: {"reason": n.reason} for n in old.nodes})
             if h.node == "mask_add"]
    assert split and all("--keep-node 'qk'" not in h.fix and "rewrite:mask" in h.fix for h in split)


def _skip_ln_model() -> onnx.ModelProto:
    """x @ w -> com.microsoft SkipLayerNormalization(h, x, gamma, beta) -> @ w2 (an ORT-optimized encoder's shape)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("SkipLayerNormalization", ["h", "x", "g", "b"], ["n"], name="skip_ln",
                         domain="com.microsoft", epsilon=1e-5),
        helper.make_node("MatMul", ["n", "w2"], ["y"], name="mm2"),
    ]
    inits = [init("w", rng_w(D, D, seed=10)), init("w2", rng_w(D, D, seed=11)), init("g", 1 + rng_w(D, seed=12)),
             init("b", rng_w(D, seed=13))]
    graph = helper.make_graph(nodes, "g", [fvi("x", ["batch", S, D])], [fvi("y", ["batch", S, D])], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def test_skip_layer_norm_goes_low_with_calibration(tmp_path):
    x = np.random.default_rng(4).standard_normal((8, S, D)).astype(np.float32)
    src, res, plan = _convert(tmp_path, _skip_ln_model(), {"x": x})
    assert (plan["skip_ln"].precision, plan["skip_ln"].reason) == (Precision.FP16, "rule:fp32-accumulate")
    assert res.plan.summary["cast_count"] == 2  # x in, y out
    check = x[:2]
    (ref,) = run_ort(src, {"x": check})
    (got,) = run_ort(res.output, {"x": check})
    strict = GraphEmulator(onnx.load(str(res.output)), follow_input_dtypes=True).run({"x": check}).outputs["y"]
    # the normalized values (|n| <~ 4) round to FP16 and feed a 16-long dot product
    tol = 4 * FP16_EPS * np.sqrt(D) * np.abs(ref).max()
    np.testing.assert_allclose(got, ref, atol=tol)
    np.testing.assert_allclose(strict, ref, atol=tol)


def test_planning_twice_gives_the_same_plan():
    """rule_plan rewrites the mask in its model; a second plan of that model finds the same site."""
    info = GraphInfo(name_nodes(_attention()))
    stats = {"scores": {"absmax": 6.0}, "masked": {"absmax": F32_LOWEST}, "probs": {"absmax": 1.0}}
    first = [(n.name, n.precision, n.reason) for n in rule_plan(info, Precision.FP16, RuleOptions(), stats=stats)[1]]
    second = [(n.name, n.precision, n.reason) for n in rule_plan(info, Precision.FP16, RuleOptions(), stats=stats)[1]]
    assert first == second
    assert ("mask_add", Precision.FP16, "rule:follow") in first
