"""Issue 37: the final verification reuses the search's cast graph session and outputs only for the model written."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest

import mpinfer.precision.budget.verify as verify
import mpinfer.precision.convert as convert
import mpinfer.precision.emulator.castgraph as castgraph
from mpinfer.data import load_feeds
from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.precision.budget.verify import VerifySettings, verify_model
from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.graph import apply_plan
from mpinfer.precision.numerics.castjudge import CastJudge
from mpinfer.precision.numerics.strict import StrictEvaluator
from mpinfer.specs import Precision, specs_from_onnx
from tests.precision.graphs import chain, save
from tests.precision.test_search import _npz

BUDGET = "max_abs<=1"  # (the rule plan meets it: the search's one candidate is the plan written)


def _convert(tmp_path, monkeypatch):
    """Convert chain(4) on 48 samples (the search reads 32); count cast graph builds and verification rows."""
    src, data = save(chain(4), tmp_path / "m.onnx"), _npz(tmp_path / "cal.npz", n=48)
    builds, rows = [], []
    real_build, real_fed = castgraph.cast_graph, verify._fed_as_declared
    monkeypatch.setattr(castgraph, "cast_graph", lambda m: builds.append(1) or real_build(m))

    def counted(candidate, runner):
        run = real_fed(candidate, runner)
        return lambda batch: rows.append(len(batch["x"])) or run(batch)

    monkeypatch.setattr(verify, "_fed_as_declared", counted)
    res = convert_precision(ConvertConfig(model=src, output=tmp_path / "o.onnx", calibration=str(data),
                                          batch_size=16, budget=BUDGET, progress=False))
    monkeypatch.setattr(castgraph, "cast_graph", real_build)  # (the convert's builds: not the own verification's)
    feeds = load_feeds(data, specs_from_onnx(onnx.load(str(src))), batch_size=16)
    settings = VerifySettings(budget=BUDGET, precision=Precision.FP16, progress=False)
    monkeypatch.setattr(verify, "_fed_as_declared", real_fed)
    own = verify_model(onnx.load(str(res.output)), onnx.load(str(src)), feeds, settings)
    return res.plan.summary, builds, rows, own


def _same_figures(got, want) -> bool:
    return all(got[o][k] == want[o][k] or (got[o][k] != got[o][k] and want[o][k] != want[o][k])
               for o in want for k in want[o])


def test_the_verification_runs_the_searchs_session_of_the_written_model_on_the_samples_it_did_not_run(
    tmp_path, monkeypatch
):
    """The search's candidate is the model written: one cast graph build in the whole convert (the search's), and
    the verification runs only the 16 samples the search did not, with the figures a verification of its own gives."""
    summary, builds, rows, own = _convert(tmp_path, monkeypatch)
    ver = summary["verification"]
    assert summary["search"]["cast_graph_candidates"] == 1 and ver["engine"] == "ort-casts"
    assert (len(builds), sum(rows), ver["samples"]) == (1, 16, 48)
    assert own.samples == 48 and _same_figures(own.figures, ver["figures"])


def test_outputs_the_emulator_judged_are_not_taken_every_sample_runs_on_the_written_model(tmp_path, monkeypatch):
    """The emulator judged the search's candidate: its outputs are the FP32 model's run with low nodes, not the
    written model's, so the verification runs all 48 samples on the written model's own cast graph."""
    monkeypatch.setattr(CastJudge, "prefers", lambda self, low, cost, whole: False)
    summary, builds, rows, own = _convert(tmp_path, monkeypatch)
    ver = summary["verification"]
    assert summary["search"]["emulator_candidates"] == 1 and ver["engine"] == "ort-casts"
    assert len(builds) == 1 and sum(rows) == 48  # (the verification's build alone)
    assert _same_figures(own.figures, ver["figures"])


def test_a_written_model_other_than_the_searchs_is_run_on_every_sample(tmp_path, monkeypatch):
    """The model written differs from the one the search ran (here: one attribute of its proto): the search's outputs
    and session are not taken, whatever the plan's precisions say."""
    real = convert.apply_validated

    def changed(*args, **kwargs):
        result, nodes = real(*args, **kwargs)
        model = onnx.ModelProto()
        model.CopyFrom(result.model)
        model.doc_string = "not the searched model"
        return replace(result, model=model, gated=None), nodes

    monkeypatch.setattr(convert, "apply_validated", changed)
    summary, builds, rows, _ = _convert(tmp_path, monkeypatch)
    assert summary["search"]["cast_graph_candidates"] == 1
    assert len(builds) == 2 and sum(rows) == 48  # (the search's build, and the written model's)


@pytest.mark.parametrize("engine", ["cast graph", "emulator"])
def test_a_candidate_says_which_model_computed_its_outputs(engine, monkeypatch):
    """``ran_as``: the applied model (equal to apply_plan's) and a runner giving the candidate's very bits when its
    cast graph ran every batch; None when the emulator did."""
    if engine == "emulator":
        monkeypatch.setattr(CastJudge, "prefers", lambda self, low, cost, whole: False)
    model = chain(4)
    info = GraphInfo(model)
    rng = np.random.default_rng(1)
    batches = [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(2)]
    low = {a: Precision.FP16 for a, ref in info.by_address.items() if ref.node.op_type == "MatMul"}
    cand = StrictEvaluator(model, info, batches, Precision.FP16).candidate(low)
    got = cand.outputs()
    ran = cand.ran_as()
    if engine == "emulator":
        assert ran is None
        return
    assert ran is not None
    assert ran.model == apply_plan(model, info, {a: low.get(a, Precision.FP32) for a in info.by_address},
                                   Precision.FP16).model
    run = ran.open()
    for batch, out in zip(batches, got, strict=True):
        assert run(batch)["y"].astype(np.float32).tobytes() == out["y"].tobytes()
