"""A plan that buys nothing says so: what keeps the heavy ops FP32, and the one flag that would change it.

An already-quantized (QDQ) model below opset 19, a BF16 CNN at an opset without BF16 Conv, a model whose budget
keeps its MatMuls FP32: convert lowers a few cheap nodes, adds Casts around them and reports success. The plan's
summary (``low_gain``) and a warning then name the reason that keeps most of the FLOPs FP32, a few of those nodes,
and the flag that lowers them, where one does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from onnx import defs

from mpinfer.modelio import MAX_OPSET
from mpinfer.precision.plan import NodeDecision, counts_as_float
from mpinfer.specs import Precision

# Below this share of the FLOPs in low precision a plan buys (almost) nothing: the Casts it adds cost about what
# the few lowered nodes save (issue 35's QDQ speech encoder: 0.04% of the FLOPs lowered, 20 Casts added).
LOW_GAIN_SHARE = 0.01
# The opset from which DequantizeLinear writes float16/bfloat16 (ONNX's DequantizeLinear-19), and with it the
# quantized ops it feeds.
QDQ_LOW_OPSET = 19


def low_gain_note(
    nodes: Sequence[NodeDecision], summary: Mapping[str, Any], info: Any, precision: Precision
) -> str | None:
    """The note for a plan whose low share of the FLOPs is under :data:`LOW_GAIN_SHARE`, or None.

    Args:
        nodes: The plan's node decisions (their ``stats["flops"]``).
        summary: The plan's summary (``low_share_flops``).
        info: The model's GraphInfo (its opsets).
        precision: FP16 or BF16.
    """
    share = float(summary.get("low_share_flops", 1.0))
    if share >= LOW_GAIN_SHARE:
        return None
    kept = [n for n in nodes if not n.precision.is_low and counts_as_float(n.reason, False) and _flops(n) > 0]
    total = sum(_flops(n) for n in nodes if counts_as_float(n.reason, n.precision.is_low))
    if not kept or total <= 0:
        return None
    by_reason: dict[str, float] = {}
    for n in kept:
        by_reason[n.reason] = by_reason.get(n.reason, 0.0) + _flops(n)
    reason, flops = max(by_reason.items(), key=lambda kv: kv[1])
    heavy = sorted((n for n in kept if n.reason == reason), key=_flops, reverse=True)
    ops = Counter(n.op_type for n in heavy)
    listed = ", ".join(f"{o} x{k}" for o, k in ops.most_common(3))
    text = (
        f"The plan runs {share:.2%} of the FLOPs in {precision.value}: it buys (almost) nothing. "
        f"{flops / total:.0%} of the FLOPs stay FP32 by '{reason}' ({listed}, e.g. "
        f"{', '.join(repr(n.name) for n in heavy[:3])}: {heavy[0].detail[:160] or reason})."
    )
    flag = _flag_for(reason, heavy, info.opsets.get("", 0), precision)
    return text + (f" Hint: {flag}." if flag else "")


def _flops(n: NodeDecision) -> float:
    try:
        return float(n.stats.get("flops", 0.0))
    except (TypeError, ValueError):
        return 0.0


def _flag_for(reason: str, heavy: Sequence[NodeDecision], opset: int, precision: Precision) -> str | None:
    """The one flag that lowers the nodes ``reason`` keeps FP32, or None when no flag does."""
    if reason == "rule:qdq" and opset < QDQ_LOW_OPSET:
        return (f"`--opset {QDQ_LOW_OPSET}` lets DequantizeLinear write {precision.value}, and the quantized ops it "
                "feeds run low with it")
    if reason == "rule:keep-fp32":
        needed = [v for n in heavy if (v := opset_with_low_type(n.op_type, opset, precision)) is not None]
        if needed:
            ops = ", ".join(sorted({n.op_type for n in heavy}))
            return f"`--opset {max(needed)}` gives {ops} a {precision.value} type"
    if reason == "user:keep-op":
        return f"drop --keep-op {' '.join(sorted({n.op_type for n in heavy}))}"
    if reason == "user:keep-node":
        return "drop the --keep-node pattern(s) that match them"
    if reason in ("sensitivity", "search", "budget"):
        return "they break the budget in low precision: a looser --budget (or --budget none, unverified) lowers them"
    if reason in ("weights:out-of-range", "range:overflow") and precision is Precision.FP16:
        return "`--precision bf16` keeps FP32's range"
    return None


def opset_with_low_type(op_type: str, opset: int, precision: Precision) -> int | None:
    """The first opset above ``opset`` (up to the highest mpinfer writes) whose ``op_type`` takes the low type."""
    name = "float16" if precision is Precision.FP16 else "bfloat16"
    for version in range(opset + 1, min(defs.onnx_opset_version(), MAX_OPSET) + 1):
        try:
            schema = defs.get_schema(op_type, version, "")
        except defs.SchemaError:
            return None
        if any(f"tensor({name})" in c.allowed_type_strs for c in schema.type_constraints):
            return version
    return None
