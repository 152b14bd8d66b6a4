"""Issue 37: search candidates judged on the cast graph (ONNX Runtime) where they qualify, else the emulator."""

from __future__ import annotations

from dataclasses import replace

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
    # (each changes most of the graph: one that changes only its end goes to the emulator's incremental run)
    plans = [{a: Precision.FP16 for a in mm}, {a: Precision.FP16 for a in mm[:3]}, {mm[1]: Precision.FP16}]
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


def test_the_search_reads_every_search_sample_when_only_some_fp32_tensors_fit(tmp_path, monkeypatch):
    """Strict numerics with a budget: a search slice that holds one batch's FP32 tensors no longer cuts the search
    to that batch (candidates on the cast graph need only the outputs); the tensors are kept for that batch only."""
    from pathlib import Path

    import mpinfer.precision.plandata as conv
    from mpinfer.data import load_feeds
    from mpinfer.precision import ConvertConfig
    from mpinfer.precision.calib.calibrate import calibrate
    from mpinfer.precision.options import resolve_options
    from mpinfer.specs import specs_from_onnx
    from tests.precision.test_search import _npz

    model = chain(4)
    feeds = load_feeds(_npz(tmp_path / "cal.npz"), specs_from_onnx(model), batch_size=16)
    stats = calibrate(model, feeds, progress=False, capture_batches=2, capture_tensors=True)
    set_slice(monkeypatch, "search", 20 * stats.sample_bytes)  # one batch of 16 fits, two do not
    cfg = ConvertConfig(model=Path("m.onnx"), output=Path("o.onnx"), search_samples=32, budget="max_abs<=1e-3")
    got, refs, tensors = conv.search_data(resolve_options(cfg), model, feeds, stats)
    assert [len(b["x"]) for b in got] == [16, 16] and got.tensor_batches == 1
    assert len(refs) == 2 and len(tensors) == 1
    ort = resolve_options(replace(cfg, numerics="ort"))  # (keeps no tensors: cut to what fits, as before)
    got, _, _ = conv.search_data(ort, model, feeds, stats)
    assert [len(b["x"]) for b in got] == [16, 4] and got.tensor_batches is None
    set_slice(monkeypatch, "search", 5 * stats.sample_bytes)  # not one whole batch: the first split where it ends
    got, refs, tensors = conv.search_data(resolve_options(cfg), model, feeds, stats)
    assert [len(b["x"]) for b in got] == [5, 11, 16] and got.tensor_batches == 1 and tensors is None
    whole = list(feeds)
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in got]), np.concatenate([b["x"] for b in whole]))
    assert [len(r["y"]) for r in refs] == [5, 11, 16]
    joined = got.per_calibration_batch(refs)  # (the search's outputs, one dict per calibration batch)
    for mine, theirs in zip(joined, stats.reference_outputs, strict=True):
        np.testing.assert_array_equal(mine["y"], theirs["y"])
    got, _, _ = conv.search_data(ort, model, feeds, stats)  # (ort numerics: the samples that fit, as before)
    assert [len(b["x"]) for b in got] == [5] and got.tensor_batches is None
    # (a rule plan no cast graph can take: the emulator would run the samples past the split whole for each candidate)
    got, _, _ = conv.search_data(resolve_options(cfg), model, feeds, stats, cast_graph=False)
    assert [len(b["x"]) for b in got] == [5] and got.tensor_batches is None


def test_batches_past_the_kept_ones_run_whole_on_the_emulator_bit_for_bit():
    """With FP32 runs kept for the first batch only, the emulator's candidates and the FP32 reference still cover
    every batch, bit for bit the whole runs."""
    model = chain(6, WIDTH)
    info, batches = GraphInfo(model), _batches(3)
    mm = _matmuls(info)
    ev = StrictEvaluator(model, info, batches, Precision.FP16, cast_graphs=False, kept_batches=1)
    emu = GraphEmulator(model)
    ref = ev.reference()
    assert len(ref) == 3 and len(ev._emu.refs) == 1
    for low in ({a: Precision.FP16 for a in mm}, {a: Precision.FP16 for a in mm[:3]}):
        cand = ev.candidate(low)
        got = cand.outputs()
        cand.judged(True)
        assert len(got) == 3
        for batch, out, r in zip(batches, got, ref, strict=True):
            assert np.array_equal(out["y"], emu.run(batch, low).outputs["y"])
            assert np.array_equal(r["y"], emu.run(batch, None).outputs["y"])


def test_the_engine_follows_the_nodes_recomputed_not_the_seconds():
    """A candidate the emulator would recompute under half of runs on it, one that changes most of the graph goes to
    the cast graph; the choice is the same however slow either engine was (a plan must not follow the load)."""
    model = chain(6, WIDTH)
    info, batches = GraphInfo(model), _batches()
    mm = _matmuls(info)
    choices = []
    for _ in range(2):
        ev = StrictEvaluator(model, info, batches, Precision.FP16)
        ev.candidate({a: Precision.FP16 for a in mm}).outputs()
        ev._open()  # (the FP32 emulator runs, as the groups' sensitivities make them)
        got = ev.candidate({mm[5]: Precision.FP16}).outputs()  # (recomputes the last 3 of 13 nodes)
        emu = GraphEmulator(model)
        for batch, out in zip(batches, got, strict=True):
            assert np.array_equal(out["y"], emu.run(batch, {mm[5]: Precision.FP16}).outputs["y"])
        ev.candidate({a: Precision.FP16 for a in mm[1:]}).outputs()  # (recomputes most of the graph)
        choices.append((ev.reuse["cast_graph_candidates"], ev.reuse["emulator_candidates"]))
    assert choices == [(2, 1), (2, 1)], choices


def test_candidates_on_the_cast_graph_make_no_fp32_emulator_runs_and_pick_the_engine_as_with_them():
    """While the cast graph judges, the emulator's FP32 runs are not made (sensitivities on a subset make their own);
    the engine of each later candidate is chosen on the node counts the kept runs would give, so a candidate that
    changes only the end of the graph still goes to the emulator, whose run then makes them."""
    model = chain(6, WIDTH)
    info, batches = GraphInfo(model), _batches()
    mm = _matmuls(info)
    ev = StrictEvaluator(model, info, batches, Precision.FP16)
    ev.candidate({a: Precision.FP16 for a in mm}).outputs()
    ev.candidate({a: Precision.FP16 for a in mm[1:]}).outputs()
    errors = ev.sensitivities([], batches[:1], True)
    assert errors == {} and not ev._emu.opened and ev._emu.refs == []
    # (whether to screen: the float values per node of one sample's FP32 run, not of the FP32 runs of every batch)
    assert ev.screen_rows(lambda: np.arange(2)) is None  # (~500 values per node: no screening)
    assert not ev._emu.opened
    opened = StrictEvaluator(model, info, batches, Precision.FP16)
    opened._open()
    assert ev._values_per_node * len(info.nodes) == opened._float_values()  # (the count the FP32 runs give)
    got = ev.candidate({mm[5]: Precision.FP16}).outputs()
    emu = GraphEmulator(model)
    for batch, out in zip(batches, got, strict=True):
        assert np.array_equal(out["y"], emu.run(batch, {mm[5]: Precision.FP16}).outputs["y"])
    assert (ev.reuse["cast_graph_candidates"], ev.reuse["emulator_candidates"]) == (2, 1), ev.reuse
    assert ev._emu.opened and len(ev._emu.refs) == len(batches)


def _constant_chain():
    """x -> MatMul -> Add(a Constant node's value) -> Tanh -> y: the Constant is low with the Add it feeds."""
    from onnx import helper

    from tests.precision.graphs import fvi, init, make, rng_w

    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
        helper.make_node("Constant", [], ["c"], name="const",
                         value=helper.make_tensor("cv", 1, [WIDTH], rng_w(WIDTH, seed=3).tolist())),
        helper.make_node("Add", ["m", "c"], ["a"], name="add"),
        helper.make_node("Tanh", ["a"], ["y"], name="tanh"),
    ]
    return make(nodes, [fvi("x", ["N", WIDTH])], [fvi("y", ["N", WIDTH])], [init("w", rng_w(WIDTH, WIDTH, seed=1))])


def test_a_plan_with_low_constants_is_judged_on_its_cast_graph_bit_for_bit():
    """A low Constant (lowered with its consumer: ``rule:follow``) is a float32 value in the cast graph: the candidate
    goes to the cast graph (PP-OCRv4's recognizer, 327 low Constants, went to the emulator) with the final bits."""
    model = _constant_chain()
    info, batches = GraphInfo(model), _batches()
    low = {a: Precision.FP16 for a in info.by_address}
    ev = StrictEvaluator(model, info, batches, Precision.FP16)
    got = ev.candidate(low).outputs()
    assert (ev.reuse["cast_graph_candidates"], ev.reuse["emulator_candidates"]) == (1, 0), ev.reuse
    written = apply_plan(model, info, low, Precision.FP16).model
    assert any(n.op_type == "Constant" and n.attribute[0].t.data_type == 10 for n in written.graph.node)
    final, emu = StrictEvaluator.model_runner(written), GraphEmulator(model)
    for batch, out in zip(batches, got, strict=True):
        want = final(batch)
        assert final.engine == ENGINE_CASTS and out["y"].tobytes() == want["y"].tobytes()
        assert np.array_equal(out["y"], emu.run(batch, low).outputs["y"])  # (and the emulator's bits)


def test_a_search_past_a_split_first_batch_hands_the_verification_its_outputs_per_batch(tmp_path, monkeypatch):
    """Strict search with a slice under one batch's FP32 tensors: it reads all 32 samples (the first batch split where
    the slice ends), and the final verification takes its outputs batch by batch, as a verification of its own
    would compute them, without running the candidate or the FP32 model again."""
    import onnx

    import mpinfer.precision.budget.verify as verify
    import mpinfer.precision.plandata as plandata
    from mpinfer.data import load_feeds
    from mpinfer.precision import ConvertConfig, convert_precision
    from mpinfer.precision.budget.verify import VerifySettings, verify_model
    from mpinfer.specs import specs_from_onnx
    from tests.precision.graphs import save
    from tests.precision.test_search import _npz

    src, data = save(chain(4), tmp_path / "m.onnx"), _npz(tmp_path / "cal.npz")
    feeds = load_feeds(data, specs_from_onnx(onnx.load(str(src))), batch_size=16)
    # (the search slice alone holds 5 samples: a whole budget that small would keep the weights external, and a
    # model with external weights has no cast graph)
    monkeypatch.setattr(plandata, "search_rows", lambda per_sample: 5 if per_sample else None)
    runs = []
    real_fed, real_ref = verify._fed_as_declared, verify._ReferenceRunner.__call__

    def counted(candidate, runner):
        run = real_fed(candidate, runner)
        return lambda batch: runs.append(len(batch["x"])) or run(batch)

    monkeypatch.setattr(verify, "_fed_as_declared", counted)
    monkeypatch.setattr(verify._ReferenceRunner, "__call__", lambda self, b: runs.append(-1) or real_ref(self, b))
    budget = "max_abs<=1"  # (the rule plan meets it: the search's one candidate is the plan written)
    res = convert_precision(ConvertConfig(model=src, output=tmp_path / "o.onnx", calibration=str(data),
                                          batch_size=16, budget=budget, progress=False))
    summary = res.plan.summary
    assert summary["search"]["samples"] == 32 and summary["verification"]["samples"] == 32
    assert summary["search"]["cast_graph_candidates"] == 1
    assert runs == []  # (every sample's candidate and FP32 outputs taken from the search and calibration)
    settings = VerifySettings(budget=budget, precision=Precision.FP16, progress=False)
    own = verify_model(onnx.load(str(res.output)), onnx.load(str(src)), feeds, settings)
    assert own.samples == 32 and _same_figures(own.figures, summary["verification"]["figures"])


def _same_figures(got, want) -> bool:
    return all(got[o][k] == want[o][k] or (got[o][k] != got[o][k] and want[o][k] != want[o][k])
               for o in want for k in want[o])


def test_a_low_batchnorm_fed_fp32_constants_is_judged_with_the_parameters_the_written_model_holds():
    """A low BatchNormalization whose parameters come from FP32 Constant nodes: the written model casts them to FP16
    (one type variable at opset 13), so the emulator's candidate rounds them too, and agrees bit for bit with the
    written model's cast graph. Read unrounded, a layout detector's search passed a plan whose written model missed
    the floor (range_err 0.017 at a box output)."""
    from onnx import helper

    from tests.precision.graphs import fvi, make

    rng = np.random.default_rng(5)
    params = {  # (none of them FP16 values: the mean far from 0 makes the rounding show after the fold)
        "scale": rng.uniform(2.0, 5.0, 4), "bias": rng.uniform(-1.0, 1.0, 4),
        "mean": rng.uniform(900.0, 1100.0, 4), "var": rng.uniform(0.05, 0.2, 4),
    }
    nodes = [helper.make_node("Constant", [], [k], name=f"c_{k}",
                              value=helper.make_tensor(f"{k}_v", 1, [4], v.tolist())) for k, v in params.items()]
    nodes.append(helper.make_node("BatchNormalization", ["x", *params], ["y"], name="bn", epsilon=1e-5))
    model = make(nodes, [fvi("x", ["N", 4, 3, 3])], [fvi("y", ["N", 4, 3, 3])], [], opset=13)
    info = GraphInfo(model)
    low = {"bn": Precision.FP16}  # (the Constants FP32: the written model casts their values for the node)
    batch = {"x": (params["mean"].reshape(1, 4, 1, 1) + rng.standard_normal((2, 4, 3, 3))).astype(np.float32)}
    written = apply_plan(model, info, {a: low.get(a, Precision.FP32) for a in info.by_address}, Precision.FP16).model
    final = StrictEvaluator.model_runner(written)
    want = final(batch)["y"]
    got = GraphEmulator(model).run(batch, low).outputs["y"]
    assert final.engine == ENGINE_CASTS and got.tobytes() == want.astype(got.dtype).tobytes()
    # the fold of the unrounded parameters (what the candidate read before) lands elsewhere: the test can tell them
    from mpinfer.precision.emulator.kernels.norm import fold_batch_norm

    h = lambda v: v.astype(np.float16).astype(np.float32)  # noqa: E731
    a, b = fold_batch_norm(*(params[k] for k in ("scale", "bias", "mean", "var")), 1e-5)
    before = h(h(h(batch["x"]) * h(a).reshape(1, 4, 1, 1)) + h(b).reshape(1, 4, 1, 1))
    assert not np.array_equal(before, want)
