"""Searches that reuse (issue 37): candidates start from kept runs, failing full runs stop once proved."""

from __future__ import annotations

import numpy as np
import pytest

from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.emulator import GraphEmulator
from mpinfer.precision.numerics.strict import StrictEvaluator
from mpinfer.specs import Precision
from tests.budget import set_slice
from tests.precision.graphs import chain
from tests.precision.test_search import _convert_chain

WIDTH = 16


@pytest.fixture(scope="module")
def setup():
    model = chain(8, WIDTH)
    info = GraphInfo(model)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((8, WIDTH)).astype(np.float32)} for _ in range(2)]
    matmuls = [a for a, ref in info.by_address.items() if ref.node.op_type == "MatMul"]
    return model, info, batches, matmuls


def _candidates(matmuls):
    """A bisection-like sequence: (low nodes, whether it met the budget)."""
    every = [{a: Precision.FP16 for a in matmuls[:k]} for k in range(len(matmuls) + 1)]
    return [(every[-1], False), (every[4], True), (every[6], False), (every[5], True),
            ({**every[5], matmuls[7]: Precision.FP16}, False), ({matmuls[7]: Precision.FP16}, False)]


def _run(setup, evaluator):
    """Each candidate's outputs from ``evaluator`` against a whole emulator run of that candidate, bit for bit."""
    model, _, batches, matmuls = setup
    whole = GraphEmulator(model)
    for low, met in _candidates(matmuls):
        cand = evaluator.candidate(low)
        got = cand.outputs()
        for batch, out in zip(batches, got, strict=True):
            want = whole.run(batch, low).outputs
            assert set(out) == set(want)
            for name in want:
                assert np.array_equal(out[name], want[name]), (low, name)
        cand.judged(met)


def test_candidates_start_from_the_kept_run_they_differ_least_from_bit_for_bit(setup):
    model, info, batches, _ = setup
    ev = StrictEvaluator(model, info, batches, Precision.FP16, cast_graphs=False)
    _run(setup, ev)
    # from the second candidate on (the first runs whole): the ones that grow or trim a kept candidate reuse it
    assert ev.reuse["reused_runs"] >= 3 and ev.reuse["evaluations_saved"] > 0, ev.reuse


def test_without_room_in_the_search_slice_every_candidate_starts_from_fp32(setup, monkeypatch):
    model, info, batches, _ = setup
    set_slice(monkeypatch, "search", 1024)  # (less than one kept run of these batches)
    ev = StrictEvaluator(model, info, batches, Precision.FP16, cast_graphs=False)
    _run(setup, ev)
    assert ev.reuse["reused_runs"] == 0 and ev.reuse["evaluations_saved"] == 0, ev.reuse


def test_rerun_count_is_what_run_from_recomputes(setup):
    model, _, batches, matmuls = setup
    emu = GraphEmulator(model)
    base = emu.run(batches[0], {a: Precision.FP16 for a in matmuls[:3]}, keep=True)
    for low in ({}, {matmuls[5]: Precision.FP16}, {a: Precision.FP16 for a in matmuls[:4]}):
        assert emu.rerun_count(base.low, low) == emu.run_from(base, low, keep=False).recomputed


def test_a_failing_full_run_stops_once_proved_and_no_decision_changes(tmp_path, monkeypatch):
    """With 4 search batches, a candidate whose first batches already break max_abs stops there; the plan, its
    figures and the written model are those of the search that runs every batch of every candidate."""
    import mpinfer.precision.budget.screening as screening_mod

    _, stopped = _convert_chain(tmp_path, 8, "max_abs<=1e-3", tag="s", batch_size=8)
    s = stopped.plan.summary["search"]
    assert s["searched"] and s["batches"] == 4 and s["stopped_early"] > 0 and s["batches_skipped"] > 0, s
    monkeypatch.setattr(screening_mod, "STOP_EARLY", False)
    _, full = _convert_chain(tmp_path, 8, "max_abs<=1e-3", tag="f", batch_size=8)
    f = full.plan.summary["search"]
    assert f["stopped_early"] == 0 and f["verifications"] == s["verifications"]
    assert f["node_evaluations"] > s["node_evaluations"]
    assert [(n.name, n.precision) for n in stopped.plan.nodes] == [(n.name, n.precision) for n in full.plan.nodes]
    assert stopped.plan.summary["expected_error"] == full.plan.summary["expected_error"]
    assert stopped.output.read_bytes() == full.output.read_bytes()


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_local_error_sums_are_the_masked_sums_bit_for_bit_and_leave_their_inputs(masked, dtype):
    from mpinfer.precision.numerics.strict import _error_sums

    rng = np.random.default_rng(1)
    ref = rng.standard_normal((3, 7, 999)).astype(dtype)
    got = (ref + rng.standard_normal(ref.shape) * 1e-3).astype(dtype)
    if masked:
        ref.reshape(-1)[::7] = np.inf
    ref0, got0 = ref.copy(), got.copy()
    want, value = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    ok = np.isfinite(want)
    assert _error_sums(ref, got) == (float(((value - want)[ok] ** 2).sum()), float((want[ok] ** 2).sum()))
    assert np.array_equal(ref, ref0) and np.array_equal(got, got0)
    got.reshape(-1)[1] = np.nan  # (index 1: a finite reference value)
    assert _error_sums(ref, got) is None


def test_the_first_candidate_keeps_nothing_and_the_next_ones_are_kept(setup):
    """With calibration's FP32 tensors the first candidate already runs from the FP32 runs; it keeps none of its
    tensors (a search of one candidate would never use them), the second keeps its runs as a base."""
    model, info, batches, matmuls = setup
    emu = GraphEmulator(model)
    tensors = [emu.run(b, None, keep=True).tensors for b in batches]
    ev = StrictEvaluator(model, info, batches, Precision.FP16, known_tensors=tensors, cast_graphs=False)
    ev.candidate({a: Precision.FP16 for a in matmuls}).outputs()
    assert ev._kept is not None and ev._kept.last is None
    ev.candidate({a: Precision.FP16 for a in matmuls[:4]}).outputs()
    assert ev._kept.last is not None and len(ev._kept.last) == len(batches)
