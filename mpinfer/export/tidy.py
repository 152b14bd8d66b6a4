"""Export clean-up: Casts that change nothing (a tensor cast to the type it already has) are removed.

The TorchScript exporter writes a ``Cast`` after many integer and float ops whose result already has the target
type (40 of the 42 Casts of a 3-layer Llama exported with its KV cache: ``Cast(to=INT64)`` after an int64
``Div``, ``Cast(to=FLOAT)`` after a float ``Mul``). Each is a copy at run time, and once a model is converted
they count with the Casts the conversion adds. A Cast whose input type (from ONNX shape inference over the
graph alone, weights left out) equals its ``to`` is removed and its consumers read its input; one whose output
is a graph output becomes an ``Identity`` (the output keeps its name). Casts whose input type inference cannot
tell are kept.
"""

from __future__ import annotations

import logging
from typing import Any

from mpinfer.modelio import iter_graphs

logger = logging.getLogger(__name__)


def _skeleton(model: Any) -> Any:
    """The model's main graph without weight data: initializers become typed inputs (for type inference)."""
    import onnx

    skel = onnx.ModelProto()
    skel.ir_version = model.ir_version
    skel.opset_import.extend(model.opset_import)
    graph = skel.graph
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    names = {i.name for i in model.graph.input}
    for t in model.graph.initializer:
        if t.name not in names:
            graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return skel


def _types(model: Any) -> dict[str, int]:
    """Element type of every main-graph tensor shape inference can tell."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(_skeleton(model), strict_mode=False, data_prop=False)
    except Exception as err:  # inference errors come in many types; without types nothing is removed
        logger.debug("type inference failed, no Cast removed: %s", err)
        return {}
    g = inferred.graph
    return {v.name: v.type.tensor_type.elem_type for v in [*g.value_info, *g.input, *g.output]
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}


def drop_noop_casts(model: Any) -> int:
    """Remove the main graph's Casts to the type their input already has (in place); returns how many."""
    types = _types(model)
    outputs = {o.name for o in model.graph.output}
    rename: dict[str, str] = {}
    kept = []
    removed = 0
    for node in model.graph.node:
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        src = types.get(rename.get(node.input[0], node.input[0])) if node.op_type == "Cast" and node.input else None
        if node.op_type != "Cast" or to is None or src is None or src != to:
            kept.append(node)
            continue
        removed += 1
        if node.output[0] in outputs:  # a graph output keeps its name
            node.op_type = "Identity"
            del node.attribute[:]
            kept.append(node)
        else:
            rename[node.output[0]] = rename.get(node.input[0], node.input[0])
    if not removed:
        return 0
    del model.graph.node[:]
    model.graph.node.extend(kept)
    for graph in iter_graphs(model.graph):  # outer-scope names the bodies read too
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name in rename:
                    node.input[i] = rename[name]
    gone = set(rename)
    kept_info = [v for v in model.graph.value_info if v.name not in gone]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept_info)
    logger.info("removed %d Cast(s) to the type their input already has", removed)
    return removed

