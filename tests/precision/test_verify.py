"""Convert's guarantee: the budget verified on every calibration sample, the default floor, visible knobs,
and explicit options that conflict with a re-applied plan."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from mpinfer.errors import AccuracyMismatchError, InvalidInputError
from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.precision.options import floor_budget
from mpinfer.specs import Precision
from tests.conftest import assert_user_error
from tests.precision.graphs import fvi, init, make, rng_w, save
from tests.tolerances import assert_error_figures_agree, assert_onnx_outputs_close, onnx_reductions, reorder_atol


def growing_mlp() -> object:
    """A 3-layer MLP x[N,16] -> 32 -> 32 -> y[N,8]."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"], name="fc1"),
        helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
        helper.make_node("MatMul", ["r1", "w2"], ["h2"], name="fc2"),
        helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
        helper.make_node("MatMul", ["r2", "w3"], ["y"], name="fc3"),
    ]
    inits = [init("w1", rng_w(16, 32)), init("w2", rng_w(32, 32, seed=1)), init("w3", rng_w(32, 8, seed=2))]
    return make(nodes, [fvi("x", ["N", 16])], [fvi("y", ["N", 8])], inits)


def growing_data(path: Path, n: int = 128) -> Path:
    """128 samples: the first 32 small, the rest 200x larger (data sorted by file name or time looks like this)."""
    x = np.random.default_rng(0).standard_normal((n, 16)).astype(np.float32)
    x[:32] *= 0.01
    x[32:] *= 2.0
    np.savez(path, x=x)
    return path


@pytest.fixture
def grown(tmp_path):
    return save(growing_mlp(), tmp_path / "m.onnx"), growing_data(tmp_path / "cal.npz")


def _convert(src, data, out, **kw):
    return convert_precision(ConvertConfig(model=src, output=out, calibration=str(data), progress=False, **kw))


def _compare(src, out, data, checks):
    from mpinfer.compare import CompareConfig, compare_models

    return compare_models(
        CompareConfig(baseline=str(src), candidates=(str(out),), data=str(data), checks=checks, numerics="strict",
                      divergence=False, show_progress=False)
    )


def test_the_budget_holds_on_every_calibration_sample_not_only_the_searched_ones(grown, tmp_path):
    src, data = grown
    budget = "max_abs<=1e-3"
    # the search alone, on the first 32 (small) samples, would pass the whole FP16 candidate
    res = _convert(src, data, tmp_path / "o.onnx", budget=budget)
    ver = res.plan.summary["verification"]
    assert ver["samples"] == 128 and ver["searched_samples"] == 32 and ver["numerics"] == "strict"
    assert ver["passed"] and ver["moved_to_fp32"] > 0 and ver["fingerprint"].startswith("sha256:")
    assert all(n["reason"] != "user:plan" for n in res.plan.to_dict()["nodes"])
    # compare on the same data and numerics measures what the plan says, and the budget holds there
    result = _compare(src, res.output, data, budget)
    assert bool(result)
    (cand,) = result.candidates
    # The candidate verified is all FP32 here, so both sides' figures are float32 noise (an SNR of ~140 dB that
    # moves by a dB between CPUs' kernels): they agree as errors within what reordering allows (~1e-4 of |y|),
    # while the pre-repair FP16 candidate's figures (max_abs > 1e-3) or another sample set's would not.
    measured = {o.name: o.values for o in cand.outputs}
    atol, rms, _ = _reorder_bound(src, data)
    for out, figures in ver["figures"].items():
        assert figures["max_abs"] <= 1e-3 and measured[out]["max_abs"] <= 1e-3
        assert_error_figures_agree(figures, measured[out], atol=atol, rms=rms, err_msg=out)


def _reorder_bound(src: Path, data: Path) -> tuple[float, float, float]:
    """How far one output's error may move between two evaluations of the MLP, the outputs' rms and the smallest
    rms of one sample.

    Twice :func:`reorder_atol` (the baseline and the candidate both recomputed) at the largest ``sum |t_i|`` of
    any layer on the data (the layers run on absolute values, in float64).
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    a = np.load(data)["x"].astype(np.float64)
    terms = 0.0
    for i, name in enumerate(("w1", "w2", "w3")):
        terms = max(terms, float((np.abs(a) @ np.abs(w[name])).max()))
        a = a @ w[name] if i == 2 else np.maximum(a @ w[name], 0.0)
    n, stages = onnx_reductions(model)
    atol = 2 * reorder_atol(np.float32, n=n, magnitude=terms, stages=stages)
    return atol, float(np.sqrt(np.mean(a * a))), float(np.sqrt(np.mean(a * a, axis=1)).min())


def _assert_plan_figures_reproduced(want, got, src: Path, data: Path) -> None:
    """The plan's figures of an FP16 candidate are compare's, up to the FP32 reference's reordering (both run
    the candidate alike; the reference is computed twice): far below the FP16 error (~1e-3) they measure."""
    atol, rms, sample_rms = _reorder_bound(src, data)
    assert want["max_abs"] > 10 * atol  # not at the noise floor: a real change would move these figures
    assert_error_figures_agree(want, got, atol=atol, rms=rms, sample_rms=sample_rms,
                               metrics=("max_abs", "cosine", "cosine_min"))


def test_without_verification_the_same_budget_would_not_hold(grown, tmp_path):
    """The case the verification exists for: what the search alone writes breaks the budget on all the data."""
    src, data = grown
    res = _convert(src, data, tmp_path / "o.onnx", budget="max_abs<=1e-3", verify_samples=32)
    assert res.plan.summary["verification"]["samples"] == 32  # --verify-samples: the searched ones only
    assert res.plan.summary["nodes_low"] == 5
    assert not _compare(src, res.output, data, "max_abs<=1e-3")


def test_a_budget_even_fp32_of_what_may_change_misses_is_refused_and_nothing_is_written(grown, tmp_path):
    src, data = grown
    out = tmp_path / "o.onnx"
    with pytest.raises(AccuracyMismatchError, match="even with every node it may change in FP32"):
        _convert(src, data, out, budget="max_abs<=1e-4", low_ops=("MatMul",))
    assert not out.exists() and not (tmp_path / "o.plan.json").exists()


def test_the_default_floor_applies_with_data_and_is_said(grown, tmp_path, invoke):
    src, data = grown
    r = invoke("convert", src, "--calibration", data, "-o", tmp_path / "a.onnx")
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "the default floor" in text and "--budget none" in text and "verified on 128 samples" in text
    plan = json.loads((tmp_path / "a.plan.json").read_text())
    # y[N, 8] passes for class scores but holds no probabilities: the floor reads range_err there, not top1
    assert plan["budget"] == floor_budget(onnx.load(src)) and plan["summary"]["verification"]["default_budget"]
    # --budget none opts out; --calibration none has no data, hence no floor
    cases = {
        "b": ("--calibration", data, "--budget", "none"),
        "c": ("--calibration", "none"),
    }
    for name, extra in cases.items():
        args = ["convert", src, *extra, "-o", tmp_path / f"{name}.onnx"]
        r = invoke(*args)
        assert r.exit_code == 0, r.output
        plan = json.loads((tmp_path / f"{name}.plan.json").read_text())
        assert plan["budget"] is None and "verification" not in plan["summary"]
    # random data (issue 35): the floor too, verified on it and said so
    r = invoke("convert", src, "--calibration", "random:2", "-o", tmp_path / "d.onnx")
    assert r.exit_code == 0, r.output
    ver = json.loads((tmp_path / "d.plan.json").read_text())["summary"]["verification"]
    assert ver["default_budget"] and ver["data"] == "random" and ver["samples"] == 2 * 16
    assert "of mpinfer's own random inputs" in " ".join(r.output.split())


def test_the_default_floor_refuses_a_broken_conversion(tmp_path):
    """Inputs that overflow FP16 in a forced-low MatMul: the floor cannot be met, nothing is written."""
    src = save(growing_mlp(), tmp_path / "m.onnx")
    np.savez(tmp_path / "big.npz", x=(np.random.default_rng(1).standard_normal((16, 16)) * 1e5).astype(np.float32))
    with pytest.raises(AccuracyMismatchError, match="default floor"):
        _convert(src, tmp_path / "big.npz", tmp_path / "o.onnx", low_ops=("MatMul",))
    assert not (tmp_path / "o.onnx").exists()


def test_search_and_verify_samples_are_visible_knobs(grown, tmp_path):
    src, data = grown
    res = _convert(src, data, tmp_path / "o.onnx", budget="cosine>=0.99", search_samples=8, verify_samples=40)
    s = res.plan.summary
    assert s["search"]["samples"] == 8 and s["verification"]["samples"] == 40
    other = _convert(src, data, tmp_path / "p.onnx", budget="cosine>=0.99", search_samples=8, verify_samples=41)
    assert other.plan.summary["verification"]["fingerprint"] != s["verification"]["fingerprint"]
    with pytest.raises(InvalidInputError, match="--search-samples"):
        _convert(src, data, tmp_path / "q.onnx", search_samples=0)


def test_the_fingerprint_does_not_depend_on_the_batch_size(grown, tmp_path):
    src, data = grown
    a = _convert(src, data, tmp_path / "a.onnx", batch_size=16).plan.summary["verification"]
    b = _convert(src, data, tmp_path / "b.onnx", batch_size=20).plan.summary["verification"]
    assert a["fingerprint"] == b["fingerprint"] and a["samples"] == b["samples"] == 128


# -- options resolved once -------------------------------------------------------------------------------------
@pytest.fixture
def planned(grown, tmp_path):
    src, data = grown
    res = _convert(src, data, tmp_path / "p" / "m.fp16.onnx", budget="none")
    return src, res.plan_path


def test_an_explicit_precision_that_conflicts_with_the_plan_is_refused(planned, tmp_path, invoke):
    src, plan = planned
    r = invoke("convert", src, "--plan", plan, "--precision", "bf16", "-o", tmp_path / "x.onnx")
    assert_user_error(r, r"--precision bf16.*plan made for fp16")
    assert not (tmp_path / "x.onnx").exists()
    same = invoke("convert", src, "--plan", plan, "--precision", "fp16", "-o", tmp_path / "y.onnx")
    assert same.exit_code == 0, same.output  # the plan's own precision: nothing to settle


def test_an_explicit_keep_io_types_is_applied_and_recorded(planned, tmp_path, invoke):
    import onnx

    src, plan = planned
    r = invoke("convert", src, "--plan", plan, "--no-keep-io-types", "-o", tmp_path / "x.onnx")
    assert r.exit_code == 0, r.output
    written = json.loads((tmp_path / "x.plan.json").read_text())
    assert written["keep_io_types"] is False and written["calibration"]["applied_with"] == {"keep_io_types": False}
    model = onnx.load(str(tmp_path / "x.onnx"))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    # the plan as it is (no option): its own keep_io_types
    r = invoke("convert", src, "--plan", plan, "-o", tmp_path / "y.onnx")
    assert onnx.load(str(tmp_path / "y.onnx")).graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT


def test_an_explicit_opset_is_applied_and_recorded(planned, tmp_path, invoke):
    src, plan = planned
    r = invoke("convert", src, "--plan", plan, "--opset", "21", "-o", tmp_path / "x.onnx")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "x.plan.json").read_text())["opset"] == 21


def test_a_plan_re_applied_in_place_refuses_options_that_change_it(planned, invoke):
    src, plan = planned
    out = plan.with_name("m.fp16.onnx")
    before = plan.read_bytes()
    r = invoke("convert", src, "--plan", plan, "--no-keep-io-types", "-o", out, "--force")
    assert_user_error(r, "re-applied in place")
    assert plan.read_bytes() == before


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--calibration", "random"), ("--numerics", "ort"), ("--search-samples", "8"), ("--verify-samples", "8"),
     ("--budget", "cosine>=0.9"), ("--seed", "1"), ("--batch-size", "4"), ("--max-batches", "2"),
     ("--dim", "N=4"), ("--class-outputs", "y")],
)
def test_planning_options_with_a_plan_are_refused_not_dropped(planned, tmp_path, invoke, flag, value):
    src, plan = planned
    r = invoke("convert", src, "--plan", plan, flag, value, "-o", tmp_path / "x.onnx")
    assert_user_error(r, flag)


def test_api_defaults_mean_not_given():
    from mpinfer.precision.options import DEFAULT_SEARCH_SAMPLES, resolve_options

    cfg = ConvertConfig(model=Path("m.onnx"), output=Path("o.onnx"))
    assert cfg.precision is None and cfg.keep_io_types is None and cfg.numerics is None
    opts = resolve_options(cfg)
    assert opts.precision is Precision.FP16 and opts.keep_io_types and opts.numerics == "strict"
    assert opts.search_samples == DEFAULT_SEARCH_SAMPLES and opts.verify_samples is None
    assert opts.default_budget  # the default floor, on convert's own random data (issue 35)
    assert resolve_options(ConvertConfig(model=Path("m"), output=Path("o"), calibration="d.npz")).default_budget
    none = resolve_options(ConvertConfig(model=Path("m"), output=Path("o"), calibration="none"))
    assert none.budget is None and not none.default_budget


def test_the_report_sets_the_plans_figures_beside_compares_and_flags_a_mismatch(grown, tmp_path):
    from mpinfer.report.html import render_html
    from mpinfer.report.markdown import render_markdown
    from mpinfer.report.plan_check import plan_check

    src, data = grown
    res = _convert(src, data, tmp_path / "o.onnx", budget="max_abs<=1e-2,cosine_min>=0.999")
    result = _compare(src, res.output, data, "max_abs<=1e-2")
    (cand,) = result.candidates
    assert result.data["fingerprint"] == res.plan.summary["verification"]["fingerprint"]
    notes, rows = plan_check(result, cand)
    assert {r[1] for r in rows} == {"max_abs", "cosine", "cosine_min"} and all(r[-1] == "match" for r in rows)
    assert "### Plan said / measured" in render_markdown(result)
    assert "<h3>Plan said / measured</h3>" in render_html(result)
    # a plan whose figures are not what this model gives on this data: flagged
    plan = json.loads(res.plan_path.read_text())
    plan["summary"]["verification"]["figures"]["y"]["max_abs"] *= 3
    res.plan_path.write_text(json.dumps(plan))
    result = _compare(src, res.output, data, "max_abs<=1e-2")
    notes, rows = plan_check(result, result.candidates[0])
    assert [r[-1] for r in rows if r[1] == "max_abs"] == ["MISMATCH"] and any("MISMATCH" in n for n in notes)
    # other data: not compared, said so
    np.savez(tmp_path / "other.npz", x=np.ones((8, 16), np.float32))
    result = _compare(src, res.output, tmp_path / "other.npz", "max_abs<=1e-2")
    notes, rows = plan_check(result, result.candidates[0])
    assert {r[-1] for r in rows} == {"other data"} and any("not comparable" in n for n in notes)


def test_the_reports_plan_figures_at_the_noise_floor_match_whatever_the_cpu(grown, tmp_path):
    """An all-FP32 plan's figures are float32 noise on both sides (its SNR of ~140 dB was 139.73 in the plan and
    139.14 in compare on an AMD EPYC): "match", while the same SNR gap on a real FP16 error is a MISMATCH."""
    from mpinfer.report.plan_check import plan_check

    src, data = grown
    res = _convert(src, data, tmp_path / "o.onnx", budget="max_abs<=1e-3,snr_db>=40")
    result = _compare(src, res.output, data, "max_abs<=1e-3")
    (cand,) = result.candidates
    assert cand.outputs[0].values["snr_db"] > 120  # the noise floor: nothing left in FP16
    plan = json.loads(res.plan_path.read_text())
    figures = plan["summary"]["verification"]["figures"]["y"]
    figures["snr_db"] = cand.outputs[0].values["snr_db"] + 0.59  # the gap the AMD EPYC showed
    res.plan_path.write_text(json.dumps(plan))
    _, rows = plan_check(result, _compare(src, res.output, data, "max_abs<=1e-3").candidates[0])
    assert {r[1] for r in rows} == {"max_abs", "cosine", "snr_db"} and all(r[-1] == "match" for r in rows), rows
    # a real error (an FP16 plan, ~70 dB): 0.59 dB is 7 % of it, flagged
    res = _convert(src, data, tmp_path / "f.onnx", budget="max_abs<=1e-2,snr_db>=40")
    result = _compare(src, res.output, data, "max_abs<=1e-2")
    measured = result.candidates[0].outputs[0].values["snr_db"]
    assert measured < 100
    _, rows = plan_check(result, result.candidates[0])
    assert all(r[-1] == "match" for r in rows), rows
    plan = json.loads(res.plan_path.read_text())
    plan["summary"]["verification"]["figures"]["y"]["snr_db"] = measured + 0.59
    res.plan_path.write_text(json.dumps(plan))
    _, rows = plan_check(result, _compare(src, res.output, data, "max_abs<=1e-2").candidates[0])
    assert [r[-1] for r in rows if r[1] == "snr_db"] == ["MISMATCH"]


def test_calibration_keeps_every_batchs_outputs_for_the_verification(grown):
    """capture_outputs: the FP32 outputs of every batch (the verification's reference), tensors of the first only."""
    import onnx

    from mpinfer.data import load_feeds
    from mpinfer.precision.calib.calibrate import calibrate
    from mpinfer.specs import specs_from_onnx
    from tests.precision.graphs import run_ort

    src, data = grown
    model = onnx.load(str(src))
    feeds = load_feeds(str(data), specs_from_onnx(model), batch_size=16)
    stats = calibrate(model, feeds, progress=False, capture_batches=2, capture_tensors=True, capture_outputs=100)
    assert len(stats.reference_outputs) == 8 and len(stats.reference_tensors) == 2
    for batch, kept in zip(feeds, stats.reference_outputs, strict=True):
        (want,) = run_ort(model, batch)
        # ONNX Runtime on the same batch, but calibrate runs its own (augmented) graph: kernels may add in
        # another order, so the outputs agree to float32 reordering of the model's reductions
        assert_onnx_outputs_close(kept["y"], want, model)


def test_pipeline_convert_table_takes_the_knobs_and_budget_none(grown, tmp_path):
    from mpinfer.pipeline import run_pipeline

    src, data = grown
    toml = tmp_path / "p.toml"
    toml.write_text(
        f'[pipeline]\nwork_dir = "w"\n[convert]\nmodel = "{src.name}"\ncalibration = "{data.name}"\n'
        'budget = "max_abs<=1e-2"\nsearch_samples = 8\nverify_samples = 48\n'
    )
    result = run_pipeline(toml)
    plan = json.loads(result.artefacts["plan"].read_text())
    assert plan["summary"]["search"]["samples"] == 8 and plan["summary"]["verification"]["samples"] == 48
    (stage,) = [s for s in result.stages if s.name == "convert"]
    assert stage.summary["verified_samples"] == 48 and stage.summary["searched_samples"] == 8
    toml.write_text(f'[pipeline]\nwork_dir = "w2"\n[convert]\nmodel = "{src.name}"\ncalibration = "{data.name}"\n'
                    'budget = "none"\n')
    plan = json.loads(run_pipeline(toml).artefacts["plan"].read_text())
    assert plan["budget"] is None and "verification" not in plan["summary"]


@pytest.fixture
def strict_rows(monkeypatch):
    """The sample counts of every batch the verification's strict runner runs (cast graph or emulator), in order."""
    from mpinfer.precision.emulator.castgraph import StrictModelRunner

    ran: list[int] = []
    real = StrictModelRunner.__call__

    def counting(self, feeds):
        ran.append(len(feeds["x"]))
        return real(self, feeds)

    monkeypatch.setattr(StrictModelRunner, "__call__", counting)
    return ran


def test_the_search_samples_are_not_run_again_when_the_plan_is_the_searched_candidate(grown, tmp_path, strict_rows):
    """The search measured the final candidate on its 32 samples: the verification runs the other 96 only, and its
    figures are those of all 128 (compare on the same data reproduces them)."""
    ran = strict_rows
    src, data = grown
    res = _convert(src, data, tmp_path / "o.onnx", budget="max_abs<=1e-2")
    assert res.plan.summary["verification"]["samples"] == 128 and res.plan.summary["nodes_low"] == 5
    assert sum(ran) == 96
    ran.clear()
    result = _compare(src, res.output, data, "max_abs<=1e-2")
    want, got = res.plan.summary["verification"]["figures"]["y"], result.candidates[0].outputs[0].values
    _assert_plan_figures_reproduced(want, got, src, data)


def test_a_batch_the_search_read_in_part_runs_only_its_other_rows(grown, tmp_path, strict_rows):
    """Search slice 40 of batches of 16: the search measured the candidate on 16 + 16 + the first 8 of the third
    batch; the verification runs the third batch's other 8 and the rest (88 samples), and still reads all 128."""
    ran = strict_rows
    src, data = grown
    res = _convert(src, data, tmp_path / "o.onnx", budget="max_abs<=1e-2", batch_size=16, search_samples=40)
    ver = res.plan.summary["verification"]
    assert ver["samples"] == 128 and res.plan.summary["search"]["samples"] == 40
    assert sum(ran) == 88
    result = _compare(src, res.output, data, "max_abs<=1e-2")
    want, got = ver["figures"]["y"], result.candidates[0].outputs[0].values
    _assert_plan_figures_reproduced(want, got, src, data)


def test_the_default_floor_skips_a_model_without_float_outputs(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
        helper.make_node("ArgMax", ["h"], ["y"], name="argmax", axis=1, keepdims=0),
    ]
    model = make(nodes, [fvi("x", ["N", 16])], [fvi("y", ["N"], 7)], [init("w", rng_w(16, 8))])
    src = save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32))
    res = _convert(src, tmp_path / "d.npz", tmp_path / "o.onnx")
    assert res.plan.budget is None and "verification" not in res.plan.summary


def test_ort_numerics_verify_with_onnx_runtime_and_compare_reproduces_them(grown, tmp_path):
    from mpinfer.compare import CompareConfig, compare_models

    src, data = grown
    res = _convert(src, data, tmp_path / "o.onnx", budget="max_abs<=1e-2", numerics="ort")
    ver = res.plan.summary["verification"]
    assert ver["numerics"] == "ort" and ver["samples"] == 128 and ver["passed"]
    result = compare_models(CompareConfig(baseline=str(src), candidates=(str(res.output),), data=str(data),
                                          checks="max_abs<=1e-2", numerics="ort", divergence=False,
                                          show_progress=False))
    _assert_plan_figures_reproduced(ver["figures"]["y"], result.candidates[0].outputs[0].values, src, data)


def test_bf16_with_ort_numerics_gets_no_floor_it_could_not_verify(grown, caplog, tmp_path):
    from mpinfer.precision.options import resolve_options

    src, data = grown
    opts = resolve_options(ConvertConfig(model=src, output=Path("o.onnx"), calibration=str(data),
                                         precision=Precision.BF16, numerics="ort"))
    assert opts.budget is None and "No default floor" in caplog.text
    with pytest.raises(InvalidInputError, match="--numerics strict"):
        convert_precision(ConvertConfig(model=src, output=tmp_path / "o.onnx", calibration=str(data),
                                        precision=Precision.BF16, numerics="ort", budget="cosine>=0.99"))
    assert not (tmp_path / "o.onnx").exists()


def test_the_cli_knobs_and_the_console_line(grown, tmp_path, invoke):
    src, data = grown
    r = invoke("convert", src, "--calibration", data, "--budget", "max_abs<=1e-2", "--search-samples", "8",
               "--verify-samples", "40", "-o", tmp_path / "o.onnx")
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "searched on 8 samples, verified on 40 samples (strict numerics): max_abs=" in text
    assert "budget max_abs<=1e-2 met" in text
    r = invoke("convert", src, "--calibration", data, "--verify-samples", "0", "-o", tmp_path / "p.onnx")
    assert r.exit_code == 2 and "--verify-samples" in r.output  # a usage error, from click


def test_the_default_floor_on_a_model_strict_emulation_cannot_run_is_verified_with_onnx_runtime(tmp_path, caplog):
    """A com.microsoft contrib op (an ORT-optimized model): no strict kernel, so the floor uses ORT numerics."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
        helper.make_node("Gelu", ["h"], ["y"], name="gelu", domain="com.microsoft"),
    ]
    graph = helper.make_graph(nodes, "g", [fvi("x", ["N", 16])], [fvi("y", ["N", 8])], [init("w", rng_w(16, 8))])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    src = save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32))
    res = _convert(src, tmp_path / "d.npz", tmp_path / "o.onnx")
    ver = res.plan.summary["verification"]
    assert ver["numerics"] == "ort" and ver["default_budget"] and ver["samples"] == 32
    assert "verified with ONNX Runtime numerics" in caplog.text



def test_the_default_floor_is_not_a_refusal_when_nothing_is_low(tmp_path):
    """An evaluator that differs from FP32 ONNX Runtime with every node FP32 is not precision the conversion lost.

    ONNX's Attention case with past, present and qk_matmul_output: the strict emulator's reference kernel writes
    -inf at causally masked positions of qk_matmul_output where ONNX Runtime writes float32's lowest, so the floor
    sees 'non-finite' values with no node low. convert keeps the plan with a warning; it used to refuse.
    """
    conformance = pytest.importorskip("bench.conformance")
    name = "test_attention_4d_with_past_and_present_qk_matmul_bias_3d_mask_causal"
    cases = [c for c in conformance.runnable_cases() if c.name == name]
    if not cases:
        pytest.skip(f"{name}: not run by this ONNX Runtime")
    result = conformance.convert_case(cases[0], "own", tmp_path)
    assert result is not None and result.status == "ok", result


def test_one_fp32_pass_the_search_and_the_verification_take_calibrations_reference(grown, tmp_path, monkeypatch):
    """Issue 27: with data, the FP32 model runs once (calibration). The search's first candidate is judged against
    calibration's outputs (a batch it read in part: their first rows), with no FP32 emulator run of its samples,
    and the verification opens no FP32 session."""
    import mpinfer.precision.budget.verify as verify
    import mpinfer.precision.plandata as plandata
    from mpinfer.precision.emulator.emulate import GraphEmulator

    passes = {"calibrate": 0, "emulator_fp32": 0, "reference_session": 0}
    real_calibrate, real_run, real_reference = plandata.calibrate, GraphEmulator.run, verify._ReferenceRunner.__call__

    def calibrate(*a, **k):
        passes["calibrate"] += 1
        return real_calibrate(*a, **k)

    def run(self, feeds, low=None, **k):
        # (the verification's StrictRunner runs the written model: its nodes follow their inputs' dtypes)
        passes["emulator_fp32"] += not self.follow_input_dtypes and not any(p.is_low for p in (low or {}).values())
        return real_run(self, feeds, low, **k)

    def reference(self, batch):
        passes["reference_session"] += 1
        return real_reference(self, batch)

    monkeypatch.setattr(plandata, "calibrate", calibrate)
    monkeypatch.setattr(GraphEmulator, "run", run)
    monkeypatch.setattr(verify._ReferenceRunner, "__call__", reference)
    src, data = grown
    res = _convert(src, data, tmp_path / "o.onnx", batch_size=16, search_samples=40)  # the default floor
    summary = res.plan.summary
    assert summary["verification"]["passed"] and summary["verification"]["samples"] == 128
    assert summary["search"]["verifications"] == 1 and summary["nodes_low"] == 5
    assert passes == {"calibrate": 1, "emulator_fp32": 0, "reference_session": 0}


def test_outputs_past_the_capture_slice_are_kept_on_disk_not_run_again(grown, tmp_path, monkeypatch):
    """Issue 27: calibration's FP32 outputs past the memory budget's capture_outputs slice go to an unlinked
    temporary file (the same values, read back per batch), so the verification still opens no FP32 session."""
    import onnx

    import mpinfer.precision.budget.verify as verify
    from mpinfer.data import load_feeds
    from mpinfer.precision.calib.calibrate import calibrate
    from mpinfer.specs import specs_from_onnx
    from tests.budget import set_slice

    src, data = grown
    model = onnx.load(str(src))
    feeds = load_feeds(str(data), specs_from_onnx(model), batch_size=16)
    whole = calibrate(model, feeds, progress=False, capture_batches=1, capture_outputs=100)
    set_slice(monkeypatch, "capture_outputs", 16 * 8 * 4)  # one batch of 16 samples of y[8] in memory
    spilled = calibrate(model, feeds, progress=False, capture_batches=1, capture_outputs=100)
    assert len(spilled.reference_outputs) == len(whole.reference_outputs) == 8
    assert isinstance(spilled.reference_outputs[1], dict) and not isinstance(spilled.reference_outputs[-1], dict)
    for kept, want in zip(spilled.reference_outputs, whole.reference_outputs, strict=True):
        np.testing.assert_array_equal(kept["y"], want["y"])  # what ONNX Runtime computed, bit for bit
    sessions = []
    real = verify._ReferenceRunner.__call__
    monkeypatch.setattr(verify._ReferenceRunner, "__call__", lambda self, b: sessions.append(1) or real(self, b))
    res = _convert(src, data, tmp_path / "o.onnx", batch_size=16)
    assert res.plan.summary["verification"]["passed"] and res.plan.summary["verification"]["samples"] == 128
    assert sessions == []


def _all_low(src: Path, tmp_path: Path) -> onnx.ModelProto:
    out = tmp_path / "low.onnx"
    convert_precision(ConvertConfig(model=src, output=out, calibration="none", progress=False))
    return onnx.load(str(out))


def test_a_repair_pass_stops_once_its_samples_prove_the_budget_fails(grown, tmp_path):
    """With the whole set's reference sums a failing candidate stops early; one that passes reads every sample."""
    from mpinfer.data import load_feeds
    from mpinfer.precision.budget.verify import VerifySettings, reference_sums, verify_model
    from mpinfer.specs import specs_from_onnx

    src, data = grown
    reference, low = onnx.load(str(src)), _all_low(src, tmp_path)
    feeds = load_feeds(data, specs_from_onnx(reference), batch_size=16)
    settings = VerifySettings(budget="max_abs<=1e-3", precision=Precision.FP16, progress=False)
    bound = reference_sums(reference, feeds, settings)
    whole = verify_model(low, reference, feeds, settings)
    early = verify_model(low, reference, feeds, settings, bound=bound)
    assert not whole.passed and whole.complete and whole.samples == 128
    # the first 32 samples are small (errors far below 1e-3); the first large batch proves the failure
    assert not early.passed and not early.complete and 32 < early.samples < 128
    probed = verify_model(low, reference, feeds, settings, bound=bound, probe=whole.worst_batch)
    assert not probed.passed and not probed.complete and probed.batches == 1 and probed.worst_batch is not None
    assert [f.split(" (")[0] for f in early.failures] == [f.split(" (")[0] for f in whole.failures]
    fp32 = verify_model(reference, reference, feeds, settings, bound=bound)
    assert fp32.passed and fp32.complete and fp32.samples == 128


def test_a_pass_stops_before_the_batch_its_abort_answers_true_for(grown, tmp_path):
    """``abort`` is asked before each batch: True stops the pass there with VerificationAborted (convert's gate refused
    the model meanwhile); answering False to the end gives the very verification of a pass without it."""
    from mpinfer.data import load_feeds
    from mpinfer.precision.budget.verify import VerificationAborted, VerifySettings, verify_model
    from mpinfer.specs import specs_from_onnx

    src, data = grown
    reference, low = onnx.load(str(src)), _all_low(src, tmp_path)
    feeds = load_feeds(data, specs_from_onnx(reference), batch_size=16)
    settings = VerifySettings(budget="max_abs<=10", precision=Precision.FP16, progress=False)
    asked: list[int] = []
    with pytest.raises(VerificationAborted):
        verify_model(low, reference, feeds, settings, abort=lambda: asked.append(1) or len(asked) == 3)
    assert len(asked) == 3  # two batches ran; the third was never run
    plain = verify_model(low, reference, feeds, settings)
    asked.clear()
    kept = verify_model(low, reference, feeds, settings, abort=lambda: asked.append(1) and False)
    assert len(asked) == plain.batches == 8 and kept.figures == plain.figures and kept.passed == plain.passed


def test_a_probe_that_proves_nothing_is_taken_by_the_pass_not_run_again(grown, tmp_path, monkeypatch):
    """A repair round's probe batch that does not prove a failure is not run a second time when the pass reaches it:
    the pass runs each batch once, with the figures and fingerprint of a pass without the probe."""
    import mpinfer.precision.budget.verify as verify
    from mpinfer.data import load_feeds
    from mpinfer.precision.budget.verify import VerifySettings, reference_sums, verify_model
    from mpinfer.specs import specs_from_onnx

    src, data = grown
    reference, low = onnx.load(str(src)), _all_low(src, tmp_path)
    feeds = load_feeds(data, specs_from_onnx(reference), batch_size=16)
    tight = VerifySettings(budget="max_abs<=1e-3", precision=Precision.FP16, progress=False)
    worst = verify_model(low, reference, feeds, tight).worst_batch
    loose = VerifySettings(budget="max_abs<=10", precision=Precision.FP16, progress=False)
    bound = reference_sums(reference, feeds, loose)
    calls: list[int] = []
    real = verify._fed_as_declared
    monkeypatch.setattr(verify, "_fed_as_declared", lambda c, r: lambda b: calls.append(1) or real(c, r)(b))
    plain = verify_model(low, reference, feeds, loose, bound=bound)
    alone = len(calls)
    calls.clear()
    probed = verify_model(low, reference, feeds, loose, bound=bound, probe=worst)
    assert plain.passed and probed.passed and probed.complete and probed.samples == plain.samples == 128
    assert len(calls) == alone == plain.batches  # (the probe's run is the pass's run of that batch)
    assert probed.figures == plain.figures and probed.fingerprint == plain.fingerprint


def test_repair_rounds_rank_groups_once_per_worst_batch_and_decide_as_before(grown, tmp_path, monkeypatch):
    """A group's local error does not depend on the other groups: rounds on the same worst batch reuse it."""
    import mpinfer.precision.budget.repair as repair

    src, data = grown
    measured: list[int] = []
    real = repair.group_errors

    def counted(info, groups, batches, low):
        measured.append(len(groups))
        return real(info, groups, batches, low)

    monkeypatch.setattr(repair, "group_errors", counted)
    budget = "max_abs<=2e-4"
    cached = _convert(src, data, tmp_path / "a.onnx", budget=budget)
    cached_count = sum(measured)
    measured.clear()
    # the same conversion ranking every round from scratch (what repair did before the cache)
    monkeypatch.setattr(repair._RankCache, "errors",
                        lambda self, info, groups, batch, low: counted(info, groups, [batch], low))
    fresh = _convert(src, data, tmp_path / "b.onnx", budget=budget)
    ver = cached.plan.summary["verification"]
    assert ver["repair_rounds"] >= 2 and ver["passed"]
    assert [(n["name"], n["precision"]) for n in cached.plan.to_dict()["nodes"]] == \
        [(n["name"], n["precision"]) for n in fresh.plan.to_dict()["nodes"]]
    assert cached_count < sum(measured)


def test_a_batchs_error_is_read_from_the_figures_it_was_added_to_and_summed_where_they_kept_none():
    """The verification's worst-batch error takes the accumulator's sums of the batch (finite values), and sums the
    outputs it has none for (NaN/Inf, other dtypes) itself: the same relative L2 error either way."""
    from mpinfer.metrics import ModelAccumulator
    from mpinfer.precision.budget.verify import _batch_error

    rng = np.random.default_rng(0)
    ref = {"a": rng.standard_normal((4, 300)).astype(np.float32), "b": rng.standard_normal((4, 7)).astype(np.float32)}
    cand = {"a": ref["a"].astype(np.float16), "b": ref["b"] * np.float32(1.01)}
    figures = ModelAccumulator(["a", "b"])
    figures.update(ref, cand)
    assert all(acc.batch_sums is not None for acc in figures.outputs.values())
    summed = _batch_error(ref, cand, ["a", "b"])
    assert summed == pytest.approx(0.01, rel=1e-4)  # (b's: every value 1 % off)
    assert _batch_error(ref, cand, ["a", "b"], figures) == pytest.approx(summed, rel=1e-12)
    cand["b"] = cand["b"].copy()
    cand["b"][1, 2] = np.nan  # the accumulator's general path: no sums kept, the batch is summed here
    figures.update(ref, cand)
    assert figures.outputs["b"].batch_sums is None and figures.outputs["a"].batch_sums is not None
    assert _batch_error(ref, cand, ["a", "b"], figures) == _batch_error(ref, cand, ["a", "b"]) == np.inf


def test_each_candidate_run_starts_on_a_thread_a_run_ahead_and_the_figures_are_those_of_runs_in_line(
    grown, tmp_path, monkeypatch
):
    """While a pass reads one run's figures, the candidate's next run is already computing on the verify thread (on
    the cast graph, not the emulator); the runner is never called twice at a time, and the figures and fingerprint are
    those of every run in line."""
    import threading
    import time

    import mpinfer.precision.budget.verify as verify
    from mpinfer.data import load_feeds
    from mpinfer.precision.budget.verify import VerifySettings, verify_model
    from mpinfer.specs import specs_from_onnx

    src, data = grown
    reference, low = onnx.load(str(src)), _all_low(src, tmp_path)
    feeds = load_feeds(data, specs_from_onnx(reference), batch_size=16)
    settings = VerifySettings(budget="max_abs<=10", precision=Precision.FP16, progress=False, run_rows=16)
    threads: list[str] = []
    busy, most = [0], [0]
    lock = threading.Lock()
    real = verify._fed_as_declared

    def watched(candidate, runner):
        run = real(candidate, runner)

        def call(batch):
            with lock:
                busy[0] += 1
                most[0] = max(most[0], busy[0])
            threads.append(threading.current_thread().name)
            time.sleep(0.01)  # (long enough for a second call to overlap, were one made)
            try:
                return run(batch)
            finally:
                with lock:
                    busy[0] -= 1

        return call

    monkeypatch.setattr(verify, "_fed_as_declared", watched)
    ahead = verify_model(low, reference, feeds, settings)
    assert most[0] == 1 and len(threads) == ahead.batches == 8
    assert threads[0] == threading.current_thread().name  # (the first run has none before it to overlap)
    assert all(name.startswith("mpinfer-verify") for name in threads[1:])
    threads.clear()
    emulated = verify_model(low, reference, feeds, settings, fast=False)  # (the strict emulator: never ahead)
    assert emulated.engine == "emulator" and set(threads) == {threading.current_thread().name}
    real_ahead = verify._Ahead
    monkeypatch.setattr(verify, "_Ahead", lambda runs, run, enabled: real_ahead(runs, run, False))
    threads.clear()
    in_line = verify_model(low, reference, feeds, settings)
    assert set(threads) == {threading.current_thread().name}
    assert (ahead.figures, ahead.fingerprint, ahead.passed) == (in_line.figures, in_line.fingerprint, in_line.passed)
