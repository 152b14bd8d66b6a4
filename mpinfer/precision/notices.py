"""What convert says about a plan besides writing it.

Nodes left FP32 and why, a broken model, FP64 nodes, outputs with no values (unmeasured), a plan that buys nothing.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from onnx import defs

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.modelio import (
    MAX_OPSET,
)
from mpinfer.precision.core import GraphInfo, NodeDecision, counts_as_float, float_outputs
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

# Below this share of the FLOPs in low precision a plan buys (almost) nothing: the Casts it adds cost about what
# the few lowered nodes save (issue 35's QDQ speech encoder: 0.04% of the FLOPs lowered, 20 Casts added).
LOW_GAIN_SHARE = 0.01
# The opset from which DequantizeLinear writes float16/bfloat16 (ONNX's DequantizeLinear-19), and with it the
# quantized ops it feeds.
QDQ_LOW_OPSET = 19


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


def unmeasured_outputs(model: Any, stats: Any, *, own_data: bool, source: str | None) -> list[str]:
    """The float outputs that had no values on the data (empty, or every value 0): their error is not measured.

    Args:
        model: The model (its float outputs).
        stats: Calibration's statistics (None: nothing calibrated, nothing said).
        own_data: The data is mpinfer's own random data.
        source: ``--calibration`` as given (None: not given).

    Raises:
        InvalidInputError: When it is every float output and the data is mpinfer's own random data: it has
            nothing to judge a plan by, and convert does not write an unmeasured plan on its own.
    """
    if stats is None:
        return []
    floats = [o.name for o in float_outputs(model)]
    silent = [n for n in floats if n in stats.tensors and _no_values(stats[n])]
    if silent and len(silent) == len(floats) and own_data:
        given = "no --calibration given" if source is None else f"--calibration {source}"
        raise InvalidInputError(
            format_message(
                f"mpinfer's own random data ({given})",
                f"no values in any output of the model ({', '.join(repr(n) for n in silent[:5])}: empty or all 0)",
                "data that gives the outputs values, to verify the plan against the default floor",
                "pass --calibration FILE with real inputs (or --dim NAME=N / --input-range NAME=LO..HI to shape the "
                "random data); --calibration none plans by the rules alone (nothing measured)",
            )
        )
    if silent:
        logger.warning(
            "Output(s) %s had no values on the calibration data (empty, or every value 0): their error is not "
            "measured. Pass data that gives them values to have them judged.", ", ".join(repr(n) for n in silent)
        )
    return silent


def _no_values(st: Any) -> bool:
    """True for a tensor's statistics with no values (none seen, or every one 0; NaN/Inf are values)."""
    return st.count == 0 or (st.absmax == 0 and not st.nan_count and not st.inf_count)


def note_measures(
    summary: dict[str, Any], nodes: Sequence[NodeDecision], info: GraphInfo, precision: Precision,
    unmeasured: Sequence[str], not_measured: str | None,
) -> None:
    """Record in a plan's ``summary`` what was not measured and whether the plan buys anything (in place).

    ``unmeasured_outputs`` (every one of them: no expected error at all, never a perfect 0), ``not_measured``
    (``--calibration none``) and ``low_gain`` (:func:`low_gain_note`, also logged).
    """
    if unmeasured:
        summary["unmeasured_outputs"] = list(unmeasured)
        if len(unmeasured) == len(float_outputs(info.model)):  # every figure of an output with no values
            summary["expected_error"] = {}
    if not_measured:
        summary["not_measured"] = not_measured
    gain = low_gain_note(nodes, summary, info, precision)
    if gain:  # (the console prints it; the opset and quantized-model warnings have said their part already)
        summary["low_gain"] = gain
        logger.info("%s", gain)


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
