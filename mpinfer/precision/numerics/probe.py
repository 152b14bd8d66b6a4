"""Group sensitivities measured in ONNX Runtime, all groups in one session (``--numerics ort``).

The probe model is the FP32 graph plus, for every group, a low-precision copy of the group's nodes fed the
FP32 graph's own tensors (the copy is the group's sub-model converted by :func:`apply_plan`, so it computes
exactly as the group would inside a converted model). Inside the graph each copy's outputs are compared with
the FP32 outputs they replace (``ReduceSumSquare`` of the difference and of the reference), so one run over a
calibration batch returns two small vectors and no intermediate tensor leaves ONNX Runtime. The cost is about
one FP32 run plus one low-precision run of the model, whatever the number of groups: the numpy emulator
needs a Python kernel call per node and group instead.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpinfer.errors import ModelLoadError
from mpinfer.memory import current_budget
from mpinfer.metrics import relative_l2
from mpinfer.modelio import ort_session
from mpinfer.precision.core import GraphInfo
from mpinfer.precision.graph import apply_plan
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

PREFIX = "__mpinfer_probe"


@dataclass
class ProbeResult:
    """Relative L2 error per group anchor; anchors the probe could not measure are missing."""

    errors: dict[str, float]
    evaluations: int


def group_submodel(info: GraphInfo, members: Sequence[str]) -> tuple[Any, list[str]] | None:
    """The group's nodes as a model whose inputs are the tensors it reads, and the float outputs it hands on.

    None when a member holds a subgraph, an input's type is unknown, or no float output leaves the group
    (the planner never makes such nodes low). Used by the probe and by the emulator's per-group runs.
    """
    from onnx import TensorProto, helper

    nodes = [info.by_address[a].node for a in members]
    if any(attr.type in (attr.GRAPH, attr.GRAPHS) for n in nodes for attr in n.attribute):
        return None
    ext = _external_inputs(nodes)
    if any(i not in info.types for i in ext):
        return None
    inits = [info.initializers[i] for i in ext if i in info.initializers]
    inputs = [helper.make_tensor_value_info(i, info.types[i], None) for i in ext if i not in info.initializers]
    outs = _handed_on(info, nodes, set(members))
    if not outs:
        return None
    graph = helper.make_graph(
        nodes, "probe", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits
    )
    sub = helper.make_model(graph, opset_imports=list(info.model.opset_import))
    sub.ir_version = info.model.ir_version
    return sub, outs


def _external_inputs(nodes: Sequence[Any]) -> list[str]:
    """The tensors the nodes read that none of them makes, in order of first use."""
    produced = {o for n in nodes for o in n.output if o}
    return list(dict.fromkeys(i for n in nodes for i in n.input if i and i not in produced))


def _handed_on(info: GraphInfo, nodes: Sequence[Any], members: set[str]) -> list[str]:
    """The float outputs of the nodes that leave the group: graph outputs, or read by a node outside it."""
    from onnx import TensorProto

    return [
        o
        for o in dict.fromkeys(o for n in nodes for o in n.output if o)
        if info.types.get(o) == TensorProto.FLOAT
        and (o in info.graph_outputs or any(c[0] not in members for c in info.consumers.get(o, [])))
    ]


def _inline(converted: Any, tag: str, keep: set[str]) -> tuple[list[Any], list[Any], dict[str, str]]:
    """Nodes and initializers of ``converted`` with every name except ``keep`` (the FP32 feeds) prefixed."""
    from onnx import NodeProto, TensorProto

    rename: dict[str, str] = {}

    def new(name: str) -> str:
        if not name or name in keep:
            return name
        return rename.setdefault(name, f"{tag}/{name}")

    inits = []
    for t in converted.graph.initializer:
        c = TensorProto()
        c.CopyFrom(t)
        c.name = new(t.name)
        inits.append(c)
    nodes = []
    for n in converted.graph.node:
        c = NodeProto()
        c.CopyFrom(n)
        c.name = f"{tag}/{n.name}"
        c.ClearField("input")
        c.ClearField("output")
        c.input.extend(new(i) for i in n.input)
        c.output.extend(new(o) for o in n.output)
        nodes.append(c)
    return nodes, inits, rename


def build_probe(info: GraphInfo, groups: Sequence[Any], low: Precision) -> tuple[Any, list[str]] | None:
    """The probe model and, per row of its ``noise``/``signal`` outputs, the group anchor it belongs to.

    None when no group can be probed (or the model is too large to hold twice).
    """
    from onnx import TensorProto, helper

    model = info.model
    # above the budget's probe slice (a second copy of every converted weight) the emulator measures instead
    if info.base_dir or model.ByteSize() > current_budget().probe:
        return None
    nodes: list[Any] = list(model.graph.node)
    inits: list[Any] = list(model.graph.initializer)
    noise, signal, rows = [], [], []
    flat: dict[str, str] = {}

    def sum_sq(x: str, out: str) -> str:
        nodes.append(helper.make_node("Flatten", [x], [f"{out}/flat"], name=f"{out}/Flatten", axis=0))
        nodes.append(helper.make_node("ReduceSumSquare", [f"{out}/flat"], [out], name=f"{out}/Reduce", keepdims=1))
        return out

    for gi, group in enumerate(groups):
        built = group_submodel(info, group.members)
        if built is None:
            continue
        sub, outs = built
        try:
            sub_info = GraphInfo(sub, ask_runtime=False)  # typed from the parent's info
            converted = apply_plan(
                sub, sub_info, {a: low for a in sub_info.by_address}, low, keep_io_types=True
            ).model
        except Exception as err:  # noqa: BLE001 - a group the probe cannot copy is measured by the emulator
            logger.debug("probe: group %s not probed: %s", group.anchor, err)
            continue
        tag = f"{PREFIX}{gi}"
        feeds = {vi.name for vi in converted.graph.input}
        g_nodes, g_inits, rename = _inline(converted, tag, feeds)
        nodes.extend(g_nodes)
        inits.extend(g_inits)
        for o in outs:
            diff = f"{tag}/{o}/diff"
            nodes.append(helper.make_node("Sub", [rename[o], o], [diff], name=f"{tag}/{o}/Sub"))
            noise.append(sum_sq(diff, f"{tag}/{o}/noise"))
            if o not in flat:
                flat[o] = sum_sq(o, f"{PREFIX}/{o}/signal")
            signal.append(flat[o])
            rows.append(group.anchor)
    if not rows:
        return None
    nodes.append(helper.make_node("Concat", noise, [f"{PREFIX}/noise"], name=f"{PREFIX}/noise", axis=0))
    nodes.append(helper.make_node("Concat", signal, [f"{PREFIX}/signal"], name=f"{PREFIX}/signal", axis=0))
    outputs = [helper.make_tensor_value_info(f"{PREFIX}/{k}", TensorProto.FLOAT, None) for k in ("noise", "signal")]
    graph = helper.make_graph(nodes, "mpinfer_probe", list(model.graph.input), outputs, inits)
    probe = helper.make_model(graph, opset_imports=list(model.opset_import))
    probe.ir_version = model.ir_version
    return probe, rows


def probe_errors(info: GraphInfo, groups: Sequence[Any], batches: Sequence[dict], low: Precision) -> ProbeResult:
    """Each group's relative L2 error at its outputs with only the group low, measured in ONNX Runtime.

    Groups the probe cannot copy, or whose FP32 reference is not finite, are left out of ``errors`` (the
    caller measures them another way); a group whose low copy overflows gets ``inf``.
    """
    built = build_probe(info, groups, low)
    if built is None:
        return ProbeResult({}, 0)
    probe, rows = built
    try:
        sess = ort_session(probe)
    except ModelLoadError as err:
        logger.debug("probe: ONNX Runtime refused the probe model: %s", err)
        return ProbeResult({}, 0)
    noise = np.zeros(len(rows))
    signal = np.zeros(len(rows))
    names = {i.name for i in sess.get_inputs()}
    for batch in batches:
        n, s = sess.run([f"{PREFIX}/noise", f"{PREFIX}/signal"], {k: v for k, v in batch.items() if k in names})
        noise += np.asarray(n, np.float64).reshape(-1)
        signal += np.asarray(s, np.float64).reshape(-1)
    per_noise: dict[str, float] = {}
    per_signal: dict[str, float] = {}
    for anchor, n, s in zip(rows, noise, signal, strict=True):
        per_noise[anchor] = per_noise.get(anchor, 0.0) + float(n)
        per_signal[anchor] = per_signal.get(anchor, 0.0) + float(s)
    errors: dict[str, float] = {}
    for anchor, n in per_noise.items():
        s = per_signal[anchor]
        if not math.isfinite(s):
            continue  # the FP32 reference itself overflows: the emulator masks those values
        if not math.isfinite(n):
            errors[anchor] = math.inf
        else:
            errors[anchor] = relative_l2(n, s)
    probed = set(rows)
    sizes = sum(len(g.members) for g in groups if g.anchor in probed)
    return ProbeResult(errors, (len(info.nodes) + sizes) * len(batches))
