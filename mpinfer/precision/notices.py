"""What convert says about a plan besides writing it: nodes left FP32 and why, a broken model, FP64 nodes."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

from onnx import defs

from mpinfer.modelio import (
    MAX_OPSET,
)
from mpinfer.precision.core import GraphInfo, NodeDecision
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)


def fp64_nodes(info: GraphInfo) -> dict[str, str]:
    """The nodes that read or write a double (FP64) tensor, Casts aside: address -> op type."""
    double = 11  # onnx.TensorProto.DOUBLE
    return {
        ref.address: ref.node.op_type
        for ref in info.nodes
        if ref.node.op_type != "Cast"
        and any(n and info.types.get(n) == double for n in [*ref.node.input, *ref.node.output])
    }


def _warn_foreign(nodes: list[NodeDecision]) -> None:
    """Say which nodes stay FP32 because mpinfer cannot know what they compute."""
    foreign = sorted({f"{n.op_type} ({n.reason})" for n in nodes if n.reason in ("unknown-op", "custom-domain")})
    if foreign:
        logger.warning("Kept FP32 (mpinfer cannot know what they compute): %s", ", ".join(foreign))


def _warn_broken(expected: Mapping[str, Any], nodes: list[NodeDecision]) -> None:
    """Say so when the plan's model computes NaN/Inf (or wrong signs) where the FP32 model does not."""
    def bad(key: str, limit: float | None = None) -> bool:
        v = expected.get(key)
        try:
            v = float(v)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return False
        return not math.isfinite(v) or (limit is not None and v < limit)

    if not (bad("max_abs") or bad("cosine", 0.0)):
        return
    forced = [n.name for n in nodes if n.precision.is_low and n.reason in ("user:low-op", "user:low-node")]
    logger.warning(
        "The converted model is broken on the calibration data (expected error: max_abs=%s, cosine=%s)%s. Keep "
        "the overflowing nodes FP32 (--keep-op/--keep-node, fewer --low-*), or pass --budget to let the search "
        "find what must stay FP32.",
        expected.get("max_abs"),
        expected.get("cosine"),
        f": nodes forced low by --low-op/--low-node overflow, e.g. {', '.join(forced[:3])}" if forced else "",
    )


def _warn_opset_blocked(nodes: list[NodeDecision], info: Any, precision: Precision) -> None:
    """Warn once when ops stay FP32 only because the model's opset lacks the low dtype for them.

    BF16 Conv, pooling and most activations arrive with opset 22: a CNN exported at an older opset
    otherwise converts to BF16 with almost nothing in BF16 and no word why.
    """
    name = "float16" if precision is Precision.FP16 else "bfloat16"
    opset = info.opsets.get("", 0)
    blocked: Counter[str] = Counter()  # ops a higher opset that mpinfer writes gives the low type
    beyond: dict[str, int] = {}  # ops that get it only above MAX_OPSET: the opset that does
    needed = 0
    for n in nodes:
        if n.reason != "rule:keep-fp32" or f"has no {name} type" not in n.detail:
            continue
        for version in range(opset + 1, defs.onnx_opset_version() + 1):
            try:
                schema = defs.get_schema(n.op_type, version, "")
            except defs.SchemaError:
                break
            if any(f"tensor({name})" in c.allowed_type_strs for c in schema.type_constraints):
                if version <= MAX_OPSET:
                    blocked[n.op_type] += 1
                    needed = max(needed, version)
                else:
                    beyond[n.op_type] = schema.since_version
                break
    if blocked:
        quantized = sum(n.reason == "rule:qdq" for n in nodes)
        logger.warning(
            "%d node(s) stay FP32 because opset %d has no %s for them (%s)%s. Hint: opset %d has it: convert "
            "with `--opset %d` (ONNX's version converter upgrades the model first), or re-export at that opset.",
            sum(blocked.values()),
            opset,
            name,
            ", ".join(f"{op} x{k}" for op, k in blocked.most_common()),
            f", and so do the {quantized} quantized op(s) they feed" if quantized else "",
            needed,
            needed,
        )
    if beyond:
        logger.info(
            "Op(s) %s stay FP32: ONNX gives them %s only from opset %d, above the highest opset mpinfer writes "
            "(%d).",
            ", ".join(sorted(beyond)),
            name,
            min(beyond.values()),
            MAX_OPSET,
        )
