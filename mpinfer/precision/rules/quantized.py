"""Already-quantized models (QDQ or int8 operators): what convert leaves as it is, and why, in one warning."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from mpinfer.precision.core import NodeDecision

logger = logging.getLogger(__name__)

# Ops that compute in integers or carry a quantizer's scales (ai.onnx and com.microsoft): their arithmetic is the
# quantizer's decision, not a float precision convert could lower.
QUANTIZED_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "DynamicQuantizeLinear",
        "QLinearConv",
        "QLinearMatMul",
        "MatMulInteger",
        "ConvInteger",
        "QLinearAdd",
        "QLinearMul",
        "QLinearSigmoid",
        "QLinearLeakyRelu",
        "QLinearAveragePool",
        "QLinearGlobalAveragePool",
        "QLinearConcat",
        "QLinearSoftmax",
        "QGemm",
        "DynamicQuantizeMatMul",
        "MatMulIntegerToFloat",
        "MatMulNBits",
    }
)


def quantized_summary(nodes: Sequence[NodeDecision]) -> str | None:
    """The warning for a quantized model, or None when it has no quantized ops.

    Names the quantized ops left as they are, those of them that stay FP32 and why (a DequantizeLinear below
    opset 19 has no FP16 output), and says when nothing at all was converted.
    """
    quantized = [n for n in nodes if n.op_type in QUANTIZED_OPS]
    if not quantized:
        return None
    ops = Counter(n.op_type for n in quantized)
    kept = [n for n in quantized if not n.precision.is_low]
    why = Counter((n.detail.split(";")[0].split(":")[0] or n.reason)[:100] for n in kept)
    lowered = len(quantized) - len(kept)
    low = sum(n.precision.is_low for n in nodes)
    text = (
        f"Quantized model: {len(quantized)} quantized op(s) ({', '.join(f'{o} x{k}' for o, k in ops.most_common())}) "
        "keep their integer arithmetic and zero points as the quantizer set them: convert only lowers float "
        "arithmetic."
    )
    if kept:
        text += f" {len(kept)} of them stay FP32 ({'; '.join(f'{k} x{v}' for k, v in why.most_common(3))})."
    if lowered:
        prec = next(n.precision.value for n in quantized if n.precision.is_low)
        text += f" {lowered} of them read and write {prec} (their scales rounded to {prec})."
    float_nodes = [n for n in nodes if n.op_type not in QUANTIZED_OPS and n.reason != "rule:index-like"]
    if low == 0:
        text += (
            f" Nothing was converted: the model's {len(float_nodes)} other node(s) stay FP32 too, so the output "
            "computes as the input does. Hint: convert the FP32 model before quantizing it, or, for QDQ at an "
            "opset below 19, `--opset 19` lets DequantizeLinear write FP16."
        )
    return text


def warn_quantized(nodes: Sequence[NodeDecision]) -> None:
    """Log :func:`quantized_summary` once, when there is one."""
    text = quantized_summary(nodes)
    if text:
        logger.warning("%s", text)
