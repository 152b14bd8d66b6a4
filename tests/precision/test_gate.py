"""Issue 28: the validity gate checks what is published, on the graphs peers' own tests build.

Each hole of the issue is one test here: a Cast chain making an FP16 graph output under --force, a keras-era graph
(opset 11 BatchNormalization, PRelu, Identity chains to the outputs, an unsorted node list), a user-forced low node
whose weight is past FP16's range, a model newer than ONNX Runtime reads, FP16 I/O kept under --force, FP64 nodes.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpinfer.errors import InternalError, InvalidInputError
from mpinfer.precision.convert import ConvertConfig, convert_precision
from tests.precision.gatesweep import check_file
from tests.tolerances import assert_onnx_outputs_close


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def _run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def _cast_chain_model() -> onnx.ModelProto:
    """X -> Add -> Cast(to=FLOAT16) -> Cast(to=FLOAT16) -> Y (an FP16 graph output made by two Casts; opset 17)."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT16, [2, 3])
    b = numpy_helper.from_array(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), "b")
    nodes = [
        helper.make_node("Add", ["X", "b"], ["s"], name="add"),
        helper.make_node("Cast", ["s"], ["c1"], name="cast1", to=TensorProto.FLOAT16),
        helper.make_node("Cast", ["c1"], ["Y"], name="cast2", to=TensorProto.FLOAT16),
    ]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], [b]), opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    "options",
    [
        {"calibration": "none"},
        {},  # seeded random calibration: the plan's error is measured (it was KeyError 'Y' in the emulator)
        {"calibration": "none", "keep_nodes": ("add",), "keep_io_types": False},
        {"calibration": "none", "low_nodes": ("add",)},
    ],
    ids=["no-data", "random-data", "keep-node-no-keep-io", "low-node"],
)
def test_force_on_a_cast_chain_making_a_graph_output_writes_a_valid_model(tmp_path, options):
    """Hole 1: every graph output keeps a producer, and the user's FP16 output stays FP16 (hole 4)."""
    src = _save(_cast_chain_model(), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    convert_precision(ConvertConfig(model=src, output=out, force=True, progress=False, **options))
    assert check_file(out) is None
    written = onnx.load(str(out))
    assert [o.type.tensor_type.elem_type for o in written.graph.output] == [TensorProto.FLOAT16]
    produced = {o for n in written.graph.node for o in n.output}
    assert {i for n in written.graph.node for i in n.input} <= produced | {"X", "b", "b__fp16"}
    x = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    got = _run(out, {k.name: x.astype(onnx.helper.tensor_dtype_to_np_dtype(k.type.tensor_type.elem_type))
                     for k in written.graph.input if k.name == "X"})[0]
    want = x + numpy_helper.to_array(_cast_chain_model().graph.initializer[0])
    assert got.dtype == np.float16
    assert_onnx_outputs_close(got, want, _cast_chain_model(), dtype=np.float16)


def test_the_gate_checks_the_bytes_published(tmp_path, monkeypatch):
    """A write that breaks the model after the in-memory gate is caught on the file: InternalError, nothing written."""
    import mpinfer.precision.convert as convert_module

    real_save = convert_module.save_onnx

    def save_without_last_node(model, path, **kwargs):
        broken = onnx.ModelProto()
        broken.CopyFrom(model)
        del broken.graph.node[-1]  # its graph output now has no producer
        return real_save(broken, path, **kwargs)

    monkeypatch.setattr(convert_module, "save_onnx", save_without_last_node)
    src = _save(_cast_chain_model(), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    with pytest.raises(InternalError, match="after writing the model"):
        convert_precision(ConvertConfig(model=src, output=out, force=True, calibration="none", progress=False))
    assert not out.exists() and not (tmp_path / "o.plan.json").exists()


def test_force_upcast_is_gated_against_the_model_as_read(tmp_path, monkeypatch):
    """--force's return to FP32 is a rewrite: one that loses a producer is refused, whatever the input failed."""
    import mpinfer.precision.convert as convert_module

    real = convert_module.check_not_low

    def losing_a_producer(model, path, *, force):
        up = real(model, path, force=force)
        del up.graph.node[-1]
        return up

    monkeypatch.setattr(convert_module, "check_not_low", losing_a_producer)
    src = _save(_cast_chain_model(), tmp_path / "m.onnx")
    with pytest.raises(InternalError, match="return to FP32"):
        convert_precision(
            ConvertConfig(model=src, output=tmp_path / "o.onnx", force=True, calibration="none", progress=False)
        )


def keras_era_model() -> onnx.ModelProto:
    """A keras2onnx-style graph: opset 11 Conv, BatchNormalization, PRelu, Transpose, Slice, ConvTranspose, Identity
    chains to the outputs, and a node list out of topological order (ONNX Runtime loads it, the checker does not)."""
    rng = np.random.default_rng(0)

    def init(name, *shape, scale=0.3):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    c = 4
    inits = [
        init("w1", c, 1, 3, 3), init("b1", c), init("bn_s", c), init("bn_b", c), init("bn_m", c, scale=0.1),
        numpy_helper.from_array(np.abs(rng.standard_normal(c)).astype(np.float32) + 0.5, "bn_v"),
        init("slope", c, 1, 1), init("wt", c, 2, 2, 2), init("bt", 2),
        numpy_helper.from_array(np.array([0], np.int64), "st"),
        numpy_helper.from_array(np.array([6], np.int64), "en"),
        numpy_helper.from_array(np.array([2], np.int64), "ax"),
    ]
    nodes = [
        helper.make_node("Identity", ["input_1"], ["id0"], name="Identity0"),
        helper.make_node("Conv", ["id0", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn_s", "bn_b", "bn_m", "bn_v"], ["bn"], name="bn1",
                         epsilon=1e-3),
        helper.make_node("PRelu", ["bn", "slope"], ["pr"], name="prelu1"),
        helper.make_node("Transpose", ["pr"], ["tr"], name="tr1", perm=[0, 1, 3, 2]),
        helper.make_node("Slice", ["tr", "st", "en", "ax"], ["sl"], name="slice1"),
        helper.make_node("ConvTranspose", ["sl", "wt", "bt"], ["ct"], name="convT1", strides=[2, 2]),
        helper.make_node("Identity", ["ct"], ["id1"], name="Identity8"),
        helper.make_node("Identity", ["id1"], ["output_1"], name="Identity9"),
        helper.make_node("Identity", ["pr"], ["output_2"], name="Identity10"),
    ]
    order = [9, 3, 0, 7, 1, 5, 2, 8, 4, 6]  # not topological
    graph = helper.make_graph(
        [nodes[i] for i in order], "keras", [helper.make_tensor_value_info("input_1", TensorProto.FLOAT, [1, 1, 8, 8])],
        [helper.make_tensor_value_info("output_1", TensorProto.FLOAT, [1, 2, 12, 16]),
         helper.make_tensor_value_info("output_2", TensorProto.FLOAT, [1, 4, 8, 8])], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], ir_version=6)


@pytest.mark.parametrize(
    "options",
    [{}, {"calibration": "none"}, {"keep_ops": ("BatchNormalization",)}, {"low_ops": ("BatchNormalization",)}],
    ids=["default", "no-data", "keep-op-bn", "low-op-bn"],
)
def test_a_keras_era_graph_converts_to_a_loadable_model(tmp_path, options):
    """Hole 2: the model ONNX Runtime loads (the checker refuses its node order) converts, and runs close to FP32."""
    model = keras_era_model()
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(model)
    src = _save(model, tmp_path / "keras.onnx")
    out = tmp_path / "o.onnx"
    convert_precision(ConvertConfig(model=src, output=out, progress=False, **options))
    assert check_file(out) is None
    x = np.random.default_rng(1).standard_normal((1, 1, 8, 8)).astype(np.float32)
    for got, want in zip(_run(out, {"input_1": x}), _run(src, {"input_1": x}), strict=True):
        assert_onnx_outputs_close(got, want, model, dtype=np.float16)


def test_nodes_sharing_a_type_variable_get_one_precision():
    """The schema's type variables decide: BatchNormalization-11 ties its five inputs and its output to T."""
    from mpinfer.modelio import name_nodes
    from mpinfer.precision.core.graphinfo import FLOAT16, GraphInfo
    from mpinfer.precision.graph.normalize import sort_nodes

    info = GraphInfo(name_nodes(sort_nodes(keras_era_model())))
    bn = info.by_address["bn1"].node
    slots = info.slots(bn, FLOAT16)
    assert slots.inputs == [0, 1, 2, 3, 4] and slots.outputs == [0] and slots.blocked is None
    info.types["bn_v"] = TensorProto.DOUBLE  # a tensor bound to T that is not FP32: T cannot go low
    tied = info.slots(bn, FLOAT16)
    assert tied.inputs == [] and tied.outputs == [] and "binds 'bn_v'" in (tied.blocked or "")


def test_sort_nodes_orders_a_graph_and_leaves_a_sorted_one_as_it_is():
    from mpinfer.precision.graph.normalize import sort_nodes

    model = keras_era_model()
    fixed = sort_nodes(model)
    onnx.checker.check_model(fixed, full_check=True)
    assert sorted(n.name for n in fixed.graph.node) == sorted(n.name for n in model.graph.node)
    assert sort_nodes(fixed) is fixed


def _out_of_range_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    w = numpy_helper.from_array(np.array([1e5, -1e5, 1, 2], np.float32), "w")
    nodes = [
        helper.make_node("Add", ["x", "w"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["y"], name="relu"),
    ]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w]), opset_imports=[helper.make_opsetid("", 17)])


def test_a_forced_low_weight_past_fp16_range_is_clamped_with_a_warning(tmp_path, caplog):
    """Hole 3: AutoCast's rule: +-65504 with a warning naming the weight, never inf, no numpy RuntimeWarning."""
    src = _save(_out_of_range_model(), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="mpinfer"):
        warnings.simplefilter("error", RuntimeWarning)
        convert_precision(
            ConvertConfig(model=src, output=out, calibration="none", low_nodes=("add",), progress=False)
        )
    clamped = [r.getMessage() for r in caplog.records if "clamped" in r.getMessage()]
    assert len(clamped) == 1 and "'w'" in clamped[0] and "65504" in clamped[0]
    got = _run(out, {"x": np.zeros(4, np.float32)})[0]
    np.testing.assert_array_equal(got, np.array([65504.0, 0.0, 1.0, 2.0], np.float32))


def _relu_model(opset: int, ir_version: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)


def test_an_ir_version_newer_than_onnxruntime_reads_is_lowered(tmp_path):
    """Hole 4: the IR version goes down to what the opsets need; the file loads."""
    from mpinfer.backends.ort import runtime_limits

    max_ir, _ = runtime_limits()
    if max_ir >= onnx.IR_VERSION:
        pytest.skip(f"the installed ONNX Runtime reads IR {max_ir}, onnx's newest")
    src = _save(_relu_model(17, onnx.IR_VERSION), tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    convert_precision(ConvertConfig(model=src, output=out, calibration="none", progress=False))
    assert check_file(out) is None
    assert onnx.load(str(out)).ir_version <= max_ir


def test_a_model_every_supported_onnxruntime_reads_needs_no_probe_of_the_runtime():
    from mpinfer.backends.ort import ORT_FLOOR_IR, ORT_FLOOR_OPSET, fit_runtime, runtime_limits

    runtime_limits.cache_clear()
    model = _relu_model(17, 8)
    assert fit_runtime(model, "m.onnx") is model
    assert runtime_limits.cache_info().currsize == 0  # not probed
    # the floor the shortcut rests on is within what the installed runtime reads
    max_ir, max_opset = runtime_limits()
    assert max_ir >= ORT_FLOOR_IR and max_opset >= ORT_FLOOR_OPSET


def test_an_opset_newer_than_onnxruntime_reads_is_refused_naming_the_versions(tmp_path, invoke):
    """Hole 4: a clear refusal (exit 1, no traceback, nothing written)."""
    from mpinfer.backends.ort import runtime_limits
    from tests.conftest import assert_user_error

    _, max_opset = runtime_limits()
    if max_opset >= onnx.defs.onnx_opset_version():
        pytest.skip(f"the installed ONNX Runtime reads opset {max_opset}, onnx's newest")
    src = _save(_relu_model(max_opset + 1, onnx.IR_VERSION), tmp_path / "m.onnx")
    with pytest.raises(InvalidInputError, match=rf"opset {max_opset + 1}.*opset {max_opset} or lower"):
        convert_precision(ConvertConfig(model=src, output=tmp_path / "o.onnx", calibration="none", progress=False))
    result = invoke("convert", src, "--calibration", "none", "-o", tmp_path / "o.onnx")
    assert_user_error(result, r"onnxruntime .*loads")
    assert not (tmp_path / "o.onnx").exists()


def test_fp64_arithmetic_is_left_as_it_is_and_reported(tmp_path, caplog):
    """Hole 4: a double Add stays double; a warning and the plan's summary say so."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    inits = [numpy_helper.from_array(np.eye(4, dtype=np.float32), "w"), numpy_helper.from_array(np.ones(4), "d")]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
        helper.make_node("Cast", ["m"], ["m64"], name="up", to=TensorProto.DOUBLE),
        helper.make_node("Add", ["m64", "d"], ["a64"], name="add64"),
        helper.make_node("Cast", ["a64"], ["y"], name="down", to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    src = _save(model, tmp_path / "m.onnx")
    out = tmp_path / "o.onnx"
    with caplog.at_level(logging.WARNING, logger="mpinfer"):
        res = convert_precision(ConvertConfig(model=src, output=out, calibration="none", progress=False))
    assert res.plan.summary["fp64_nodes"] == 1
    assert any("FP64" in r.getMessage() and "Add" in r.getMessage() for r in caplog.records)
    written = onnx.load(str(out))
    add = next(n for n in written.graph.node if n.name == "add64")
    assert next(t for t in written.graph.initializer if t.name == add.input[1]).data_type == TensorProto.DOUBLE


def test_low_array_clamps_finite_values_and_keeps_float32_extremes_as_infinity():
    """Clamped to +-65504; inf, NaN and float32's own extremes (a mask's minus infinity) stay what they mean."""
    from mpinfer.precision.graph.apply import low_array
    from mpinfer.specs import Precision

    f32 = np.finfo(np.float32)
    arr = np.array([1e5, -7e4, f32.min, f32.max, np.inf, np.nan, 3.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = low_array(arr, Precision.FP16)
    want = np.array([65504, -65504, -np.inf, np.inf, np.inf, np.nan, 3.0], np.float16)
    np.testing.assert_array_equal(got, want)


def test_force_takes_the_fp16_data_saved_for_an_fp16_model(tmp_path):
    """--force brings an FP16-input model back to FP32; the FP16 .npz saved for its inputs still calibrates it."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((8, 4)) * 0.3).astype(np.float16), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"), helper.make_node("Relu", ["m"], ["y"], name="relu")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["N", 4])], [w])
    src = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((32, 8)).astype(np.float16))
    out = tmp_path / "o.onnx"
    res = convert_precision(ConvertConfig(model=src, output=out, force=True, calibration=str(tmp_path / "d.npz"),
                                          progress=False))
    assert check_file(out) is None
    assert res.plan.summary["verification"]["samples"] == 32 and res.plan.summary["verification"]["passed"]


def _counting_sessions(monkeypatch) -> list[str]:
    """Every ONNX Runtime session created from now on (the gate's loads included), by its source's kind."""
    import onnxruntime as ort

    made: list[str] = []
    real = ort.InferenceSession

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, src, *args, **kwargs):
            made.append("bytes" if isinstance(src, bytes) else "path")
            super().__init__(src, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", Counting)
    return made


def test_the_published_gate_skips_only_the_bytes_the_apply_gate_passed(tmp_path, monkeypatch):
    """apply_validated gates the bytes save_onnx writes; gate_published loads nothing again for those bytes only."""
    import hashlib

    from mpinfer.modelio import save_onnx
    from mpinfer.precision.core import GraphInfo, NodeDecision
    from mpinfer.precision.graph import apply_validated, gate_published
    from mpinfer.specs import Precision

    model = _cast_chain_model()
    info = GraphInfo(model)
    nodes = [NodeDecision("add", "Add", Precision.FP16, "test")]
    made = _counting_sessions(monkeypatch)
    result, _ = apply_validated(info, nodes, Precision.FP16)
    assert made == ["bytes"]  # the apply gate's one load
    out = save_onnx(result.model, tmp_path / "o.onnx")
    assert result.gated == hashlib.sha256(out.read_bytes()).hexdigest()
    gate_published(out, baseline_model=model, gated=result.gated)
    assert made == ["bytes"]  # the same bytes: no second load
    other = onnx.load(str(out))
    other.producer_name = "edited"
    onnx.save(other, str(out))
    gate_published(out, baseline_model=model, gated=result.gated)
    assert made == ["bytes", "path"]  # other bytes: the whole gate on the file


def test_strict_inference_runs_once_and_its_failures_are_still_named(monkeypatch):
    """The full checker ends with strict type inference: passed, the inference check is not run again; failed,
    both checks still report (the verdicts and the input-model comparison are those of the two checks)."""
    from mpinfer.precision.graph.validate import run_checks

    calls = []
    real = onnx.shape_inference.infer_shapes

    def counting(model, *args, **kwargs):
        calls.append(type(model).__name__)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", counting)
    offline = ("checker", "inference")  # (helper.make_model's IR version may be past what ONNX Runtime reads)
    assert run_checks(_cast_chain_model(), offline) == [] and calls == []
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2])
    h = helper.make_tensor_value_info("H", TensorProto.FLOAT16, [2])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])
    mixed = helper.make_model(helper.make_graph([helper.make_node("Add", ["X", "H"], ["Y"], name="a")], "g", [x, h],
                                                [y]), opset_imports=[helper.make_opsetid("", 17)])
    checks = {f.check: f.node for f in run_checks(mixed, offline)}
    assert checks["checker"] == "a" and checks["inference"] == "a" and calls == ["bytes"]
    assert {f.check for f in run_checks(mixed.SerializeToString(), ("inference",))} == {"inference"}


def test_a_deferred_load_gates_the_bytes_once_it_passed_and_only_the_model_it_loaded(tmp_path, monkeypatch):
    """apply_validated(defer_load=True) runs the checker and inference in line and leaves the ONNX Runtime load of the
    same bytes on a thread: the digest gate_published trusts is set by settle_load once that load passed, and only on
    the very model it loaded (a model the verification rewrote was gated by its own apply)."""
    import hashlib
    from dataclasses import replace

    from mpinfer.modelio import save_onnx
    from mpinfer.precision.core import GraphInfo, NodeDecision
    from mpinfer.precision.graph import apply_validated, gate_published, settle_load
    from mpinfer.specs import Precision

    model = _cast_chain_model()
    info = GraphInfo(model)
    made = _counting_sessions(monkeypatch)
    result, _ = apply_validated(info, [NodeDecision("add", "Add", Precision.FP16, "test")], Precision.FP16,
                                defer_load=True)
    assert result.gated is None and result.load is not None  # not trusted before its load passed
    settled, failures = settle_load(result, result)
    assert failures == [] and made == ["bytes"] and settled.load is None
    out = save_onnx(settled.model, tmp_path / "o.onnx")
    assert settled.gated == hashlib.sha256(out.read_bytes()).hexdigest()
    gate_published(out, baseline_model=model, gated=settled.gated)
    assert made == ["bytes"]  # the deferred load was the gate's one load
    rewritten = replace(result, model=onnx.ModelProto())  # (what a repaired verification hands back)
    assert settle_load(result, rewritten) == (rewritten, [])


def test_a_model_onnx_runtime_refuses_after_its_verification_is_applied_again_with_those_nodes_fp32(tmp_path, caplog):
    """The gate's ONNX Runtime load runs beside the final verification; when it refuses the model (ONNX's BF16
    Attention before opset 24 has no ONNX Runtime kernel), convert applies the plan again with the gate in line, which
    keeps the refused node FP32 with the reason, verifies that model and writes it: the same plan as a gate in line."""
    from mpinfer.precision.graph import run_checks
    from mpinfer.specs import Precision
    from tests.precision.conformance import _feeds, float_cases

    case = next(c for c in float_cases() if c.name == "test_attention_4d_attn_mask_3d_causal")
    src = _save(case.model, tmp_path / "m.onnx")
    np.savez(tmp_path / "cal.npz", **_feeds(case))  # (the case's own inputs)
    out = tmp_path / "o.onnx"
    with caplog.at_level(logging.INFO, logger="mpinfer"):
        res = convert_precision(ConvertConfig(model=src, output=out, calibration=str(tmp_path / "cal.npz"),
                                              precision=Precision.BF16, force=True, progress=False))
    assert any("ONNX Runtime refused the model under verification" in r.getMessage() for r in caplog.records)
    attn = next(n for n in res.plan.nodes if n.op_type == "Attention")
    assert attn.precision is Precision.FP32 and "ONNX Runtime refuses it in bf16" in attn.detail
    verification = res.plan.summary["verification"]
    assert verification["passed"] is True and verification["engine"] == "ort-casts"  # (the model written, verified)
    assert run_checks(onnx.load(str(out))) == []
