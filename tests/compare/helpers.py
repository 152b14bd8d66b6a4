"""Test fixtures for compare/report: export example models and make FP16 candidates by hand.

The FP16 conversions here are deliberately tiny (whole-model cast, or one node forced to FP16) and follow the
converter's naming contract: node names are kept, inserted Casts are named ``<tensor>__cast_to_fp16`` /
``<tensor>__cast_to_fp32``.
"""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mpinfer.modelio import name_nodes, save_onnx

MODELS = ["mlp", "digits_cnn", "resnet_small", "transformer_small", "control_flow"]


def export_model(name: str, out_dir: Path) -> Path:
    """Export models/<name>.py with the TorchScript exporter (fast), nodes named, dynamic batch."""
    import torch

    mod = importlib.import_module(f"models.{name}")
    model = mod.build_scriptable() if name == "control_flow" else mod.build()
    inp = mod.INPUT_SPECS[0].split(":")[0]
    axes = {inp: {0: "batch", 1: "seq"}} if name == "transformer_small" else {inp: {0: "batch"}}
    path = out_dir / f"{name}.onnx"
    tmp = out_dir / f".{name}.raw.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice; it is the fast one
        torch.onnx.export(
            model,
            mod.example_inputs(),
            str(tmp),
            dynamo=False,
            input_names=[inp],
            output_names=["logits"],
            dynamic_axes={**axes, "logits": {0: "batch"}},
            opset_version=17,
        )
    save_onnx(name_nodes(onnx.load(str(tmp))), path)
    tmp.unlink()
    return path


def _cast(src: str, dst: str, to: int) -> onnx.NodeProto:
    return helper.make_node("Cast", [src], [dst], name=dst, to=to)


def _fp16_graph(graph: onnx.GraphProto) -> None:
    for init in graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float16)))
            elif node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.FLOAT16
            elif attr.type == onnx.AttributeProto.GRAPH:
                _fp16_graph(attr.g)
                for out in attr.g.output:
                    if out.type.tensor_type.elem_type == TensorProto.FLOAT:
                        out.type.tensor_type.elem_type = TensorProto.FLOAT16
    del graph.value_info[:]


def _rename_uses(graph: onnx.GraphProto, old: str, new: str, skip: onnx.NodeProto | None = None) -> None:
    for node in graph.node:
        if node is not skip:
            for i, name in enumerate(node.input):
                if name == old:
                    node.input[i] = new
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _rename_uses(attr.g, old, new)


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """Whole-model FP16 with FP32 inputs/outputs (keep_io_types)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    _fp16_graph(g)
    casts = []
    for inp in g.input:
        if inp.type.tensor_type.elem_type == TensorProto.FLOAT:
            _rename_uses(g, inp.name, inp.name + "__cast_to_fp16")
            casts.append(_cast(inp.name, inp.name + "__cast_to_fp16", TensorProto.FLOAT16))
    tail = []
    for out in g.output:
        if out.type.tensor_type.elem_type == TensorProto.FLOAT:
            low = out.name + "__fp16"
            for node in g.node:
                for i, name in enumerate(node.output):
                    if name == out.name:
                        node.output[i] = low
            _rename_uses(g, out.name, low)
            tail.append(_cast(low, out.name, TensorProto.FLOAT))
    nodes = casts + list(g.node) + tail
    del g.node[:]
    g.node.extend(nodes)
    return m


def force_low(model: onnx.ModelProto, node_names: list[str]) -> onnx.ModelProto:
    """Run only the named nodes in FP16 (Casts around them), everything else FP32."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    new_nodes = []
    for node in g.node:
        if node.name not in node_names:
            new_nodes.append(node)
            continue
        for i, name in enumerate(node.input):
            if name:
                new_nodes.append(_cast(name, name + "__cast_to_fp16", TensorProto.FLOAT16))
                node.input[i] = name + "__cast_to_fp16"
        new_nodes.append(node)
        for out in node.output:
            new_nodes.append(_cast(out, out + "__cast_to_fp32", TensorProto.FLOAT))
    del g.node[:]
    g.node.extend(new_nodes)
    for node in node_names:
        outs = next(n.output for n in g.node if n.name == node)
        for out in outs:
            for n in g.node:
                if n.op_type == "Cast" and n.name == out + "__cast_to_fp32":
                    continue
                for i, name in enumerate(n.input):
                    if name == out:
                        n.input[i] = out + "__cast_to_fp32"
    del g.value_info[:]
    return m


def write_plan(candidate: Path, model: onnx.ModelProto, low: dict[str, tuple[str, str]]) -> Path:
    """Write a <stem>.plan.json as the converter would: {node: (reason, detail)} for the low nodes."""
    nodes = []
    for n in model.graph.node:
        if n.op_type == "Cast" and "__cast_to_" in n.name:
            continue
        reason, detail = low.get(n.name, ("rule:keep-fp32", "kept FP32 by default in this test plan"))
        nodes.append(
            {
                "name": n.name,
                "op_type": n.op_type,
                "precision": "fp16" if n.name in low else "fp32",
                "reason": reason,
                "detail": detail,
                "stats": {},
            }
        )
    casts = sum(1 for n in model.graph.node if n.op_type == "Cast")
    plan = {
        "schema_version": 1,
        "mpinfer_version": "test",
        "source": {"path": "x", "sha256": ""},
        "precision": "fp16",
        "numerics": "ort",
        "keep_io_types": True,
        "budget": None,
        "calibration": None,
        "nodes": nodes,
        "summary": {
            "nodes_total": len(nodes),
            "nodes_low": len(low),
            "low_share_nodes": len(low) / len(nodes),
            "low_share_flops": None,
            "low_share_weight_bytes": None,
            "cast_count": casts,
            "expected_error": {},
        },
    }
    path = Path(str(candidate)[: -len(".onnx")] + ".plan.json")
    path.write_text(json.dumps(plan, indent=2))
    return path


def broken_fixture(out_dir: Path) -> dict[str, Path]:
    """The MLP, its FP16 copy, a copy with the first LayerNorm forced to FP16 (plus plan), and data that
    overflows FP16 at that LayerNorm's input (|x| ~ 1e6 gives pre-LayerNorm activations far above 65504)."""
    base = export_model("mlp", out_dir)
    model = onnx.load(str(base))
    fp16 = out_dir / "mlp.fp16.onnx"
    save_onnx(to_fp16(model), fp16)
    ln = next(n.name for n in model.graph.node if n.op_type == "LayerNormalization")
    broken_model = force_low(model, [ln])
    broken = out_dir / "mlp.lnfp16.onnx"
    save_onnx(broken_model, broken)
    write_plan(broken, broken_model, {ln: ("user:low-node", "forced to FP16 by --low-node")})
    rng = np.random.default_rng(0)
    small = out_dir / "small.npz"
    np.savez(small, x=rng.standard_normal((48, 64)).astype(np.float32), _labels=rng.integers(0, 10, 48))
    big = out_dir / "overflow.npz"
    np.savez(big, x=(rng.standard_normal((32, 64)) * 1e6).astype(np.float32))
    return {"base": base, "fp16": fp16, "broken": broken, "small": small, "big": big, "ln": Path(ln)}
