"""Build a PrecisionPlan from rules (and calibration statistics), and summarise a plan."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.precision.core import FLOAT, GraphInfo, NodeDecision, counts_as_float, precisions_digest
from mpinfer.precision.graph import FUSED_OPS, FUSED_SUFFIXES, MaskSite, find_mask_sites, mask_tensors, rewrite_masks
from mpinfer.precision.graph import REASON as MASK_REASON
from mpinfer.precision.rules.classify import (
    Decision,
    Kind,
    NodeClassifier,
    RuleContext,
    compile_pattern,
    default_rules,
    shape_subgraph,
)
from mpinfer.precision.rules.resolve import resolve_precisions
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


def check_overrides(info: GraphInfo, options: RuleOptions) -> None:
    """Refuse contradicting overrides and say which ones match nothing (a typo would be a silent no-op).

    Raises:
        InvalidInputError: An op type in both --keep-op and --low-op, a pattern in both --keep-node and
            --low-node, or an op type ONNX does not know.
    """
    _refuse_contradictions(options)
    _check_op_types(info, options)
    _warn_unmatched_patterns(info, options)


def _refuse_contradictions(options: RuleOptions) -> None:
    """An op type in both --keep-op and --low-op (or a pattern in both --keep-node and --low-node) is refused."""
    for what, keep, low in (("op type", options.keep_ops, options.low_ops), ("node pattern", options.keep_nodes,
                                                                             options.low_nodes)):
        both = sorted(set(keep) & set(low))
        if both:
            flag = "op" if what == "op type" else "node"
            raise InvalidInputError(
                format_message(
                    f"--keep-{flag} and --low-{flag}",
                    f"the {what} {', '.join(repr(b) for b in both)} in both",
                    "each in one of them",
                    f"--keep-{flag} would win; drop it from the one you did not mean",
                )
            )


def _check_op_types(info: GraphInfo, options: RuleOptions) -> None:
    """An op type ONNX does not know is refused (with the closest name); one the model lacks is a warning."""
    if not options.keep_ops and not options.low_ops:
        return  # (ONNX's every schema, read below, takes 20 ms)
    import difflib

    from onnx import defs

    present = sorted({ref.node.op_type for ref in info.nodes})
    known = {schema.name for schema in defs.get_all_schemas_with_history()}
    for flag, ops in (("--keep-op", options.keep_ops), ("--low-op", options.low_ops)):
        for op in ops:
            if op in present:
                continue
            close = (
                [p for p in present if p.lower() == op.lower()]
                or difflib.get_close_matches(op, present, n=1, cutoff=0.6)
                or difflib.get_close_matches(op, sorted(known), n=1, cutoff=0.6)
            )
            if op not in known:
                raise InvalidInputError(
                    format_message(
                        flag,
                        repr(op),
                        "an ONNX op type (case matters)",
                        f"did you mean {close[0]!r}?" if close else f"the model's op types: {', '.join(present)}",
                    )
                )
            fused = sorted({ref.node.op_type for ref in info.nodes if op in FUSED_OPS
                            and ref.node.name.endswith(FUSED_SUFFIXES)})
            why = (f" (its normalization chains were fused into {' and '.join(fused)}: name that op instead)"
                   if fused else "")
            logger.warning("%s %s: the model has no %s node, so it changes nothing%s.", flag, op, op, why)


def _warn_unmatched_patterns(info: GraphInfo, options: RuleOptions) -> None:
    """A --keep-node/--low-node pattern that matches no node is a warning (a typo would be a silent no-op)."""
    addresses = [ref.address for ref in info.nodes]
    for flag, patterns in (("--keep-node", options.keep_nodes), ("--low-node", options.low_nodes)):
        for pattern in patterns:
            rx = compile_pattern(pattern)
            if not any(rx.search(a) for a in addresses):
                logger.warning(
                    "%s '%s' matches no node, so it changes nothing (node names look like %s).",
                    flag,
                    pattern,
                    ", ".join(repr(a) for a in addresses[:3]),
                )


def classify_nodes(
    info: GraphInfo,
    precision: Precision,
    options: RuleOptions,
    stats: Mapping[str, Any] | None = None,
    masks: Sequence[MaskSite] = (),
) -> dict[str, Decision]:
    """Rule verdict per node address (``masks``: the attention masks to rewrite, from ``find_mask_sites``)."""
    rules = default_rules(
        keep_ops=options.keep_ops,
        low_ops=options.low_ops,
        keep_nodes=options.keep_nodes,
        low_nodes=options.low_nodes,
        overflow_nodes=options.overflow_nodes,
    )
    ctx = RuleContext(
        info=info,
        precision=precision,
        index_like=shape_subgraph(info),
        stats=stats,
        mask_sites={site.node: site for site in masks},
        mask_tensors=mask_tensors(masks),
    )
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
    """Classify, resolve follow-ops, and return verdicts and plan entries.

    The attention masks the plan rewrites (reason ``rewrite:mask``) are rewritten in ``info.model`` in place,
    so that the search and the rewrite of the graph see them: ``info`` must hold a model of the caller's own.
    """
    if stats is not None and type(stats) is not dict:
        stats = dict(stats.items())  # (the rules look up each float tensor: a Mapping's get raises on every miss)
    sites = find_mask_sites(info, precision, stats)
    decisions = classify_nodes(info, precision, options, stats, sites)
    rewrite_masks(info, sites, [a for a, d in decisions.items() if d.reason == MASK_REASON])
    precisions = resolve_precisions(info, decisions, precision, keep_io_types=keep_io_types)
    return decisions, decisions_to_nodes(info, decisions, precisions, stats)


def rewrite_planned_masks(info: GraphInfo, nodes: Sequence[NodeDecision], precision: Precision) -> int:
    """Re-apply a plan's mask rewrites to ``info.model`` (in place): the sites whose entry names a ``mask_value``.

    Deleting ``mask_value`` from a node's numbers in the plan file keeps that mask's original constant.
    """
    planned = [n.name for n in nodes if "mask_value" in n.stats]
    if not planned:
        return 0
    return rewrite_masks(info, find_mask_sites(info, precision), planned)


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
    float_nodes = [n for n in nodes if counts_as_float(n.reason, n.precision.is_low)]
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
        "precisions_digest": precisions_digest(nodes),
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
            mapping = isinstance(st, Mapping)
            for key in RANGE_KEYS:
                val = st.get(key) if mapping else getattr(st, key, None)
                if isinstance(val, (int, float)):
                    out[key] = float(val) if math.isfinite(val) else str(val)
            return out
    return {}
