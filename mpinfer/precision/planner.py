"""Build a PrecisionPlan from rules (and calibration statistics), and summarise a plan."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpinfer.precision.graphinfo import FLOAT, GraphInfo
from mpinfer.precision.plan import NodeDecision
from mpinfer.precision.resolve import resolve_precisions
from mpinfer.precision.rules import Decision, Kind, NodeClassifier, RuleContext, default_rules, shape_subgraph
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuleOptions:
    """User overrides for the rules."""

    keep_ops: tuple[str, ...] = ()
    low_ops: tuple[str, ...] = ()
    keep_nodes: tuple[str, ...] = ()
    low_nodes: tuple[str, ...] = ()
    overflow_nodes: Mapping[str, str] = field(default_factory=dict)


def classify_nodes(
    info: GraphInfo, precision: Precision, options: RuleOptions, stats: Mapping[str, Any] | None = None
) -> dict[str, Decision]:
    """Rule verdict per node address."""
    rules = default_rules(
        keep_ops=options.keep_ops,
        low_ops=options.low_ops,
        keep_nodes=options.keep_nodes,
        low_nodes=options.low_nodes,
        overflow_nodes=options.overflow_nodes,
    )
    ctx = RuleContext(info=info, precision=precision, index_like=shape_subgraph(info), stats=stats)
    return NodeClassifier(rules).classify(ctx)


def decisions_to_nodes(
    info: GraphInfo,
    decisions: Mapping[str, Decision],
    precisions: Mapping[str, Precision],
    stats: Mapping[str, Any] | None = None,
) -> list[NodeDecision]:
    """Plan entries in graph order, with FLOPs, weight bytes and output range statistics among the numbers."""
    nodes = []
    for ref in info.nodes:
        d = decisions[ref.address]
        p = precisions[ref.address]
        detail = d.detail
        if d.kind is Kind.FOLLOW:
            detail += "; inputs are " + ("low precision" if p.is_low else "FP32 (or its consumers need FP32)")
        numbers: dict[str, float | str] = {"flops": float(info.flops(ref))}
        wb = info.weight_bytes(ref)
        if wb:
            numbers["weight_bytes"] = float(wb)
        numbers.update(_output_range(info, ref, stats))
        numbers.update({k: float(v) for k, v in d.stats.items()})
        nodes.append(NodeDecision(ref.address, ref.node.op_type, p, d.reason, detail, numbers))
    return nodes


def rule_plan(
    info: GraphInfo,
    precision: Precision,
    options: RuleOptions,
    *,
    keep_io_types: bool = True,
    stats: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Decision], list[NodeDecision]]:
    """Classify, resolve follow-ops, and return verdicts and plan entries."""
    decisions = classify_nodes(info, precision, options, stats)
    precisions = resolve_precisions(info, decisions, precision, keep_io_types=keep_io_types)
    return decisions, decisions_to_nodes(info, decisions, precisions, stats)


def summarize(
    info: GraphInfo,
    nodes: Sequence[NodeDecision],
    *,
    cast_count: int,
    converted_weights: Sequence[str],
    expected_error: Mapping[str, Any] | None = None,
    search: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The plan summary: shares of nodes, FLOPs and weight bytes in low precision, casts, error, cost."""
    float_nodes = [n for n in nodes if n.reason != "rule:index-like" or n.precision.is_low]
    low = [n for n in nodes if n.precision.is_low]
    total_flops = sum(_num(n.stats.get("flops", 0.0)) for n in float_nodes) or 1.0
    low_flops = sum(_num(n.stats.get("flops", 0.0)) for n in low)
    weights = {
        name: 4 * info.numel(name)
        for name, t in info.types.items()
        if t == FLOAT and info.is_const(name) and name in info.consumers
    }
    total_w = sum(weights.values())
    low_w = sum(weights.get(name, 0) for name in set(converted_weights))
    reasons: dict[str, int] = {}
    for n in nodes:
        reasons[n.reason] = reasons.get(n.reason, 0) + 1
    out: dict[str, Any] = {
        "nodes_total": len(nodes),
        "nodes_low": len(low),
        "low_share_nodes": round(len(low) / max(len(float_nodes), 1), 6),
        "low_share_flops": round(low_flops / total_flops, 6),
        "low_share_weight_bytes": round(low_w / total_w, 6) if total_w else 0.0,
        "cast_count": int(cast_count),
        "expected_error": dict(expected_error or {}),
        "reasons": dict(sorted(reasons.items())),
    }
    if search:
        out["search"] = dict(search)
    return out


def _num(value: float | str) -> float:
    return float(value)


# Calibration numbers copied into each node's plan entry (of its first float output).
RANGE_KEYS = ("absmax", "p999", "fp16_overflow_frac", "fp16_underflow_frac", "bf16_underflow_frac")


def _output_range(info: GraphInfo, ref: Any, stats: Mapping[str, Any] | None) -> dict[str, float | str]:
    if not stats:
        return {}
    prefix = ref.address[: len(ref.address) - len(ref.node.name)]
    for name in ref.node.output:
        if name and info.types.get(name) == FLOAT:
            st = stats.get(prefix + name) if prefix else None
            st = st if st is not None else stats.get(name)
            if st is None:
                return {}
            out: dict[str, float | str] = {}
            for key in RANGE_KEYS:
                val = st.get(key) if isinstance(st, Mapping) else getattr(st, key, None)
                if isinstance(val, (int, float)):
                    out[key] = float(val) if math.isfinite(val) else str(val)
            return out
    return {}
