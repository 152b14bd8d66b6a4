"""Tiny ONNX graphs for the precision tests (built in the test, never checked in)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def make(
    nodes, inputs, outputs, inits=(), *, opset: int = OPSET, value_info=(), doc: str = ""
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", inputs, outputs, initializer=list(inits), value_info=list(value_info)
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    model.doc_string = doc
    onnx.checker.check_model(model)
    return model


def fvi(name: str, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def init(name: str, arr) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr), name)


def rng_w(*shape, seed=0, scale=0.3):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def mlp(hidden: int = 16) -> onnx.ModelProto:
    """x[N,8] -> MatMul -> Add -> Relu -> MatMul -> Add -> Softmax -> y[N,4]."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["o"], name="fc2"),
        helper.make_node("Add", ["o", "b2"], ["logits"], name="add2"),
        helper.make_node("Softmax", ["logits"], ["y"], name="softmax", axis=-1),
    ]
    inits = [
        init("w1", rng_w(8, hidden)),
        init("b1", rng_w(hidden, seed=1)),
        init("w2", rng_w(hidden, 4, seed=2)),
        init("b2", rng_w(4, seed=3)),
    ]
    return make(nodes, [fvi("x", ["N", 8])], [fvi("y", ["N", 4])], inits)


def embedding(table: np.ndarray | None = None) -> onnx.ModelProto:
    """Gather from an FP32 ``table`` (100 x 8 by default) by INT64 token ids ``ids`` [2, 5], then MatMul to 4."""
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["e"], name="embed"),
        helper.make_node("MatMul", ["e", "w"], ["y"], name="mm"),
    ]
    return make(
        nodes,
        [fvi("ids", [2, 5], TensorProto.INT64)],
        [fvi("y", [2, 5, 4])],
        [init("table", rng_w(100, 8) if table is None else table), init("w", rng_w(8, 4))],
    )


def chain(n: int, width: int = 16) -> onnx.ModelProto:
    """``n`` x (MatMul + Tanh) of width ``width``: weights large enough that FP16 error grows along the chain."""
    nodes, inits, prev = [], [], "x"
    for i in range(n):
        nodes += [
            helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
            helper.make_node("Tanh", [f"m{i}"], [f"t{i}"], name=f"tanh{i}"),
        ]
        inits.append(init(f"w{i}", rng_w(width, width, seed=i, scale=1.0 / math.sqrt(width) * 1.5)))
        prev = f"t{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    return make(nodes, [fvi("x", ["N", width])], [fvi("y", ["N", width])], inits)


# The heads of :func:`score_mlp` (issue 27's repro models): what the one value per sample goes through last.
SCORE_HEADS = ("sigmoid", "offset", "relu")


def score_mlp(head: str, *, width: int = 96, hidden: int = 384) -> onnx.ModelProto:
    """An MLP ``x[N, 96] -> 384 -> 384 -> 1`` (Gemm, ReLU) with one score per sample, ``y[N, 1]``.

    ``head``: ``sigmoid`` (the logit times 40 into a Sigmoid: a probability that saturates to exactly 0 or 1
    on many samples), ``offset`` (``Add(z, 1000)``: a score on a large constant, which FP16 rounds to steps of
    0.5) or ``relu`` (a ReLU'd score, where FP16 is fine).
    """
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], name="fc1"),
        helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
        helper.make_node("Gemm", ["r1", "w2", "b2"], ["h2"], name="fc2"),
        helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
        helper.make_node("Gemm", ["r2", "w3", "b3"], ["z"], name="fc3"),
    ]
    inits = [
        init("w1", rng_w(width, hidden, seed=11, scale=1.0 / math.sqrt(width))),
        init("b1", rng_w(hidden, seed=12, scale=0.1)),
        init("w2", rng_w(hidden, hidden, seed=13, scale=1.0 / math.sqrt(hidden))),
        init("b2", rng_w(hidden, seed=14, scale=0.1)),
        init("w3", rng_w(hidden, 1, seed=15, scale=1.1 / math.sqrt(hidden))),
        init("b3", np.zeros(1, np.float32)),
    ]
    if head == "sigmoid":
        nodes += [
            helper.make_node("Mul", ["z", "gain"], ["zg"], name="gain"),
            helper.make_node("Sigmoid", ["zg"], ["y"], name="prob"),
        ]
        inits.append(init("gain", np.array(40.0, np.float32)))
    elif head == "offset":
        nodes.append(helper.make_node("Add", ["z", "offset"], ["y"], name="offset"))
        inits.append(init("offset", np.array(1000.0, np.float32)))
    elif head == "relu":
        nodes.append(helper.make_node("Relu", ["z"], ["y"], name="relu_out"))
    else:
        raise ValueError(f"head {head!r}: expected one of {SCORE_HEADS}")
    return make(nodes, [fvi("x", ["N", width])], [fvi("y", ["N", 1])], inits)


def score_data(path: Path, n: int = 160, *, seed: int = 0, width: int = 96) -> Path:
    """``n`` samples ``x ~ N(0, 3^2)`` for :func:`score_mlp`, saved as an .npz."""
    x = (np.random.default_rng(seed).standard_normal((n, width)) * 3.0).astype(np.float32)
    np.savez(path, x=x)
    return path


def export_digits(path: Path) -> Path:
    """The digits CNN of models/ (width 8) exported by TorchScript at opset 17 with a dynamic batch."""
    import torch

    from models import digits_cnn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            digits_cnn.build(width=8),
            digits_cnn.example_inputs(),
            str(path),
            dynamo=False,
            input_names=["x"],
            output_names=["y"],
            opset_version=17,
            dynamic_axes={"x": {0: "batch"}},
        )
    return path


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(model.SerializeToString())
    return path


def run_ort(model_or_path, feeds):
    import onnxruntime as ort

    src = (
        model_or_path.SerializeToString()
        if isinstance(model_or_path, onnx.ModelProto)
        else str(model_or_path)
    )
    sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)
