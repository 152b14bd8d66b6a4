"""The cast graph: a converted model's strict numerics run by ONNX Runtime, bit for bit the emulator's (issue 27)."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mpinfer.precision import ConvertConfig, convert_precision
from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.emulator.castgraph import (
    ENGINE_CASTS,
    ENGINE_EMULATOR,
    EXACT_OPS,
    EXPANDED_OPS,
    ROUNDED_OPS,
    SHAPE_OPS,
    cast_graph,
    open_cast_session,
)
from mpinfer.precision.emulator.emulate import GraphEmulator
from mpinfer.precision.emulator.kernels.ortexec import MIN_SIZE
from mpinfer.precision.emulator.runner import StrictRunner
from mpinfer.precision.graph.apply import apply_plan
from mpinfer.precision.numerics.strict import StrictEvaluator
from mpinfer.specs import Precision
from tests.precision.graphs import fvi, init, make, rng_w, save

LOW = {
    "fp16": (TensorProto.FLOAT16, np.dtype(np.float16)),
    "bf16": (TensorProto.BFLOAT16, np.dtype(ml_dtypes.bfloat16)),
}
SHAPE = [4, 8, 8]  # per sample: 256 values, so 2 samples go through the emulator's numpy casts, 80 through ORT's
ROWS = (2, 80)


def _edges(kind: str) -> np.ndarray:
    """float32 values at the edges of the low dtype: its largest finite values, the overflow tie, subnormals, ties."""
    if kind == "fp16":
        big = [65504.0, 65519.0, 65520.0, 32768.0, 60000.0]
        tiny = [2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-14, 2.0**-15 + 2.0**-24, 1e-9]
        ties = [1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 2048.0 + 1.0, 0.1]
    else:
        big = [3.3895e38, 3.39e38, 1.7e38, 3.0e38]
        tiny = [1e-39, 9.2e-41, 1.2e-38, 2.0**-133, 5e-45]
        ties = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 256.0 + 1.0, 0.1]
    vals = big + tiny + ties + [0.0, np.inf, np.nan, 1.0, 0.5]
    return np.array(vals + [-v for v in vals], np.float32)


def _feed(kind: str, rows: int, seed: int, share: float = 0.25) -> np.ndarray:
    """[rows, 4, 8, 8] float32: mostly N(0, 4), ``share`` of the values drawn from :func:`_edges`."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal([rows, *SHAPE]) * 4).astype(np.float32)
    pick = rng.random(x.shape) < share
    x[pick] = rng.choice(_edges(kind), size=int(pick.sum()))
    return x


def _converted(op: str, kind: str, opset: int = 17, **attrs) -> object:
    """A model as convert writes it with keep_io_types: float32 inputs cast to the low dtype, one low ``op`` node,
    its output cast back to float32. Weights (Conv, ConvTranspose) are initializers of the low dtype."""
    elem, dtype = LOW[kind]
    two = op in ("Add", "Sub", "Mul", "Div", "Max", "Min", "Concat")
    names = ["x", "y"] if two else ["x"]
    nodes = [helper.make_node("Cast", [n], [f"{n}_low"], to=elem) for n in names]
    ins, inits = [f"{n}_low" for n in names], []
    if op in ("Conv", "ConvTranspose"):
        w = rng_w(*((6, 4, 3, 3) if op == "Conv" else (4, 6, 3, 3)), seed=3, scale=0.4)
        w.flat[:4] = [30000.0, -3.0e38 if kind == "bf16" else -60000.0, 1e-6, 0.0]  # overflow, a tiny weight, a zero
        inits += [init("w", w.astype(dtype)), init("b", rng_w(6, seed=4).astype(dtype))]
        ins += ["w", "b"]
    elif op == "Clip":
        inits += [init("lo", np.array(-2.5, dtype)), init("hi", np.array(6.0, dtype))]
        ins += ["lo", "hi"]
    elif op == "BatchNormalization":
        rng = np.random.default_rng(5)
        scale, shift = rng.standard_normal(4) * 3, rng.standard_normal(4)
        mean, var = rng.standard_normal(4), np.array([1e-4, 0.5, 2.0, 1e4])  # a tiny variance: a large folded scale
        for n, v in (("scale", scale), ("shift", shift), ("mean", mean), ("var", var)):
            inits.append(init(n, v.astype(np.float32).astype(dtype)))
        ins += ["scale", "shift", "mean", "var"]
    elif op == "MatMul":
        w = rng_w(8, 5, seed=3, scale=0.4)
        w.flat[:3] = [30000.0, -3.0e38 if kind == "bf16" else -60000.0, 1e-6]  # overflow, a tiny weight
        inits.append(init("w", w.astype(dtype)))
        ins.append("w")
    elif op in ("Reshape",):
        inits.append(init("shape", np.array([0, -1], np.int64)))
        ins.append("shape")
    elif op in ("Slice",):
        inits += [init(n, np.array(v, np.int64)) for n, v in (("st", [1, 2]), ("en", [3, 7]), ("ax", [1, 3]))]
        ins += ["st", "en", "ax"]
    elif op in ("Unsqueeze", "Squeeze"):
        inits.append(init("axes", np.array([1], np.int64)))  # (an input since opset 13)
        ins.append("axes")
    outs = ["z_low"] if op != "Split" else ["z_low", "z2_low"]
    nodes.append(helper.make_node(op, ins, outs, name="op", **attrs))
    rank = {"Reshape": 2, "Flatten": 2, "Unsqueeze": 5, "Shape": 1, "Size": 0}.get(op, 4)
    dims = [f"d{i}" for i in range(rank)]
    inputs = [fvi(n, ["N", *SHAPE]) for n in names]
    if op in SHAPE_OPS:
        return make(nodes, inputs, [fvi("z_low", dims, TensorProto.INT64)], inits, opset=opset)
    nodes += [helper.make_node("Cast", [o], [o[:-4]], to=TensorProto.FLOAT) for o in outs]
    return make(nodes, inputs, [fvi(o[:-4], dims) for o in outs], inits, opset=opset)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit (any NaN matches any NaN: payloads are not specified)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    width = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return bool(np.array_equal(nan_a, nan_b) and np.array_equal(a.view(width)[~nan_a], b.view(width)[~nan_b]))


CASES = [
    ("Conv", {"pads": [1, 1, 1, 1]}),
    ("Conv", {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ("ConvTranspose", {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("MatMul", {}), ("Tanh", {}), ("Sigmoid", {}), ("HardSwish", {}), ("BatchNormalization", {"epsilon": 1e-3}),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}), ("Clip", {}), ("GlobalAveragePool", {}),
    ("Softmax", {}), ("Softmax", {"axis": 1}), ("Softmax", {"axis": 2, "opset": 18}), ("Softmax", {"opset": 12}),
    ("MaxPool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ("MaxPool", {"kernel_shape": [2, 2], "strides": [3, 3], "ceil_mode": 1}),
    ("AveragePool", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ("AveragePool", {"kernel_shape": [2, 2], "pads": [1, 0, 1, 0], "count_include_pad": 1, "ceil_mode": 1}),
    ("Add", {}), ("Sub", {}), ("Mul", {}), ("Div", {}),
    ("Relu", {}), ("Max", {}), ("Min", {}), ("Abs", {}), ("Neg", {}), ("Identity", {}),
    ("Reshape", {}), ("Flatten", {"axis": 2}), ("Transpose", {"perm": [0, 2, 3, 1]}), ("Concat", {"axis": 1}),
    ("Slice", {}), ("Split", {"axis": 1, "num_outputs": 2}), ("Unsqueeze", {}), ("Shape", {}), ("Size", {}),
]


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize(("op", "attrs"), CASES, ids=[f"{op}{i}" for i, (op, _) in enumerate(CASES)])
def test_each_listed_op_gives_the_emulators_bits(op, attrs, kind):
    """Single low node, FP16 and BF16, inputs with inf/NaN/±0, overflow ties, subnormals and rounding ties; batches
    below and above the emulator's ONNX Runtime threshold (its numpy casts and its ONNX Runtime casts)."""
    model = _converted(op, kind, **({**attrs, "opset": 18} if op == "Split" else attrs))
    sess, why = open_cast_session(model)
    if kind == "bf16" and attrs.get("opset", 17) < 13:  # (BF16 Casts need opset 13: refused, the emulator runs it)
        assert sess is None and "opset 12" in why
        return
    assert sess is not None, why
    emulator = StrictRunner(model)
    emulator.activate()
    for rows in ROWS:
        share = 0.01 if op.startswith("Conv") else 0.25  # (a window of 36 values: most would hold an inf or a NaN)
        feeds = {n: _feed(kind, rows, seed, share) for seed, n in enumerate(i.name for i in model.graph.input)}
        assert rows * int(np.prod(SHAPE)) >= MIN_SIZE or rows == ROWS[0]
        want, got = emulator.infer(feeds), sess(feeds)
        for name in want:
            assert _same_bits(np.asarray(want[name]), np.asarray(got[name])), (op, kind, rows, name)
    if op in ROUNDED_OPS or op in EXPANDED_OPS:  # the test would pass for an op that never rounds: it does round
        assert cast_graph(model)[0].rounded == len(model.graph.input) + 1, op  # the input Casts, and the op
    else:
        assert op in EXACT_OPS | SHAPE_OPS


def test_the_edge_values_do_overflow_and_make_nans():
    """The feeds above reach what the emulator rounds at the edges: FP16 Conv outputs overflow to inf, and NaN."""
    model = _converted("Conv", "fp16", pads=[1, 1, 1, 1])
    y = open_cast_session(model)[0]({"x": _feed("fp16", ROWS[1], 0, 0.01)})["z"]
    assert np.isinf(y).any() and np.isnan(y).any() and np.isfinite(y).mean() > 0.5


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_gemm_gives_the_emulators_bits(kind):
    """Gemm with alpha, beta, transB and a bias, after a Flatten: ONNX Runtime's kernel in both engines."""
    elem, dtype = LOW[kind]
    w, b = rng_w(6, 256, seed=3, scale=0.1), rng_w(6, seed=4)
    w.flat[:2] = [30000.0, 1e-6]
    nodes = [
        helper.make_node("Cast", ["x"], ["x_low"], to=elem),
        helper.make_node("Flatten", ["x_low"], ["f_low"], name="flat", axis=1),
        helper.make_node("Gemm", ["f_low", "w", "b"], ["z_low"], name="op", alpha=0.5, beta=2.0, transB=1),
        helper.make_node("Cast", ["z_low"], ["z"], to=TensorProto.FLOAT),
    ]
    model = make(nodes, [fvi("x", ["N", *SHAPE])], [fvi("z", ["N", 6])],
                 [init("w", w.astype(dtype)), init("b", b.astype(dtype))])
    sess, why = open_cast_session(model)
    assert sess is not None, why
    emulator = StrictRunner(model)
    emulator.activate()
    for rows in ROWS:
        feeds = {"x": _feed(kind, rows, 0, 0.01)}
        want, got = emulator.infer(feeds), sess(feeds)
        assert _same_bits(np.asarray(want["z"]), np.asarray(got["z"])), (kind, rows)
    assert cast_graph(model)[0].rounded == 2  # the input Cast and the Gemm


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_a_batchnorm_whose_input_rank_is_not_inferred_gives_the_emulators_bits(kind):
    """Shape inference cannot tell the input's rank: the folded scale and shift are shaped from it at run time."""
    model = _converted("BatchNormalization", kind)
    model.graph.input[0].type.tensor_type.ClearField("shape")
    model.graph.output[0].type.tensor_type.ClearField("shape")
    sess, why = open_cast_session(model)
    assert sess is not None, why
    assert any(n.op_type == "Shape" for n in cast_graph(model)[0].model.graph.node)
    feeds = {"x": _feed(kind, ROWS[1], 0)}
    want = GraphEmulator(model, follow_input_dtypes=True).run(feeds).outputs
    assert _same_bits(np.asarray(want["z"]), np.asarray(sess(feeds)["z"]))


@pytest.mark.parametrize(
    ("op", "reason"), [("Exp", "Exp"), ("Erf", "Erf"), ("GlobalMaxPool", "GlobalMaxPool"), ("LogSoftmax", "LogSoftmax")]
)
def test_a_low_node_off_the_lists_keeps_the_emulator(op, reason):
    elem = TensorProto.FLOAT16
    inits, ins, attrs = [], ["x16"], {}
    if op == "MaxPool":
        attrs = {"kernel_shape": [2, 2]}
    nodes = [
        helper.make_node("Cast", ["x"], ["x16"], to=elem),
        helper.make_node(op, ins, ["z16"], name="op", **attrs),
        helper.make_node("Cast", ["z16"], ["z"], to=TensorProto.FLOAT),
    ]
    model = make(nodes, [fvi("x", ["N", 4, 8, 8])], [fvi("z", ["N", "c", "h", "w"])], inits)
    built, why = cast_graph(model)
    assert built is None and reason in why


def test_low_tensors_inside_an_if_body_keep_the_emulator():
    body = helper.make_graph(
        [helper.make_node("Relu", ["h"], ["o"], name="r")], "then", [], [fvi("o", [4], TensorProto.FLOAT16)]
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["h"], ["o2"], name="n")], "else", [], [fvi("o2", [4], TensorProto.FLOAT16)]
    )
    nodes = [
        helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
        helper.make_node("If", ["c"], ["z16"], name="if", then_branch=body, else_branch=other),
        helper.make_node("Cast", ["z16"], ["z"], to=TensorProto.FLOAT),
    ]
    model = make(nodes, [fvi("x", [4]), fvi("c", [], TensorProto.BOOL)], [fvi("z", [4])])
    built, why = cast_graph(model)
    assert built is None and "If" in why


def _cnn(opset: int = 17) -> object:
    """Conv3x3+ReLU twice with a residual Add, then a 1x1 Conv: every node on the lists (BF16 Conv: opset 22)."""
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", pads=[1] * 4),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"], name="conv1", pads=[1] * 4),
        helper.make_node("Add", ["c1", "r0"], ["s"], name="res"),
        helper.make_node("Relu", ["s"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="head"),
    ]
    inits = [init("w0", rng_w(8, 3, 3, 3, seed=0, scale=0.5)), init("b0", rng_w(8, seed=1)),
             init("w1", rng_w(8, 8, 3, 3, seed=2, scale=0.2)), init("b1", rng_w(8, seed=3)),
             init("w2", rng_w(4, 8, 1, 1, seed=4)), init("b2", rng_w(4, seed=5))]
    model = make(nodes, [fvi("x", ["N", 3, 16, 16])], [fvi("y", ["N", 4, 16, 16])], inits, opset=opset)
    model.ir_version = 10 if opset >= 21 else model.ir_version
    return model


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_convert_verifies_a_cnn_through_the_cast_graph_and_records_it(tmp_path, precision):
    """The written model's strict outputs by the cast graph are the emulator's, and the plan says which engine ran."""
    src = save(_cnn(22 if precision == "bf16" else 17), tmp_path / "cnn.onnx")
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(0).standard_normal((48, 3, 16, 16)).astype(np.float32))
    res = convert_precision(ConvertConfig(model=src, output=tmp_path / "o.onnx", calibration=str(tmp_path / "cal.npz"),
                                          precision=Precision.parse(precision), progress=False, batch_size=16))
    ver = json.loads(res.plan_path.read_text())["summary"]["verification"]
    assert ver["engine"] == ENGINE_CASTS and ver["samples"] == 48 and res.plan.summary["nodes_low"] == 6
    written = onnx.load(res.output)
    x = np.random.default_rng(1).standard_normal((5, 3, 16, 16)).astype(np.float32)
    emulator = StrictRunner(written)
    emulator.activate()
    assert _same_bits(open_cast_session(written)[0]({"x": x})["y"], emulator.infer({"x": x})["y"])


def test_a_model_with_a_low_op_off_the_lists_is_verified_by_the_emulator_and_says_so(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("LeakyRelu", ["h"], ["y"], name="act", alpha=0.1)]
    src = save(make(nodes, [fvi("x", ["N", 4, 8])], [fvi("y", ["N", 4, 8])], [init("w", rng_w(8, 8))]),
               tmp_path / "m.onnx")
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(0).standard_normal((32, 4, 8)).astype(np.float32))
    res = convert_precision(ConvertConfig(model=src, output=tmp_path / "o.onnx", calibration=str(tmp_path / "cal.npz"),
                                          progress=False))
    assert res.plan.summary["nodes_low"] == 2 and res.plan.summary["verification"]["engine"] == ENGINE_EMULATOR


def test_a_gated_mlp_is_verified_through_the_cast_graph(tmp_path):
    """MatMul, Tanh, Sigmoid and Mul (the deep net of bench/convert_cost.py): all on the lists."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("Tanh", ["h"], ["t"], name="tanh"),
             helper.make_node("MatMul", ["x", "v"], ["g"], name="gate"),
             helper.make_node("Sigmoid", ["g"], ["s"], name="sig"),
             helper.make_node("Mul", ["t", "s"], ["y"], name="mul")]
    src = save(make(nodes, [fvi("x", ["N", 8])], [fvi("y", ["N", 8])],
                    [init("w", rng_w(8, 8)), init("v", rng_w(8, 8, seed=1))]), tmp_path / "m.onnx")
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32))
    res = convert_precision(ConvertConfig(model=src, output=tmp_path / "o.onnx", calibration=str(tmp_path / "cal.npz"),
                                          progress=False))
    assert res.plan.summary["nodes_low"] == 5 and res.plan.summary["verification"]["engine"] == ENGINE_CASTS


def test_the_searchs_first_candidate_through_the_cast_graph_is_the_emulators_run():
    """The search judges its first candidate (no FP32 tensors from calibration) on the applied model's cast graph:
    the same outputs as the emulator's run of the plan on the FP32 model."""
    model = _cnn()
    info = GraphInfo(model)
    rng = np.random.default_rng(2)
    batches = [{"x": (rng.standard_normal((4, 3, 16, 16)) * 8).astype(np.float32)} for _ in range(2)]
    low = {a: Precision.FP16 for a in info.by_address}
    for keep_io_types in (True, False):
        ev = StrictEvaluator(model, info, batches, Precision.FP16, keep_io_types=keep_io_types)
        got = ev.candidate(low).outputs()
        emu = GraphEmulator(model)
        for batch, out in zip(batches, got, strict=True):
            want = emu.run(batch, low).outputs["y"]
            assert out["y"].dtype == np.float32 and _same_bits(out["y"], want)
        assert ev.evaluations == len(info.nodes) * len(batches)


def test_a_pass_asked_for_the_emulator_gets_it_with_the_same_bits():
    """verify_and_repair runs the floor's noise pass and the repairs on the first pass's engine (fast=False when
    that was the emulator); on a qualifying model both engines give the same outputs."""
    model = _cnn()
    x = {"x": np.random.default_rng(3).standard_normal((3, 3, 16, 16)).astype(np.float32)}
    info = GraphInfo(model)
    written = apply_plan(model, info, {a: Precision.FP16 for a in info.by_address}, Precision.FP16).model
    fast, slow = StrictEvaluator.model_runner(written), StrictEvaluator.model_runner(written, fast=False)
    assert (fast.engine, slow.engine) == (ENGINE_CASTS, ENGINE_EMULATOR)
    assert _same_bits(fast(x)["y"], slow(x)["y"]) and (fast.engine, slow.engine) == (ENGINE_CASTS, ENGINE_EMULATOR)
