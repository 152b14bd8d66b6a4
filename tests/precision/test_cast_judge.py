"""Issue 37: search candidates judged on the cast graph (ONNX Runtime) where they qualify, else the emulator."""

from __future__ import annotations

import numpy as np

from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.emulator import GraphEmulator
from mpinfer.precision.emulator.castgraph import ENGINE_CASTS
from mpinfer.precision.graph import apply_plan
from mpinfer.precision.numerics.strict import StrictEvaluator
from mpinfer.specs import Precision
from tests.budget import set_slice
from tests.precision.graphs import chain

WIDTH = 16


def _batches(n: int = 2):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((8, WIDTH)).astype(np.float32)} for _ in range(n)]


def _matmuls(info):
    return [a for a, ref in info.by_address.items() if ref.node.op_type == "MatMul"]


def test_every_candidate_is_judged_as_the_final_verification_runs_its_plan_bit_for_bit():
    """Each candidate of a search (not only the first) runs on its cast graph, giving the bits the final
    verification's cast-graph run of the same plan gives."""
    model = chain(6, WIDTH)
    info, batches = GraphInfo(model), _batches()
    mm = _matmuls(info)
    ev = StrictEvaluator(model, info, batches, Precision.FP16)
    plans = [{a: Precision.FP16 for a in mm}, {a: Precision.FP16 for a in mm[:3]}, {mm[4]: Precision.FP16}]
    for low in plans:
        cand = ev.candidate(low)
        got = cand.outputs()
        cand.judged(False)
        precisions = {a: low.get(a, Precision.FP32) for a in info.by_address}
        written = apply_plan(model, info, precisions, Precision.FP16).model
        final = StrictEvaluator.model_runner(written)
        for batch, out in zip(batches, got, strict=True):
            want = final(batch)
            assert final.engine == ENGINE_CASTS
            assert out["y"].dtype == want["y"].dtype and out["y"].tobytes() == want["y"].tobytes(), low
    assert ev.reuse["cast_graph_candidates"] == len(plans) and ev.reuse["emulator_candidates"] == 0, ev.reuse


def test_candidates_the_cast_graph_refuses_fall_back_to_the_emulator(monkeypatch):
    """Weights past the weight_cache slice: the cast graph refuses the candidate and the emulator judges it (bit for
    bit its whole runs); a later candidate holding the refused one is not built again."""
    model = chain(6, WIDTH)
    info, batches = GraphInfo(model), _batches()
    mm = _matmuls(info)
    set_slice(monkeypatch, "weight_cache", 64)  # (less than one weight of the chain)
    ev = StrictEvaluator(model, info, batches, Precision.FP16)
    emu = GraphEmulator(model)
    for low in ({a: Precision.FP16 for a in mm[:2]}, {a: Precision.FP16 for a in mm}):
        cand = ev.candidate(low)
        for batch, out in zip(batches, cand.outputs(), strict=True):
            assert np.array_equal(out["y"], emu.run(batch, low).outputs["y"])
        cand.judged(True)
    r = ev.reuse
    assert (r["cast_graph_candidates"], r["emulator_candidates"], r["cast_graph_refused"]) == (0, 2, 1), r


def test_the_emulator_judges_when_its_measured_run_is_cheaper():
    """With both costs measured, a candidate whose incremental emulator run recomputes far less than a cast
    graph's build and run costs goes to the emulator (and still gives its bits)."""
    model = chain(6, WIDTH)
    info, batches = GraphInfo(model), _batches()
    mm = _matmuls(info)
    ev = StrictEvaluator(model, info, batches, Precision.FP16)
    ev.candidate({a: Precision.FP16 for a in mm}).outputs()  # (cast graph: its cost measured)
    ev.sensitivities([], batches, False)  # (opens the FP32 emulator runs)
    ev._casts.timing.emu_s, ev._casts.timing.emu_evals = 1e-9, 1  # (an emulator far cheaper than any graph build)
    low = {mm[5]: Precision.FP16}
    got = ev.candidate(low).outputs()
    emu = GraphEmulator(model)
    for batch, out in zip(batches, got, strict=True):
        assert np.array_equal(out["y"], emu.run(batch, low).outputs["y"])
    assert (ev.reuse["cast_graph_candidates"], ev.reuse["emulator_candidates"]) == (1, 1), ev.reuse
