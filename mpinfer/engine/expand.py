"""Expand ops a TensorRT parser predates back into the ONNX ops it reads, for the engine only.

``mpinfer convert`` fuses a decoder's RMSNorm chains into ``RMSNormalization`` (opset 23, ``stash_type=1``): one
node, FP16 (or BF16) in and out, its statistics in float32, no Cast. TensorRT's ONNX parser imports that op only
from 10.15 on (:data:`mpinfer.engine.machine.TENSORRT_OP_SINCE`). For an older TensorRT, build-engine hands the
parser the model with each such node written back as the chain the op's definition computes, in float32 as
``stash_type=1`` says, with a Cast to float32 on the way in and one back to the node's type on the way out::

    x (T) -> Cast(float32) -> Pow(., 2) -> ReduceMean(axes) -> Add(eps) -> Sqrt -> Reciprocal
          -> Mul(x32, .) -> Mul(., Cast(scale, float32)) -> Cast(T) -> y

(the Casts are left out where ``T`` is float32). The user's model file is never changed: the expanded graph is
serialized beside the parser's call, its external weights still read from the model's folder.
"""

from __future__ import annotations

import logging
from typing import Any

from mpinfer.modelio import iter_graphs

logger = logging.getLogger(__name__)

# The ops :func:`expand_ops` writes back as plain ONNX ops, and where the expanded nodes' names start from.
EXPANDABLE_OPS = frozenset({"RMSNormalization"})
EXPANDED_SUFFIX = "/expanded"


def _types(model: Any) -> dict[str, int]:
    """ONNX element type per tensor name (graph I/O, value_info, initializers; every graph of ``model``)."""
    out: dict[str, int] = {}
    for g in iter_graphs(model.graph):
        for vi in [*g.input, *g.output, *g.value_info]:
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                out[vi.name] = vi.type.tensor_type.elem_type
        for t in g.initializer:
            out[t.name] = t.data_type
        for n in g.node:
            if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
                for a in n.attribute:
                    if a.name == "value":
                        out[n.output[0]] = a.t.data_type
    return out


def _rms_chain(node: Any, elem: int, scale_elem: int) -> list[Any]:
    """The nodes computing RMSNormalization ``node`` (stash_type=1) for input type ``elem``."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    axis, eps = int(attrs.get("axis", -1)), float(attrs.get("epsilon", 1e-5))
    base = f"{node.name or node.output[0]}{EXPANDED_SUFFIX}"
    x, scale = node.input[0], node.input[1]
    y = node.output[0]
    f32 = TensorProto.FLOAT

    def name(step: str) -> str:
        return f"{base}/{step}"

    def const(step: str, value: Any) -> Any:
        return helper.make_node("Constant", [], [name(step)], name=name(step),
                                value=numpy_helper.from_array(np.asarray(value), name(step)))

    nodes = []
    xu = x
    if elem != f32:
        nodes.append(helper.make_node("Cast", [x], [name("x_f32")], name=name("Cast_in"), to=f32))
        xu = name("x_f32")
    nodes.append(const("two", np.float32(2.0)))
    nodes.append(helper.make_node("Pow", [xu, name("two")], [name("squared")], name=name("Pow")))
    if axis < 0:  # the axes from ``axis`` to the last, whatever the rank
        nodes.append(const("axes", np.arange(axis, 0, dtype=np.int64)))
    else:  # [axis, rank): the rank read at run time, as the op's own definition does
        nodes.append(helper.make_node("Shape", [xu], [name("shape")], name=name("Shape")))
        nodes.append(helper.make_node("Size", [name("shape")], [name("rank")], name=name("Size")))
        nodes.append(const("axis", np.int64(axis)))
        nodes.append(const("one", np.int64(1)))
        nodes.append(helper.make_node("Range", [name("axis"), name("rank"), name("one")], [name("axes")],
                                      name=name("Range")))
    nodes.append(helper.make_node("ReduceMean", [name("squared"), name("axes")], [name("mean")],
                                  name=name("ReduceMean"), keepdims=1))
    nodes.append(const("eps", np.float32(eps)))
    nodes.append(helper.make_node("Add", [name("mean"), name("eps")], [name("mean_eps")], name=name("Add")))
    nodes.append(helper.make_node("Sqrt", [name("mean_eps")], [name("rms")], name=name("Sqrt")))
    nodes.append(helper.make_node("Reciprocal", [name("rms")], [name("inv_rms")], name=name("Reciprocal")))
    nodes.append(helper.make_node("Mul", [xu, name("inv_rms")], [name("normalized")], name=name("Mul")))
    scale32 = scale
    if scale_elem != f32:
        nodes.append(helper.make_node("Cast", [scale], [name("scale_f32")], name=name("Cast_scale"), to=f32))
        scale32 = name("scale_f32")
    scaled = y if elem == f32 else name("scaled")
    nodes.append(helper.make_node("Mul", [name("normalized"), scale32], [scaled], name=name("Mul_scale")))
    if elem != f32:
        nodes.append(helper.make_node("Cast", [scaled], [y], name=name("Cast_out"), to=elem))
    return nodes


def expand_ops(model: Any, ops: frozenset[str] | set[str] = EXPANDABLE_OPS) -> tuple[Any, int]:
    """A copy of ``model`` with every node of ``ops`` (of :data:`EXPANDABLE_OPS`) written as plain ONNX ops.

    Every graph is rewritten, bodies of If/Loop/Scan included; each expanded node's new nodes are named after it
    (``<name>/expanded/<step>``). ``model`` is not changed; external tensors stay references to its files.

    Returns:
        The new model and the number of nodes expanded (0: the copy is ``model`` as it was).

    Raises:
        ValueError: A node to expand has no known input type, or a stash type other than float32.
    """
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    wanted = set(ops) & EXPANDABLE_OPS
    types = _types(out)
    reads = {n.input[0] for g in iter_graphs(out.graph) for n in g.node if n.op_type in wanted and n.input}
    if reads - set(types):  # an intermediate without value_info: ONNX's shape inference types it (graph only)
        types = _types(onnx.shape_inference.infer_shapes(out)) | types
    count = 0
    for g in iter_graphs(out.graph):
        if not any(n.op_type in wanted for n in g.node):
            continue
        nodes = []
        for n in g.node:
            if n.op_type not in wanted or n.domain not in ("", "ai.onnx"):
                nodes.append(n)
                continue
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            if int(attrs.get("stash_type", 1)) != onnx.TensorProto.FLOAT or len(n.input) < 2 or len(n.output) != 1:
                raise ValueError(f"RMSNormalization node '{n.name}': only stash_type=1 (float32), two inputs and "
                                 "one output are expanded")
            elem = types.get(n.input[0])
            if elem is None:
                raise ValueError(f"RMSNormalization node '{n.name}': the type of its input '{n.input[0]}' is unknown")
            nodes.extend(_rms_chain(n, elem, types.get(n.input[1], elem)))
            count += 1
        del g.node[:]
        g.node.extend(nodes)
    if count:
        logger.info("expanded %d RMSNormalization node(s) into their float32 chain", count)
        _declare_older_opset(out)
    return out, count


# The default-domain ops that opset 23 brought; its other changes only add types (float4e2m1, ...) to existing ops.
_OPSET_23_OPS = frozenset({"Attention", "RMSNormalization", "RotaryEmbedding"})


def _declare_older_opset(model: Any) -> None:
    """Declare opset 22 for an opset-23 model that no longer uses an op opset 23 brought.

    The graph's meaning is the same (opset 23 added those ops, and types no op here uses to others), and a
    TensorRT that predates RMSNormalization reads opset 22 models.
    """
    from mpinfer.modelio import default_opset

    if default_opset(model) != 23:
        return
    if any(n.op_type in _OPSET_23_OPS and n.domain in ("", "ai.onnx") for g in iter_graphs(model.graph)
           for n in g.node):
        return
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            imp.version = 22
