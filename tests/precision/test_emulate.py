"""GraphEmulator: FP32 parity with ONNX Runtime, honest FP16/BF16 arithmetic, incremental runs."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpinfer.errors import BackendUnavailableError, InvalidInputError
from mpinfer.modelio import iter_nodes
from mpinfer.precision.emulator.emulate import GraphEmulator
from mpinfer.specs import Precision
from tests.precision.numerics_graphs import MODEL_NAMES, export_dynamo, make_model, ort_run
from tests.tolerances import assert_onnx_outputs_close, assert_reorder_close, eps

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_fp32_matches_onnxruntime_on_example_models(exported, name):
    model, feeds = exported(name)
    emu = GraphEmulator(model)
    assert emu.unsupported_ops() == set()
    want = ort_run(model, feeds)
    got = emu.run(feeds).outputs
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype
        assert_onnx_outputs_close(got[k], want[k], model, err_msg=k)


@pytest.mark.parametrize("name", ["transformer_small", "control_flow"])
def test_fp32_matches_onnxruntime_on_dynamo_exports(name):
    model, feeds = export_dynamo(name)
    emu = GraphEmulator(model)
    want = ort_run(model, feeds)
    got = emu.run(feeds).outputs
    for k in want:
        assert_onnx_outputs_close(got[k], want[k], model, err_msg=k)
    assert emu.fallback_ops() == {}


def _single(op, inputs, outputs, attrs=None, inits=(), opset=17):
    """One-node model: inputs/outputs are (name, shape[, elem]) tuples; inits are (name, array)."""
    node = helper.make_node(
        op,
        [i[0] for i in inputs] + [n for n, _ in inits],
        [o[0] for o in outputs],
        name=f"{op}_0",
        **(attrs or {}),
    )
    return make_model([node], inputs, outputs, [_init(n, a) for n, a in inits], opset=opset)


R = np.random.default_rng(1)
X4 = R.standard_normal((2, 4, 9, 9)).astype(np.float32)
W4 = R.standard_normal((6, 4, 3, 3)).astype(np.float32)

# (id, op, input specs, output specs, attrs, initializers, feeds, opset)
OP_CASES = [
    (
        "conv-strided-padded",
        "Conv",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"strides": [2, 2], "pads": [1, 0, 2, 1]},
        [("w", W4), ("b", np.arange(6, dtype=np.float32))],
        {"x": X4},
        17,
    ),
    (
        "conv-groups-dilated",
        "Conv",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"group": 2, "dilations": [2, 1]},
        [("w", R.standard_normal((6, 2, 3, 3)).astype(np.float32))],
        {"x": X4},
        17,
    ),
    (
        "conv-depthwise-same",
        "Conv",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"group": 4, "auto_pad": "SAME_UPPER", "strides": [2, 2]},
        [("w", R.standard_normal((4, 1, 4, 4)).astype(np.float32))],
        {"x": X4},
        17,
    ),
    (
        "conv-depthwise-multiplier",
        "Conv",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"group": 4, "pads": [1, 2, 1, 0], "dilations": [1, 2]},
        [("w", R.standard_normal((8, 1, 3, 2)).astype(np.float32)), ("b", np.ones(8, np.float32))],
        {"x": X4},
        17,
    ),
    (
        "conv-1d",
        "Conv",
        [("x", [2, 3, 11])],
        [("y", None)],
        {"pads": [1, 1]},
        [("w", R.standard_normal((5, 3, 3)).astype(np.float32))],
        {"x": R.standard_normal((2, 3, 11)).astype(np.float32)},
        17,
    ),
    (
        "convtranspose",
        "ConvTranspose",
        [("x", [2, 4, 5, 5])],
        [("y", None)],
        {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
        [("w", R.standard_normal((4, 3, 3, 3)).astype(np.float32)), ("b", np.ones(3, np.float32))],
        {"x": R.standard_normal((2, 4, 5, 5)).astype(np.float32)},
        17,
    ),
    (
        "convtranspose-groups",
        "ConvTranspose",
        [("x", [1, 4, 4, 4])],
        [("y", None)],
        {"group": 2, "strides": [2, 2]},
        [("w", R.standard_normal((4, 2, 2, 2)).astype(np.float32))],
        {"x": R.standard_normal((1, 4, 4, 4)).astype(np.float32)},
        17,
    ),
    (
        "maxpool-ceil",
        "MaxPool",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
        [],
        {"x": X4},
        17,
    ),
    (
        "maxpool-pads",
        "MaxPool",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "dilations": [2, 2]},
        [],
        {"x": X4},
        17,
    ),
    (
        "avgpool-exclude-pad",
        "AveragePool",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        [],
        {"x": X4},
        17,
    ),
    (
        "avgpool-include-pad-ceil",
        "AveragePool",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {
            "kernel_shape": [2, 2],
            "strides": [2, 2],
            "pads": [1, 1, 1, 1],
            "count_include_pad": 1,
            "ceil_mode": 1,
        },
        [],
        {"x": X4},
        17,
    ),
    # Feature maps smaller than the window (a CNN run at a size it is not used at): ONNX Runtime's output
    # size truncates toward zero, so a window overhanging the map still gives one output from what is there.
    (
        "maxpool-map-smaller-than-window",
        "MaxPool",
        [("x", [2, 4, 1, 3])],
        [("y", None)],
        {"kernel_shape": [2, 2], "strides": [2, 2]},
        [],
        {"x": X4[:, :, :1, :3]},
        11,
    ),
    (
        "avgpool-map-smaller-than-window",
        "AveragePool",
        [("x", [2, 4, 1, 1])],
        [("y", None)],
        {"kernel_shape": [2, 2], "strides": [2, 2]},
        [],
        {"x": X4[:, :, :1, :1]},
        11,
    ),
    (
        "avgpool-window-fits-nowhere",
        "AveragePool",
        [("x", [2, 4, 2, 2])],
        [("y", None)],
        {"kernel_shape": [3, 3]},
        [],
        {"x": X4[:, :, :2, :2]},
        11,
    ),
    (
        "resize-nearest",
        "Resize",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"mode": "nearest"},
        [("roi", np.zeros(0, np.float32)), ("scales", np.array([1, 1, 2, 1.5], np.float32))],
        {"x": X4},
        13,
    ),
    (
        "resize-linear-align",
        "Resize",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
        [("roi", np.zeros(0, np.float32)), ("scales", np.array([1, 1, 0.6, 2.5], np.float32))],
        {"x": X4},
        13,
    ),
    (
        "resize-linear-sizes",
        "Resize",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"mode": "linear"},
        [
            ("roi", np.zeros(0, np.float32)),
            ("scales", np.zeros(0, np.float32)),
            ("sizes", np.array([2, 4, 13, 7], np.int64)),
        ],
        {"x": X4},
        13,
    ),
    (
        "groupnorm",
        "GroupNormalization",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"num_groups": 2, "epsilon": 1e-3},
        [
            ("s", np.array([1.0, 2.0, 3.0, 4.0], np.float32)),
            ("b", np.array([0.1, 0.2, 0.3, 0.4], np.float32)),
        ],
        {"x": X4},
        21,
    ),
    (
        "instancenorm",
        "InstanceNormalization",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {},
        [
            ("s", np.array([1.0, 2.0, 3.0, 4.0], np.float32)),
            ("b", np.array([0.1, 0.2, 0.3, 0.4], np.float32)),
        ],
        {"x": X4},
        17,
    ),
    (
        "batchnorm",
        "BatchNormalization",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"epsilon": 1e-3},
        [
            ("s", np.array([1.0, 2.0, 3.0, 4.0], np.float32)),
            ("b", np.array([0.1, 0.2, 0.3, 0.4], np.float32)),
            ("m", np.array([0.5, -0.5, 0, 1], np.float32)),
            ("v", np.array([1, 2, 0.5, 4], np.float32)),
        ],
        {"x": X4},
        15,
    ),
    (
        "softmax-opset11-coerced",
        "Softmax",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"axis": 1},
        [],
        {"x": X4},
        11,
    ),
    ("logsoftmax", "LogSoftmax", [("x", [2, 4, 9, 9])], [("y", None)], {"axis": 2}, [], {"x": X4}, 13),
    (
        "reducel2-opset18",
        "ReduceL2",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"keepdims": 0},
        [("axes", np.array([1, -1], np.int64))],
        {"x": X4},
        18,
    ),
    (
        "reducelogsumexp",
        "ReduceLogSumExp",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"axes": [2]},
        [],
        {"x": X4},
        13,
    ),
    (
        "reducesum-opset13",
        "ReduceSum",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {},
        [("axes", np.array([0, 2], np.int64))],
        {"x": X4},
        13,
    ),
    (
        "reduceprod",
        "ReduceProd",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"axes": [3], "keepdims": 0},
        [],
        {"x": X4},
        13,
    ),
    (
        "pad-reflect",
        "Pad",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {"mode": "reflect"},
        [("p", np.array([0, 0, 2, -1, 0, 0, 1, 3], np.int64))],
        {"x": X4},
        17,
    ),
    (
        "slice-negative-step",
        "Slice",
        [("x", [2, 4, 9, 9])],
        [("y", None)],
        {},
        [
            ("st", np.array([-1, 7], np.int64)),
            ("en", np.array([-100, 1], np.int64)),
            ("ax", np.array([2, 3], np.int64)),
            ("sp", np.array([-2, -3], np.int64)),
        ],
        {"x": X4},
        17,
    ),
    (
        "topk",
        "TopK",
        [("x", [2, 4, 9, 9])],
        [("v", None), ("i", None, I64)],
        {"axis": 2},
        [("k", np.array([4], np.int64))],
        {"x": X4},
        17,
    ),
    (
        "argmax-last",
        "ArgMax",
        [("x", [5, 6])],
        [("y", None, I64)],
        {"axis": 1, "select_last_index": 1, "keepdims": 0},
        [],
        {"x": np.array(R.integers(0, 3, (5, 6)), np.float32)},
        17,
    ),
    (
        "einsum",
        "Einsum",
        [("a", [3, 4, 5]), ("b", [3, 5, 2])],
        [("y", None)],
        {"equation": "bij,bjk->bik"},
        [],
        {
            "a": R.standard_normal((3, 4, 5)).astype(np.float32),
            "b": R.standard_normal((3, 5, 2)).astype(np.float32),
        },
        17,
    ),
    (
        "cumsum-exclusive-reverse",
        "CumSum",
        [("x", [4, 5])],
        [("y", None)],
        {"exclusive": 1, "reverse": 1},
        [("axis", np.array(1, np.int64))],
        {"x": R.standard_normal((4, 5)).astype(np.float32)},
        17,
    ),
    (
        "scatternd-add",
        "ScatterND",
        [("x", [4, 3])],
        [("y", None)],
        {"reduction": "add"},
        [("i", np.array([[1], [3], [1]], np.int64)), ("u", np.ones((3, 3), np.float32))],
        {"x": R.standard_normal((4, 3)).astype(np.float32)},
        17,
    ),
    (
        "gatherelements",
        "GatherElements",
        [("x", [3, 4])],
        [("y", None)],
        {"axis": 1},
        [("i", np.array([[0, -1], [2, 1], [3, 3]], np.int64))],
        {"x": R.standard_normal((3, 4)).astype(np.float32)},
        17,
    ),
    (
        "gelu-tanh",
        "Gelu",
        [("x", [3, 4])],
        [("y", None)],
        {"approximate": "tanh"},
        [],
        {"x": R.standard_normal((3, 4)).astype(np.float32) * 3},
        20,
    ),
    (
        "hardswish",
        "HardSwish",
        [("x", [3, 4])],
        [("y", None)],
        {},
        [],
        {"x": R.standard_normal((3, 4)).astype(np.float32) * 4},
        17,
    ),
    (
        "softplus",
        "Softplus",
        [("x", [3, 4])],
        [("y", None)],
        {},
        [],
        {"x": R.standard_normal((3, 4)).astype(np.float32) * 20},
        17,
    ),
    (
        "split-opset18",
        "Split",
        [("x", [2, 7])],
        [("a", None), ("b", None), ("c", None)],
        {"axis": 1, "num_outputs": 3},
        [],
        {"x": R.standard_normal((2, 7)).astype(np.float32)},
        18,
    ),
    (
        "rmsnorm",
        "RMSNormalization",
        [("x", [2, 4, 9])],
        [("y", None)],
        {"epsilon": 1e-3, "axis": 1},
        [("s", R.standard_normal((4, 9)).astype(np.float32))],
        {"x": R.standard_normal((2, 4, 9)).astype(np.float32)},
        23,
    ),
    (
        "lstm-bidirectional-peepholes",
        "LSTM",
        [("x", [5, 2, 3])],
        [("y", None), ("yh", None), ("yc", None)],
        {"hidden_size": 4, "direction": "bidirectional"},
        [
            ("w", R.standard_normal((2, 16, 3)).astype(np.float32) * 0.5),
            ("r", R.standard_normal((2, 16, 4)).astype(np.float32) * 0.5),
            ("b", R.standard_normal((2, 32)).astype(np.float32) * 0.1),
            ("lens", np.array([5, 5], np.int32)),
            ("h0", R.standard_normal((2, 2, 4)).astype(np.float32)),
            ("c0", R.standard_normal((2, 2, 4)).astype(np.float32)),
            ("p", R.standard_normal((2, 12)).astype(np.float32) * 0.3),
        ],
        {"x": R.standard_normal((5, 2, 3)).astype(np.float32)},
        17,
    ),
    (
        "gru-reverse-linear-before-reset",
        "GRU",
        [("x", [6, 3, 5])],
        [("y", None), ("yh", None)],
        {"hidden_size": 4, "direction": "reverse", "linear_before_reset": 1},
        [
            ("w", R.standard_normal((1, 12, 5)).astype(np.float32) * 0.5),
            ("r", R.standard_normal((1, 12, 4)).astype(np.float32) * 0.5),
            ("b", R.standard_normal((1, 24)).astype(np.float32) * 0.1),
        ],
        {"x": R.standard_normal((6, 3, 5)).astype(np.float32)},
        17,
    ),
    (
        "gru-default",
        "GRU",
        [("x", [6, 3, 5])],
        [("y", None), ("yh", None)],
        {"hidden_size": 4},
        [
            ("w", R.standard_normal((1, 12, 5)).astype(np.float32) * 0.5),
            ("r", R.standard_normal((1, 12, 4)).astype(np.float32) * 0.5),
        ],
        {"x": R.standard_normal((6, 3, 5)).astype(np.float32)},
        17,
    ),
    (
        "attention-4d-causal-past",
        "Attention",
        [("q", [2, 4, 3, 8]), ("k", [2, 4, 3, 8]), ("v", [2, 4, 3, 8])],
        [("y", None), ("pk", None), ("pv", None)],
        {"is_causal": 1},
        [
            ("mask", np.ones((3, 5), bool)),
            ("past_k", R.standard_normal((2, 4, 2, 8)).astype(np.float32)),
            ("past_v", R.standard_normal((2, 4, 2, 8)).astype(np.float32)),
        ],
        {k: R.standard_normal((2, 4, 3, 8)).astype(np.float32) for k in "qkv"},
        23,
    ),
    (
        "attention-3d-gqa-mask-softcap",
        "Attention",
        [("q", [2, 5, 32]), ("k", [2, 6, 16]), ("v", [2, 6, 16])],
        [("y", None)],
        {"q_num_heads": 4, "kv_num_heads": 2, "softcap": 3.0, "scale": 0.2},
        [("mask", R.standard_normal((5, 6)).astype(np.float32))],
        {
            "q": R.standard_normal((2, 5, 32)).astype(np.float32),
            "k": R.standard_normal((2, 6, 16)).astype(np.float32),
            "v": R.standard_normal((2, 6, 16)).astype(np.float32),
        },
        23,
    ),
    (
        "trilu-fallback",
        "Trilu",
        [("x", [4, 4])],
        [("y", None)],
        {"upper": 0},
        [],
        {"x": R.standard_normal((4, 4)).astype(np.float32)},
        17,
    ),
    (
        "depthtospace-fallback",
        "DepthToSpace",
        [("x", [1, 8, 2, 3])],
        [("y", None)],
        {"blocksize": 2, "mode": "CRD"},
        [],
        {"x": R.standard_normal((1, 8, 2, 3)).astype(np.float32)},
        17,
    ),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_op_kernels_match_onnxruntime(case):
    _id, op, ins, outs, attrs, inits, feeds, opset = case
    model = _single(op, ins, outs, attrs, inits, opset)
    want = ort_run(model, feeds)
    emu = GraphEmulator(model)
    got = emu.run(feeds).outputs
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert_onnx_outputs_close(got[k], want[k], model, err_msg=k)
    assert (f"{op}_0" in emu.fallback_ops()) == _id.endswith("fallback")


def _chain(elem):
    """x*y + z, relu, / y, - z, sigmoid: every node's output rounded when elem is FLOAT16."""
    nodes = [
        helper.make_node("Mul", ["x", "y"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "z"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("Div", ["r", "y"], ["d"], name="div"),
        helper.make_node("Sub", ["d", "z"], ["s"], name="sub"),
        helper.make_node("MatMul", ["s", "w"], ["out"], name="matmul"),
    ]
    shape = [8, 16]
    return make_model(
        nodes, [("x", shape), ("y", shape), ("z", shape), ("w", [16, 4])], [("out", None)], elem=elem
    )


def _ort_node_by_node(model, feeds):
    """ORT on an FP16 model one node per session: every node's output really is stored in FP16.

    (A whole-model ORT CPU session keeps FP32 intermediates between the Casts it inserts around ops
    without FP16 kernels, which is why it understates FP16 error.)
    """
    env = dict(feeds)
    for node in model.graph.node:
        ins = [(i, list(env[i].shape), TensorProto.FLOAT16) for i in node.input]
        single = make_model([node], ins, [(node.output[0], None, TensorProto.FLOAT16)])
        env.update(ort_run(single, {i: env[i] for i in node.input}))
    return env


def test_fp16_matches_onnxruntime_computing_each_node_in_fp16(rng):
    feeds = {
        k: (rng.standard_normal(s) * 3).astype(np.float32)
        for k, s in (("x", (8, 16)), ("y", (8, 16)), ("z", (8, 16)), ("w", (16, 4)))
    }
    feeds["y"] = np.where(np.abs(feeds["y"]) < 0.1, 0.5, feeds["y"]).astype(np.float32)
    feeds16 = {k: v.astype(np.float16) for k, v in feeds.items()}
    fp16_model = _chain(TensorProto.FLOAT16)
    want = _ort_node_by_node(fp16_model, feeds16)
    emu = GraphEmulator(_chain(TensorProto.FLOAT))
    low = {a: Precision.FP16 for a in emu.node_addresses()}
    run = emu.run(feeds, low, keep=True)
    for name in ("m", "a", "r", "d", "s"):  # elementwise: bit-exact
        assert run.tensors[name].dtype == np.float16
        np.testing.assert_array_equal(run.tensors[name], want[name], err_msg=name)
    got = run.outputs["out"]
    assert got.dtype == np.float32  # graph outputs keep the declared dtype
    # the MatMul's 16-term sums: FP16 on either side at worst (sum |s_k w_kj| from the FP16 operands)
    terms = np.abs(want["s"].astype(np.float64)) @ np.abs(feeds16["w"].astype(np.float64))
    assert_reorder_close(got, want["out"].astype(np.float32), np.float16, n=16, magnitude=terms)
    exact = emu.run(feeds).outputs["out"]
    assert np.abs(got - exact).max() > 1e-3  # the FP16 error is really there
    # the strict mode on the FP16 model itself (dtype-following) computes the same thing
    strict = GraphEmulator(fp16_model, follow_input_dtypes=True).run(feeds16).outputs["out"]
    assert strict.dtype == np.float16
    np.testing.assert_array_equal(strict.astype(np.float32), got)


def _norm_model(op):
    if op == "LayerNormalization":
        node = helper.make_node(op, ["x", "s", "b"], ["y"], name="ln", axis=-1)
        inits = [_init("s", np.ones(64, np.float32)), _init("b", np.zeros(64, np.float32))]
        return make_model([node], [("x", [4, 64])], [("y", None)], inits)
    node = helper.make_node(op, ["x"], ["y"], name="rss", axes=[1], keepdims=1)
    return make_model([node], [("x", [4, 64])], [("y", None)], opset=13)


@pytest.mark.parametrize("op", ["LayerNormalization", "ReduceSumSquare"])
def test_fp16_overflow_shows_where_fp32_is_finite(op, rng):
    x = (300 + rng.standard_normal((4, 64)) * 50).astype(np.float32)  # squares ~ 9e4 > 65504
    if op == "LayerNormalization":
        x = (rng.standard_normal((4, 64)) * 300).astype(np.float32)
    emu = GraphEmulator(_norm_model(op))
    addr = next(iter(emu.node_addresses()))
    fp32 = emu.run({"x": x}).outputs["y"]
    fp16 = emu.run({"x": x}, {addr: Precision.FP16}).outputs["y"]
    assert np.all(np.isfinite(fp32))
    if op == "ReduceSumSquare":
        assert np.all(np.isinf(fp16))
    else:  # stash_type=1 (default): the variance is float32, so only the normalised value is rounded
        assert_reorder_close(fp32.std(axis=-1), np.ones(4), n=64, magnitude=1.0, stages=3)
        assert np.all(np.isfinite(fp16))
        np.testing.assert_allclose(fp16, fp32, rtol=2.0**-10, atol=2.0**-10 * np.abs(fp32).max())
    # the same values at a tenth of the scale stay finite in FP16 and close to FP32
    small = emu.run({"x": x / 30}, {addr: Precision.FP16}).outputs["y"]
    assert np.all(np.isfinite(small))


def test_bf16_follows_ml_dtypes_rounding(rng):
    nodes = [
        helper.make_node("Mul", ["x", "y"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "z"], ["out"], name="add"),
    ]
    model = make_model(nodes, [("x", [64]), ("y", [64]), ("z", [64])], [("out", None)])
    feeds = {k: rng.standard_normal(64).astype(np.float32) * 7 for k in "xyz"}
    emu = GraphEmulator(model)
    run = emu.run(feeds, {"mul": Precision.BF16, "add": Precision.BF16}, keep=True)
    bf = ml_dtypes.bfloat16
    want_m = feeds["x"].astype(bf) * feeds["y"].astype(bf)  # ml_dtypes computes and rounds to bf16
    want = want_m + feeds["z"].astype(bf)
    assert run.tensors["m"].dtype == bf
    np.testing.assert_array_equal(run.tensors["m"], want_m)
    np.testing.assert_array_equal(run.outputs["out"], want.astype(np.float32))
    assert not np.array_equal(run.outputs["out"], emu.run(feeds).outputs["out"])
    # only "add" in BF16: "mul" output is exact FP32 and is rounded when "add" reads it
    only_add = emu.run(feeds, {"add": Precision.BF16}).outputs["out"]
    m32 = feeds["x"] * feeds["y"]
    np.testing.assert_array_equal(only_add, (m32.astype(bf) + feeds["z"].astype(bf)).astype(np.float32))


@pytest.mark.parametrize("name", ["resnet_small", "transformer_small"])
def test_run_from_equals_full_run_and_recomputes_less(exported, name):
    model, feeds = exported(name)
    emu = GraphEmulator(model)
    addrs = [r.address for r in iter_nodes(model.graph)]
    ref = emu.run(feeds, keep=True)
    rng = np.random.default_rng(3)
    for _trial in range(3):
        pick = rng.choice(len(addrs), size=max(1, len(addrs) // 4), replace=False)
        low = {addrs[i]: Precision.FP16 for i in pick}
        full = emu.run(feeds, low).outputs
        inc = emu.run_from(ref, low)
        lean = emu.run_from(ref, low, keep=False)  # frees dead tensors: same outputs, no tensors
        assert not lean.complete and not lean.tensors and lean.recomputed == inc.recomputed
        for k in full:
            np.testing.assert_array_equal(inc.outputs[k], full[k])
            np.testing.assert_array_equal(lean.outputs[k], full[k])
    last = {addrs[-1]: Precision.FP16}
    inc = emu.run_from(ref, last)
    assert inc.recomputed == 1 < ref.recomputed
    # from a low reference back to FP32 reproduces the reference FP32 outputs
    low_ref = emu.run(feeds, last, keep=True)
    back = emu.run_from(low_ref, {})
    for k in ref.outputs:
        np.testing.assert_array_equal(back.outputs[k], ref.outputs[k])


def test_a_run_takes_known_fp32_tensors_and_still_computes_low_nodes(exported):
    """``known`` (calibration's ONNX Runtime tensors): a node computed in FP32 whose float32 outputs are known
    is not executed, its outputs are the known arrays; nodes computed low run on them, as run_from does."""
    model, feeds = exported("transformer_small")
    emu = GraphEmulator(model)
    ref = emu.run(feeds, keep=True)
    produced = {o for n in model.graph.node for o in n.output}
    floats = {k: v for k, v in ref.tensors.items() if k in produced and is_f32(v)}
    shifted = {k: np.asarray(v + np.float32(1)) for k, v in floats.items()}  # values no kernel would compute
    taken = emu.run(feeds, keep=True, known=shifted)
    for k, v in ref.outputs.items():
        np.testing.assert_array_equal(taken.outputs[k], shifted[k])
        assert not np.array_equal(taken.outputs[k], v)
    assert all(taken.tensors[k] is shifted[k] for k in shifted)  # taken, not copied
    last = [r.address for r in iter_nodes(model.graph)][-1]
    low = emu.run(feeds, {last: Precision.FP16}, known=shifted).outputs
    for k, v in emu.run_from(taken, {last: Precision.FP16}).outputs.items():
        np.testing.assert_array_equal(low[k], v)
        assert not np.array_equal(low[k], shifted[k])
    # known arrays that are not float32 are not taken: the nodes compute
    wide = emu.run(feeds, known={k: v.astype(np.float64) + 1 for k, v in floats.items()}).outputs
    for k, v in ref.outputs.items():
        np.testing.assert_array_equal(wide[k], v)


def is_f32(v):
    return isinstance(v, np.ndarray) and v.dtype == np.float32


def test_run_from_needs_a_kept_reference(exported):
    model, feeds = exported("mlp")
    emu = GraphEmulator(model)
    with pytest.raises(InvalidInputError, match="keep=True"):
        emu.run_from(emu.run(feeds), {})
    with pytest.raises(InvalidInputError, match="no_such_node"):
        emu.run(feeds, {"no_such_node": Precision.FP16})
    with pytest.raises(InvalidInputError, match="missing"):
        emu.run({})


def test_nodes_inside_if_branches_are_addressable(exported):
    model, _ = exported("control_flow")
    emu = GraphEmulator(model)
    inner = [a for a in emu.node_addresses() if "/then_branch/" in a or "/else_branch/" in a]
    assert inner
    x = np.full((4, 16), 0.5, np.float32) * np.linspace(
        0.5, 40, 16, dtype=np.float32
    )  # mean > 0: then branch
    ref = emu.run({"input_0": x}, keep=True)
    then_nodes = {a: Precision.FP16 for a in inner if "/then_branch/" in a}
    else_nodes = {a: Precision.FP16 for a in inner if "/else_branch/" in a}
    low = emu.run({"input_0": x}, then_nodes).outputs
    untouched = emu.run({"input_0": x}, else_nodes).outputs
    for k in ref.outputs:
        assert not np.array_equal(low[k], ref.outputs[k])
        np.testing.assert_array_equal(untouched[k], ref.outputs[k])
        np.testing.assert_array_equal(emu.run_from(ref, then_nodes).outputs[k], low[k])
    seen = []
    emu.run({"input_0": x}, observe=lambda prefix, name, v: seen.append(prefix + name))
    assert any("/then_branch/" in n for n in seen)


def _loop_model():
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="id"),
            helper.make_node("Mul", ["acc_in", "k"], ["acc_out"], name="mul"),
            helper.make_node("Add", ["acc_out", "k"], ["scan_out"], name="add"),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", I64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", F, [3]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", F, [3]),
            helper.make_tensor_value_info("scan_out", F, [3]),
        ],
    )
    loop = helper.make_node("Loop", ["trip", "cond", "x"], ["acc", "scans"], name="loop", body=body)
    return make_model(
        [loop],
        [("x", [3])],
        [("acc", None), ("scans", None)],
        [
            _init("trip", np.array(5, np.int64)),
            _init("cond", np.array(True)),
            _init("k", np.array([1.5, -2.25, 3.1], np.float32)),
        ],
    )


def _scan_model():
    body = helper.make_graph(
        [
            helper.make_node("Add", ["s_in", "x_t"], ["s_out"], name="add"),
            helper.make_node("Mul", ["s_out", "x_t"], ["y_t"], name="mul"),
        ],
        "body",
        [helper.make_tensor_value_info("s_in", F, [2]), helper.make_tensor_value_info("x_t", F, [2])],
        [helper.make_tensor_value_info("s_out", F, [2]), helper.make_tensor_value_info("y_t", F, [2])],
    )
    scan = helper.make_node(
        "Scan",
        ["s0", "xs"],
        ["s", "ys"],
        name="scan",
        body=body,
        num_scan_inputs=1,
        scan_input_directions=[1],
        scan_output_axes=[1],
    )
    return make_model([scan], [("s0", [2]), ("xs", [4, 2])], [("s", None), ("ys", None)])


def test_loop_and_scan_match_onnxruntime_and_body_nodes_can_be_low(rng):
    for model, feeds in (
        (_loop_model(), {"x": np.array([1.1, 0.3, -0.7], np.float32)}),
        (
            _scan_model(),
            {"s0": np.array([0.1, 0.2], np.float32), "xs": rng.standard_normal((4, 2)).astype(np.float32)},
        ),
    ):
        emu = GraphEmulator(model)
        want = ort_run(model, feeds)
        got = emu.run(feeds).outputs
        for k in want:
            assert_onnx_outputs_close(got[k], want[k], model, err_msg=k)
        body_mul = next(a for a in emu.node_addresses() if a.endswith("/body/mul"))
        low = emu.run(feeds, {body_mul: Precision.FP16}).outputs
        assert any(not np.array_equal(low[k], got[k]) for k in got)
        inc = emu.run_from(emu.run(feeds, keep=True), {body_mul: Precision.FP16})
        assert inc.recomputed == 1  # the Loop/Scan node is the unit of recomputation
        for k in got:
            np.testing.assert_array_equal(inc.outputs[k], low[k])


def test_unsupported_custom_op_is_reported_and_refused():
    node = helper.make_node("FancyOp", ["x"], ["y"], name="fancy", domain="com.example")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", F, [2])],
        [helper.make_tensor_value_info("y", F, [2])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    )
    emu = GraphEmulator(model)
    assert emu.unsupported_ops() == {"com.example::FancyOp"}
    with pytest.raises(BackendUnavailableError, match="FancyOp"):
        emu.run({"x": np.ones(2, np.float32)})


def test_unnamed_nodes_get_name_nodes_addresses():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])]
    model = make_model(nodes, [("x", [3])], [("y", None)])
    emu = GraphEmulator(model)
    assert list(emu.node_addresses()) == ["Relu_0", "Neg_1"]
    out = emu.run({"x": np.array([1.0, -2.0, 3.0], np.float32)}, {"Neg_1": Precision.FP16}).outputs["y"]
    np.testing.assert_array_equal(out, [-1.0, 0.0, -3.0])


def _conformance_cases():
    from onnx.backend.test.case.node import collect_testcases

    skip = (
        "bernoulli",  # random
        "training_dropout",  # random
        "FLOAT8",  # 8- and 4-bit types: saturation rules, not this emulator's business
        "FLOAT4",
        "INT4",
        "UINT4",
        "e4m3",
        "e5m2",
        "float8",
        "int4",
        "test_if_opt",  # an optional wrapping a sequence as a graph output
        # ONNX's reference uses the unrounded length * scale here; we follow ONNX Runtime (integer size)
        "test_resize_downsample_scales_linear_align_corners",
    )
    with warnings.catch_warnings():  # the case generators overflow on purpose
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    return [c for c in cases if c.kind == "node" and not any(k in c.name for k in skip)]


def _assert_conforms(g, w, case):
    same_kind = g.dtype == w.dtype or g.dtype.kind in "OU" and w.dtype.kind in "OU"  # strings
    assert g.shape == w.shape and same_kind, (g.shape, w.shape, g.dtype, w.dtype)
    if w.dtype.kind == "f" or w.dtype.name == "bfloat16":
        # strict BF16/FP16 rounds every step, the reference only some: an ulp each side (eps bounds one)
        tol = 2 * eps(w.dtype) if w.dtype.name in ("bfloat16", "float16") else max(case.rtol, 1e-4)
        atol = max(case.atol, 1e-5 if tol < 1e-3 else tol)
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=tol, atol=atol)
    else:
        np.testing.assert_array_equal(g, w)


def _run_conformance(cases):
    """Each case through the emulator: (counts, failures) against the case's expected outputs."""
    from onnx import TensorProto

    counts = {"ok": 0, "unsupported": 0}
    failures = []
    for case in cases:
        emu = GraphEmulator(case.model, follow_input_dtypes=True)
        if emu.unsupported_ops():
            counts["unsupported"] += 1
            continue
        inputs, outputs = case.data_sets[0]
        conv = [numpy_helper.to_array(v) if isinstance(v, TensorProto) else v for v in inputs]
        want = [numpy_helper.to_array(v) if isinstance(v, TensorProto) else v for v in outputs]
        try:
            got = emu.run(dict(zip([i.name for i in case.model.graph.input], conv, strict=False))).outputs
            for vi, w in zip(case.model.graph.output, want, strict=False):
                g = got[vi.name]
                if isinstance(w, list) or w is None:  # sequences and empty optionals
                    assert isinstance(g, list) == isinstance(w, list) and (w is None) == (g is None)
                    for a, b in zip(g or [], w or [], strict=True):
                        _assert_conforms(np.asarray(a), np.asarray(b), case)
                else:
                    _assert_conforms(np.asarray(g), np.asarray(w), case)
            counts["ok"] += 1
        except Exception as err:  # collect all failures for one readable message
            failures.append(f"{case.name}: {type(err).__name__}: {str(err)[:120]}")
    return counts, failures


def test_onnx_node_conformance_suite():
    """Every ONNX operator test case (FP32 and typed FP16/BF16 models) runs and matches, or is reported."""
    counts, failures = _run_conformance(_conformance_cases())
    print(f"ONNX node conformance through the emulator: {counts}")
    assert not failures, "\n".join(failures)
    assert counts["ok"] > 1500
    assert counts["unsupported"] < 40  # ai.onnx.ml, preview training ops, FlexAttention


def test_onnx_conformance_with_onnxruntime_doing_every_cast_and_conv(monkeypatch):
    """The ONNX Runtime paths (ortexec) on ONNX's own cases: every Conv/ConvTranspose case, every case typed
    FP16/BF16 and every Cast case, with no array too small to take them."""
    from mpinfer.precision.emulator.kernels import ortexec

    monkeypatch.setattr(ortexec, "MIN_SIZE", 1)
    monkeypatch.setattr(ortexec, "_ops", {})
    typed = ("conv", "cast", "erf", "gelu", "float16", "bfloat16", "FLOAT16", "BFLOAT16")
    cases = [c for c in _conformance_cases() if any(k in c.name for k in typed)]
    convs = [c for c in cases if c.name.startswith(("test_conv", "test_convtranspose"))]
    assert len(convs) > 12 and len(cases) > 80, (len(convs), len(cases))
    counts, failures = _run_conformance(cases)
    assert not failures, "\n".join(failures)
    assert counts["ok"] == len(cases)
    assert ortexec._ops and all(s is not None for s in ortexec._ops.values())  # ONNX Runtime ran every conv
    assert all(ortexec._casts.get(k) is not None for k in ("round_fp16", "to_fp16", "from_fp16"))


def test_duplicate_node_names_get_unique_addresses():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="n"),
        helper.make_node("Neg", ["r"], ["y"], name="n"),
    ]
    model = make_model(nodes, [("x", [3])], [("y", None)])
    emu = GraphEmulator(model)
    assert list(emu.node_addresses()) == ["n", "n_1"]
    out = emu.run({"x": np.array([1.0, -2.0, 3.0], np.float32)}, {"n_1": Precision.FP16}).outputs["y"]
    np.testing.assert_array_equal(out, [-1.0, 0.0, -3.0])


def _f16_oracle_softmax(x):
    h = x.astype(np.float16)
    d = h - h.max(axis=-1, keepdims=True)
    e = np.exp(d.astype(np.float32)).astype(np.float16)
    s = e.astype(np.float32).sum(axis=-1, keepdims=True).astype(np.float16)  # FP32 accumulator, stored FP16
    return e / s


def _f16_oracle_layernorm(x, eps=1e-5):
    """stash_type=1 (the default): mean, variance and the normalized value in float32, rounded to FP16 once."""
    h = x.astype(np.float16).astype(np.float32)
    mean = h.mean(axis=-1, keepdims=True, dtype=np.float32)
    d = h - mean
    var = (d * d).mean(axis=-1, keepdims=True, dtype=np.float32)
    return (d / np.sqrt(var + np.float32(eps))).astype(np.float16)


@pytest.mark.parametrize("op", ["Softmax", "LayerNormalization"])
def test_fp16_softmax_and_layernorm_round_every_step(op, rng):
    """Bit-exact against numpy float16 arithmetic done one step at a time (LayerNorm: its float32 stash)."""
    x = (rng.standard_normal((6, 32)) * 4).astype(np.float32)
    if op == "Softmax":
        node = helper.make_node(op, ["x"], ["y"], name="op", axis=-1)
        model = make_model([node], [("x", [6, 32])], [("y", None)])
        want = _f16_oracle_softmax(x)
    else:
        node = helper.make_node(op, ["x", "s"], ["y"], name="op", axis=-1)
        model = make_model([node], [("x", [6, 32])], [("y", None)], [_init("s", np.ones(32, np.float32))])
        want = _f16_oracle_layernorm(x)
    run = GraphEmulator(model).run({"x": x}, {"op": Precision.FP16}, keep=True)
    np.testing.assert_array_equal(run.tensors["y"], want)
    fp32 = GraphEmulator(model).run({"x": x}).outputs["y"]
    assert not np.array_equal(want.astype(np.float32), fp32)


def test_lstm_in_fp16_keeps_its_state_in_fp16(rng):
    case = next(c for c in OP_CASES if c[0] == "lstm-bidirectional-peepholes")
    _id, op, ins, outs, attrs, inits, feeds, opset = case
    emu = GraphEmulator(_single(op, ins, outs, attrs, inits, opset))
    exact = emu.run(feeds).outputs
    run = emu.run(feeds, {"LSTM_0": Precision.FP16}, keep=True)
    assert run.tensors["y"].dtype == np.float16
    err = np.abs(run.outputs["y"] - exact["y"]).max()
    assert 1e-5 < err < 1e-2
    h = emu.run(feeds, {"LSTM_0": Precision.BF16}).outputs["y"]
    assert np.abs(h - exact["y"]).max() > err  # BF16 keeps 8 bits, FP16 11


@pytest.mark.parametrize("engine", ["onnxruntime", "numpy"])
def test_fast_fp16_rounding_is_bit_exact(engine, monkeypatch):
    from mpinfer.precision.emulator.kernels import ortexec
    from mpinfer.precision.emulator.kernels.numerics import Numerics, fp16_to_float32, round_to_fp16

    # every array takes ONNX Runtime's Cast, or none does (numpy's integer rounding and table lookup)
    monkeypatch.setattr(ortexec, "MIN_SIZE", 1 if engine == "onnxruntime" else 1 << 62)
    on = ortexec.cast(np.ones(3, np.float32), "round_fp16") is not None
    assert on == (engine == "onnxruntime")
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    np.testing.assert_array_equal(fp16_to_float32(every), every.astype(np.float32))  # NaNs compare equal
    assert fp16_to_float32(np.float16(3.5)[()].reshape(())).shape == ()
    # every exponent and top mantissa pattern, with the low bits that decide rounding (ties, just above/below)
    top = np.arange(0, 1 << 19, 3, dtype=np.uint32) << np.uint32(13)
    with np.errstate(over="ignore", invalid="ignore"):
        for low in (0, 0x0001, 0x0FFE, 0x0FFF, 0x1000, 0x1001, 0x1FFF):
            for sign in (0, 0x80000000):
                v = (top | np.uint32(low | sign)).view(np.float32)
                np.testing.assert_array_equal(round_to_fp16(v), v.astype(np.float16).astype(np.float32))
        v = np.array(
            [65504, 65519.99, 65520, -65520, 2.0**-25, 3 * 2.0**-26, 2.0**-24 * 1.5, np.inf, np.nan],
            np.float32,
        )
        np.testing.assert_array_equal(round_to_fp16(v), v.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(Numerics(Precision.FP16).store(v), v.astype(np.float16))
        ties = (top | np.uint32(0x8000)).view(np.float32)  # BF16 ties (and their neighbours below)
        for arr in (ties, np.nextafter(ties, np.float32(0))):
            want = arr.astype(ml_dtypes.bfloat16).astype(np.float32)
            np.testing.assert_array_equal(Numerics(Precision.BF16).r(arr), want)


def test_onnxruntime_casts_are_checked_before_use(monkeypatch):
    """A cast whose result differs from numpy's on the check values is never used: numpy rounds instead."""
    from mpinfer.precision.emulator.kernels import ortexec
    from mpinfer.precision.emulator.kernels.numerics import round_to_fp16

    v = np.linspace(-3, 3, ortexec.MIN_SIZE, dtype=np.float32)
    monkeypatch.setattr(ortexec, "_casts", {})
    monkeypatch.setattr(ortexec, "_reference_cast", lambda name, x: np.zeros_like(x))  # "numpy says 0"
    assert ortexec.cast(v, "round_fp16") is None
    assert ortexec._casts == {"round_fp16": None}  # decided once
    np.testing.assert_array_equal(round_to_fp16(v), v.astype(np.float16).astype(np.float32))
    monkeypatch.undo()
    assert ortexec.cast(v, "round_fp16") is not None
    assert ortexec._same_bits(np.array([np.nan, 1], np.float32), np.array([-np.nan, 1], np.float32))
    assert not ortexec._same_bits(np.array([0.0], np.float32), np.array([-0.0], np.float32))


@pytest.mark.parametrize("engine", ["onnxruntime", "numpy"])
def test_erf_is_accurate_with_either_engine(engine, monkeypatch):
    import math

    from mpinfer.precision.emulator.kernels import ortexec
    from mpinfer.precision.emulator.kernels.numerics import erf

    monkeypatch.setattr(ortexec, "MIN_SIZE", 1 if engine == "onnxruntime" else 1 << 62)
    x = np.concatenate([np.linspace(-7, 7, 20001), [0.0, -0.0, 1e-30, np.inf, -np.inf]]).astype(np.float32)
    got = erf(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    want = np.array([math.erf(float(v)) for v in x])
    assert np.abs(got - want).max() <= eps(np.float32)  # an ulp at 1, the top of erf's range
    assert (ortexec.float32_op("Erf", {}, [x]) is not None) == (engine == "onnxruntime")
    assert erf(np.float32(0.5)) == pytest.approx(math.erf(0.5), abs=eps(np.float32))  # scalars take numpy's path


@pytest.mark.parametrize(
    "op,x_shape,w_shape,attrs",
    [
        ("Conv", (2, 8, 19, 17), (16, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
        ("Conv", (2, 8, 19, 17), (16, 8, 3, 3), {"strides": [2, 2], "dilations": [2, 1], "pads": [2, 0, 1, 1]}),
        ("Conv", (2, 8, 19, 17), (8, 1, 5, 5), {"group": 8, "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
        ("Conv", (2, 8, 19, 17), (16, 1, 3, 3), {"group": 8, "auto_pad": "SAME_LOWER", "strides": [2, 2]}),
        ("Conv", (2, 8, 19, 17), (12, 2, 3, 1), {"group": 4, "auto_pad": "VALID"}),
        ("Conv", (2, 6, 40), (4, 6, 5), {"pads": [2, 1], "strides": [3]}),
        ("Conv", (1, 4, 9, 8, 7), (6, 4, 3, 3, 3), {"pads": [1, 0, 1, 1, 0, 1]}),
        ("ConvTranspose", (2, 8, 11, 9), (8, 6, 3, 3), {"strides": [2, 2], "pads": [1, 0, 1, 1]}),
        ("ConvTranspose", (2, 8, 11, 9), (8, 3, 4, 4), {"group": 2, "strides": [2, 2], "output_padding": [1, 0]}),
    ],
)
def test_onnxruntime_convolutions_match_the_numpy_kernels(op, x_shape, w_shape, attrs, rng, monkeypatch):
    """Conv/ConvTranspose through ONNX Runtime (large inputs) and through numpy im2col agree, FP32 and FP16."""
    from mpinfer.precision.emulator.kernels import ortexec

    bias = w_shape[0] if op == "Conv" else w_shape[1] * attrs.get("group", 1)
    inits = [
        ("w", rng.standard_normal(w_shape).astype(np.float32)),
        ("b", rng.standard_normal(bias).astype(np.float32)),
    ]
    model = _single(op, [("x", list(x_shape))], [("y", None)], attrs, inits, 17)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    runs = {}
    for engine, size in (("onnxruntime", 1), ("numpy", 1 << 62)):
        monkeypatch.setattr(ortexec, "MIN_SIZE", size)
        monkeypatch.setattr(ortexec, "KERNEL_MIN_SIZE", size)
        monkeypatch.setattr(ortexec, "_ops", {})
        emu = GraphEmulator(model)
        runs[engine] = [emu.run(feeds, p).outputs["y"] for p in (None, {f"{op}_0": Precision.FP16})]
        assert (len(ortexec._ops) == 1) == (engine == "onnxruntime")
    want = ort_run(model, feeds)["y"]
    # each output sums C_in/group * kernel terms in float32 (ConvTranspose: at most C_in * kernel), in an order
    # each engine picks; sum |x_k w_k| + |b| is the same op on absolute values
    n = int(np.prod(w_shape[1:]) if op == "Conv" else w_shape[0] * np.prod(w_shape[2:]))
    absolute = _single(op, [("x", list(x_shape))], [("y", None)], attrs, [(k, np.abs(v)) for k, v in inits], 17)
    terms = ort_run(absolute, {"x": np.abs(feeds["x"])})["y"]
    for got in (runs["onnxruntime"][0], runs["numpy"][0]):
        assert_reorder_close(got, want, n=n, magnitude=terms)
    a, b = runs["onnxruntime"][1], runs["numpy"][1]  # FP16 outputs: the float32 sums, then an FP16 rounding each
    assert_reorder_close(a, b, n=n, magnitude=terms, rtol=eps(np.float16))
    assert np.abs(a - want).max() > 0  # really rounded


def test_onnxruntime_step_sessions_stay_small():
    """Each step session has at most MAX_THREADS threads that sleep between calls and no memory arena."""
    from mpinfer.memory import usable_cpus
    from mpinfer.precision.emulator.kernels import ortexec

    x = np.linspace(-2, 2, ortexec.MIN_SIZE, dtype=np.float32)
    assert ortexec.cast(x, "round_fp16") is not None
    opts = ortexec._casts["round_fp16"].get_session_options()
    assert opts.intra_op_num_threads == min(ortexec.MAX_THREADS, usable_cpus())
    assert not opts.enable_cpu_mem_arena
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"


@pytest.mark.parametrize(
    ("op", "attrs", "inits", "x", "pattern"),
    [
        ("Conv", {"kernel_shape": [5]}, [("w", np.ones((2, 1, 5), np.float32))], np.ones((1, 1, 3), np.float32),
         r"Node 'Conv_0' \(Conv\).*smaller than the window"),
        ("Pad", {"mode": "reflect"}, [("p", np.array([0, 0, 0, 0, 0, 3], np.int64))], np.ones((1, 1, 3), np.float32),
         r"Node 'Pad_0' \(Pad\).*reflect pads"),
    ],
)
def test_inputs_the_op_cannot_take_are_the_datas_fault_not_a_bug(op, attrs, inits, x, pattern):
    # ONNX Runtime refuses these too (Conv: "Invalid input shape"; Pad: "post-pad exceeds maximum allowed")
    model = _single(op, [("x", ["n", 1, "len"])], [("y", None)], attrs, inits)
    with pytest.raises(InvalidInputError, match=pattern):
        GraphEmulator(model).run({"x": x})
    assert GraphEmulator(model).run({"x": np.ones((1, 1, 8), np.float32)}).outputs["y"].shape[-1] in (4, 11)


@pytest.mark.slow
def test_the_ops_the_emulator_cannot_run_are_named_without_compiling_it_on_every_node_test():
    """unsupported_op_types says what GraphEmulator says on every ONNX node test case (30 s: slow)."""
    from mpinfer.precision.emulator.emulate import unsupported_op_types

    seen = 0
    for case in _conformance_cases():
        assert unsupported_op_types(case.model) == GraphEmulator(case.model).unsupported_ops(), case.name
        seen += bool(GraphEmulator(case.model).unsupported_ops())
    assert seen  # (ai.onnx.ml and preview training ops among them)


def test_the_ops_the_emulator_cannot_run_are_named_without_compiling_the_model():
    """unsupported_op_types (the default floor's question before calibration) says what GraphEmulator says: custom
    ops in the main graph and in an If body."""
    from mpinfer.precision.emulator.emulate import unsupported_op_types

    x, y = helper.make_tensor_value_info("x", F, [2]), helper.make_tensor_value_info("y", F, [2])
    body = helper.make_graph([helper.make_node("Other", ["x"], ["b"], domain="com.other")], "then", [],
                             [helper.make_tensor_value_info("b", F, [2])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["c"])], "else", [],
                              [helper.make_tensor_value_info("c", F, [2])])
    nodes = [helper.make_node("FancyOp", ["x"], ["f"], name="fancy", domain="com.example"),
             helper.make_node("ReduceSum", ["f"], ["s"], name="sum", keepdims=0),
             helper.make_node("Cast", ["s"], ["cond"], name="cast", to=TensorProto.BOOL),
             helper.make_node("If", ["cond"], ["y"], name="if", then_branch=body, else_branch=other)]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1), helper.make_opsetid("com.other", 1)])
    assert unsupported_op_types(model) == GraphEmulator(model).unsupported_ops() == {"com.example::FancyOp",
                                                                                     "com.other::Other"}
