"""The cast graph: a converted model's strict numerics run by ONNX Runtime, bit for bit the emulator's (issue 27)."""

from __future__ import annotations

import json
import logging

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
    elif op == "PRelu":  # a slope per channel: negative, zero of either sign, one that overflows FP16 products
        inits.append(init("slope", np.array([-0.25, 0.0, -0.0, 3000.0], np.float32).reshape(4, 1, 1).astype(dtype)))
        ins.append("slope")
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
    ("Add", {}), ("Sub", {}), ("Mul", {}), ("Div", {}), ("LeakyRelu", {"alpha": 0.1}), ("LeakyRelu", {}),
    ("PRelu", {}),
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


def test_a_model_with_a_low_op_off_the_lists_is_verified_by_the_emulator_and_says_so(tmp_path, caplog):
    """The log says once per convert which low op keeps the emulator, and why (issue 37)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("Elu", ["h"], ["y"], name="act", alpha=0.1)]
    src = save(make(nodes, [fvi("x", ["N", 4, 8])], [fvi("y", ["N", 4, 8])], [init("w", rng_w(8, 8))]),
               tmp_path / "m.onnx")
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(0).standard_normal((32, 4, 8)).astype(np.float32))
    with caplog.at_level(logging.INFO, logger="mpinfer"):
        res = convert_precision(ConvertConfig(model=src, output=tmp_path / "o.onnx",
                                              calibration=str(tmp_path / "cal.npz"), progress=False))
    assert res.plan.summary["nodes_low"] == 2 and res.plan.summary["verification"]["engine"] == ENGINE_EMULATOR
    said = [r.getMessage() for r in caplog.records if "the emulator runs the model" in r.getMessage()]
    assert len(said) == 1 and "low Elu cannot be expressed as a float32 graph because" in said[0], said


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


def _signed_zeros(x: np.ndarray, seed: int) -> np.ndarray:
    """``x`` made non-positive, a third of it zeros of either sign: a max over it is often a zero of some sign."""
    rng = np.random.default_rng(seed + 100)
    out = -np.abs(x)
    zero = rng.random(x.shape) < 0.35
    out[zero] = np.where(rng.random(int(zero.sum())) < 0.5, np.float32(-0.0), np.float32(0.0))
    return out


def _idx(name: str, value) -> object:
    return init(name, np.array(value, np.int64))


# (op, extra initializers (name, maker(dtype)), node attributes, opset, output rank, two float inputs, feed share,
#  feed transform): each op the cast graph added in issue 37, in the variants the emulator computes.
ADDED = [
    ("ReduceMax", [], {"axes": [2, 3], "keepdims": 1}, 17, 4, False, 0.02, None),
    ("ReduceMax", [], {"axes": [1], "keepdims": 0}, 17, 3, False, 0.02, _signed_zeros),
    ("ReduceMin", [], {"axes": [-1], "keepdims": 1}, 17, 4, False, 0.02, lambda x, s: -_signed_zeros(x, s)),
    ("ReduceMax", [lambda d: _idx("axes", [1, 3])], {"keepdims": 1}, 18, 4, False, 0.02, _signed_zeros),
    ("ReduceMin", [], {"keepdims": 0}, 17, 0, False, 0.001, None),
    ("Pad", [lambda d: _idx("pads", [0, 0, 1, 2, 0, 0, 2, 1]), lambda d: init("cv", np.array(0.1, d))],
     {"mode": "constant"}, 17, 4, False, 0.25, None),
    ("Pad", [lambda d: _idx("pads", [0, 0, 1, 2, 0, 0, 2, 1])], {"mode": "reflect"}, 17, 4, False, 0.25, None),
    ("Pad", [lambda d: _idx("pads", [0, 1, -1, 3, 0, 0, 2, -2])], {"mode": "edge"}, 17, 4, False, 0.25, None),
    ("Pad", [lambda d: _idx("pads", [0, 0, 3, 1, 0, 0, 1, 2])], {"mode": "wrap"}, 19, 4, False, 0.25, None),
    ("Pad", [], {"pads": [0, 0, 1, 1, 0, 0, 2, 0], "value": 0.1}, 10, 4, False, 0.25, None),
    ("Gather", [lambda d: _idx("i", [[3, 0], [-1, 2]])], {"axis": 2}, 17, 5, False, 0.25, None),
    ("GatherElements", [lambda d: _idx("i", np.random.default_rng(0).integers(-8, 8, (1, 4, 8, 3)))],
     {"axis": 3}, 17, 4, False, 0.25, None),
    ("Tile", [lambda d: _idx("r", [1, 2, 1, 3])], {}, 17, 4, False, 0.25, None),
    ("Expand", [lambda d: _idx("s", [2, 1, 4, 8, 8])], {}, 17, 5, False, 0.25, None),
    ("Sqrt", [], {}, 17, 4, False, 0.25, lambda x, s: np.abs(x)),
    ("Sqrt", [], {}, 17, 4, False, 0.25, None),
    ("Reciprocal", [], {}, 17, 4, False, 0.25, None),
    ("Floor", [], {}, 17, 4, False, 0.25, None), ("Ceil", [], {}, 17, 4, False, 0.25, None),
    ("Round", [], {}, 17, 4, False, 0.25, lambda x, s: np.round(np.clip(x, -1e4, 1e4) * 2) / 2),  # (ties: halves)
    ("Sign", [], {}, 17, 4, False, 0.25, None),
    ("Equal", [], {}, 17, 4, True, 0.25, lambda x, s: np.round(x)), ("Less", [], {}, 17, 4, True, 0.25, None),
    ("GreaterOrEqual", [], {}, 17, 4, True, 0.25, None),
    ("Resize", [lambda d: init("roi", np.zeros(0, np.float32)), lambda d: init("sc", np.float32([1, 1, 2, 2]))],
     {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, 13, 4, False, 0.25,
     None),  # (layout_cdla's)
    ("Resize", [lambda d: init("roi", np.zeros(0, np.float32)), lambda d: init("sc", np.float32([1, 2, 3, 2]))],
     {"mode": "nearest"}, 17, 4, False, 0.25, None),
    ("Resize", [lambda d: init("roi", np.zeros(0, np.float32)), lambda d: init("sc", np.float32([1, 1, 2, 3]))],
     {"mode": "nearest", "coordinate_transformation_mode": "pytorch_half_pixel", "nearest_mode": "round_prefer_ceil"},
     18, 4, False, 0.25, None),
    ("Resize", [lambda d: init("roi", np.zeros(0, np.float32)), lambda d: init("sc", np.float32([1, 1, 2, 2]))],
     {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor",
      "cubic_coeff_a": -0.75, "exclude_outside": 0, "extrapolation_value": 0.0}, 17, 4, False, 0.25,
     None),  # (a torch export's, YOLO's: attributes nearest sampling never reads)
    ("Resize", [lambda d: init("sc", np.float32([1, 1, 4, 2]))], {"mode": "nearest"}, 10, 4, False, 0.25, None),
    ("Upsample", [lambda d: init("sc", np.float32([1, 1, 2, 2]))], {"mode": "nearest"}, 9, 4, False, 0.25, None),
]


def _added(op: str, kind: str, extra: list, attrs: dict, opset: int, rank: int, two: bool) -> object:
    """Float32 inputs cast to the low dtype, one low ``op`` node, its output cast back to float32 (Equal, Less...: a
    boolean output cast to float32)."""
    elem, dtype = LOW[kind]
    names = ["x", "y"] if two else ["x"]
    nodes = [helper.make_node("Cast", [n], [f"{n}_low"], to=elem) for n in names]
    inits = [make_init(dtype) for make_init in extra]
    ins = [f"{n}_low" for n in names] + [t.name for t in inits]
    if op == "GatherElements":  # (indices of the data's shape but the batch: the first sample's data)
        inits += [_idx("one", [1]), _idx("zero", [0])]
        nodes.insert(0, helper.make_node("Slice", ["x", "zero", "one", "zero"], ["x0"], name="first"))
        nodes[1].input[0] = "x0"
    nodes.append(helper.make_node(op, ins, ["z_low"], name="op", **attrs))
    nodes.append(helper.make_node("Cast", ["z_low"], ["z"], to=TensorProto.FLOAT))
    dims = [f"d{i}" for i in range(rank)]
    model = make(nodes, [fvi(n, ["N", *SHAPE]) for n in names], [fvi("z", dims)], inits, opset=opset)
    return model


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize(("op", "extra", "attrs", "opset", "rank", "two", "share", "shape_feed"), ADDED,
                         ids=[f"{c[0]}{i}" for i, c in enumerate(ADDED)])
def test_each_added_op_gives_the_emulators_bits(op, extra, attrs, opset, rank, two, share, shape_feed, kind):
    """Issue 37's ops (reductions to an extreme, Pad, indexing, broadcasting, IEEE square root and reciprocal,
    integer rounding, comparisons, nearest Resize by whole scales): one low node, FP16 and BF16, inf/NaN/±0/subnormal/
    tie inputs, the emulator's numpy casts and its ONNX Runtime casts; the cast graph gives the emulator's bits."""
    model = _added(op, kind, extra, attrs, opset, rank, two)
    sess, why = open_cast_session(model)
    if kind == "bf16" and opset < 13:  # (BF16 Casts need opset 13: refused, the emulator runs it)
        assert sess is None and f"opset {opset}" in why
        return
    assert sess is not None, why
    emulator = StrictRunner(model)
    emulator.activate()
    for rows in ROWS:
        feeds = {}
        for seed, name in enumerate(i.name for i in model.graph.input):
            x = _feed(kind, rows, seed, share)
            feeds[name] = np.ascontiguousarray(shape_feed(x, seed) if shape_feed else x, np.float32)
        want, got = emulator.infer(feeds), sess(feeds)
        assert _same_bits(np.asarray(want["z"]), np.asarray(got["z"])), (op, kind, rows)
        if op.startswith("Reduce") and rows == ROWS[1] and rank:  # the feeds reach the NaNs and the signed zeros
            z = np.asarray(want["z"])
            assert np.isnan(z).any() and not np.isnan(z).all(), op
            if shape_feed is not None:
                assert (np.signbit(z[z == 0])).any() and (~np.signbit(z[z == 0])).any(), op
    assert op in EXACT_OPS | ROUNDED_OPS
    if op in ROUNDED_OPS or (op == "Pad" and opset < 11):
        assert cast_graph(model)[0].rounded == len(model.graph.input) + 1, op


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_a_batchnorm_whose_parameters_are_cast_from_fp32_weights_gives_the_emulators_bits(kind):
    """Convert casts an FP32 weight that FP32 nodes read too (layout_cdla's BatchNorms): the parameters are Casts of
    FP32 initializers, folded from numpy's cast as the emulator's Cast kernel computes it."""
    elem, _ = LOW[kind]
    rng = np.random.default_rng(5)
    params = {"scale": rng.standard_normal(4) * 3, "shift": rng.standard_normal(4) + 0.1,
              "mean": rng.standard_normal(4), "var": np.array([1e-4, 0.5, 2.0, 1e4])}
    nodes = [helper.make_node("Cast", ["x"], ["x_low"], to=elem)]
    nodes += [helper.make_node("Cast", [n], [f"{n}_low"], to=elem) for n in params]
    nodes += [helper.make_node("BatchNormalization", ["x_low", *(f"{n}_low" for n in params)], ["z_low"], name="op"),
              helper.make_node("Cast", ["z_low"], ["z"], to=TensorProto.FLOAT)]
    inits = [init(n, v.astype(np.float32) * np.float32(1.0 + 2.0**-12)) for n, v in params.items()]  # (not low values)
    model = make(nodes, [fvi("x", ["N", *SHAPE])], [fvi("z", ["N", *SHAPE])], inits)
    sess, why = open_cast_session(model)
    assert sess is not None, why
    emulator = StrictRunner(model)
    emulator.activate()
    for rows in ROWS:
        feeds = {"x": _feed(kind, rows, 0)}
        assert _same_bits(np.asarray(emulator.infer(feeds)["z"]), np.asarray(sess(feeds)["z"])), (kind, rows)


@pytest.mark.parametrize(("attrs", "scales", "reason"), [
    ({"mode": "linear"}, [1, 1, 2, 2], "mode linear"),
    ({"mode": "nearest", "coordinate_transformation_mode": "align_corners"}, [1, 1, 2, 2], "align_corners"),
    ({"mode": "nearest"}, [1, 1, 1.5, 2], "whole numbers"),
])
def test_a_resize_the_cast_graph_cannot_place_keeps_the_emulator_and_says_why(attrs, scales, reason):
    """Linear modes round per axis, other coordinate modes and fractional scales pick pixels from float64 coordinates
    in the emulator (float32 in ONNX Runtime): the emulator runs them, and the reason names the node's variant."""
    nodes = [helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
             helper.make_node("Resize", ["x16", "roi", "sc"], ["z16"], name="op", **attrs),
             helper.make_node("Cast", ["z16"], ["z"], to=TensorProto.FLOAT)]
    model = make(nodes, [fvi("x", ["N", 4, 8, 8])], [fvi("z", ["N", "c", "h", "w"])],
                 [init("roi", np.zeros(0, np.float32)), init("sc", np.float32(scales))])
    built, why = cast_graph(model)
    assert built is None and "low Resize" in why and reason in why


@pytest.mark.parametrize("stored_low", [False, True])
@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_an_fp32_batchnorm_before_low_nodes_gives_the_emulators_bits(kind, stored_low):
    """An FP32 BatchNorm (kept by the search) feeding low nodes: the cast graph folds it as the emulator does, so the
    low nodes after it see the emulator's float32 bits (ONNX Runtime's BatchNormalization kernel lands elsewhere).
    ``stored_low``: its parameters are low weights cast back to float32, as convert writes a weight low nodes share
    (layout_cdla's)."""
    elem, dtype = LOW[kind]
    rng = np.random.default_rng(7)
    params = {"scale": rng.standard_normal(4) * 3, "shift": rng.standard_normal(4) + 0.1,
              "mean": rng.standard_normal(4), "var": np.array([1e-4, 0.5, 2.0, 1e4]) * 1.37}
    ins = [f"{n}_up" if stored_low else n for n in params]
    nodes = [helper.make_node("Cast", [n], [f"{n}_up"], to=TensorProto.FLOAT) for n in params] if stored_low else []
    nodes += [helper.make_node("BatchNormalization", ["x", *ins], ["b"], name="bn", epsilon=1e-3),
              helper.make_node("Cast", ["b"], ["b_low"], to=elem),
              helper.make_node("Mul", ["b_low", "b_low"], ["z_low"], name="op"),
              helper.make_node("Cast", ["z_low"], ["z"], to=TensorProto.FLOAT)]
    inits = [init(n, v.astype(np.float32).astype(dtype) if stored_low else v.astype(np.float32))
             for n, v in params.items()]
    model = make(nodes, [fvi("x", ["N", *SHAPE])], [fvi("z", ["N", *SHAPE]), fvi("b", ["N", *SHAPE])], inits)
    sess, why = open_cast_session(model)
    assert sess is not None, why
    assert not any(n.op_type == "BatchNormalization" for n in cast_graph(model)[0].model.graph.node)
    emulator = StrictRunner(model)
    emulator.activate()
    for rows in ROWS:
        feeds = {"x": _feed(kind, rows, 0, 0.01)}
        want, got = emulator.infer(feeds), sess(feeds)
        for name in ("z", "b"):
            assert _same_bits(np.asarray(want[name]), np.asarray(got[name])), (kind, rows, name)


def test_a_cast_graphs_inputs_carry_their_type_and_no_shape():
    """ONNX Runtime's setup of a partly symbolic input shape grows with the graph's low tensors (the OCR recognizer's
    cast graph: 0.48 s to open, 0.056 s unshaped): the cast graph declares its inputs by element type alone, and runs
    any shape the converted model takes, with the emulator's bits."""
    model = _cnn()
    info = GraphInfo(model)
    low = dict.fromkeys(info.by_address, Precision.FP16)
    applied = apply_plan(model, info, low, Precision.FP16)
    built, why = cast_graph(applied.model)
    assert built is not None, why
    for vi in built.model.graph.input:
        assert vi.type.tensor_type.elem_type == TensorProto.FLOAT and not vi.type.tensor_type.HasField("shape")
    sess, _ = open_cast_session(applied.model)
    assert sess is not None
    emu = GraphEmulator(model)
    for n in (1, 3):
        x = {"x": (np.random.default_rng(n).standard_normal((n, 3, 16, 16)) * 8).astype(np.float32)}
        assert _same_bits(sess(x)["y"], emu.run(x, low).outputs["y"])


@pytest.mark.parametrize("width", [64, 512])
def test_wide_matmuls_give_the_emulators_bits(width):
    """The emulator's MatMul reads its weight as an input (never prepacked); the cast graph's weights are initializers,
    which ONNX Runtime would prepack, and the prepacked kernel sums on other bits from a width of 256 on."""
    nodes, prev, inits = [], "x", []
    for i in range(3):
        inits.append(init(f"w{i}", rng_w(width, width, seed=i) / 16))
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Tanh", [f"m{i}"], [f"t{i}"], name=f"tanh{i}")]
        prev = f"t{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    model = make(nodes, [fvi("x", ["N", width])], [fvi("y", ["N", width])], inits)
    info = GraphInfo(model)
    low = dict.fromkeys(info.by_address, Precision.FP16)
    sess, why = open_cast_session(apply_plan(model, info, low, Precision.FP16).model)
    assert sess is not None, why
    x = {"x": np.random.default_rng(0).standard_normal((64, width)).astype(np.float32)}
    assert _same_bits(sess(x)["y"], GraphEmulator(model).run(x, low).outputs["y"])
