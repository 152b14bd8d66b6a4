"""The magnitude candidate: after the rule candidate fails, the candidate without the groups calibration saw above
|512| (ModelOpt AutoCast's data_max) is verified before any sensitivity is measured."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import helper

from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.precision.budget import search
from mpinfer.precision.budget.groups import MAGNITUDE_LIMIT
from mpinfer.specs import Precision
from tests.precision.graphs import chain, fvi, init, make, rng_w, save


def _offset_model():
    """``x[N,16]``: a wide MLP (16 -> 512 -> 16, where FP16 is fine) and a one-value score on |1000|
    (``MatMul`` + ``Add(1000)``: FP16 rounds it to steps of 0.5, far beyond the floor's range_err)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu1"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2"),
        helper.make_node("MatMul", ["x", "ws"], ["s"], name="score"),
        helper.make_node("Add", ["s", "offset"], ["z"], name="offset"),
    ]
    inits = [
        init("w1", rng_w(16, 512, seed=1, scale=1.0 / math.sqrt(16))),
        init("w2", rng_w(512, 16, seed=2, scale=1.0 / math.sqrt(512))),
        init("ws", rng_w(16, 1, seed=3, scale=1.0 / math.sqrt(16))),
        init("offset", np.full((1,), 1000.0, np.float32)),
    ]
    return make(nodes, [fvi("x", ["N", 16])], [fvi("y", ["N", 16]), fvi("z", ["N", 1])], inits)


def _convert(tmp_path, model, budget=None, tag=""):
    src = save(model, tmp_path / f"m{tag}.onnx")
    data = tmp_path / f"cal{tag}.npz"
    np.savez(data, x=np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32))
    extra = {} if budget is None else {"budget": budget}
    return convert_precision(
        ConvertConfig(model=src, output=tmp_path / f"out{tag}.onnx", calibration=str(data), progress=False, **extra)
    )


def test_the_magnitude_candidate_ends_the_search_without_sensitivities(tmp_path):
    res = _convert(tmp_path, _offset_model())
    s = res.plan.summary["search"]
    assert s["magnitude_groups"] == 1 and s["magnitude_met"] is True
    assert s["verifications"] == 2 and s["sensitivity_s"] == 0.0 and s["searched"] is True
    by = {n.name: n for n in res.plan.nodes}
    for name in ("score", "offset"):  # the group that reaches |1000|
        assert by[name].precision is Precision.FP32 and by[name].reason == "sensitivity"
        assert f"above {MAGNITUDE_LIMIT:g}" in by[name].detail
    assert by["fc1"].precision.is_low and by["fc2"].precision.is_low
    assert not any("sensitivity" in n.stats for n in res.plan.nodes)  # (no group measured)
    assert res.plan.summary["verification"]["passed"]


def test_without_the_magnitude_candidate_the_search_finds_the_same_plan_at_more_cost(tmp_path, monkeypatch):
    with_it = _convert(tmp_path, _offset_model(), tag="a")
    monkeypatch.setattr(search, "magnitude_groups", lambda *a, **k: [])
    without = _convert(tmp_path, _offset_model(), tag="b")
    assert [(n.name, n.precision) for n in with_it.plan.nodes] == [(n.name, n.precision) for n in without.plan.nodes]
    assert without.plan.summary["search"]["magnitude_groups"] == 0
    assert without.plan.summary["search"]["verifications"] > with_it.plan.summary["search"]["verifications"]


@pytest.mark.parametrize("numerics", ["strict", "ort"])
def test_a_magnitude_candidate_that_misses_changes_no_decision(tmp_path, monkeypatch, numerics):
    """A flagged group that is not what breaks the budget: the search after it is the one made without it."""
    budget = "max_abs<=1e-3"
    model = chain(8)

    def run(tag):
        src = save(model, tmp_path / f"c{tag}.onnx")
        data = tmp_path / f"cal{tag}.npz"
        np.savez(data, x=np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32))
        return convert_precision(
            ConvertConfig(model=src, output=tmp_path / f"o{tag}.onnx", calibration=str(data), budget=budget,
                          numerics=numerics, progress=False)
        )

    plain = run("plain")
    monkeypatch.setattr(search, "MAGNITUDE_FLOPS_SHARE", 1.0)
    only_mm0 = lambda _info, groups, _nodes: [g for g in groups if g.anchor == "mm0"]  # noqa: E731
    monkeypatch.setattr(search, "magnitude_groups", only_mm0)
    flagged = run("flagged")
    s = flagged.plan.summary["search"]
    assert s["magnitude_groups"] == 1 and s["magnitude_met"] is False
    assert [(n.name, n.precision, n.reason) for n in flagged.plan.nodes] == [
        (n.name, n.precision, n.reason) for n in plain.plan.nodes
    ]
    assert s["verifications"] == plain.plan.summary["search"]["verifications"] + 1
