"""Issue 37: staged full runs (strict numerics on the cast graph): after screening, the hardest half of the samples,
then the rest; the decisions, figures and written model are those of full runs of every batch."""

from __future__ import annotations

import numpy as np

import mpinfer.precision.budget.screening as screening_mod
import mpinfer.precision.numerics.strict as strict_mod
from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.numerics.strict import StrictEvaluator
from mpinfer.specs import Precision
from tests.precision.graphs import chain
from tests.precision.test_search import _convert_chain


def _spy(monkeypatch) -> list[str]:
    """Record what each staged run gave: 'dict' (rejected on the hardest samples), 'list' (every sample), 'NoneType'."""
    seen: list[str] = []
    real = screening_mod._Verifier._staged

    def staged(self, cand, rows, steer=False):
        out = real(self, cand, rows, steer)
        seen.append(type(out).__name__)
        return out

    monkeypatch.setattr(screening_mod._Verifier, "_staged", staged)
    return seen


def test_staged_runs_change_no_decision_figure_or_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(strict_mod, "STRICT_SCREEN_MIN_VALUES", 0)  # (screen this small chain)
    seen = _spy(monkeypatch)
    monkeypatch.setattr(screening_mod, "STEER", False)
    _, staged = _convert_chain(tmp_path, 8, "max_abs<=1e-3", tag="s")
    s = staged.plan.summary["search"]
    assert s["searched"] and "list" in seen, (seen, s)  # candidates ran in stages to the last sample
    monkeypatch.setattr(screening_mod, "STEER", True)
    seen.clear()
    _, steered = _convert_chain(tmp_path, 8, "max_abs<=1e-3", tag="t")
    t = steered.plan.summary["search"]
    assert t["steered"] >= 1 and t["unsteered"] == 0, t  # bisection prefixes passed on the hardest half alone
    monkeypatch.setattr(screening_mod._Verifier, "_staged", lambda self, cand, rows, steer=False: None)
    _, whole = _convert_chain(tmp_path, 8, "max_abs<=1e-3", tag="w")
    w = whole.plan.summary["search"]
    assert w["verifications"] == s["verifications"] and w["stopped_early"] <= s["stopped_early"]
    assert w["steered"] == 0 and t["verifications"] <= w["verifications"] + 1  # (a steered plan: one settling run)
    for res in (staged, steered):
        assert [(n.name, n.precision) for n in res.plan.nodes] == [(n.name, n.precision) for n in whole.plan.nodes]
        assert res.plan.summary["expected_error"] == whole.plan.summary["expected_error"]
        assert res.output.read_bytes() == whole.output.read_bytes()


def test_cast_rows_give_the_full_runs_bits_and_only_where_the_cast_graph_judges():
    """Any subset of the samples through ``cast_rows`` is, bit for bit, those rows of the candidate's full run (the
    first candidate's too: the search previews it); candidates the emulator would judge get no row runner."""
    model = chain(6, 16)
    info = GraphInfo(model)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(2)]
    mm = [a for a, ref in info.by_address.items() if ref.node.op_type == "MatMul"]
    ev = StrictEvaluator(model, info, batches, Precision.FP16)
    low = {a: Precision.FP16 for a in mm[1:]}
    first = ev.cast_rows(low)  # (the first candidate: the engine its full run takes, the cast graph)
    assert first is not None
    full = ev.candidate(low).outputs()
    run = ev.cast_rows(low)
    assert run is not None
    joined = np.concatenate([b["x"] for b in batches])
    want = np.concatenate([o["y"] for o in full])
    for rows in (np.array([3, 11]), np.array([0, 1, 2, 5, 9, 15]), np.arange(16)):
        assert run({"x": joined[rows]})["y"].tobytes() == want[rows].tobytes()
        assert first({"x": joined[rows]})["y"].tobytes() == want[rows].tobytes()
    assert ev.cast_rows({mm[5]: Precision.FP16}) is None  # (the emulator recomputes 3 of 13 nodes: it judges)


def _whole_array_errors(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """The per-sample hardness as the verifier computed it before sample_errors: whole float64 arrays."""
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    ok = np.isfinite(ref)
    scale = float(np.abs(ref[ok]).max()) if ok.any() else 1.0
    with np.errstate(invalid="ignore"):
        err = np.where(ok, np.abs(got - ref), 0.0) / max(scale, 1e-30)
    err[~np.isfinite(err)] = np.inf
    return err.max(axis=1) if err.shape[1] else np.zeros(len(err))


def test_sample_errors_are_the_whole_array_figures_bit_for_bit(monkeypatch):
    """The blocked per-sample hardness gives the bits of the whole-array formula it replaced: the row's largest
    difference divided by the scale once (division is monotone), NaN/Inf in the candidate where the reference is
    finite the hardest (inf), values where the reference is not finite left out, an all-zero or all-inf reference,
    float16 candidates, and blocks of one row or several (the block size shrunk to cut rows across blocks)."""
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((9, 40)).astype(np.float32) * 10 ** rng.uniform(-3, 3, (9, 1)).astype(np.float32)
    got = (ref + rng.standard_normal(ref.shape).astype(np.float32) * np.float32(1e-3)).astype(np.float32)
    ref[2, 5], ref[4, :3] = np.inf, np.nan  # (left out where the reference is not finite)
    got[2, 5], got[4, 1] = 7.0, np.nan
    got[6, 7], got[7, 9] = np.nan, -np.inf  # (the hardest)
    cases = [(ref, got), (ref, got.astype(np.float16)), (np.zeros((3, 5), np.float32), np.ones((3, 5), np.float32)),
             (np.full((2, 4), np.inf, np.float32), np.zeros((2, 4), np.float32)), (ref[:, :0], got[:, :0])]
    for block in (screening_mod.HARDNESS_BLOCK, 40, 80, 1):
        monkeypatch.setattr(screening_mod, "HARDNESS_BLOCK", block)
        for r, g in cases:
            want = _whole_array_errors(r, g)
            got_rows = screening_mod.sample_errors(r, g)
            assert got_rows.dtype == np.float64 and got_rows.tobytes() == want.tobytes(), (block, r.shape)
    assert np.isinf(screening_mod.sample_errors(ref, got)[[6, 7]]).all()
