"""Speed hints and the precision summary of an ONNX candidate.

Hints:

* ``alignment``: an FP16/BF16 MatMul/Gemm/Conv whose channel or inner dimensions are not multiples of
  :data:`ALIGNMENT`; Tensor Cores want aligned shapes, so such a layer gains little from FP16.
* ``cast-split``: a Cast between a producer and a consumer a GPU engine would fuse (Conv→Relu,
  MatMul→Add, ...), so the pair runs as two kernels plus a cast. With the candidate's plan beside it, a node
  the plan keeps FP32 for a reason of its own (range, a keep rule, the search, the user) is never proposed for
  FP16: the hint then offers only the FP32 side, and says why. An Add kept FP32 only because it adds an
  attention mask built from a huge negative constant (a model converted before mpinfer rewrote such masks) is
  never a reason to keep the MatMul beside it FP32: the hint says to convert again, which rewrites the mask
  (``rewrite:mask``).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.compare.result import SpeedHint
from mpinfer.modelio import iter_nodes
from mpinfer.precision.core import counts_as_float
from mpinfer.precision.graph import MASK_PATH_OPS, MASK_SENTINEL

logger = logging.getLogger(__name__)

# Tensor Cores process FP16/BF16 tiles of 8 elements along channels / inner dims.
ALIGNMENT = 8
# Ops whose speed depends on Tensor Core alignment.
_MATH_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose"}
# Producer -> consumers a GPU engine (TensorRT, ORT CUDA) fuses into one kernel.
_FUSIBLE = {
    "Conv": {"Relu", "Clip", "Add", "Sigmoid", "LeakyRelu", "BatchNormalization", "Mul", "HardSigmoid"},
    "ConvTranspose": {"Relu", "Clip", "Add", "BatchNormalization"},
    "MatMul": {"Add", "Relu", "Gelu", "Mul", "Div", "Softmax"},
    "Gemm": {"Relu", "Gelu", "Add", "Clip"},
    "BatchNormalization": {"Relu", "Clip"},
    "Add": {"Relu", "LayerNormalization"},
}
# onnx.TensorProto.FLOAT, the ``to`` of a Cast back to FP32 (onnx is imported where used).
_FLOAT = 1
# Constants up to this size are looked at for an attention mask's minus infinity (causal tables included).
MASK_CONST_MAX_ELEMENTS = 1 << 22
# Hints listed per candidate at most (the rest are counted in the log).
MAX_HINTS = 20


def _infer(model: Any) -> tuple[dict[str, int], dict[str, list[int | str]]]:
    """Element types and shapes of every tensor (shape inference plus initializers)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception as err:  # shape inference fails on some custom ops; hints are best effort
        logger.info("shape inference failed (%s); hints use initializer shapes only", err)
        inferred = model
    types: dict[str, int] = {}
    shapes: dict[str, list[int | str]] = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        tt = vi.type.tensor_type
        types[vi.name] = tt.elem_type
        shapes[vi.name] = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim
        ]
    for init in inferred.graph.initializer:
        types[init.name] = init.data_type
        shapes[init.name] = list(init.dims)
    return types, shapes


def _misaligned_dims(node: Any, shapes: dict[str, list[int | str]]) -> list[tuple[str, int]]:
    def dims(name: str) -> list[int | str]:
        return shapes.get(name, [])

    out: list[tuple[str, int | str]] = []
    if node.op_type in ("Conv", "ConvTranspose") and len(node.input) > 1:
        w = dims(node.input[1])
        group = next((a.i for a in node.attribute if a.name == "group"), 1)
        if len(w) >= 2 and group == 1:
            cout, cin = (w[0], w[1]) if node.op_type == "Conv" else (w[1], w[0])
            out += [("output channels", cout), ("input channels", cin)]
    elif node.op_type in ("MatMul", "Gemm") and len(node.input) > 1:
        a, b = dims(node.input[0]), dims(node.input[1])
        trans_b = (
            next((a_.i for a_ in node.attribute if a_.name == "transB"), 0) if node.op_type == "Gemm" else 0
        )
        if len(b) >= 2:
            k, n = (b[-1], b[-2]) if trans_b else (b[-2], b[-1])
            out += [("inner dim K", k), ("output dim N", n)]
        elif len(a) >= 1:
            out += [("inner dim K", a[-1])]
    return [(what, int(v)) for what, v in out if isinstance(v, int) and v > 0 and v % ALIGNMENT]


def speed_hints(model: Any, plan_nodes: dict[str, dict[str, Any]] | None = None) -> list[SpeedHint]:
    """Speed hints for a (mixed-precision) ONNX model.

    Args:
        model: The candidate.
        plan_nodes: Its plan's node entries by name
            (:func:`mpinfer.compare.divergence.load_plan_nodes`), when it has a plan.
    """
    from onnx import TensorProto

    low = {TensorProto.FLOAT16, TensorProto.BFLOAT16}
    types, shapes = _infer(model)
    hints: list[SpeedHint] = []
    nodes = list(model.graph.node)
    for node in nodes:
        if node.op_type in _MATH_OPS and node.input and types.get(node.input[0]) in low:
            bad = _misaligned_dims(node, shapes)
            if bad:
                what = ", ".join(f"{w} {v}" for w, v in bad)
                kind = "BF16" if types.get(node.input[0]) == TensorProto.BFLOAT16 else "FP16"
                hints.append(
                    SpeedHint(
                        "alignment",
                        node.name,
                        node.op_type,
                        f"{kind} {node.op_type} '{node.name}' has {what}, not a multiple of {ALIGNMENT}: "
                        f"Tensor Cores need aligned shapes, so it gains little from {kind}.",
                        f"pad the layer to a multiple of {ALIGNMENT} in the model, or keep it FP32 "
                        f"(`mpinfer convert --keep-node '{node.name}'`) and save the casts.",
                    )
                )
    hints += _cast_splits(nodes, plan_nodes or {}, model.graph.initializer)
    if len(hints) > MAX_HINTS:
        logger.info("%d speed hints; the report lists the first %d", len(hints), MAX_HINTS)
    return hints[:MAX_HINTS]


# Reasons a plan keeps a node FP32 by itself (not just following its neighbours): a hint never proposes FP16 for it.
_FOLLOWING = {"rule:follow"}


def _cast_splits(
    nodes: list[Any], plan: dict[str, dict[str, Any]], initializers: Sequence[Any] = ()
) -> list[SpeedHint]:
    producer = {o: n for n in nodes for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    hints = []
    consts = _float_constants(nodes, initializers)
    for cast in (n for n in nodes if n.op_type == "Cast" and n.input):
        prod = producer.get(cast.input[0])
        if prod is None or prod.op_type not in _FUSIBLE:
            continue
        to = next((a.i for a in cast.attribute if a.name == "to"), 0)
        for cons in consumers.get(cast.output[0], []):
            if cons.op_type not in _FUSIBLE[prod.op_type]:
                continue
            fix = _cast_split_fix(prod, cons, to == _FLOAT, plan, producer, consts)
            hints.append(
                SpeedHint(
                    "cast-split",
                    cons.name,
                    cons.op_type,
                    f"Cast '{cast.name}' sits between {prod.op_type} '{prod.name}' and {cons.op_type} "
                    f"'{cons.name}', which a GPU engine would fuse; the pair runs as separate kernels "
                    "plus a cast.",
                    fix,
                )
            )
    return hints


def _cast_split_fix(
    prod: Any,
    cons: Any,
    to_fp32: bool,
    plan: dict[str, dict[str, Any]],
    producer: dict[str, Any],
    consts: dict[str, Any],
) -> str:
    """How to mend a Cast between ``prod`` and ``cons`` (``to_fp32``: a Cast to FP32, after a low producer)."""
    # A Cast to FP32 follows a low producer; a Cast to FP16/BF16 follows an FP32 one.
    low, keep = (cons.name, prod.name) if to_fp32 else (prod.name, cons.name)
    entry = plan.get(low, {})
    reason = str(entry.get("reason", ""))
    fp32_node = cons if to_fp32 else prod
    if _adds_attention_mask(fp32_node, producer, consts):
        return (f"convert the model again with this mpinfer: '{fp32_node.name}' adds an attention mask built "
                "from a huge negative constant, which mpinfer rewrites to the low format's safe lowest "
                "(plan reason rewrite:mask), so the mask-add, the Softmax and this MatMul all run low.")
    if reason and reason not in _FOLLOWING:
        detail = str(entry.get("detail", "")).rstrip(".")
        return (f"keep both FP32 (`mpinfer convert --keep-node '{keep}'`): the plan keeps '{low}' FP32 "
                f"({reason}{': ' + detail if detail else ''}), so it should not go to low precision.")
    return f"run both in the same precision: `mpinfer convert --low-node '{low}'` or `--keep-node '{keep}'`."


def _float_constants(nodes: list[Any], initializers: Sequence[Any]) -> dict[str, Any]:
    """Name -> TensorProto of the float initializers and Constant values (read only when a hint asks)."""
    from onnx import TensorProto

    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    out = {t.name: t for t in initializers if t.data_type in floats}
    for n in nodes:
        if n.op_type == "Constant" and n.output:
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            if value is not None and value.data_type in floats:
                out[n.output[0]] = value
    return out


def _is_mask_constant(tensor: Any) -> bool:
    """A constant holding an attention mask's minus infinity (a finite value at or below MASK_SENTINEL)."""
    from onnx import numpy_helper

    if int(np.prod(tensor.dims)) > MASK_CONST_MAX_ELEMENTS:
        return False
    arr = numpy_helper.to_array(tensor).astype(np.float32)
    finite = arr[np.isfinite(arr)]
    return bool(finite.size) and float(finite.min()) <= MASK_SENTINEL


def _adds_attention_mask(node: Any, producer: dict[str, Any], consts: dict[str, Any]) -> bool:
    """Whether ``node`` is an Add one of whose inputs comes from a mask constant through mask-path ops."""
    if node.op_type != "Add":
        return False
    todo, seen = list(node.input), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in consts:
            if _is_mask_constant(consts[name]):
                return True
            continue
        src = producer.get(name)
        if src is not None and src.op_type in MASK_PATH_OPS:
            todo.extend(i for i in src.input if i)
    return False


def precision_summary(model: Any, candidate_path: str | Path) -> dict[str, Any]:
    """FP16/BF16 share and cast count, from the plan file when present, else counted from the model."""
    from onnx import TensorProto

    plan_path = Path(str(candidate_path)[: -len(".onnx")] + ".plan.json")
    from_plan = _summary_from_plan(plan_path) if plan_path.is_file() else None
    if from_plan is not None:
        return from_plan
    types, _ = _infer(model)
    names: dict[int | None, str] = {
        int(TensorProto.FLOAT16): "fp16",
        int(TensorProto.BFLOAT16): "bf16",
        int(TensorProto.FLOAT): "fp32",
    }
    counts: Counter[str] = Counter()
    casts = 0
    for ref in iter_nodes(model.graph):
        node = ref.node
        if node.op_type == "Cast":  # type: ignore[attr-defined]
            casts += 1
            continue
        outs = [types.get(o) for o in node.output]  # type: ignore[attr-defined]
        prec = next((names[t] for t in outs if t in names), None)
        if prec:
            counts[prec] += 1
    total = sum(counts.values())
    low = counts["fp16"] + counts["bf16"]
    return {
        "source": "model",
        "precision": "fp16" if counts["fp16"] >= counts["bf16"] else "bf16",
        "nodes_total": total,
        "nodes_low": low,
        "low_share": low / total if total else 0.0,
        "low_share_flops": None,
        "cast_count": casts,
        "counts": dict(counts),
        "reasons": {},
    }


def _summary_from_plan(plan_path: Path) -> dict[str, Any] | None:
    """The precision summary of a plan file, or None when it is unreadable."""
    try:
        plan = json.loads(plan_path.read_text())
        plan_counts = Counter(str(n.get("precision", "fp32")) for n in plan.get("nodes", []))
        summ = plan.get("summary", {})
        low = int(summ.get("nodes_low", sum(v for k, v in plan_counts.items() if k in ("fp16", "bf16"))))
        # float nodes, as the plan's own share counts them
        nodes = plan["nodes"]
        total = sum(counts_as_float(str(n.get("reason")), n.get("precision") in ("fp16", "bf16")) for n in nodes)
        return {
            "source": str(plan_path),
            "precision": plan.get("precision"),
            "nodes_total": total,
            "nodes_low": low,
            "low_share": low / total if total else 0.0,
            "low_share_flops": summ.get("low_share_flops"),
            "cast_count": summ.get("cast_count"),
            "counts": dict(plan_counts),
            "reasons": dict(Counter(str(n.get("reason")) for n in plan["nodes"])),
            "verification": summ.get("verification"),  # what convert verified: report sets it beside compare's
        }
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.warning("plan file '%s' is unreadable (%s); counting from the model", plan_path, err)
    return None
