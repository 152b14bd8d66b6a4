"""Budget search: meets the budget, falls back to FP32 where needed, costs O(n log n) evaluations."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from mpinfer.checks import parse_checks
from mpinfer.errors import AccuracyMismatchError
from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.precision.numerics.strict import StrictEvaluator
from mpinfer.precision.options import resolve_options
from mpinfer.specs import Precision
from tests.budget import set_slice
from tests.precision.graphs import chain, export_digits, fvi, init, make, rng_w, save
from tests.tolerances import eps, network_atol

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def digits_onnx(tmp_path_factory):
    return export_digits(tmp_path_factory.mktemp("digits") / "digits.onnx")


def _npz(path, n=32, width=16):
    np.savez(path, x=np.random.default_rng(0).standard_normal((n, width)).astype(np.float32))
    return path


def _convert_chain(tmp_path, n, budget, tag="", **cfg):
    """Save ``chain(n)`` and 32 samples under ``tmp_path``, convert with ``budget``; returns (source, result)."""
    src = save(chain(n), tmp_path / f"chain{tag}.onnx")
    data = _npz(tmp_path / f"cal{tag}.npz")
    res = convert_precision(
        ConvertConfig(
            model=src, output=tmp_path / f"c{tag}.onnx", calibration=str(data), budget=budget, progress=False, **cfg
        )
    )
    return src, res


def test_search_meets_budget_on_digits(digits_onnx, tmp_path):
    res = convert_precision(
        ConvertConfig(
            model=digits_onnx,
            output=tmp_path / "d.fp16.onnx",
            calibration=str(ROOT / "calibration" / "digits.npz"),
            budget="cosine>=0.9999,top1>=0.99",
            progress=False,
        )
    )
    s = res.plan.summary
    assert parse_checks("cosine>=0.9999,top1>=0.99").met({"model": s["expected_error"]})
    assert s["low_share_flops"] > 0.9
    assert s["search"]["node_evaluations"] > 0 and s["search"]["numerics"] == "strict"
    assert res.plan.calibration["kind"] == "npz"
    # The whole rule candidate met the budget: nothing was searched, so no group was measured.
    assert s["search"]["searched"] is False and s["search"]["verifications"] == 1
    assert not any("sensitivity" in n.stats for n in res.plan.nodes)


def test_tight_budget_keeps_sensitive_groups_fp32(tmp_path):
    _, res = _convert_chain(tmp_path, 8, "max_abs<=1e-3")
    reasons = res.plan.reasons()
    assert reasons.get("sensitivity", 0) > 0 and res.plan.summary["nodes_low"] > 0
    assert res.plan.summary["search"]["searched"] is True
    searched = [n for n in res.plan.nodes if n.op_type == "MatMul"]
    assert searched and all("sensitivity" in n.stats for n in searched)
    assert res.plan.summary["expected_error"]["max_abs"] <= 1e-3
    plan = json.loads(res.plan_path.read_text())
    assert any(n["reason"] == "sensitivity" and n["precision"] == "fp32" for n in plan["nodes"])


def test_ort_numerics_verifies_with_onnxruntime(tmp_path):
    _, res = _convert_chain(tmp_path, 4, "cosine>=0.999", numerics="ort")
    assert res.plan.numerics == "ort" and res.plan.summary["search"]["numerics"] == "ort"
    assert res.plan.summary["expected_error"]["cosine"] >= 0.999
    # The FP32 reference came from the calibration run: one ORT run in all, the whole candidate's.
    assert res.plan.summary["search"]["verifications"] == 1 and not res.plan.summary["search"]["searched"]


def test_ort_numerics_search_bisects_and_meets_the_budget(tmp_path):
    src, res = _convert_chain(tmp_path, 8, "max_abs<=1e-3", numerics="ort")
    s = res.plan.summary
    assert s["search"]["searched"] and s["search"]["verifications"] > 2
    assert 0 < s["nodes_low"] and s["expected_error"]["max_abs"] <= 1e-3
    from tests.precision.numerics_graphs import ort_run

    x = np.load(tmp_path / "cal.npz")["x"]
    import onnx

    ref, got = ort_run(onnx.load(str(src)), {"x": x})["y"], ort_run(onnx.load(str(res.output)), {"x": x})["y"]
    assert np.abs(ref - got).max() <= 1e-3


def test_search_cost_grows_gently(tmp_path):
    evals = {}
    for n in (8, 32):
        _, res = _convert_chain(tmp_path, n, "max_abs<=2e-3", tag=str(n))
        evals[n] = res.plan.summary["search"]["node_evaluations"]
    # 4x the nodes: a per-group full re-run would cost ~16x; the local sensitivity + bisection stays near 4x.
    assert evals[32] / evals[8] < 8, evals


def test_budget_unmeetable_even_in_fp32(tmp_path):
    src = save(chain(2), tmp_path / "chain.onnx")
    data = tmp_path / "cal.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.standard_normal((32, 16)).astype(np.float32), _labels=rng.integers(0, 16, 32))
    with pytest.raises(AccuracyMismatchError, match="even with every node in FP32"):
        convert_precision(
            ConvertConfig(
                model=src,
                output=tmp_path / "c.onnx",
                calibration=str(data),
                budget="accuracy>=0.99",
                progress=False,
            )
        )
    assert not (tmp_path / "c.onnx").exists()


def test_bf16_search_strict(tmp_path):
    _, res = _convert_chain(tmp_path, 4, "cosine>=0.99", precision=Precision.BF16)
    assert res.plan.precision is Precision.BF16 and res.plan.summary["nodes_low"] > 0


def test_ort_search_final_model_is_its_verified_candidate_and_equals_reapplying_the_plan(tmp_path, monkeypatch):
    """With ORT numerics the last candidate that met the budget was applied and run already: the output is
    that model (no second apply), byte-identical to re-applying the written plan."""
    import mpinfer.precision.graph.apply as apply_mod
    import mpinfer.precision.graph.validate as validate_mod
    import mpinfer.precision.numerics.ort as ort_mod
    import mpinfer.precision.numerics.strict as ev_mod

    calls = []
    real = apply_mod.apply_plan

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    for mod in (apply_mod, ev_mod, ort_mod, validate_mod):  # every module that binds the name
        monkeypatch.setattr(mod, "apply_plan", counting, raising=False)
    src, res = _convert_chain(tmp_path, 4, "cosine>=0.999", numerics="ort")
    s = res.plan.summary["search"]
    assert s["verifications"] == 1 and len(calls) == 1  # the one verification; the final model reuses it
    again = convert_precision(
        ConvertConfig(model=src, plan=res.plan_path, output=tmp_path / "again.onnx", progress=False)
    )
    assert len(calls) == 2
    assert again.output.read_bytes() == res.output.read_bytes()


def _fixed_batch_chain(n: int, rows: int, width: int = 16):
    model = chain(n, width)
    for vi in (*model.graph.input, *model.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_value = rows
    return model


@pytest.mark.parametrize("numerics", ["ort", "strict"])
def test_screening_rejects_on_the_hardest_samples_and_changes_no_decision(tmp_path, monkeypatch, numerics):
    """Candidates that fail are rejected after a run on the hardest samples (ORT: a session run on them;
    strict: an incremental emulator run from their kept FP32 run); the search's decisions, its final error
    and the written model are those of the search that runs every candidate on every sample."""
    import mpinfer.precision.budget.screening as screening_mod
    import mpinfer.precision.numerics.ort as ort_mod
    import mpinfer.precision.numerics.strict as ev_mod

    runs = []
    if numerics == "ort":
        real = ort_mod.OrtEvaluator.ort_run

        def counting(sess, batch):
            runs.append(len(next(iter(batch.values()))))
            return real(sess, batch)

        monkeypatch.setattr(ort_mod.OrtEvaluator, "ort_run", staticmethod(counting))
    else:
        real_rows = ev_mod.StrictEvaluator.strict_rows

        def counting_rows(self, feeds, rows, low, *rest):
            runs.append(len(next(iter(feeds.values()))))
            return real_rows(self, feeds, rows, low, *rest)

        monkeypatch.setattr(ev_mod.StrictEvaluator, "strict_rows", counting_rows)
        # this small chain holds ~1e3 float values per node: screening is off below the threshold ...
        _, small = _convert_chain(tmp_path, 8, "max_abs<=1e-3", tag="o", numerics=numerics)
        assert small.plan.summary["search"]["screened"] == 0 and not runs
        monkeypatch.setattr(ev_mod, "STRICT_SCREEN_MIN_VALUES", 0)  # ... and on for models the data dominates
    _, screened = _convert_chain(tmp_path, 8, "max_abs<=1e-3", tag="s", numerics=numerics)
    s = screened.plan.summary["search"]
    assert s["searched"] and s["screened"] > 0, s
    assert runs.count(4) >= s["screened"]  # 32 samples: each screening run holds the 4 hardest
    monkeypatch.setattr(screening_mod, "SCREEN_MIN_TOTAL", 10**9)  # no screening
    _, full = _convert_chain(tmp_path, 8, "max_abs<=1e-3", tag="f", numerics=numerics)
    f = full.plan.summary["search"]
    assert f["screened"] == 0 and f["steered"] == 0
    # (the same candidates, and one more run on every sample when the plan is a prefix steered on the hardest samples)
    assert s["verifications"] - f["verifications"] == (1 if s["steered"] else 0)
    assert [(n.name, n.precision) for n in screened.plan.nodes] == [(n.name, n.precision) for n in full.plan.nodes]
    assert screened.plan.summary["expected_error"] == full.plan.summary["expected_error"]
    assert screened.output.read_bytes() == full.output.read_bytes()


def _convert_fixed_batch(tmp_path, cal_name):
    """Convert ``_fixed_batch_chain(8, 32)`` with 32 samples saved as ``cal_name`` (max_abs <= 1e-3, ORT)."""
    src = save(_fixed_batch_chain(8, 32), tmp_path / "fixed.onnx")
    return convert_precision(
        ConvertConfig(
            model=src,
            output=tmp_path / "fixed.fp16.onnx",
            calibration=str(_npz(tmp_path / cal_name)),
            budget="max_abs<=1e-3",
            numerics="ort",
            batch_size=32,
            force=True,
            progress=False,
        )
    )


def test_ort_screening_needs_samples_it_can_split(tmp_path):
    """A model whose input fixes the batch size runs every candidate on all samples: no screening."""
    res = _convert_fixed_batch(tmp_path, "cal.npz")
    s = res.plan.summary["search"]
    assert s["searched"] and s["screened"] == 0 and res.plan.summary["expected_error"]["max_abs"] <= 1e-3


def _recorded_hardness(monkeypatch):
    """A list that receives a copy of the verifier's per-sample hardness after each full verification."""
    import mpinfer.precision.budget.search as search_mod

    hardness = []
    real = search_mod._Verifier._update_hardness

    def recording(self, outs):
        real(self, outs)
        hardness.append(None if self.hardness is None else self.hardness.copy())

    monkeypatch.setattr(search_mod._Verifier, "_update_hardness", recording)
    return hardness


def test_ort_probe_measures_on_the_samples_the_whole_candidate_got_most_wrong(tmp_path, monkeypatch):
    """The probe ranks the groups on the hardest quarter of the samples (per-sample error of the first full
    verification); a model whose batch is fixed is probed on every sample."""
    import mpinfer.precision.numerics.probe as probe_mod

    probed, hardness = [], _recorded_hardness(monkeypatch)
    real_probe = probe_mod.probe_errors

    def recording_probe(info, groups, batches, low):
        probed.append(np.concatenate([b["x"] for b in batches]))
        return real_probe(info, groups, batches, low)

    monkeypatch.setattr(probe_mod, "probe_errors", recording_probe)
    _, res = _convert_chain(tmp_path, 8, "max_abs<=1e-3", numerics="ort")
    assert res.plan.summary["search"]["searched"] and res.plan.summary["expected_error"]["max_abs"] <= 1e-3
    samples = np.load(tmp_path / "cal.npz")["x"]
    hardest = np.sort(np.argsort(-hardness[0], kind="stable")[:8])  # after the whole candidate's run
    assert len(probed) == 1 and np.array_equal(probed[0], samples[hardest])

    probed.clear()
    _convert_fixed_batch(tmp_path, "cal32.npz")
    assert len(probed) == 1 and np.array_equal(probed[0], np.load(tmp_path / "cal32.npz")["x"])


def test_strict_sensitivities_are_measured_on_the_hardest_quarter_of_the_samples(tmp_path, monkeypatch):
    """Strict numerics rank the groups on the FP32 tensors of the quarter of the samples the whole candidate
    got most wrong (per-sample error of its strict run), as the ORT probe does: the strict probe (every group has a
    cast graph here) reads those samples, and the emulator measures no group."""
    import mpinfer.precision.numerics.probe as probe_mod
    import mpinfer.precision.numerics.strict as ev_mod

    seen, hardness = [], _recorded_hardness(monkeypatch)
    real_probe = probe_mod.strict_probe_errors

    def recording_probe(info, groups, batches, low):
        seen.append((len(groups), np.concatenate([b[info.model.graph.input[0].name] for b in batches])))
        return real_probe(info, groups, batches, low)

    monkeypatch.setattr(probe_mod, "strict_probe_errors", recording_probe)
    monkeypatch.setattr(ev_mod, "local_error", lambda *a: pytest.fail("a group measured on the emulator"))
    _, res = _convert_chain(tmp_path, 8, "max_abs<=1e-3", numerics="strict")
    s = res.plan.summary
    assert s["search"]["searched"] and s["expected_error"]["max_abs"] <= 1e-3
    samples = np.load(tmp_path / "cal.npz")["x"]
    hardest = np.sort(np.argsort(-hardness[0], kind="stable")[:8])  # after the whole candidate's run
    assert len(seen) == 1 and seen[0][0] == s["search"]["groups"] and np.array_equal(seen[0][1], samples[hardest])
    assert not np.array_equal(samples[hardest], samples[:8])


def test_strict_reference_run_takes_calibrations_fp32_tensors(tmp_path, monkeypatch):
    """With strict numerics the emulator's FP32 reference run executes no FP32 node whose tensors calibration
    computed (ONNX Runtime's), and the search decides as it does from the emulator's own FP32 run."""
    import mpinfer.precision.plandata as plandata
    from mpinfer.precision.emulator.emulate import GraphEmulator

    executed: list[int] = []
    real_run, real_exec = GraphEmulator.run, GraphEmulator._exec_step

    def run(self, feeds, low=None, *, known=None, **kw):
        if known is None:
            return real_run(self, feeds, low, **kw)
        count = [0]

        def counting(*a, **k):
            count[0] += 1
            return real_exec(self, *a, **k)

        self._exec_step = counting
        try:
            return real_run(self, feeds, low, known=known, **kw)
        finally:
            del self._exec_step
            executed.append(count[0])

    monkeypatch.setattr(GraphEmulator, "run", run)
    # (the emulator judges the candidates: the cast graph makes no FP32 emulator runs)
    monkeypatch.setattr(StrictEvaluator, "_cast_session", lambda *a: None)
    budget = "max_abs<=1e-3"
    _, seeded = _convert_chain(tmp_path, 8, budget, tag="a", numerics="strict")
    assert executed and set(executed) == {0}  # one run per search batch: every node's tensors were known
    runs = len(executed)
    real_calibrate = plandata.calibrate  # convert's calibration step, told not to keep the tensors
    monkeypatch.setattr(plandata, "calibrate", lambda *a, **k: real_calibrate(*a, **{**k, "capture_tensors": False}))
    _, own = _convert_chain(tmp_path, 8, budget, tag="b", numerics="strict")
    assert len(executed) == runs  # no known tensors this time: the emulator computed its own
    assert seeded.plan.summary["search"]["searched"]
    assert [(n.name, n.precision) for n in seeded.plan.nodes] == [(n.name, n.precision) for n in own.plan.nodes]
    err_a, err_b = seeded.plan.summary["expected_error"], own.plan.summary["expected_error"]
    # the FP32 reference came from onnxruntime (a) or the emulator (b): 8 chained 16-term MatMuls into tanh (<= 1)
    assert err_a["max_abs"] == pytest.approx(err_b["max_abs"], rel=0, abs=network_atol(n=16, stages=8, magnitude=1))


def test_expected_error_without_a_budget_compares_with_calibrations_outputs(tmp_path, monkeypatch):
    """Without a budget the plan's expected error is the strict run of the plan against the FP32 outputs
    calibration kept (no FP32 emulator run); the emulator computes them only when none were kept."""
    import mpinfer.precision.plandata as plandata
    from mpinfer.precision.budget.search import measure_plan
    from mpinfer.precision.emulator.emulate import GraphEmulator

    model = chain(4)
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    batch = {"x": x}
    assert measure_plan(model, [], [batch])["max_abs"] == 0.0  # all FP32 against the emulator's own run
    ref = GraphEmulator(model).run(batch).outputs["y"]
    shifted = [{"y": ref + np.float32(0.25)}]
    shift_rounding = eps() * float(np.abs(ref).max() + 0.25)  # ref + 0.25 rounds to float32
    shifted_error = measure_plan(model, [], [batch], reference_outputs=shifted)["max_abs"]
    assert shifted_error == pytest.approx(0.25, abs=shift_rounding)
    # convert asks calibration for one batch's outputs and hands them over
    kept = []
    real = plandata.calibrate

    def recording(*a, **k):
        stats = real(*a, **k)
        kept.append((k.get("capture_batches"), k.get("capture_tensors"), stats.reference_outputs))
        return stats

    monkeypatch.setattr(plandata, "calibrate", recording)
    src = save(model, tmp_path / "c.onnx")
    res = convert_precision(
        ConvertConfig(model=src, output=tmp_path / "o.onnx", calibration=str(_npz(tmp_path / "d.npz")), budget="none",
                      progress=False)
    )
    ((batches, tensors, outputs),) = kept
    assert batches == 1 and not tensors and outputs is not None and len(outputs) == 1
    assert 0 < res.plan.summary["expected_error"]["max_abs"] < 1e-2


def _if_model():
    """All the compute inside an If (a streaming model's shape). then = Relu(x @ w) + (z @ I - 1000) with z near
    1000: the first chain is harmless in FP16, the second is not (z in FP16 is rounded to 0.5, and ONNX Runtime
    sees that too: the Cast is in the graph); else = x @ w."""

    def body(name, nodes, out):
        return helper.make_graph(nodes, name, [], [fvi(out, ["N", 16])])

    big = helper.make_tensor("big", 1, [], [1000.0])
    then = body(
        "then",
        [
            helper.make_node("MatMul", ["x", "w"], ["tm"], name="t_mm"),
            helper.make_node("Relu", ["tm"], ["tr"], name="t_relu"),
            helper.make_node("MatMul", ["z", "eye"], ["tz"], name="t_mm2"),
            helper.make_node("Constant", [], ["k"], name="t_k", value=big),
            helper.make_node("Sub", ["tz", "k"], ["ts"], name="t_sub"),
            helper.make_node("Add", ["tr", "ts"], ["ty"], name="t_out"),
        ],
        "ty",
    )
    other = body("else", [helper.make_node("MatMul", ["x", "w"], ["ey"], name="e_mm")], "ey")
    node = helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)
    inits = [init("w", rng_w(16, 16, scale=0.25)), init("eye", np.eye(16, dtype=np.float32))]
    inputs = [fvi("x", ["N", 16]), fvi("z", ["N", 16]), fvi("c", [], elem=9)]
    return make([node], inputs, [fvi("y", ["N", 16])], inits)


@pytest.mark.parametrize(("numerics", "limit"), [("strict", 1e-2), ("ort", 1e-4)])
def test_search_decides_nodes_inside_control_flow_bodies(tmp_path, numerics, limit):
    """Nodes inside If/Loop/Scan bodies are searched too (a model whose compute is all in bodies used to fail its
    budget as if the user had forced them low): body groups go FP32 where the budget needs it. (ONNX Runtime's CPU
    provider computes this FP16 graph in FP32 and drops the Cast pair around z, so its budget is tighter.)"""
    src = save(_if_model(), tmp_path / "if.onnx")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    z = (1000 + rng.standard_normal((32, 16))).astype(np.float32)
    np.savez(tmp_path / "cal.npz", x=x, z=z, c=np.array(True))
    res = convert_precision(
        ConvertConfig(model=src, output=tmp_path / f"if.{numerics}.onnx", calibration=str(tmp_path / "cal.npz"),
                      budget=f"max_abs<={limit}", numerics=numerics, progress=False)
    )
    nodes = {n.name: n for n in res.plan.nodes}
    assert res.plan.summary["search"]["searched"] and res.plan.summary["expected_error"]["max_abs"] <= limit
    kept = [n for n in res.plan.nodes if n.reason == "sensitivity"]
    assert kept and all(n.name.startswith("if/") and "control-flow body" in n.detail for n in kept)
    assert nodes["if/else_branch/e_mm"].precision is Precision.FP16  # not taken on this data: costs nothing
    if numerics == "strict":  # the fragile chain goes FP32, the harmless one keeps FP16
        assert {n.name for n in kept} == {"if/then_branch/t_mm2", "if/then_branch/t_sub"}
        assert nodes["if/then_branch/t_mm"].precision is Precision.FP16
    import onnx

    from tests.precision.numerics_graphs import ort_run

    feeds = {"x": x, "z": z, "c": np.array(True)}
    ref, got = ort_run(onnx.load(str(src)), feeds)["y"], ort_run(onnx.load(str(res.output)), feeds)["y"]
    assert np.abs(ref - got).max() <= limit


def test_search_data_is_bounded_by_bytes(tmp_path, monkeypatch):
    """The budget search keeps its samples' FP32 tensors: above the budget's search slice it verifies on fewer batches,
    then on the first samples of the first (with labels to match); below it, on calibration's batches as they are."""
    import onnx

    import mpinfer.precision.plandata as conv
    from mpinfer.data import load_feeds
    from mpinfer.precision.calib.calibrate import calibrate
    from mpinfer.specs import specs_from_onnx

    model = chain(4)
    path = _npz(tmp_path / "cal.npz")
    data = dict(np.load(path))
    np.savez(path, **data, _labels=np.arange(32) % 4)
    feeds = load_feeds(path, specs_from_onnx(model), batch_size=16)
    stats = calibrate(model, feeds, progress=False, capture_batches=2, capture_tensors=True)
    per = stats.sample_bytes
    assert per and per == sum(4 * 16 for n in model.graph.node for o in n.output)  # 9 float tensors of 16 a sample
    # (ort numerics: strict ones read every search sample and keep the tensors of the batches that fit, see
    # test_cast_judge.py)
    opts = resolve_options(ConvertConfig(model=Path("m.onnx"), output=Path("o.onnx"), search_samples=32,
                                         numerics="ort"))
    got, refs, tensors = conv.search_data(opts, model, feeds, stats)
    assert [len(b["x"]) for b in got] == [16, 16] and (refs, tensors) == (stats.reference_outputs,
                                                                          stats.reference_tensors)
    got, refs, tensors = conv.search_data(replace(opts, search_samples=16), model, feeds, stats)
    assert [len(b["x"]) for b in got] == [16] and len(refs) == len(tensors) == 1  # --search-samples 16
    set_slice(monkeypatch, "search", 20 * per)  # one batch of 16 fits, two do not: 20 samples
    got, refs, tensors = conv.search_data(opts, model, feeds, stats)
    # calibration's outputs of the cut batch are cut with it (issue 27: the search takes them as its reference);
    # its tensors are not (an intermediate need not hold the samples on axis 0)
    assert [len(b["x"]) for b in got] == [16, 4] and tensors is None
    assert [len(r["y"]) for r in refs] == [16, 4]
    np.testing.assert_array_equal(refs[1]["y"], stats.reference_outputs[1]["y"][:4])
    set_slice(monkeypatch, "search", 5 * per)  # not even one batch: its first 5 samples
    got, refs, tensors = conv.search_data(opts, model, feeds, stats)
    (batch,) = list(got)
    np.testing.assert_array_equal(batch["x"], data["x"][:5])
    assert [len(r["y"]) for r in refs] == [5] and tensors is None and list(got.labels[:5]) == [0, 1, 2, 3, 0]
    res = convert_precision(
        ConvertConfig(model=save(model, tmp_path / "m.onnx"), output=tmp_path / "o.onnx", calibration=str(path),
                      batch_size=16, budget="max_abs<=1e-3,accuracy>=0", numerics="ort", progress=False)
    )
    assert res.plan.summary["verification"]["figures"]["y"]["max_abs"] <= 1e-3 and onnx.load(str(res.output)).graph.node
    # the 5 samples the limit leaves (strict numerics read all 32, the first batch split: test_cast_judge.py)
    assert res.plan.summary["search"]["samples"] == 5
    assert res.plan.summary["verification"]["samples"] == 32  # the guarantee reads them all


def test_expected_error_without_a_budget_is_measured_on_the_bounded_samples(tmp_path, monkeypatch):
    import mpinfer.precision.convert as convert  # the step that measures it (convert._expected_error)

    seen = []
    measure = convert.measure_plan

    def spy(model, nodes, feeds, **kw):
        seen.append(list(feeds))
        return measure(model, nodes, feeds, **kw)

    monkeypatch.setattr(convert, "measure_plan", spy)
    path = _npz(tmp_path / "cal.npz")
    src = save(chain(4), tmp_path / "m.onnx")
    set_slice(monkeypatch, "search", 6 * 576)  # 576 bytes of tensors a sample: 6 samples
    res = convert_precision(
        ConvertConfig(model=src, output=tmp_path / "o.onnx", calibration=str(path), batch_size=16, budget="none",
                      progress=False)
    )
    assert [len(b["x"]) for b in seen[0]] == [6] and res.plan.summary["expected_error"]["max_abs"] > 0


class _ByGroups:
    """A verifier for :func:`search._bisect` alone: the budget (max_abs<=1) breaks when any of ``bad`` is low.

    The verdicts are given, not measured: what is under test is how the bisection walks the ranked groups.
    """

    def __init__(self, bad: set[str]) -> None:
        from mpinfer.checks import parse_checks

        self.bad, self.budget, self.seen = bad, parse_checks("max_abs<=1"), []
        self.fp32_metrics = {"y": {"max_abs": 0.0}}
        self.steered = False  # (every verdict a full run's)

    def metrics(self, low, *, screen=True, steer=False):
        self.seen.append(sorted(low))
        return {"y": {"max_abs": 2.0 if self.bad & set(low) else 0.5}}


class _Bar:
    def advance(self, task) -> None:
        pass


def test_a_top_group_that_breaks_the_budget_alone_stays_fp32_and_the_rest_is_searched_again():
    """The top-ranked group alone breaks the budget (its local error mis-ranked it): it stays FP32 and the rest is
    tried whole, then bisected again; before, every prefix held it and one bisection kept the whole order FP32
    but for a few groups refined one by one (layout_cdla: 8 of 964 groups low)."""
    from mpinfer.precision.budget import search
    from mpinfer.precision.budget.groups import _Group
    from mpinfer.precision.budget.screening import SearchConfig

    order = [_Group(f"g{i}", [f"n{i}"], flops=100.0 - i) for i in range(40)]
    cfg = SearchConfig(budget="max_abs<=1", precision=Precision.FP16, progress=False)
    ver = _ByGroups({"n0"})
    accepted, metrics = search._bisect(order, {}, ver, _Bar(), None, cfg)
    assert [g.anchor for g in accepted] == [f"g{i}" for i in range(1, 40)] and metrics["y"]["max_abs"] == 0.5
    assert len(ver.seen) == 5 + 1  # the bisection down to the empty prefix (40 groups), then the rest whole: met
    # two mis-ranked groups at the top, and one further down: each left FP32, every other group low
    ver = _ByGroups({"n0", "n1", "n30"})
    accepted, _ = search._bisect(order, {}, ver, _Bar(), None, cfg)
    assert {g.anchor for g in accepted} == {f"g{i}" for i in range(2, 40)} - {"g30"}
    # a bad group further down changes nothing: one bisection, as before
    ver = _ByGroups({"n20"})
    accepted, _ = search._bisect(order, {}, ver, _Bar(), None, cfg)
    assert {g.anchor for g in accepted} == {f"g{i}" for i in range(40)} - {"g20"}
    assert search.MAX_HEAD_DROPS >= 2
