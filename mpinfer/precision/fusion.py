"""Fuse decomposed RMSNorm chains into ONNX's RMSNormalization with a float32 stash (opset 23 and later).

Exporters write a Llama-style RMSNorm as seven nodes::

    Pow(x, 2) | Mul(x, x) -> ReduceMean(last axis, keepdims) -> Add(eps) -> Sqrt
        -> Div(1, .) | Reciprocal -> Mul(x, .)    (or Div(x, .))    -> Mul(weight, .)

A normalization stays FP32 by rule (its sum of squares overflows FP16 and its mean loses digits), so in a model
converted to FP16 every such chain is an FP32 island behind two Casts: 14 Casts on a 3-layer decoder, two per
norm. ONNX's ``RMSNormalization`` (opset 23) with ``stash_type=1`` computes the same thing in float32 whatever
its input type, so the fused op runs with FP16 input and output and no Cast at all, the statistics still in
float32 (the rules lower it only where the calibrated range of its input and output fits the low format, see
``rules.Fp32AccumulationRule``).

The fusion runs only on models at opset 23 or later: an export at that opset, or ``convert --opset 23``
(ONNX's version converter upgrades the model first). ONNX Runtime runs RMSNormalization in the releases that
read opset 23 (1.31 is tested here); the TensorRT ONNX parser imports it from 10.15 on, and in TensorRT 11
(``mpinfer.engine.machine.TENSORRT_OP_SINCE``). Below opset 23 the chains are only counted, for a warning.

A chain is fused only when it computes exactly RMSNormalization(x, weight, axis=-1, epsilon=eps): the exponent
is 2, the mean runs over the last axis alone with keepdims, eps and 1 are scalar constants, the weight is a
constant broadcastable to the last axis, and no intermediate is read anywhere else (or is a graph output).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpinfer.modelio import default_opset

logger = logging.getLogger(__name__)

RMS_NORM_MIN_OPSET = 23
FUSED_SUFFIX = "/RMSNormalization_fused"


@dataclass(frozen=True)
class RmsChain:
    """One decomposed RMSNorm found in a graph.

    Attributes:
        x: The normalized tensor.
        scale: The weight tensor (a constant).
        output: The chain's output (the weight Mul's).
        epsilon: The constant added to the mean of squares.
        nodes: The names of the chain's nodes, first to last (the weight Mul last).
    """

    x: str
    scale: str
    output: str
    epsilon: float
    nodes: tuple[str, ...]


def _constants(graph: Any) -> dict[str, np.ndarray]:
    """Small constants by name: embedded initializers and Constant nodes with a tensor value (at most 64 values)."""
    from onnx import numpy_helper

    out: dict[str, np.ndarray] = {}
    for t in graph.initializer:
        if not t.external_data and int(np.prod(t.dims, dtype=np.int64)) <= 64:
            out[t.name] = numpy_helper.to_array(t)
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1:
            attr = node.attribute[0]
            if attr.name == "value" and int(np.prod(attr.t.dims, dtype=np.int64)) <= 64:
                out[node.output[0]] = numpy_helper.to_array(attr.t)
            elif attr.name == "value_float":
                out[node.output[0]] = np.array(attr.f, np.float32)
            elif attr.name == "value_ints":
                out[node.output[0]] = np.array(list(attr.ints), np.int64)
    return out


def _scalar(consts: Mapping[str, np.ndarray], name: str) -> float | None:
    v = consts.get(name)
    if v is None or v.size != 1 or v.dtype.kind != "f":
        return None
    return float(v.reshape(()))


def _last_axis_only(node: Any, consts: Mapping[str, np.ndarray]) -> bool:
    """ReduceMean over the last axis alone, with keepdims (axes as attribute before opset 18, input after)."""
    attrs = {a.name: a for a in node.attribute}
    if "keepdims" in attrs and attrs["keepdims"].i != 1:
        return False
    if "axes" in attrs:
        axes = list(attrs["axes"].ints)
    elif len(node.input) > 1 and node.input[1]:
        v = consts.get(node.input[1])
        if v is None:
            return False
        axes = [int(a) for a in v.reshape(-1)]
    else:
        return False  # (all axes)
    return axes == [-1]


def find_rms_chains(graph: Any) -> list[RmsChain]:
    """Every decomposed RMSNorm of ``graph`` (its own nodes, not its subgraphs') that fuses exactly."""
    consts = _constants(graph)
    producer = {o: n for n in graph.node for o in n.output if o}
    consumers: dict[str, list[Any]] = defaultdict(list)
    for n in graph.node:
        for i in n.input:
            if i:
                consumers[i].append(n)
    outputs = {o.name for o in graph.output}
    weights = {t.name: t for t in graph.initializer}

    def sole(name: str, op: str | tuple[str, ...]) -> Any:
        """The one consumer of ``name`` when it has exactly one, of type ``op``, and ``name`` is no graph output."""
        users = consumers.get(name, [])
        ops = (op,) if isinstance(op, str) else op
        if len(users) != 1 or name in outputs or users[0].op_type not in ops or users[0].domain not in ("", "ai.onnx"):
            return None
        return users[0]

    def other(node: Any, name: str) -> str | None:
        """The input of binary ``node`` that is not ``name`` (None when both are, or the arity is not 2)."""
        if len(node.input) != 2:
            return None
        a, b = node.input
        return b if a == name else a if b == name else None

    def constant_scale(name: str) -> str | None:
        """``name``, or the tensor an Identity chain copies it from, when that is a 1-D float32 constant."""
        while name in producer and producer[name].op_type == "Identity" and name not in weights:
            name = producer[name].input[0]  # (exporters share equal weights through Identity nodes)
        t = weights.get(name)
        if t is not None:
            return name if len(t.dims) == 1 and t.data_type == 1 else None
        v = consts.get(name)
        return name if v is not None and v.ndim == 1 and v.dtype == np.float32 else None

    chains = []
    for rm in graph.node:
        if rm.op_type != "ReduceMean" or rm.domain not in ("", "ai.onnx") or not _last_axis_only(rm, consts):
            continue
        sq = producer.get(rm.input[0])
        if sq is None or len(consumers[rm.input[0]]) != 1 or rm.input[0] in outputs:
            continue
        if sq.op_type == "Pow" and _scalar(consts, sq.input[1]) == 2.0:
            x = sq.input[0]
        elif sq.op_type == "Mul" and len(sq.input) == 2 and sq.input[0] == sq.input[1]:
            x = sq.input[0]
        else:
            continue
        add = sole(rm.output[0], "Add")
        eps_name = other(add, rm.output[0]) if add is not None else None
        eps = _scalar(consts, eps_name) if eps_name else None
        sqrt = sole(add.output[0], "Sqrt") if add is not None and eps is not None and eps >= 0 else None
        if sqrt is None:
            continue
        step = sole(sqrt.output[0], ("Div", "Reciprocal"))
        if step is None:
            continue
        if step.op_type == "Div" and list(step.input) == [x, sqrt.output[0]]:  # x / rms
            middle, norm = [step], step
        else:
            is_inverse = step.op_type == "Reciprocal" or (
                list(step.input[1:]) == [sqrt.output[0]] and _scalar(consts, step.input[0]) == 1.0
            )
            norm = sole(step.output[0], "Mul") if is_inverse else None
            if norm is None or other(norm, step.output[0]) != x:
                continue
            middle = [step, norm]
        wmul = sole(norm.output[0], "Mul")
        scale = other(wmul, norm.output[0]) if wmul is not None else None
        scale = constant_scale(scale) if scale is not None else None
        if scale is None:
            continue
        nodes = (sq, rm, add, sqrt, *middle, wmul)
        chains.append(RmsChain(x, scale, wmul.output[0], eps, tuple(n.name for n in nodes)))  # type: ignore[arg-type]
    return chains


def fuse_rms_norms(model: Any) -> list[RmsChain]:
    """Replace, in place, every exact decomposed RMSNorm of the main graph by one RMSNormalization (stash_type=1).

    Nothing changes below opset :data:`RMS_NORM_MIN_OPSET`. Each fused node takes the name of the chain's last
    node plus :data:`FUSED_SUFFIX` and its place in the node list; Constant nodes left unread are removed.
    Node names must be unique (``mpinfer.modelio.name_nodes``).

    Returns:
        The chains fused.
    """
    from onnx import helper

    if default_opset(model) < RMS_NORM_MIN_OPSET:
        return []
    graph = model.graph
    chains = find_rms_chains(graph)
    if not chains:
        return chains
    fused = {c.nodes[-1]: c for c in chains}
    dropped = {name for c in chains for name in c.nodes[:-1]}
    kept = []
    for node in graph.node:
        chain = fused.get(node.name)
        if chain is not None:
            kept.append(helper.make_node("RMSNormalization", [chain.x, chain.scale], [chain.output],
                                         name=node.name + FUSED_SUFFIX, axis=-1, epsilon=chain.epsilon, stash_type=1))
        elif node.name not in dropped:
            kept.append(node)
    read = {i for n in kept for i in n.input} | {o.name for o in graph.output}
    read |= {i for n in kept for g in _bodies(n) for i in _outer_reads(g)}
    # Constants and the Identity copies of shared weights that only the chains read
    kept = [n for n in kept if n.op_type not in ("Constant", "Identity") or n.domain not in ("", "ai.onnx")
            or any(o in read for o in n.output)]
    gone = {o for n in graph.node for o in n.output} - {o for n in kept for o in n.output}
    del graph.node[:]
    graph.node.extend(kept)
    for vi in [vi for vi in graph.value_info if vi.name in gone]:  # the removed intermediates' shapes
        graph.value_info.remove(vi)
    logger.info("Fused %d decomposed RMSNorm chain(s) into RMSNormalization with stash_type=1 (float32 statistics "
                "whatever the I/O type; %d nodes replaced)", len(chains), len(dropped) + len(fused))
    return chains


def _bodies(node: Any) -> list[Any]:
    from mpinfer.modelio import subgraphs

    return list(subgraphs(node))


def _outer_reads(graph: Any) -> set[str]:
    """Names a subgraph reads (its nodes' inputs, nested bodies included); a superset of its outer reads."""
    out = {i for n in graph.node for i in n.input}
    for n in graph.node:
        for g in _bodies(n):
            out |= _outer_reads(g)
    return out


def fuse_norms(model: Any) -> list[RmsChain]:
    """:func:`fuse_rms_norms` at opset 23 and later; below it, a hint when the model has chains it would fuse."""
    if default_opset(model) >= RMS_NORM_MIN_OPSET:
        return fuse_rms_norms(model)
    found = len(find_rms_chains(model.graph))
    if found:
        logger.warning("%d decomposed RMSNorm chain(s) stay FP32 islands behind two Casts each. Hint: `--opset %d` "
                    "fuses them into RMSNormalization with float32 statistics and no Cast (ONNX Runtime releases "
                       "that read opset 23, TensorRT 10.15+).", found, RMS_NORM_MIN_OPSET)
    return []
