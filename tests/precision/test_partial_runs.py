"""Issue 37: a candidate's partial cast graph (only what its low nodes change, fed the FP32 cast graph's tensors) gives
its whole cast graph's bits, on whole search batches and on any subset of the samples."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.emulator.castgraph import CastGraphSession, cast_graph
from mpinfer.precision.graph import apply_plan
from mpinfer.precision.numerics import castjudge as castjudge_mod
from mpinfer.precision.numerics.castjudge import CastJudge
from mpinfer.precision.numerics.partial import FP32Tensors, partial_graph
from mpinfer.precision.numerics.strict import StrictEvaluator
from mpinfer.specs import Precision
from tests.precision.graphs import chain, fvi, init, make, rng_w


def _convnet():
    """Conv -> FP32-able BatchNorm -> Relu -> Conv -> Add (skip) -> Conv -> GlobalAveragePool -> Flatten -> Gemm."""
    rng = np.random.default_rng(3)
    bn = [init(f"bn_{k}", v) for k, v in (("s", rng.uniform(0.5, 2, 8)), ("b", rng.uniform(-1, 1, 8)),
                                          ("m", rng.uniform(-1, 1, 8)), ("v", rng.uniform(0.5, 2, 8)))]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn_s", "bn_b", "bn_m", "bn_v"], ["b1"], name="bn1"),
        helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["a2"], name="add2"),
        helper.make_node("Conv", ["a2", "w3"], ["c3"], name="conv3", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c3"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "wf"], ["y"], name="fc"),
    ]
    inits = [init("w1", rng_w(8, 3, 3, 3, seed=1)), init("w2", rng_w(8, 8, 3, 3, seed=2)),
             init("w3", rng_w(8, 8, 3, 3, seed=3)), init("wf", rng_w(8, 5, seed=4)), *bn]
    return make(nodes, [fvi("x", ["N", 3, 8, 8])], [fvi("y", ["N", 5])], inits, opset=13)


def _applied(model, info, low):
    return apply_plan(model, info, {a: low.get(a, Precision.FP32) for a in info.by_address}, Precision.FP16).model


@pytest.mark.parametrize("net", ["conv", "chain"])
def test_a_partial_graph_gives_the_whole_cast_graphs_bits_on_batches_and_rows(net):
    model = _convnet() if net == "conv" else chain(6)
    info = GraphInfo(model)
    rng = np.random.default_rng(0)
    shape = (3, 8, 8) if net == "conv" else (16,)
    batches = [{"x": rng.standard_normal((6, *shape)).astype(np.float32)} for _ in range(2)]
    fp32 = cast_graph(_applied(model, info, {}))[0]
    assert fp32 is not None
    kept = FP32Tensors(fp32, batches, 1 << 30)
    assert len(kept.batches) == 2
    names = [a for a, r in info.by_address.items() if r.node.op_type in ("Conv", "Add", "Gemm", "MatMul", "Tanh")]
    joined = {"x": np.concatenate([b["x"] for b in batches])}
    for low in ({names[-1]: Precision.FP16}, {a: Precision.FP16 for a in names[2:4]},
                {a: Precision.FP16 for a in names[1:]}):
        built = cast_graph(_applied(model, info, low))[0]
        assert built is not None
        part = partial_graph(built, kept)
        assert part is not None and part.changed < part.total, low
        whole = CastGraphSession(built)
        for index, batch in enumerate(batches):
            assert part.run(kept.batches[index])["y"].tobytes() == whole(batch)["y"].tobytes(), low
        for rows in (np.array([1, 7]), np.array([0, 2, 3, 8, 11]), np.arange(12)):
            cut = kept.rows(part.cut + part.taken, rows)
            assert cut is not None
            assert part.run(cut)["y"].tobytes() == whole({"x": joined["x"][rows]})["y"].tobytes(), (low, rows)


def test_a_search_runs_its_later_candidates_partially_with_the_whole_runs_decisions(monkeypatch):
    """With partial runs on: from the second candidate on, candidates run partial graphs (counted); each one's
    outputs are the bits of the cast graph the final verification runs on the written model."""
    monkeypatch.setattr(castjudge_mod, "PARTIAL_RUNS", True)
    model = _convnet()
    info = GraphInfo(model)
    rng = np.random.default_rng(1)
    batches = [{"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32)} for _ in range(2)]
    ev = StrictEvaluator(model, info, batches, Precision.FP16)
    names = [a for a, r in info.by_address.items() if r.node.op_type in ("Conv", "Add", "Gemm")]
    plans = [{a: Precision.FP16 for a in names}, {a: Precision.FP16 for a in names[1:]},
             {a: Precision.FP16 for a in names[2:]}]
    for low in plans:
        cand = ev.candidate(low)
        got = cand.outputs()
        cand.judged(False)
        final = StrictEvaluator.model_runner(_applied(model, info, low))
        for batch, out in zip(batches, got, strict=True):
            assert out["y"].tobytes() == final(batch)["y"].tobytes(), low
    r = ev.reuse
    assert r["cast_graph_candidates"] == 3 and r["cast_graph_partial"] == 2 and r["partial_nodes_share"] < 1, r


def test_no_partial_graph_when_every_node_changes():
    model = chain(3)
    info = GraphInfo(model)
    batches = [{"x": np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)}]
    judge = CastJudge(model, info, Precision.FP16)
    judge.keep_fp32(batches)
    low = {a: Precision.FP16 for a in info.by_address}
    judged = judge.session(low)
    assert judged is not None and judged.partial is None  # (the first MatMul reads the rounded input: all change)
    assert judged(batches[0], 0)["y"].tobytes() == CastGraphSession(judged.built)(batches[0])["y"].tobytes()
