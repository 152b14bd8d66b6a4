"""Fuse decomposed RMSNorm and LayerNorm chains into ONNX's normalization ops with a float32 stash.

Exporters write a Llama-style RMSNorm as seven nodes, and older exporters (below opset 17) a LayerNorm as nine::

    RMSNorm:   Pow(x, 2) | Mul(x, x) -> ReduceMean(last axis) -> Add(eps) -> Sqrt
                   -> Div(1, .) | Reciprocal -> Mul(x, .)   (or Div(x, .))   -> Mul(weight, .)
    LayerNorm: d = Sub(x, ReduceMean(x)); the RMSNorm of d as above, then Add(bias, .) (optional)

A normalization stays FP32 by rule (a sum of squares overflows FP16 and a mean loses digits), so in a model
converted to FP16 every such chain is an FP32 island behind two Casts: 14 Casts on a 3-layer Llama, two per norm.
ONNX's ``RMSNormalization`` (opset 23) and ``LayerNormalization`` (opset 17) with ``stash_type=1`` compute the same
thing in float32 whatever their input type, so a fused op runs with FP16 input and output and no Cast at all, its
statistics still in float32 (the rules lower it only where the calibrated range of its input and output fits the
low format, see ``rules.Fp32AccumulationRule``; without calibration data it stays FP32, as the chain did).

LayerNorm chains fuse at opset 17 and later, which ONNX Runtime and every TensorRT that mpinfer builds with (10
and 11) run. RMSNorm chains fuse at opset 23 and later: an export at that opset, or ``convert --opset 23``
(ONNX's version converter upgrades the model first). ONNX Runtime runs RMSNormalization in the releases that read
opset 23 (1.31 is tested here); the TensorRT ONNX parser imports it from 10.15 on, and in TensorRT 11
(``mpinfer.engine.machine.TENSORRT_OP_SINCE``), which is why it is not the default. Below those opsets the chains
are only counted, for a warning.

A chain is fused only when it computes exactly the op: the exponent is 2, each mean runs over the last axis alone
with keepdims, eps and 1 are scalar constants, weight and bias are 1-D float32 constants, and no intermediate is
read anywhere else (or is a graph output).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpinfer.modelio import RMS_NORM_OPSET, default_opset

logger = logging.getLogger(__name__)

RMS_NORM_MIN_OPSET = RMS_NORM_OPSET
LAYER_NORM_MIN_OPSET = 17
FUSED_SUFFIX = "/RMSNormalization_fused"
FUSED_LN_SUFFIX = "/LayerNormalization_fused"
FUSED_SUFFIXES = (FUSED_SUFFIX, FUSED_LN_SUFFIX)
_DEFAULT = ("", "ai.onnx")
# Each fused op, and the opset it arrives with
FIRST_OPSET = (("RMSNormalization", RMS_NORM_MIN_OPSET), ("LayerNormalization", LAYER_NORM_MIN_OPSET))
# The op types a fused chain replaces (a --keep-op/--low-op naming one then names the fused op's node instead)
FUSED_OPS = frozenset({"Pow", "Mul", "ReduceMean", "Add", "Sub", "Sqrt", "Div", "Reciprocal"})


@dataclass(frozen=True)
class NormChain:
    """One decomposed normalization found in a graph.

    Attributes:
        op: ``RMSNormalization`` or ``LayerNormalization``.
        x: The normalized tensor.
        scale: The weight tensor (a constant).
        bias: The bias tensor (a constant; LayerNorm only), or ``""``.
        output: The chain's output (its last node's).
        epsilon: The constant added to the mean of squares.
        nodes: The names of the chain's nodes, first to last.
    """

    op: str
    x: str
    scale: str
    bias: str
    output: str
    epsilon: float
    nodes: tuple[str, ...]


def _constants(graph: Any) -> dict[str, np.ndarray]:
    """Small constants by name: embedded initializers and Constant nodes with a tensor value (at most 64 values)."""
    from onnx import numpy_helper

    out: dict[str, np.ndarray] = {}
    for t in graph.initializer:
        if not t.external_data and math.prod(t.dims) <= 64:
            out[t.name] = numpy_helper.to_array(t)
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in _DEFAULT and len(node.attribute) == 1:
            attr = node.attribute[0]
            if attr.name == "value" and math.prod(attr.t.dims) <= 64:
                out[node.output[0]] = numpy_helper.to_array(attr.t)
            elif attr.name == "value_float":
                out[node.output[0]] = np.array(attr.f, np.float32)
            elif attr.name == "value_ints":
                out[node.output[0]] = np.array(list(attr.ints), np.int64)
    return out


class _Wiring:
    """Who produces and who reads each tensor of one graph, and its small constants."""

    def __init__(self, graph: Any) -> None:
        self.consts = _constants(graph)
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.consumers: dict[str, list[Any]] = defaultdict(list)
        for n in graph.node:
            for i in n.input:
                if i:
                    self.consumers[i].append(n)
        self.outputs = {o.name for o in graph.output}
        self.weights = {t.name: t for t in graph.initializer}

    def scalar(self, name: str) -> float | None:
        """The value of a one-value float constant, else None."""
        v = self.consts.get(name)
        if v is None or v.size != 1 or v.dtype.kind != "f":
            return None
        return float(v.reshape(()))

    def sole(self, name: str, op: str | tuple[str, ...]) -> Any:
        """The one reader of ``name`` when it has exactly one, of type ``op``, and ``name`` is no graph output."""
        users = self.consumers.get(name, [])
        ops = (op,) if isinstance(op, str) else op
        if len(users) != 1 or name in self.outputs or users[0].op_type not in ops or users[0].domain not in _DEFAULT:
            return None
        return users[0]

    def made_by(self, name: str, op: str) -> Any:
        """The default-domain ``op`` node that produces ``name``, read by that one node alone, or None."""
        node = self.producer.get(name)
        if node is None or node.op_type != op or node.domain not in _DEFAULT:
            return None
        return node if len(self.consumers[name]) == 1 and name not in self.outputs else None

    @staticmethod
    def other(node: Any, name: str) -> str | None:
        """The input of binary ``node`` that is not ``name`` (None when both are, or the arity is not 2)."""
        if len(node.input) != 2:
            return None
        a, b = node.input
        return b if a == name else a if b == name else None

    def constant_1d(self, name: str) -> str | None:
        """``name``, or the tensor an Identity chain copies it from, when that is a 1-D float32 constant."""
        while name in self.producer and self.producer[name].op_type == "Identity" and name not in self.weights:
            name = self.producer[name].input[0]  # (exporters share equal weights through Identity nodes)
        t = self.weights.get(name)
        node = self.producer.get(name)
        if t is None and node is not None and node.op_type == "Constant" and node.domain in _DEFAULT:
            t = next((a.t for a in node.attribute if a.name == "value"), None)  # (any size: not read)
        return name if t is not None and len(t.dims) == 1 and t.data_type == 1 else None

    def last_axis_mean(self, node: Any) -> bool:
        """A ReduceMean over the last axis alone, with keepdims (axes an attribute before opset 18, an input after)."""
        if node.op_type != "ReduceMean" or node.domain not in _DEFAULT:
            return False
        attrs = {a.name: a for a in node.attribute}
        if "keepdims" in attrs and attrs["keepdims"].i != 1:
            return False
        if "axes" in attrs:
            axes = list(attrs["axes"].ints)
        elif len(node.input) > 1 and node.input[1]:
            v = self.consts.get(node.input[1])
            if v is None:
                return False
            axes = [int(a) for a in v.reshape(-1)]
        else:
            return False  # (all axes)
        return axes == [-1]

    def squared(self, node: Any) -> str | None:
        """``x`` when ``node`` is Pow(x, 2) or Mul(x, x), else None."""
        if node.op_type == "Pow" and node.domain in _DEFAULT and self.scalar(node.input[1]) == 2.0:
            return str(node.input[0])
        same = len(node.input) == 2 and node.input[0] == node.input[1]
        if node.op_type == "Mul" and node.domain in _DEFAULT and same:
            return str(node.input[0])
        return None

    def scaled_rms(self, mean_sq: Any, x: str) -> tuple[float, list[Any], str] | None:
        """From ``mean_sq`` (the ReduceMean of x^2) on: Add(eps), Sqrt, x / it (or x * 1/it), * weight.

        Returns:
            (eps, those nodes, the weight), or None when the chain differs.
        """
        add = self.sole(mean_sq.output[0], "Add")
        eps_name = self.other(add, mean_sq.output[0]) if add is not None else None
        eps = self.scalar(eps_name) if eps_name else None
        sqrt = self.sole(add.output[0], "Sqrt") if add is not None and eps is not None and eps >= 0 else None
        step = self.sole(sqrt.output[0], ("Div", "Reciprocal")) if sqrt is not None else None
        if step is None or eps is None or sqrt is None:
            return None
        if step.op_type == "Div" and list(step.input) == [x, sqrt.output[0]]:  # x / rms
            middle, norm = [step], step
        else:
            is_inverse = step.op_type == "Reciprocal" or (
                list(step.input[1:]) == [sqrt.output[0]] and self.scalar(step.input[0]) == 1.0
            )
            norm = self.sole(step.output[0], "Mul") if is_inverse else None
            if norm is None or self.other(norm, step.output[0]) != x:
                return None
            middle = [step, norm]
        wmul = self.sole(norm.output[0], "Mul")
        scale = self.other(wmul, norm.output[0]) if wmul is not None else None
        scale = self.constant_1d(scale) if scale is not None else None
        if scale is None:
            return None
        return eps, [add, sqrt, *middle, wmul], scale


def find_norm_chains(graph: Any, ops: tuple[str, ...] = ("RMSNormalization", "LayerNormalization")) -> list[NormChain]:
    """Every decomposed normalization of ``graph`` (its own nodes, not its subgraphs') that fuses exactly."""
    if not any(n.op_type == "ReduceMean" for n in graph.node):
        return []  # (every chain has one: no wiring to index, three times a convert)
    w = _Wiring(graph)
    chains = []
    for rm in graph.node:
        if not w.last_axis_mean(rm):
            continue
        sq = w.made_by(rm.input[0], "Pow") or w.made_by(rm.input[0], "Mul")
        x = w.squared(sq) if sq is not None else None
        tail = w.scaled_rms(rm, x) if x is not None else None
        if x is None or tail is None:
            continue
        eps, rest, scale = tail
        centre = w.producer.get(x)
        mean = w.made_by(centre.input[1], "ReduceMean") if centre is not None and centre.op_type == "Sub" else None
        if centre is not None and mean is not None and w.last_axis_mean(mean) and mean.input[0] == centre.input[0]:
            if "LayerNormalization" not in ops or len(w.consumers[x]) != 2 or x in w.outputs:
                continue  # (d = x - mean(x) read by the square and the division alone)
            nodes, last, bias = [mean, centre, sq, rm, *rest], rest[-1], ""
            badd = w.sole(last.output[0], "Add")
            bias_name = w.other(badd, last.output[0]) if badd is not None else None
            if bias_name is not None and w.constant_1d(bias_name) is not None:
                bias, last = str(w.constant_1d(bias_name)), badd
                nodes.append(badd)
            chains.append(NormChain("LayerNormalization", str(centre.input[0]), scale, bias, str(last.output[0]), eps,
                                    tuple(n.name for n in nodes)))
        elif "RMSNormalization" in ops:
            nodes = [sq, rm, *rest]
            chains.append(NormChain("RMSNormalization", x, scale, "", str(rest[-1].output[0]), eps,
                                    tuple(n.name for n in nodes)))
    return chains


def _fuse(model: Any, chains: list[NormChain]) -> None:
    """Replace each chain of the main graph by its op, in place (see :func:`fuse_norm_chains`)."""
    from onnx import helper

    graph = model.graph
    fused = {c.nodes[-1]: c for c in chains}
    dropped = {name for c in chains for name in c.nodes[:-1]}
    kept = []
    for node in graph.node:
        chain = fused.get(node.name)
        if chain is not None:
            suffix = FUSED_SUFFIX if chain.op == "RMSNormalization" else FUSED_LN_SUFFIX
            inputs = [chain.x, chain.scale] + ([chain.bias] if chain.bias else [])
            kept.append(helper.make_node(chain.op, inputs, [chain.output], name=node.name + suffix, axis=-1,
                                         epsilon=chain.epsilon, stash_type=1))
        elif node.name not in dropped:
            kept.append(node)
    read = {i for n in kept for i in n.input} | {o.name for o in graph.output}
    read |= {i for n in kept for g in _bodies(n) for i in _outer_reads(g)}
    # Constants and the Identity copies of shared weights that only the chains read
    kept = [n for n in kept if n.op_type not in ("Constant", "Identity") or n.domain not in _DEFAULT
            or any(o in read for o in n.output)]
    gone = {o for n in graph.node for o in n.output} - {o for n in kept for o in n.output}
    del graph.node[:]
    graph.node.extend(kept)
    for vi in [vi for vi in graph.value_info if vi.name in gone]:  # the removed intermediates' shapes
        graph.value_info.remove(vi)


def fuse_norm_chains(model: Any) -> list[NormChain]:
    """Replace, in place, every exact decomposed normalization of the main graph by its ONNX op (stash_type=1).

    LayerNorm chains from opset :data:`LAYER_NORM_MIN_OPSET`, RMSNorm chains from :data:`RMS_NORM_MIN_OPSET`; below
    them nothing changes. Each fused node takes the name of the chain's last node plus :data:`FUSED_SUFFIX` (or
    :data:`FUSED_LN_SUFFIX`) and its place in the node list; Constant (and weight-sharing Identity) nodes left
    unread are removed. Node names must be unique (``mpinfer.modelio.name_nodes``).

    Returns:
        The chains fused.
    """
    opset = default_opset(model)
    ops = tuple(op for op, since in FIRST_OPSET if opset >= since)
    chains = find_norm_chains(model.graph, ops) if ops else []
    if chains:
        _fuse(model, chains)
        counts = {op: sum(c.op == op for c in chains) for op in ops}
        logger.info("Fused decomposed normalization chains into ONNX ops with stash_type=1 (float32 statistics "
                    "whatever the I/O type): %s", ", ".join(f"{n} into {op}" for op, n in counts.items() if n))
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


def fuse_norms(model: Any) -> list[NormChain]:
    """:func:`fuse_norm_chains`; below an op's opset, a warning when the model has chains it would fuse."""
    opset = default_opset(model)
    fused = fuse_norm_chains(model)
    waiting = find_norm_chains(model.graph) if opset < RMS_NORM_MIN_OPSET else []  # (those it could not fuse)
    for op, since in FIRST_OPSET:
        found = sum(c.op == op for c in waiting)
        if found and opset < since:
            runs = ("ONNX Runtime releases that read opset 23, TensorRT 10.15+" if op == "RMSNormalization"
                    else "ONNX Runtime, TensorRT 8.6+")
            logger.warning("%d decomposed %s chain(s) stay FP32 islands behind two Casts each. Hint: `--opset %d` "
                           "fuses them into %s with float32 statistics and no Cast (%s).", found,
                           "RMSNorm" if op == "RMSNormalization" else "LayerNorm", since, op, runs)
    return fused


def fusion_opset(model: Any) -> tuple[int, str] | None:
    """The opset convert upgrades ``model`` to when the user pinned none, so that its RMSNorm chains fuse; and why.

    :data:`RMS_NORM_MIN_OPSET` for a model below it with RMSNorm chains that fuse exactly, when the installed ONNX
    Runtime runs RMSNormalization there (probed: every later step runs the model on it), with the reason for the
    one line that says the model was upgraded. None otherwise (the model's own opset: its chains, if any, stay
    FP32 and :func:`fuse_norms` warns).
    """
    from mpinfer.modelio import ort_runs_rms_normalization

    opset = default_opset(model)
    if not opset or opset >= RMS_NORM_MIN_OPSET:
        return None
    found = sum(c.op == "RMSNormalization" for c in find_norm_chains(model.graph, ("RMSNormalization",)))
    if not found or not ort_runs_rms_normalization(RMS_NORM_MIN_OPSET):
        return None
    return RMS_NORM_MIN_OPSET, (f"so that its {found} RMSNorm chain(s) fuse into RMSNormalization: float32 "
                                f"statistics, no FP32 island behind Casts; --opset {opset} keeps its opset")
