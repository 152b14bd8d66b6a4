"""Graph builders shared by the numerics tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import importlib
import io
import warnings

import onnx
from onnx import TensorProto, helper

MODEL_NAMES = ("resnet_small", "digits_cnn", "mlp", "transformer_small", "control_flow")


def export_module(name: str, batch: int = 2):
    """Export models/<name>.py with the TorchScript exporter; returns (named ModelProto, feeds)."""
    import torch

    from mpinfer.modelio import name_nodes

    mod = importlib.import_module(f"models.{name}")
    model = mod.build_scriptable() if name == "control_flow" else mod.build()
    args = mod.example_inputs(batch)
    names = [f"input_{i}" for i in range(len(args))]
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            args,
            buf,
            dynamo=False,
            input_names=names,
            opset_version=17,
            dynamic_axes={n: {0: "batch"} for n in names},
        )
    proto = name_nodes(onnx.load_from_string(buf.getvalue()))
    return proto, {n: a.numpy() for n, a in zip(names, args, strict=False)}


def export_dynamo(name: str, batch: int = 2):
    """Export models/<name>.py with the dynamo exporter (torch.export); returns (named ModelProto, feeds)."""
    import logging

    import torch

    from mpinfer.modelio import name_nodes

    mod = importlib.import_module(f"models.{name}")
    args = mod.example_inputs(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            program = torch.onnx.export(mod.build(), args, dynamo=True, verbose=False)
        finally:
            logging.disable(previous)
    proto = name_nodes(program.model_proto)
    return proto, {vi.name: a.numpy() for vi, a in zip(proto.graph.input, args, strict=True)}


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 17, elem=TensorProto.FLOAT):
    """A checked single-graph model; inputs/outputs are (name, shape|None) or (name, shape, elem) tuples."""

    def vi(spec):
        name, shape, *rest = spec
        return helper.make_tensor_value_info(name, rest[0] if rest else elem, shape)

    graph = helper.make_graph(
        list(nodes), "g", [vi(i) for i in inputs], [vi(o) for o in outputs], initializer=list(initializers)
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    if all(spec[1] is not None for spec in list(inputs) + list(outputs)):
        onnx.checker.check_model(model)
    return model


def ort_run(model, feeds):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=False))


def gated_model(width: int):
    """x -> Mul(k) -> Tanh -> Mul(x) -> Relu over [N, width]: elementwise, so no ONNX Runtime fusion applies (exposing
    its intermediates as outputs changes no bit of ``z``) and a call's samples never change another's bits."""
    import numpy as np
    from onnx import numpy_helper

    nodes = [
        helper.make_node("Mul", ["x", "k"], ["s"], name="scale"),
        helper.make_node("Tanh", ["s"], ["t"], name="tanh"),
        helper.make_node("Mul", ["t", "x"], ["p"], name="gate"),
        helper.make_node("Relu", ["p"], ["z"], name="relu"),
    ]
    return make_model(
        nodes, [("x", [None, width])], [("z", [None, width])], [numpy_helper.from_array(np.float32(0.5), "k")]
    )
