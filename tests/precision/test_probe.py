"""The ONNX Runtime sensitivity probe: every group's local error from one session, as a converted model shows it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import helper

from mpinfer.precision.budget.search import build_groups
from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.graph.apply import apply_plan
from mpinfer.precision.numerics.probe import build_probe, probe_errors
from mpinfer.precision.rules.planner import RuleOptions, rule_plan
from mpinfer.specs import Precision
from tests.precision.graphs import fvi, init, make, rng_w
from tests.precision.numerics_graphs import ort_run


def two_outputs() -> object:
    """x -> MatMul/Add/Tanh -> y1 -> MatMul/Relu -> y2: two groups, each one ending at a graph output."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], name="mm1"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], name="add1"),
        helper.make_node("Tanh", ["a1"], ["y1"], name="tanh1"),
        helper.make_node("MatMul", ["y1", "w2"], ["m2"], name="mm2"),
        helper.make_node("Relu", ["m2"], ["y2"], name="relu2"),
    ]
    inits = [init("w1", rng_w(16, 32, seed=1)), init("b1", rng_w(32, seed=2)), init("w2", rng_w(32, 8, seed=3))]
    return make(nodes, [fvi("x", ["N", 16])], [fvi("y1", ["N", 32]), fvi("y2", ["N", 8])], inits)


def _groups(model):
    info = GraphInfo(model)
    decisions, nodes = rule_plan(info, Precision.FP16, RuleOptions())
    return info, build_groups(info, nodes, decisions)


def _rel_l2(want, got) -> float:
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    return float(np.sqrt(((got - want) ** 2).sum() / (want**2).sum()))


def test_probe_error_equals_the_group_alone_in_a_converted_model():
    """Only group g low in the whole converted model: its inputs are exact FP32 there too, so the error the
    model shows at g's output is exactly the probe's local error for g."""
    model = two_outputs()
    info, groups = _groups(model)
    assert len(groups) == 2
    batch = {"x": np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)}
    probed = probe_errors(info, groups, [batch], Precision.FP16)
    ref = ort_run(model, batch)
    for g, out in zip(sorted(groups, key=lambda g: g.anchor), ("y1", "y2"), strict=True):
        precisions = {a: (Precision.FP16 if a in g.members else Precision.FP32) for a in info.by_address}
        converted = apply_plan(model, info, precisions, Precision.FP16).model
        expected = _rel_l2(ref[out], ort_run(converted, batch)[out])
        assert expected > 1e-5  # FP16 rounding shows
        assert probed.errors[g.anchor] == pytest.approx(expected, rel=1e-3), g.anchor
    assert probed.evaluations == len(info.nodes) + sum(len(g.members) for g in groups)


def test_probe_sums_over_batches_and_keeps_the_model_unchanged():
    model = two_outputs()
    before = model.SerializeToString()
    info, groups = _groups(model)
    rng = np.random.default_rng(1)
    a, b = ({"x": rng.standard_normal((n, 16)).astype(np.float32)} for n in (8, 24))
    both = probe_errors(info, groups, [a, b], Precision.FP16)
    joined = probe_errors(info, groups, [{"x": np.concatenate([a["x"], b["x"]])}], Precision.FP16)
    for anchor, err in joined.errors.items():
        assert both.errors[anchor] == pytest.approx(err, rel=1e-4)
    assert model.SerializeToString() == before
    probe, rows = build_probe(info, groups, Precision.FP16)
    assert sorted(set(rows)) == sorted(g.anchor for g in groups)
    assert [o.name for o in probe.graph.output] == ["__mpinfer_probe/noise", "__mpinfer_probe/signal"]


def test_a_group_whose_low_copy_overflows_gets_inf():
    """ONNX Runtime's CPU provider computes MatMul in FP32 even in an FP16 model, but a Transpose after it
    runs on the FP16 tensor: 1e5 is inf there, as it is in the converted model."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], name="mm1"),
        helper.make_node("Tanh", ["m1"], ["y1"], name="tanh1"),
        helper.make_node("MatMul", ["x", "w2"], ["m2"], name="mm2"),
        helper.make_node("Transpose", ["m2"], ["y2"], name="t2", perm=[1, 0]),
    ]
    inits = [init("w1", rng_w(16, 16, seed=1)), init("w2", np.full((16, 16), 3e4, np.float32))]
    model = make(nodes, [fvi("x", ["N", 16])], [fvi("y1", ["N", 16]), fvi("y2", [16, "N"])], inits)
    info, groups = _groups(model)
    batch = {"x": np.ones((4, 16), np.float32)}
    assert np.abs(ort_run(model, batch)["y2"]).max() > 65504
    converted = apply_plan(model, info, {a: Precision.FP16 for a in info.by_address}, Precision.FP16).model
    assert np.isinf(ort_run(converted, batch)["y2"]).all()
    errors = probe_errors(info, groups, [batch], Precision.FP16).errors
    assert sorted(errors) == ["mm1", "mm2"]
    assert math.isinf(errors["mm2"]) and math.isfinite(errors["mm1"])
