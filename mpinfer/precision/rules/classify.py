"""Op-type and range rules that classify every node as low-precision, FP32, or follow-its-inputs.

The policy is seeded from torch.amp's CUDA autocast lists (``autocast_mode.cpp``: ops that autocast to
lower precision, and ops that autocast to float32) mapped to ONNX op types. Each rule is a small class
with one question (``decide``); :class:`NodeClassifier` asks them in order and the first answer wins,
in the style of ModelOpt AutoCast's node classifier.
"""

from __future__ import annotations

import abc
import enum
import functools
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.modelio import NodeRef
from mpinfer.precision.core import (
    CONTRIB_SLOTS,
    DEFAULT_DOMAINS,
    FLOAT,
    FP16_MAX,
    LOW_MAX,
    SHAPE_INPUTS,
    GraphInfo,
    out_of_range,
    sum_of_squares,
)
from mpinfer.precision.rules import optables
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

# Activations whose |x| reaches FP16_MAX / margin are kept FP32: room for the unseen inputs that go
# beyond what the calibration data showed.
RANGE_MARGIN = 2.0
# A tensor where more than this share of the non-zero values would flush to zero in the low dtype
# loses its information: its producer stays FP32.
UNDERFLOW_LIMIT = 0.10
# Weights: a share of non-zero values below the FP16 subnormal range above this is "out of range".
WEIGHT_UNDERFLOW_LIMIT = 0.10
# ...and only when the flushed values carry more of the tensor's energy (sum of squares) than FP16's own
# rounding noise does (unit roundoff 2**-11, squared): flushing less than that is below FP16's noise floor.
# Pruned "dead" channels at 1e-15 next to live weights at 1e-2 carry ~1e-26 of the energy and go FP16.
UNDERFLOW_ENERGY_LIMIT = 2.0**-22
# Gathers from constant tables at least this big are embeddings (small gathers are shape arithmetic).
EMBEDDING_MIN_ELEMENTS = 256
FP16_TINY = 5.96e-8  # smallest positive FP16 subnormal


class Kind(str, enum.Enum):
    """The outcome of classification for one node."""

    LOW = "low"
    KEEP = "keep"
    FOLLOW = "follow"


@dataclass(frozen=True)
class Decision:
    """One rule's verdict: kind, reason code (plan contract), human detail, numbers."""

    kind: Kind
    reason: str
    detail: str
    stats: Mapping[str, float] = field(default_factory=dict)


@dataclass
class RuleContext:
    """What rules can look at besides the node itself."""

    info: GraphInfo
    precision: Precision
    index_like: set[str]
    stats: Mapping[str, Any] | None = None
    weight_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    # Additive attention masks rewritten to the low format's safe lowest (mpinfer.precision.graph.masks): the
    # node reading each mask constant, and every tensor carrying a mask (its calibrated range is the mask's).
    mask_sites: Mapping[str, Any] = field(default_factory=dict)
    mask_tensors: frozenset[str] = frozenset()
    clamped: set[str] = field(default_factory=set)  # weights said to be clamped (warned once each)
    # statistics' id -> (them, overflow, underflow): ActivationRangeRule's verdict on each tensor, read once
    ranges: dict[int, tuple[Any, bool, bool]] = field(default_factory=dict)

    @functools.cached_property
    def low_type(self) -> int:
        """The ONNX element type of ``precision`` (asked once per node by several rules)."""
        return self.precision.onnx_dtype


class NodeRule(abc.ABC):
    """A rule: answers a Decision for the nodes it is about, None for the rest."""

    @abc.abstractmethod
    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """Return the verdict for ``ref`` or None."""


class UserNodeRule(NodeRule):
    """``--keep-node`` / ``--low-node``: regexes matched (fullmatch, then search) against node addresses."""

    def __init__(self, keep: Sequence[str] = (), low: Sequence[str] = ()) -> None:
        self.keep = [(p, compile_pattern(p)) for p in keep]
        self.low = [(p, compile_pattern(p)) for p in low]

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        for pattern, rx in self.keep:
            if rx.search(ref.address):
                return Decision(Kind.KEEP, "user:keep-node", f"--keep-node '{pattern}' matches this node")
        for pattern, rx in self.low:
            if rx.search(ref.address):
                return Decision(Kind.LOW, "user:low-node", f"--low-node '{pattern}' matches this node")
        return None


class NodeSetRule(NodeRule):
    """Keep a given set of node addresses FP32 (from an overflow.json of the AMP trainer)."""

    def __init__(self, nodes: Mapping[str, str]) -> None:
        self.nodes = dict(nodes)

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        if ref.address in self.nodes:
            return Decision(Kind.KEEP, "overflow-json", self.nodes[ref.address])
        return None


class UserOpRule(NodeRule):
    """``--keep-op`` / ``--low-op``: by op type."""

    def __init__(self, keep: Iterable[str] = (), low: Iterable[str] = ()) -> None:
        self.keep, self.low = set(keep), set(low)

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        if ref.node.op_type in self.keep:
            return Decision(Kind.KEEP, "user:keep-op", f"--keep-op {ref.node.op_type}")
        if ref.node.op_type in self.low:
            return Decision(Kind.LOW, "user:low-op", f"--low-op {ref.node.op_type}")
        return None


class DomainRule(NodeRule):
    """Custom-domain and unknown ops stay FP32: mpinfer cannot know what they compute."""

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        node = ref.node
        if (node.domain, node.op_type) in CONTRIB_SLOTS:
            return None  # a contrib op mpinfer knows (its float slots and its strict kernel)
        if node.domain not in DEFAULT_DOMAINS and node.domain != "ai.onnx.ml":
            return Decision(Kind.KEEP, "custom-domain", f"op {node.op_type} of custom domain '{node.domain}'")
        if ctx.info.schema(node) is None:
            return Decision(
                Kind.KEEP, "unknown-op", f"op {node.op_type} is not in ONNX opset {ctx.info.opset_of(node)}"
            )
        return None


class NoFloatRule(NodeRule):
    """Nodes without FP32 tensors have nothing to convert (shape and index arithmetic on integers)."""

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        if ref.node.op_type in optables.CONTROL_FLOW_OPS:
            return Decision(
                Kind.KEEP,
                "rule:keep-fp32",
                "control flow: interface kept FP32, body nodes planned one by one",
            )
        if not ctx.info.slots(ref.node, ctx.low_type).has_float:
            return Decision(Kind.KEEP, "rule:index-like", "no floating-point tensors")
        return None


class SchemaRule(NodeRule):
    """The op must accept the low dtype at the model's opset (and work on tensors, not sequences)."""

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        blocked = ctx.info.slots(ref.node, ctx.low_type).blocked or _never_low(ref, ctx)
        if blocked:
            return Decision(Kind.KEEP, "rule:keep-fp32", blocked)
        return None


class QuantizedOpRule(NodeRule):
    """An op reading a DequantizeLinear that must stay FP32 stays FP32 with it.

    In a quantized (QDQ) model TensorRT fuses DequantizeLinear -> Conv/MatMul -> QuantizeLinear into one INT8
    kernel. Below opset 19 DequantizeLinear has no float16 output (no bfloat16 below 19 either), so it stays
    FP32; running its consumer low would put a Cast between them, which breaks the pattern TensorRT fuses and
    gains nothing (the op runs in INT8 anyway). From opset 19 the whole QDQ pattern converts, scales included.
    """

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        node, info = ref.node, ctx.info
        if node.op_type in optables.QDQ_OPS:
            return None
        low = ctx.low_type
        for i in info.slots(node, low).inputs:
            src = info.producer.get(node.input[i])
            dq = info.by_address[src].node if src is not None else None
            if dq is not None and dq.op_type == "DequantizeLinear" and info.slots(dq, low).blocked:
                return Decision(
                    Kind.KEEP,
                    "rule:qdq",
                    f"reads DequantizeLinear '{src}', which stays FP32 at opset {info.opset_of(dq)}: the pair runs "
                    "quantized, and a Cast between them would stop TensorRT fusing them",
                )
        return None


class WeightRangeRule(NodeRule):
    """Weights (initializers, Constant values) beyond FP16 range keep their consumer FP32; never clamped."""

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        if ctx.precision is Precision.BF16:
            return None
        for name in ref.node.input:
            if not name or ctx.info.types.get(name) != FLOAT or not ctx.info.is_const(name):
                continue
            st = ctx.weight_stats.get(name)
            if st is None:
                st = ctx.weight_stats[name] = _weight_stats(ctx.info.const_array(name))
            if st["absmax"] > FP16_MAX:
                return Decision(
                    Kind.KEEP,
                    "weights:out-of-range",
                    f"weight '{name}' reaches |{st['absmax']:.4g}| > FP16 max {FP16_MAX:g}",
                    st,
                )
            if st["underflow_frac"] > WEIGHT_UNDERFLOW_LIMIT and st["underflow_energy"] > UNDERFLOW_ENERGY_LIMIT:
                return Decision(
                    Kind.KEEP,
                    "weights:out-of-range",
                    f"{st['underflow_frac']:.1%} of weight '{name}' would flush to zero in FP16, "
                    f"{st['underflow_energy']:.2g} of its energy",
                    st,
                )
        return None


class ActivationRangeRule(NodeRule):
    """Calibration statistics: tensors that overflow (or mostly underflow) keep their nodes FP32.

    The producer and the consumers of such a tensor stay FP32. Integer tensors (token ids, indices) are
    never counted.
    """

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        stats = ctx.stats
        if not stats:
            return None
        node, info = ref.node, ctx.info
        types, masks = info.types, ctx.mask_tensors
        prefix = ref.address[: len(ref.address) - len(node.name)]
        for name in (*node.output, *node.input):
            if not name or types.get(name) != FLOAT or name in masks or info.is_const(name):
                continue
            st = stats.get(name) if not prefix else (stats.get(prefix + name) or stats.get(name))
            if st is None:
                continue
            overflows, underflows = _out_of_range(st, ctx)
            if overflows:
                peak = max(_get(st, "absmax"), 0.0)
                return Decision(
                    Kind.KEEP,
                    "range:overflow",
                    f"tensor '{name}' reaches |{peak:.4g}| (x{RANGE_MARGIN:g} margin > {FP16_MAX:g})",
                    {"absmax": peak, "p999": _get(st, "p999")},
                )
            if underflows and name in node.output:
                key = "fp16_underflow_frac" if ctx.precision is Precision.FP16 else "bf16_underflow_frac"
                frac = _get(st, key)
                energy = _underflow_energy(st) if ctx.precision is Precision.FP16 else 1.0
                if frac > UNDERFLOW_LIMIT and energy > UNDERFLOW_ENERGY_LIMIT:
                    return Decision(
                        Kind.KEEP,
                        "range:underflow",
                        f"{frac:.1%} of tensor '{name}' flushes to zero in {ctx.precision.value}"
                        + (f", {energy:.2g} of its energy" if ctx.precision is Precision.FP16 else ""),
                        {key: frac, "min_nonzero": _get(st, "min_nonzero")},
                    )
        return None


def _out_of_range(st: Any, ctx: RuleContext) -> tuple[bool, bool]:
    """Whether a tensor's statistics overflow (FP16, with the margin) and underflow the low format.

    Read once per tensor: its producer and each of its readers ask (``ctx.ranges``, by the statistics' identity).
    """
    known = ctx.ranges.get(id(st))
    if known is not None and known[0] is st:
        return known[1], known[2]
    fp16 = ctx.precision is Precision.FP16
    peak = max(_get(st, "absmax"), 0.0)
    overflows = fp16 and (peak * RANGE_MARGIN > FP16_MAX or _get(st, "fp16_overflow_frac") > 0)
    frac = _get(st, "fp16_underflow_frac" if fp16 else "bf16_underflow_frac")
    underflows = frac > UNDERFLOW_LIMIT and (_underflow_energy(st) if fp16 else 1.0) > UNDERFLOW_ENERGY_LIMIT
    ctx.ranges[id(st)] = (st, overflows, underflows)
    return overflows, underflows


class IndexLikeRule(NodeRule):
    """Index-like ops and the shape arithmetic that feeds Reshape/Expand/Slice/Resize/... stay FP32."""

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        if ref.node.op_type in optables.INDEX_LIKE_OPS:
            return Decision(Kind.KEEP, "rule:index-like", f"{ref.node.op_type} computes indices or positions")
        if ref.address in ctx.index_like:
            return Decision(Kind.KEEP, "rule:index-like", "feeds only shape/index inputs (shape arithmetic)")
        return None


class EmbeddingRule(NodeRule):
    """A Gather from a weight table (an embedding) runs low.

    The table is stored once in the low dtype and the rows it returns are exact copies; the integer ids
    never count against range rules.
    """

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        node = ref.node
        if node.op_type != "Gather" or len(node.input) < 2:
            return None
        table, ids = node.input[0], node.input[1]
        if (
            ctx.info.types.get(table) == FLOAT
            and ctx.info.is_const(table)
            and ctx.info.types.get(ids) in (6, 7)
            and ctx.info.numel(table) >= EMBEDDING_MIN_ELEMENTS
        ):
            return Decision(
                Kind.LOW, "rule:fp16-safe", "embedding lookup: the table is stored in low precision"
            )
        return None


class ShapeReadRule(NodeRule):
    """Shape and Size read only their input's dimensions: they follow it, so they never need a Cast of it."""

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        if ref.node.op_type in ("Shape", "Size") and ref.node.domain in DEFAULT_DOMAINS:
            return Decision(
                Kind.FOLLOW, "rule:follow", f"{ref.node.op_type} reads only the dimensions of its input"
            )
        return None


class MaskRule(NodeRule):
    """The node reading an additive attention mask's minus infinity runs low, its constant rewritten.

    See :mod:`mpinfer.precision.graph.masks`: the constant becomes the low format's safe lowest value, so the mask, the
    mask-add and the Softmax input fit the low format and masked positions still get probability 0.
    """

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        site = ctx.mask_sites.get(ref.address)
        if site is None:
            return None
        return Decision(
            Kind.LOW,
            "rewrite:mask",
            site.detail(ctx.precision),
            {"mask_lowest": site.lowest, "mask_value": site.value},
        )


# Ops whose definition (or every GPU kernel, for Softmax) computes its statistics in float32 whatever the I/O
# dtype: with low inputs and outputs only the rounding of the inputs and of the result remains. The value is
# the attribute that names the accumulation type (float32 when 1) and its default, or None.
FP32_ACCUMULATING_OPS: dict[str, tuple[str, int] | None] = {
    "LayerNormalization": ("stash_type", 1),
    "RMSNormalization": ("stash_type", 1),
    "Softmax": None,
    "LogSoftmax": None,
    "SkipLayerNormalization": None,  # com.microsoft: ONNX Runtime's kernels keep mean and variance in float32
}


class Fp32AccumulationRule(NodeRule):
    """Normalizations and softmax that accumulate in float32 run low when calibration shows their range fits.

    ONNX's ``LayerNormalization`` and ``RMSNormalization`` compute mean and variance in ``stash_type``
    (float32 by default) even with FP16 inputs, and the softmax kernels of TensorRT and ONNX Runtime's CUDA
    provider keep their max and sum in float32. Such an op is unsafe only when its input or output leaves the
    low format's range, which the range rules (asked first) check on the calibration statistics. Without
    calibration there is nothing to check, and the torch.amp policy (FP32) stands.
    """

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        node = ref.node
        known = node.domain in DEFAULT_DOMAINS or (node.domain, node.op_type) in CONTRIB_SLOTS
        if node.op_type not in FP32_ACCUMULATING_OPS or not known or not ctx.stats:
            return None
        attr = FP32_ACCUMULATING_OPS[node.op_type]
        if attr is not None:
            stash = next((a.i for a in node.attribute if a.name == attr[0]), attr[1])
            if stash != 1:
                return None
        x = node.input[0] if node.input else ""
        prefix = ref.address[: len(ref.address) - len(node.name)]
        if x not in ctx.mask_tensors and ctx.stats.get(prefix + x) is None and ctx.stats.get(x) is None:
            return None
        how = "with stash_type=1 computes its mean and variance" if attr else "kernels keep their statistics"
        return Decision(
            Kind.LOW,
            "rule:fp32-accumulate",
            f"{node.op_type} {how} in float32; the calibrated range of its input and output fits "
            f"{ctx.precision.value.upper()}",
        )


class OpPolicyRule(NodeRule):
    """The torch.amp-seeded op-type policy; anything else follows its inputs."""

    def decide(self, ref: NodeRef, ctx: RuleContext) -> Decision | None:
        """The verdict for ``ref``, or None when the rule does not apply."""
        op = ref.node.op_type
        if op in optables.FP16_SAFE_OPS:
            return Decision(Kind.LOW, "rule:fp16-safe", f"{op} runs on matrix engines with FP32 accumulation")
        if op in optables.KEEP_FP32_OPS:
            return Decision(
                Kind.KEEP, "rule:keep-fp32", f"{op} overflows or accumulates error in low precision"
            )
        return Decision(Kind.FOLLOW, "rule:follow", f"{op} follows the precision of its inputs")


class NodeClassifier:
    """Asks the rules in order; the first verdict wins.

    Args:
        rules: The rules, highest priority first.
    """

    def __init__(self, rules: Sequence[NodeRule]) -> None:
        self.rules = list(rules)

    def classify(self, ctx: RuleContext) -> dict[str, Decision]:
        """Return address → Decision for every node of the model."""
        out = {}
        for ref in ctx.info.walk():
            for rule in self.rules:
                verdict = rule.decide(ref, ctx)
                if verdict is not None:
                    out[ref.address] = _respect_schema(verdict, ref, ctx)
                    break
        return out


def _respect_schema(verdict: Decision, ref: NodeRef, ctx: RuleContext) -> Decision:
    """A user override cannot make a node low that has no low type or no float tensors."""
    if verdict.kind is not Kind.LOW:
        return verdict
    slots = ctx.info.slots(ref.node, ctx.low_type)
    if not slots.has_float:
        return Decision(Kind.KEEP, "rule:index-like", "no floating-point tensors")
    blocked = slots.blocked or _never_low(ref, ctx)
    if blocked:
        return Decision(Kind.KEEP, "rule:keep-fp32", f"{blocked} ({verdict.detail})")
    _warn_clamped(ref, ctx, slots.inputs, verdict)
    return verdict


def _warn_clamped(ref: NodeRef, ctx: RuleContext, lowered: Sequence[int], verdict: Decision) -> None:
    """Say which weights of a node made low are past the low format's range: the rewrite clamps them."""
    for i in lowered:
        name = ref.node.input[i]
        if name in ctx.clamped or not ctx.info.is_const(name):
            continue
        st = ctx.weight_stats.get(name)  # (WeightRangeRule's, FP16: its largest finite |x| bounds what is clamped)
        if st is not None and st["absmax"] <= LOW_MAX[ctx.precision]:
            continue
        arr = ctx.info.const_array(name)
        peak = out_of_range(np.asarray(arr), ctx.precision) if arr is not None else 0.0
        if peak:
            ctx.clamped.add(name)
            logger.warning(
                "Weight '%s' reaches |%.4g|, past %s's largest finite value %.6g; node '%s' runs %s (%s), so the "
                "weight is clamped to +-%.6g there, not rounded to inf. Keep the node FP32 (--keep-node) to keep "
                "the value.",
                name, peak, ctx.precision.value.upper(), LOW_MAX[ctx.precision], ref.address, ctx.precision.value,
                verdict.detail, LOW_MAX[ctx.precision],
            )


def _never_low(ref: NodeRef, ctx: RuleContext) -> str | None:
    node = ref.node
    if node.op_type in optables.CONTROL_FLOW_OPS:
        return "control flow: interface kept FP32"
    if node.op_type in optables.NEVER_LOW_OPS:
        return f"{node.op_type} cannot compute in low precision"
    non_tensor, types = ctx.info.non_tensor, ctx.info.types
    if non_tensor and any(n in non_tensor for n in (*node.input, *node.output) if n):
        return "sequence/optional values are kept FP32"
    if any(n and n not in types for n in node.input):
        return "an input's type is unknown (downstream of an op ONNX type inference does not know)"
    return None


def default_rules(
    *,
    keep_ops: Iterable[str] = (),
    low_ops: Iterable[str] = (),
    keep_nodes: Sequence[str] = (),
    low_nodes: Sequence[str] = (),
    overflow_nodes: Mapping[str, str] | None = None,
) -> list[NodeRule]:
    """The standard rule list, user overrides first."""
    return [
        DomainRule(),
        NoFloatRule(),
        UserNodeRule(keep_nodes, low_nodes),
        NodeSetRule(overflow_nodes or {}),
        UserOpRule(keep_ops, low_ops),
        SchemaRule(),
        QuantizedOpRule(),
        ShapeReadRule(),
        MaskRule(),
        WeightRangeRule(),
        ActivationRangeRule(),
        IndexLikeRule(),
        EmbeddingRule(),
        Fp32AccumulationRule(),
        OpPolicyRule(),
    ]


def shape_subgraph(info: GraphInfo) -> set[str]:
    """Addresses of nodes whose outputs only feed shape/index inputs (directly or through such nodes)."""
    index_like: set[str] = set()
    for ref in reversed(info.nodes):
        node = ref.node
        if not node.output or node.op_type in optables.CONTROL_FLOW_OPS or node.op_type == "Constant":
            continue
        uses = [c for o in node.output if o for c in info.consumers.get(o, [])]
        if not uses or any(o in info.graph_outputs for o in node.output):
            continue
        if all(_is_shape_use(info, c) or c[0] in index_like for c in uses):
            index_like.add(ref.address)
    return index_like


def _is_shape_use(info: GraphInfo, use: tuple[str, int]) -> bool:
    node = info.by_address[use[0]].node
    return use[1] in SHAPE_INPUTS.get(node.op_type, ())


def _weight_stats(arr: np.ndarray | None) -> dict[str, float]:
    if arr is None or arr.size == 0:
        return {"absmax": 0.0, "underflow_frac": 0.0, "underflow_energy": 0.0}
    a = np.abs(arr.astype(np.float32, copy=False)).ravel()
    peak = float(a.max())  # (NaN or inf when there is one)
    if not math.isfinite(peak):
        a = a[np.isfinite(a)]
        if a.size == 0:
            return {"absmax": 0.0, "underflow_frac": 0.0, "underflow_energy": 0.0}
        peak = float(a.max())
    # Few weights are tiny: the passes over all of them are a max, a min (or a comparison), and for the few with
    # tiny values a count and a dot product.
    if not a.min() < FP16_TINY / 2:  # (the comparison below, on the least value: float32 scalar to the same float)
        return {"absmax": peak, "underflow_frac": 0.0, "underflow_energy": 0.0}
    tiny = a < FP16_TINY / 2
    flushed = a[tiny & (a > 0)]
    if not flushed.size:  # (zeros alone: nothing flushes)
        return {"absmax": peak, "underflow_frac": 0.0, "underflow_energy": 0.0}
    under = float(flushed.size / (a.size - int(np.count_nonzero(a == 0))))
    total = sum_of_squares(a)
    energy = float(np.dot(flushed.astype(np.float64), flushed.astype(np.float64)) / total) if total > 0 else 0.0
    return {"absmax": peak, "underflow_frac": under, "underflow_energy": energy}


def _underflow_energy(st: Any) -> float:
    """The flushed share of a tensor's energy; statistics without it count as all of it (the old rule)."""
    val = st.get("fp16_underflow_energy") if isinstance(st, Mapping) else getattr(st, "fp16_underflow_energy", None)
    return 1.0 if val is None else float(val)


def _get(st: Any, key: str) -> float:
    val = st.get(key, 0.0) if isinstance(st, Mapping) else getattr(st, key, 0.0)
    return float(val) if val is not None and math.isfinite(val) else (float("inf") if val else 0.0)


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A --keep-node/--low-node regex, compiled.

    Raises:
        InvalidInputError: For an invalid regular expression.
    """
    try:
        return re.compile(pattern)
    except re.error as err:
        raise InvalidInputError(
            format_message(
                f"Node pattern '{pattern}'",
                f"an invalid regex ({err})",
                "a Python regular expression, e.g. 'head/.*'",
            )
        ) from err
