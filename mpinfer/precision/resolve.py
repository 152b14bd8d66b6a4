"""Turn rule verdicts into one precision per node.

Follow-ops take their inputs' precision (forward),
and where the inputs say nothing (constants only) their consumers' (backward).
"""

from __future__ import annotations

from collections.abc import Mapping

from mpinfer.precision.graphinfo import FLOAT, GraphInfo
from mpinfer.precision.rules import Decision, Kind
from mpinfer.specs import Precision


def resolve_precisions(
    info: GraphInfo, decisions: Mapping[str, Decision], low: Precision, *, keep_io_types: bool = True
) -> dict[str, Precision]:
    """Return address → precision for every node.

    Args:
        info: The graph.
        decisions: Address → rule verdict (LOW / KEEP / FOLLOW).
        low: The low precision (FP16 or BF16).
        keep_io_types: Graph inputs and outputs stay FP32.

    Returns:
        Address → Precision (``low`` or FP32).
    """
    low_type = low.onnx_dtype
    state: dict[str, bool | None] = {}  # tensor -> True (low), False (fp32), None (free: constants)
    for name in info.graph_inputs:
        state[name] = not keep_io_types
    for name in info.initializers:
        state[name] = None
    prec: dict[str, Precision | None] = {}
    for ref in info.nodes:
        verdict = decisions[ref.address]
        slots = info.slots(ref.node, low_type)
        if verdict.kind is Kind.LOW:
            p: Precision | None = low
        elif verdict.kind is Kind.KEEP:
            p = Precision.FP32
        else:
            seen = [_state(state, info, ref.node.input[i]) for i in slots.inputs]
            known = [s for s in seen if s is not None]
            p = None if not known else (low if all(known) else Precision.FP32)
        prec[ref.address] = p
        for i, name in enumerate(ref.node.output):
            if name:
                state[name] = None if p is None else (p is low and i in slots.outputs)
    for ref in reversed(info.nodes):
        if prec[ref.address] is not None:
            continue
        wants = []
        for name in ref.node.output:
            if not name or info.types.get(name) != FLOAT:
                continue
            if name in info.graph_outputs:
                wants.append(not keep_io_types)
            for addr, pos in info.consumers.get(name, []):
                cp = prec.get(addr)
                cslots = info.slots(info.by_address[addr].node, low_type)
                wants.append(cp is low and pos in cslots.inputs)
        slots = info.slots(ref.node, low_type)
        ok = bool(wants) and all(wants) and not slots.blocked and bool(slots.outputs or slots.inputs)
        prec[ref.address] = low if ok else Precision.FP32
    return {k: (v or Precision.FP32) for k, v in prec.items()}


def _state(state: dict[str, bool | None], info: GraphInfo, name: str) -> bool | None:
    if name in state:
        return state[name]
    # Names produced by no node and no graph input: body inputs of Loop/Scan (FP32 interface).
    return False
