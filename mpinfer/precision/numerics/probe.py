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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpinfer.errors import ModelLoadError
from mpinfer.memory import current_budget
from mpinfer.metrics import relative_l2
from mpinfer.modelio import ort_session
from mpinfer.precision.core import GraphInfo, constant_tensor
from mpinfer.precision.graph import apply_plan
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

PREFIX = "__mpinfer_probe"
# Groups per probe model: larger probes are split, each part the FP32 graph (what its groups read) and this many low
# copies. ONNX Runtime's session setup grows faster than the probe's nodes: on the OCR recognizer (399 groups) one
# probe took 6.2 CPU s to open and 4.0 s to run 8 samples, eight probes of 50 groups 1.8 s and 5.6 s (each part runs
# the FP32 nodes its groups read again). Each group's sums are the same nodes on the same tensors whichever part
# holds it, so the errors do not depend on the split.
PROBE_GROUPS = 50
# The same for the strict probe (None: one model). Its setup cost was ONNX Runtime's shape propagation from the
# partly symbolic input shape through the FP16 tensors, which the cast graph no longer declares (castgraph._unshaped):
# the OCR recognizer's sensitivities take 7.7-8.1 s as one probe, 10.1 s in parts of 50 (the FP32 nodes run again
# in each part), the same errors bit for bit.
STRICT_PROBE_GROUPS: int | None = None


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
    held = {**_constants(info, ext), **{i: info.initializers[i] for i in ext if i in info.initializers}}
    inits = [held[i] for i in ext if i in held]  # (weights: initializers, and what Constant nodes make)
    inputs = [helper.make_tensor_value_info(i, info.types[i], None) for i in ext if i not in held]
    outs = _handed_on(info, nodes, set(members))
    if not outs:
        return None
    graph = helper.make_graph(
        nodes, "probe", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits
    )
    sub = helper.make_model(graph, opset_imports=list(info.model.opset_import))
    sub.ir_version = info.model.ir_version
    return sub, outs


def _constants(info: GraphInfo, names: Sequence[str]) -> dict[str, Any]:
    """The tensors of ``names`` a top-level Constant node makes (:func:`constant_tensor`), as initializers.

    A sub-model holds them as the weights they are rather than as inputs fed their values: a low node's parameters
    from a Constant (a BatchNormalization's in Paddle exports: PP-OCRv4's recognizer, layout_cdla) are then
    constants its cast graph folds, as the whole model's cast graph does, instead of sending the group to the
    emulator. The values are the same either way.
    """
    from onnx import TensorProto

    out = {}
    for name in names:
        address = info.producer.get(name)
        ref = info.by_address.get(address) if address is not None else None
        if ref is None or ref.depth or ref.node.op_type != "Constant":
            continue
        made = constant_tensor(ref.node)
        if made is None or made.data_location == TensorProto.EXTERNAL:
            continue
        t = TensorProto()
        t.CopyFrom(made)
        t.name = name
        out[name] = t
    return out


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


def build_probe(
    info: GraphInfo, groups: Sequence[Any], low: Precision, *, exact: bool = False, left: dict[str, str] | None = None
) -> tuple[Any, list[str]] | None:
    """The probe model and, per row of its ``noise``/``signal`` outputs, the group anchor it belongs to.

    ``exact`` (strict numerics, :func:`strict_probe_errors`): only groups whose low copy has a cast graph
    (:func:`~mpinfer.precision.emulator.castgraph.cast_graph`: the strict emulator's bits in float32 ONNX Runtime
    ops) are copied, and the sums are :func:`_exact_sums`' (float64, as the emulator's
    :func:`~mpinfer.precision.numerics.strict.local_error` sums them); else float32 ``ReduceSumSquare``.

    ``left``: filled with group anchor -> why the probe does not copy it.

    None when no group can be probed (or the model is too large to hold twice).
    """
    from onnx import TensorProto, helper

    left = {} if left is None else left
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
        converted, outs = _low_copy(info, group, low, exact, left)
        if converted is None:
            continue
        tag = f"{PREFIX}{gi}"
        feeds = {vi.name for vi in converted.graph.input}
        g_nodes, g_inits, rename = _inline(converted, tag, feeds)
        nodes.extend(g_nodes)
        inits.extend(g_inits)
        for o in outs:
            if exact:
                n_out, s_out = _exact_sums(nodes, inits, rename[o], o, f"{tag}/{o}")
                noise.append(n_out)
                signal.append(s_out)
            else:
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
    sum_type = TensorProto.DOUBLE if exact else TensorProto.FLOAT
    outputs = [helper.make_tensor_value_info(f"{PREFIX}/{k}", sum_type, None) for k in ("noise", "signal")]
    nodes = _read_by(nodes, [f"{PREFIX}/noise", f"{PREFIX}/signal"])
    read = {i for n in nodes for i in n.input}
    inits = [t for t in inits if t.name in read] if len(nodes) < len(model.graph.node) else inits
    graph = helper.make_graph(nodes, "mpinfer_probe", list(model.graph.input), outputs, inits)
    probe = helper.make_model(graph, opset_imports=list(model.opset_import))
    probe.ir_version = model.ir_version
    return probe, rows


def _read_by(nodes: list[Any], outputs: Sequence[str]) -> list[Any]:
    """The nodes ``outputs`` depend on, in their order: a probe of some groups runs only the FP32 nodes they read.

    Every node when one holds a subgraph (whose reads of outer tensors the walk does not follow).
    """
    if any(attr.type in (attr.GRAPH, attr.GRAPHS) for n in nodes for attr in n.attribute):
        return nodes
    needed = set(outputs)
    kept = []
    for n in reversed(nodes):
        if any(o in needed for o in n.output):
            kept.append(n)
            needed.update(i for i in n.input if i)
    kept.reverse()
    return kept


def _low_copy(
    info: GraphInfo, group: Any, low: Precision, exact: bool, left: dict[str, str]
) -> tuple[Any, list[str]]:
    """The group's sub-model converted with every node low, and its outputs; (None, []) when the probe cannot copy it.

    ``exact``: also (None, []) when the copy has no cast graph (a low op the strict emulator alone computes). Each
    group not copied gets its reason in ``left``.
    """
    built = group_submodel(info, group.members)
    if built is None:
        left[group.anchor] = "no sub-model (a subgraph, an untyped input or no float output)"
        return None, []
    sub, outs = built
    try:
        sub_info = GraphInfo(sub, ask_runtime=False)  # typed from the parent's info
        converted = apply_plan(sub, sub_info, {a: low for a in sub_info.by_address}, low, keep_io_types=True).model
    except Exception as err:  # noqa: BLE001 - a group the probe cannot copy is measured by the emulator
        logger.debug("probe: group %s not probed: %s", group.anchor, err)
        left[group.anchor] = f"its low copy failed ({err})"
        return None, []
    if exact:
        from mpinfer.precision.emulator.castgraph import cast_graph

        fast, why = cast_graph(converted)
        if fast is None:
            left[group.anchor] = why
            return None, []
    return converted, outs


def _exact_sums(nodes: list[Any], inits: list[Any], got: str, want: str, tag: str) -> tuple[str, str]:
    """Nodes summing, in float64, the squared error of ``got`` against ``want`` and the squares of ``want``.

    The sums :func:`~mpinfer.precision.numerics.strict.local_error` takes where every reference value is finite
    (most tensors; its fast path): a ``got`` not finite there makes the noise sum inf or NaN (the group overflows).
    A ``want`` with a value not finite makes the signal sum so: the caller measures that group on the emulator, which
    leaves those values out (masking them here would cost more than the group's Convs). Returns the two sums' names.
    """
    from onnx import TensorProto, helper, numpy_helper

    shape = f"{PREFIX}/one"
    if not any(t.name == shape for t in inits):
        inits.append(numpy_helper.from_array(np.asarray([1], np.int64), shape))

    def node(op: str, ins: list[str], out: str, **attrs: Any) -> str:
        nodes.append(helper.make_node(op, ins, [f"{tag}/{out}"], name=f"{tag}/{out}", **attrs))
        return f"{tag}/{out}"

    w = node("Cast", [want], "want64", to=TensorProto.DOUBLE)
    d = node("Sub", [node("Cast", [got], "got64", to=TensorProto.DOUBLE), w], "diff")
    noise = node("Reshape", [node("ReduceSumSquare", [d], "noise_sum", keepdims=0), shape], "noise")
    signal = node("Reshape", [node("ReduceSumSquare", [w], "signal_sum", keepdims=0), shape], "signal")
    return noise, signal


def _parts(groups: Sequence[Any], size: int | None) -> list[Sequence[Any]]:
    """``groups`` in runs of at most ``size`` (None: all in one), one probe model each."""
    if size is None:
        return [groups]
    return [groups[i : i + size] for i in range(0, len(groups), size)]


def probe_errors(info: GraphInfo, groups: Sequence[Any], batches: Sequence[dict], low: Precision) -> ProbeResult:
    """Each group's relative L2 error at its outputs with only the group low, measured in ONNX Runtime.

    Groups the probe cannot copy, or whose FP32 reference is not finite, are left out of ``errors`` (the
    caller measures them another way); a group whose low copy overflows gets ``inf``. One probe model per
    :data:`PROBE_GROUPS` groups.
    """
    return _in_parts(_probe_part, info, groups, batches, low, PROBE_GROUPS)


def _in_parts(
    measure: Callable[[GraphInfo, Sequence[Any], Sequence[dict], Precision], ProbeResult],
    info: GraphInfo, groups: Sequence[Any], batches: Sequence[dict], low: Precision, size: int | None,
) -> ProbeResult:
    """``measure`` of each part of ``groups`` (:func:`_parts` of ``size``), the errors and evaluations added up."""
    errors: dict[str, float] = {}
    evaluations = 0
    for part in _parts(groups, size):
        got = measure(info, part, batches, low)
        errors.update(got.errors)
        evaluations += got.evaluations
    return ProbeResult(errors, evaluations)


def _probe_part(info: GraphInfo, groups: Sequence[Any], batches: Sequence[dict], low: Precision) -> ProbeResult:
    """:func:`probe_errors` of ``groups`` with one probe model."""
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
    per_noise, per_signal = _per_group(rows, noise, signal)
    errors = {}
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


def _per_group(rows: Sequence[str], noise: np.ndarray, signal: np.ndarray) -> tuple[dict[str, float], dict[str, float]]:
    """The noise and signal sums of each group (the probe's rows of one group added up)."""
    per_noise: dict[str, float] = {}
    per_signal: dict[str, float] = {}
    for anchor, n, s in zip(rows, noise, signal, strict=True):
        per_noise[anchor] = per_noise.get(anchor, 0.0) + float(n)
        per_signal[anchor] = per_signal.get(anchor, 0.0) + float(s)
    return per_noise, per_signal


def strict_probe_errors(
    info: GraphInfo, groups: Sequence[Any], batches: Sequence[dict], low: Precision
) -> ProbeResult:
    """:func:`probe_errors` for strict numerics: the probe's cast graph, each low copy on the emulator's bits.

    The probe (:func:`build_probe` with ``exact``) runs as a float32 graph with rounding casts
    (:mod:`~mpinfer.precision.emulator.castgraph`): each group's low copy computes what the strict emulator computes
    for it, bit for bit, fed the FP32 tensors ONNX Runtime computes (the reference the candidates are judged
    against), and the sums are float64 as :func:`~mpinfer.precision.numerics.strict.local_error` takes them. One run
    per batch: an FP32 pass plus a low pass of the copied groups, at ONNX Runtime speed. Groups without a cast graph
    are left out of ``errors`` (the caller measures them on the emulator); a group whose copy overflows gets ``inf``.
    One probe model, or one per :data:`STRICT_PROBE_GROUPS` groups when it is set (a part ONNX Runtime refuses: the
    emulator measures its groups).
    """
    return _in_parts(_strict_part, info, groups, batches, low, STRICT_PROBE_GROUPS)


def _strict_part(info: GraphInfo, groups: Sequence[Any], batches: Sequence[dict], low: Precision) -> ProbeResult:
    """:func:`strict_probe_errors` of ``groups`` with one probe model."""
    from mpinfer.precision.emulator.castgraph import CastGraphSession, cast_graph

    left: dict[str, str] = {}
    built = build_probe(info, groups, low, exact=True, left=left)
    for anchor, why in left.items():  # (what a float32 graph cannot express, named)
        logger.info("sensitivities: group %s measured on the strict emulator: %s", anchor, why)
    if built is None:
        return ProbeResult({}, 0)
    probe, rows = built
    fast, why = cast_graph(probe)
    if fast is None:
        logger.info("sensitivities: the strict probe has no cast graph (%s); the emulator measures its groups", why)
        return ProbeResult({}, 0)
    try:
        sess = CastGraphSession(fast)
        noise = np.zeros(len(rows))
        signal = np.zeros(len(rows))
        names = {vi.name for vi in fast.model.graph.input}
        for batch in batches:
            out = sess({k: v for k, v in batch.items() if k in names})
            noise += np.asarray(out[f"{PREFIX}/noise"], np.float64).reshape(-1)
            signal += np.asarray(out[f"{PREFIX}/signal"], np.float64).reshape(-1)
    except Exception as err:  # onnxruntime raises its own types: a graph or data it refuses; the emulator measures
        logger.info("sensitivities: ONNX Runtime refused the strict probe (%s); the emulator measures its groups", err)
        return ProbeResult({}, 0)
    per_noise, per_signal = _per_group(rows, noise, signal)
    errors = {}
    for anchor, total in per_noise.items():
        if not math.isfinite(per_signal[anchor]):  # (a reference value not finite: the emulator leaves those out)
            logger.info("sensitivities: group %s measured on the strict emulator: its FP32 reference is not finite "
                        "everywhere", anchor)
            continue
        errors[anchor] = math.inf if not math.isfinite(total) else relative_l2(total, per_signal[anchor])
    sizes = sum(len(g.members) for g in groups if g.anchor in errors)
    return ProbeResult(errors, (len(info.nodes) + sizes) * len(batches))
