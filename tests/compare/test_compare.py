from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpinfer.compare import CompareConfig, ComparisonResult, compare_models
from mpinfer.compare.hints import precision_summary, speed_hints
from mpinfer.errors import InvalidInputError, ModelLoadError
from tests.budget import set_slice
from tests.tolerances import network_atol, onnx_reductions, reorder_atol


def _cfg(base, *cands, **kw):
    kw.setdefault("show_progress", False)
    return CompareConfig(str(base), tuple(str(c) for c in cands), **kw)


def test_fp16_candidate_passes_and_roundtrips(mlp_files):
    result = compare_models(
        _cfg(
            mlp_files["base"],
            mlp_files["fp16"],
            data=str(mlp_files["small"]),
            checks="cosine>=0.9999,top1>=0.9,max_abs<=0.01",
        )
    )
    assert result and bool(result) is True
    cand = result.candidates[0]
    v = cand.outputs[0].values
    assert 0 < v["max_abs"] < 1e-2 and v["cosine"] > 0.9999 and v["top1"] >= 0.9
    assert v["accuracy"] is not None  # the data has _labels
    assert cand.runner["numerics"] == "ort-cpu"
    assert cand.precision["low_share"] == 1.0 and cand.precision["source"] == "model"
    assert cand.divergence is not None and cand.divergence.first_jump is None
    assert cand.divergence.tensors_compared > 10
    again = ComparisonResult.from_dict(result.to_dict())
    assert again.to_dict() == result.to_dict()
    strict = result.with_checks("max_abs<=1e-9")
    assert not strict and strict.failed_checks()[0][1].check == "max_abs<=1e-09"
    assert result  # the original is unchanged


def test_broken_layernorm_is_caught_and_named(mlp_files):
    result = compare_models(
        _cfg(
            mlp_files["base"],
            mlp_files["fp16"],
            mlp_files["broken"],
            data=str(mlp_files["big"]),
            checks="cosine>=0.9999",
        )
    )
    assert not result
    broken = result.candidates[1]
    assert not broken.passed
    assert any(o.check == "cosine>=0.9999" for _c, o in result.failed_checks())
    jump = broken.divergence.first_jump
    assert jump is not None and jump.address == str(mlp_files["ln"])
    assert jump.op_type == "LayerNormalization" and jump.precision == "fp16"
    assert jump.reason == "user:low-node" and "low-node" in jump.detail
    # its input: FP32 in both, yet onnxruntime may fuse the two graphs' FP32 nodes differently (relative units)
    n, stages = onnx_reductions(onnx.load(str(mlp_files["base"])))
    assert math.isinf(jump.error) and jump.input_error <= network_atol(n=n, stages=stages, magnitude=1.0)
    assert broken.divergence.ranking[0] == jump.address
    assert "FAIL" in result.summary() and str(mlp_files["broken"]) in result.summary()


def test_torch_baseline_against_onnx(mlp_files):
    result = compare_models(
        _cfg(
            "models/mlp.py:build",
            mlp_files["base"],
            data=str(mlp_files["small"]),
            checks="max_abs<=1e-4,cosine>=0.999999",
        )
    )
    assert result, result.summary()
    assert result.baseline["runner"]["backend"] == "torch"
    assert result.candidates[0].divergence is None  # needs an ONNX baseline


def test_latency_same_run(mlp_files):
    result = compare_models(
        _cfg(
            mlp_files["base"],
            mlp_files["fp16"],
            data=str(mlp_files["small"]),
            latency=True,
            batch_sizes=(1, 4),
            iterations=5,
            warmup=1,
            divergence=False,
        )
    )
    stats = result.latency.stats
    assert [(s.runner, s.batch_size) for s in stats] == [
        (str(mlp_files["base"]), 1),
        (str(mlp_files["fp16"]), 1),
        (str(mlp_files["base"]), 4),
        (str(mlp_files["fp16"]), 4),
    ]
    for s in stats:
        assert s.iterations == 5 and 0 < s.min_ms <= s.p50_ms <= s.p90_ms <= s.p99_ms
        assert s.throughput > 0 and s.speedup > 0
    assert stats[0].speedup == 1.0
    assert result.latency.runners[str(mlp_files["base"])]["providers"] == ["CPUExecutionProvider"]


def test_time_budget_stops_early(mlp_files):
    result = compare_models(
        _cfg(
            mlp_files["base"],
            mlp_files["fp16"],
            num_batches=1,
            latency=True,
            iterations=100000,
            warmup=0,
            time_budget_s=0.05,
            divergence=False,
        )
    )
    assert all(1 <= s.iterations < 100000 for s in result.latency.stats)


def test_mismatched_models_are_named(mlp_files, tmp_path):
    m = onnx.load(str(mlp_files["fp16"]))
    m.graph.output[0].name = "probs"
    m.graph.node[-1].output[0] = "probs"
    bad = tmp_path / "renamed.onnx"
    onnx.save(m, str(bad))
    with pytest.raises(InvalidInputError, match=r"Candidate '.*renamed.onnx': output names.*probs"):
        compare_models(_cfg(mlp_files["base"], bad))
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match=r"Candidate '.*garbage.onnx' could not be loaded"):
        compare_models(_cfg(mlp_files["base"], garbage))


def _fp16_conv_graph(cin: int, cout: int) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((cout, cin, 3, 3), np.float16), "w")
    nodes = [
        helper.make_node("Cast", ["x"], ["x16"], name="x__cast_to_fp16", to=TensorProto.FLOAT16),
        helper.make_node("Conv", ["x16", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Cast", ["c"], ["c32"], name="c__cast_to_fp32", to=TensorProto.FLOAT),
        helper.make_node("Relu", ["c32"], ["y"], name="relu"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cout, 8, 8])],
        [w],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_an_fp32_node_reading_a_rounded_constant_starts_from_its_rounding(tmp_path):
    # The candidate holds the constant in FP16 and Casts it back for an FP32 Mul: the rounding is the Mul's
    # input error (it once read 0 there, and the Mul "added" the weight's rounding).
    w = (np.random.default_rng(0).standard_normal(64) * 3).astype(np.float32)

    def model(low: bool) -> onnx.ModelProto:
        const = numpy_helper.from_array(w.astype(np.float16) if low else w)
        nodes = [helper.make_node("Constant", [], ["w"], name="c", value=const)]
        if low:
            nodes.append(helper.make_node("Cast", ["w"], ["w__cast_to_fp32"], name="w_cast", to=TensorProto.FLOAT))
        nodes.append(helper.make_node("Relu", ["x"], ["r"], name="relu"))  # a shared intermediate tensor
        nodes.append(helper.make_node("Mul", ["r", "w__cast_to_fp32" if low else "w"], ["y"], name="mul"))
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 64])
        m = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return m

    onnx.save(model(False), str(tmp_path / "b.onnx"))
    onnx.save(model(True), str(tmp_path / "c.onnx"))
    result = compare_models(_cfg(tmp_path / "b.onnx", tmp_path / "c.onnx", data="random:2"))
    mul = next(n for n in result.candidates[0].divergence.nodes if n.address == "mul")
    rounding = float(np.linalg.norm(w.astype(np.float16).astype(np.float32) - w) / np.linalg.norm(w))
    # both sides: float32 sums of 64 squares (each within gamma_64), then a square root (halves it)
    assert mul.precision == "fp32" and mul.input_error == pytest.approx(rounding, rel=reorder_atol(n=64))
    assert abs(mul.added) < 0.5 * mul.error  # the Mul itself, in FP32, adds (almost) nothing


def test_a_candidate_sharing_no_intermediate_tensor_is_not_blamed_on_its_last_node(mlp_files, tmp_path):
    # An optimised engine renames every intermediate tensor: only the outputs are shared, and the whole error
    # used to land on the node that makes an output ("error jumps at Identity 'out'").
    model = onnx.load(str(mlp_files["fp16"]))
    outputs = {o.name for o in model.graph.output}
    rename = {o: f"renamed_{o}" for n in model.graph.node for o in n.output if o and o not in outputs}
    for n in model.graph.node:
        n.input[:] = [rename.get(i, i) for i in n.input]
        n.output[:] = [rename.get(o, o) for o in n.output]
    del model.graph.value_info[:]
    onnx.save(model, str(tmp_path / "renamed.onnx"))
    result = compare_models(_cfg(mlp_files["base"], tmp_path / "renamed.onnx", data=str(mlp_files["big"])))
    div = result.candidates[0].divergence
    assert div.nodes == [] and div.first_jump is None and div.ranking == []
    assert any("cannot be located" in n for n in div.notes)


def test_speed_hints():
    hints = speed_hints(_fp16_conv_graph(3, 12))
    kinds = {(h.kind, h.node) for h in hints}
    assert ("alignment", "conv") in kinds and ("cast-split", "relu") in kinds
    align = next(h for h in hints if h.kind == "alignment")
    assert "input channels 3" in align.message and "output channels 12" in align.message
    assert "--keep-node 'conv'" in align.fix
    split = next(h for h in hints if h.kind == "cast-split")
    assert "Conv 'conv'" in split.message and "--low-node 'relu'" in split.fix
    assert [h.kind for h in speed_hints(_fp16_conv_graph(8, 16))] == ["cast-split"]


def test_precision_summary_from_model_and_plan(mlp_files):
    model = _fp16_conv_graph(8, 16)
    summary = precision_summary(model, "nowhere/model.onnx")
    assert summary["counts"] == {"fp16": 1, "fp32": 1} and summary["cast_count"] == 2
    plan = precision_summary(onnx.load(str(mlp_files["broken"])), mlp_files["broken"])
    assert plan["source"].endswith("mlp.lnfp16.plan.json") and plan["nodes_low"] == 1


def test_strict_numerics_sees_what_ort_hides(mlp_files):
    """ORT's CPU provider folds Cast pairs and computes in FP32; the strict emulator overflows like a GPU."""
    pytest.importorskip("mpinfer.precision.emulator.runner", reason="strict numerics not in this build")
    kw = {"data": str(mlp_files["big"]), "checks": "cosine>=0.9999"}
    assert compare_models(_cfg(mlp_files["base"], mlp_files["fp16"], **kw))
    strict = compare_models(_cfg(mlp_files["base"], mlp_files["fp16"], numerics="strict", **kw))
    assert not strict
    cand = strict.candidates[0]
    assert cand.runner["numerics"] == "strict-fp16" and cand.divergence.numerics == "strict"
    assert cand.divergence.first_jump is not None and cand.divergence.first_jump.op_type == "Gemm"


def test_bf16_candidate_tensors_are_compared_and_blamed(mlp_files, tmp_path):
    # ml_dtypes' bfloat16 has numpy kind 'V': divergence once skipped every BF16 tensor and blamed FP32 nodes.
    from mpinfer.precision import ConvertConfig, convert_precision
    from mpinfer.specs import Precision

    res = convert_precision(
        ConvertConfig(model=mlp_files["base"], output=tmp_path / "m.bf16.onnx", precision=Precision.BF16,
                      calibration="random:1", progress=False)
    )
    result = compare_models(_cfg(mlp_files["base"], res.output, data=str(mlp_files["big"]), numerics="strict"))
    div = result.candidates[0].divergence
    low = {n.name for n in res.plan.nodes if n.precision.value == "bf16" and n.op_type != "Constant"}
    ranked = {n.address: n for n in div.nodes}
    assert low and low <= set(ranked), (low, sorted(ranked))
    assert {ranked[a].precision for a in low} == {"bf16"}
    assert ranked[div.ranking[0]].precision == "bf16"  # the most error is added where the arithmetic is BF16
    # Under ONNX Runtime numerics the candidate cannot load on CPU: the error says how to compare it.
    with pytest.raises(ModelLoadError, match="--numerics strict"):
        compare_models(_cfg(mlp_files["base"], res.output, data=str(mlp_files["big"])))


def test_real_converter_plan_reason_in_report(mlp_files, tmp_path):
    precision = pytest.importorskip("mpinfer.precision", reason="convert stage not in this build")
    ln = str(mlp_files["ln"])
    res = precision.convert_precision(
        precision.ConvertConfig(
            model=mlp_files["base"],
            output=tmp_path / "mlp.forced.onnx",
            calibration="random:1",
            low_nodes=(ln,),
            keep_ops=("Gemm",),  # the Gemms stay FP32: the overflow first happens at the LayerNorm
            progress=False,
        )
    )
    result = compare_models(
        _cfg(mlp_files["base"], res.output, data=str(mlp_files["big"]), numerics="strict")
    )
    assert not result
    cand = result.candidates[0]
    assert cand.precision["source"] == str(res.plan_path)
    jump = cand.divergence.first_jump
    assert jump.address == ln and jump.reason == "user:low-node" and ln in jump.detail


def test_ort_engine_candidate(mlp_files, tmp_path):
    engine = pytest.importorskip("mpinfer.engine", reason="engine stage not in this build")
    built = engine.build_engine(
        engine.BuildConfig(
            model=mlp_files["fp16"],
            output=tmp_path / "mlp.ort",
            backend=engine.Backend.ONNXRUNTIME,
            device="cpu",
        )
    )
    result = compare_models(
        _cfg(
            mlp_files["base"], built.path, data=str(mlp_files["small"]), latency=True, iterations=3, warmup=1
        )
    )
    assert result, result.summary()
    cand = result.candidates[0]
    assert cand.runner["backend"] == "onnxruntime-engine"
    assert cand.divergence is None and cand.outputs[0].values["cosine"] > 0.9999
    assert [s.runner for s in result.latency.stats] == [str(mlp_files["base"]), str(built.path)]


def test_cast_split_fix_names_the_fp32_side_when_the_cast_goes_to_fp16():
    """Conv kept FP32 feeding an FP16 Relu: the fix lowers the Conv or keeps the Relu, not the reverse."""
    w = numpy_helper.from_array(np.ones((8, 8, 3, 3), np.float32), "w")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Cast", ["c"], ["c16"], name="c__cast_to_fp16", to=TensorProto.FLOAT16),
        helper.make_node("Relu", ["c16"], ["r"], name="relu"),
        helper.make_node("Cast", ["r"], ["y"], name="r__cast_to_fp32", to=TensorProto.FLOAT),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])],
        [w],
    )
    hints = speed_hints(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    split = next(h for h in hints if h.kind == "cast-split")
    assert "--low-node 'conv'" in split.fix and "--keep-node 'relu'" in split.fix


def test_cast_split_never_proposes_fp16_for_a_node_the_plan_keeps_fp32_for_a_reason(tmp_path):
    """Relu FP32 for range (its plan says so): the fix keeps the Conv FP32 too and says why; a Relu that only
    follows its inputs may be lowered, as without a plan."""
    from mpinfer.compare.divergence import load_plan_nodes

    model = _fp16_conv_graph(8, 16)
    path = tmp_path / "m.fp16.onnx"
    onnx.save(model, path)
    entry = {"name": "relu", "op_type": "Relu", "precision": "fp32", "reason": "range:overflow",
             "detail": "tensor 'y' reaches |1e+06| (x2 margin > 65504)"}
    (tmp_path / "m.fp16.plan.json").write_text(json.dumps({"nodes": [entry]}))
    nodes = load_plan_nodes(path)
    assert nodes == {"relu": entry}
    split = next(h for h in speed_hints(model, nodes) if h.kind == "cast-split")
    assert "--low-node" not in split.fix and "--keep-node 'conv'" in split.fix
    assert "range:overflow: tensor 'y' reaches" in split.fix
    split = next(h for h in speed_hints(model, {"relu": {**entry, "reason": "rule:follow"}}) if h.kind == "cast-split")
    assert "--low-node 'relu'" in split.fix
    assert load_plan_nodes(tmp_path / "none.onnx") == {}


def test_latency_with_a_scalar_input(tmp_path):
    """A rank-0 input (a loop count, a temperature) has no batch axis: latency must not index its shape."""
    nodes = [
        helper.make_node("Mul", ["x", "s"], ["m"], name="mul"),
        helper.make_node("Relu", ["m"], ["y"], name="relu"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    path = tmp_path / "scalar.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    result = compare_models(
        CompareConfig(
            str(path), (str(path),), latency=True, iterations=2, warmup=1, batch_sizes=(1, 4), show_progress=False
        )
    )
    assert {s.batch_size for s in result.latency.stats} == {1, 4}


def test_config_takes_paths_as_in_the_readme(mlp_files):
    """README: ``CompareConfig(Path("out/resnet.onnx"), (Path("out/resnet.fp16.onnx"),))``."""
    result = compare_models(CompareConfig(mlp_files["base"], (mlp_files["fp16"],), show_progress=False))
    assert result.candidates[0].name == str(mlp_files["fp16"])


def _state_model(tmp_path, state_batch):
    """y = x + sum(s, axis 0): x [batch, 4], a recurrent state s [2, state_batch, 4]."""
    nodes = [
        helper.make_node("ReduceSum", ["s", "ax"], ["h"], name="sum", keepdims=0),
        helper.make_node("Add", ["x", "h"], ["y"], name="add"),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, state_batch, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.array([0], np.int64), "ax")],
    )
    path = tmp_path / f"state_{state_batch or 'unnamed'}.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    data = tmp_path / "d.npz"
    np.savez(data, x=np.ones((3, 4), np.float32), s=np.ones((2, 3, 4), np.float32))
    return path, data


def test_latency_resizes_a_state_along_its_batch_axis(tmp_path):
    """A state [2, batch, 4] is tiled on axis 1 with x's samples; with its batch dim unnamed only the data's batch
    can be timed (the state cannot be resized), and --batch-sizes says so."""
    from mpinfer.compare.latency import batch_of_size

    path, data = _state_model(tmp_path, "batch")
    result = compare_models(_cfg(path, path, data=str(data), latency=True, iterations=2, warmup=1, batch_sizes=(1, 5)))
    assert {s.batch_size for s in result.latency.stats} == {1, 5}
    tiled = batch_of_size({"x": np.arange(6.0).reshape(3, 2), "s": np.zeros((2, 3, 4))}, 5, {"x": 0, "s": 1})
    assert tiled["x"].shape == (5, 2) and tiled["s"].shape == (2, 5, 4) and tiled["x"][3, 0] == 0
    path, data = _state_model(tmp_path, None)
    with pytest.raises(InvalidInputError, match=r"expected \[3\] only.*s have no batch dim by name"):
        compare_models(_cfg(path, path, data=str(data), latency=True, iterations=2, batch_sizes=(1, 3)))
    assert {s.batch_size for s in compare_models(_cfg(path, path, data=str(data), latency=True, iterations=2))
            .latency.stats} == {3}


def test_divergence_chunks_are_sized_by_bytes(mlp_files, monkeypatch):
    import mpinfer.compare.divergence as dv
    from mpinfer.modelio import ort_session
    from mpinfer.precision.calib.capture import pack_chunks

    base, cand = onnx.load(str(mlp_files["base"])), onnx.load(str(mlp_files["fp16"]))
    names, _ = dv._shared_tensors(base, cand)
    data = np.load(mlp_files["small"])
    batches = [{"x": data["x"][:16]}, {"x": data["x"][16:32]}]
    providers = ["CPUExecutionProvider"]
    sizes = dv.tensor_bytes(base, names, batches, providers)
    full = ort_session(dv._with_outputs(base, names)).run(names, dict(batches[0]))
    # The one-sample probe times 16 samples: exact for tensors with a batch axis, an upper bound for the rest
    # (a weight's Transpose).
    assert all(s >= v.nbytes for s, v in zip(sizes, full, strict=True))
    assert sum(s == v.nbytes for s, v in zip(sizes, full, strict=True)) > len(names) // 2
    # Strict numerics: with ORT's CPU provider a tensor's FP16 error depends on which tensors are graph outputs
    # (it drops the FP32->FP16->FP32 Cast pairs around FP16 kernels it lacks except where a value is fetched).
    whole = dv.measure_tensors(base, cand, names, batches, providers, strict=True)
    limit = 2 * max(sizes)
    chunks = pack_chunks(names, sizes, dv.CHUNK_SIZE, limit)
    assert len(chunks) > 1 and [n for c in chunks for n in c] == names
    assert all(sum(sizes[names.index(n)] for n in c) <= limit for c in chunks)
    set_slice(monkeypatch, "divergence_chunk", limit)
    chunked = dv.measure_tensors(base, cand, names, batches, providers, strict=True)
    assert chunked.keys() == whole.keys()
    # the chunks change what onnxruntime fuses in the FP32 baseline, which moves each relative error by up to
    # the baseline's own reordering (relative units), times (1 + the error)
    depth, stages = onnx_reductions(base)
    for n in whole:
        tol = network_atol(n=depth, stages=stages, magnitude=1.0) * (1 + whole[n].error)
        assert chunked[n].error == pytest.approx(whole[n].error, rel=0, abs=tol), n
    assert pack_chunks(["a", "b"], [10, 1], 64, 5) == [["a"], ["b"]]  # a tensor above the limit: alone


def test_big_models_are_compared_one_at_a_time_with_the_same_figures(tmp_path, monkeypatch):
    """Above the budget's share the baseline runs over the data first (its outputs kept), then each candidate: the
    same figures as with every model loaded at once, and never two models' sessions alive together."""
    import mpinfer.compare.passes as passes
    from mpinfer import memory
    from mpinfer.backends.ort import OrtRunner
    from mpinfer.precision import ConvertConfig, convert_precision
    from tests.precision.graphs import mlp, save

    src = save(mlp(), tmp_path / "m.onnx")
    low = convert_precision(ConvertConfig(model=src, output=tmp_path / "m.fp16.onnx", calibration="none",
                                          progress=False)).output
    cfg = CompareConfig(baseline=str(src), candidates=(str(low),), data="random:4", show_progress=False)
    together = compare_models(cfg)
    alive, most = [0], [0]
    activate, deactivate = OrtRunner._activate, OrtRunner._deactivate

    def counted(method, step):
        def run(self):
            method(self)
            alive[0] += step
            most[0] = max(most[0], alive[0])
        return run

    monkeypatch.setattr(OrtRunner, "_activate", counted(activate, 1))
    monkeypatch.setattr(OrtRunner, "_deactivate", counted(deactivate, -1))
    monkeypatch.setattr(memory, "default_budget", lambda: memory.MemoryBudget(passes.ONE_AT_A_TIME_SHARE))
    apart = compare_models(cfg)
    assert most[0] == 1 and alive[0] == 0
    for a, b in zip(together.candidates[0].outputs, apart.candidates[0].outputs, strict=True):
        assert a.values == b.values
    assert bool(apart) == bool(together)


def test_a_model_heavier_than_a_chunk_is_measured_in_one_session_per_model(mlp_files, monkeypatch):
    """Its weights cost more per session than a chunk of tensors: the divergence reads the first samples of each
    batch that fit one chunk, one session per model, says so, and finds the same jump as on every sample."""
    import mpinfer.compare.divergence as dv

    big = dict(np.load(mlp_files["big"]))
    batches = [{"x": big["x"][:16]}, {"x": big["x"][16:32]}]
    whole = dv.find_divergence(mlp_files["base"], mlp_files["broken"], batches)
    base, cand = onnx.load(str(mlp_files["base"])), onnx.load(str(mlp_files["broken"]))
    names, _ = dv._shared_tensors(base, cand)
    total = sum(dv.tensor_bytes(base, names, batches, ["CPUExecutionProvider"]))
    limit = (total // 4) * (len(batches) + 1)  # a quarter of a batch's tensors per batch held
    assert dv.weight_bytes(base) > limit, "the MLP's weights must outweigh the chunk for this test"
    set_slice(monkeypatch, "divergence_chunk", limit)
    cut, sizes, notes = dv.fit_batches(base, names, batches, ["CPUExecutionProvider"])
    assert [len(b["x"]) for b in cut] == [4, 4] and sizes is not None and sum(sizes) <= limit
    assert notes and "first 4 of 16 samples" in notes[0]
    sessions: list[int] = []
    real = dv._session
    monkeypatch.setattr(dv, "_session", lambda *a: sessions.append(1) or real(*a))
    fitted = dv.find_divergence(mlp_files["base"], mlp_files["broken"], batches)
    assert len(sessions) == 2  # one session of each model: the baseline's is the size probe's (the same outputs)
    assert fitted.notes[:1] == notes
    assert whole.first_jump is not None and fitted.first_jump is not None
    assert fitted.first_jump.address == whole.first_jump.address
