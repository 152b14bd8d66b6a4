"""Turn rule verdicts into one precision per node.

Follow-ops take their inputs' precision (forward),
and where the inputs say nothing (constants only) their consumers' (backward).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mpinfer.precision.core import FLOAT, GraphInfo, components
from mpinfer.precision.rules.classify import Decision, Kind
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
    prec = _forward_pass(info, decisions, low, keep_io_types)
    _backward_pass(info, prec, low, keep_io_types)
    final = {k: (v or Precision.FP32) for k, v in prec.items()}
    _move_casts_upstream(info, decisions, final, low, keep_io_types=keep_io_types)
    return final


def _forward_pass(
    info: GraphInfo, decisions: Mapping[str, Decision], low: Precision, keep_io_types: bool
) -> dict[str, Precision | None]:
    """LOW and KEEP verdicts as they are; a FOLLOW node takes its inputs' precision (None: only constants)."""
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
    return prec


def _backward_pass(info: GraphInfo, prec: dict[str, Precision | None], low: Precision, keep_io_types: bool) -> None:
    """Nodes still undecided (fed by constants only) go low when every consumer of their outputs is low."""
    low_type = low.onnx_dtype
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


def _state(state: dict[str, bool | None], info: GraphInfo, name: str) -> bool | None:
    if name in state:
        return state[name]
    # Names produced by no node and no graph input: body inputs of Loop/Scan (FP32 interface).
    return False


def _wants_low(info: GraphInfo, prec: Mapping[str, Precision], addr: str, pos: int, low_type: int) -> bool:
    return prec[addr].is_low and pos in info.slots(info.by_address[addr].node, low_type).inputs


def _move_casts_upstream(
    info: GraphInfo,
    decisions: Mapping[str, Decision],
    prec: dict[str, Precision],
    low: Precision,
    *,
    keep_io_types: bool,
) -> None:
    """Run FP32 follow-op regions low when every consumer wants low and it costs no extra Cast.

    A GELU between an FP32 LayerNorm and an FP16 MatMul follows the LayerNorm and stays FP32 with one Cast
    at its end; casting its input instead (one Cast, shared by all its readers) runs the whole region low at
    the same Cast count, as the FP16 kernels downstream expect.
    """
    low_type = low.onnx_dtype
    cand = [
        ref
        for ref in info.nodes
        if not prec[ref.address].is_low
        and decisions[ref.address].kind is Kind.FOLLOW
        and not info.slots(ref.node, low_type).blocked
        and info.slots(ref.node, low_type).outputs
    ]
    links = (
        (ref.address, src)
        for ref in cand
        for src in (info.producer.get(name) for name in ref.node.input)
        if src is not None and info.by_address[src].graph is ref.graph
    )
    regions = components([ref.address for ref in cand], links)
    for members in regions.values():
        if _region_pays_off(info, prec, set(members), low_type, keep_io_types):
            for a in members:
                prec[a] = low


def _region_pays_off(
    info: GraphInfo, prec: Mapping[str, Precision], members: set[str], low_type: int, keep_io_types: bool
) -> bool:
    """True when running ``members`` low removes at least one Cast and adds no more than it removes."""
    removed, added = 0, set()
    for addr in members:
        node = info.by_address[addr].node
        outputs_cast = _output_casts_removed(info, prec, members, node, low_type, keep_io_types)
        if outputs_cast is None:
            return False
        removed += outputs_cast
        added |= _input_casts_added(info, prec, members, node, low_type)
    return len(added) <= removed and removed > 0


def _output_casts_removed(
    info: GraphInfo, prec: Mapping[str, Precision], members: set[str], node: Any, low_type: int, keep_io_types: bool
) -> int | None:
    """Float outputs of ``node`` read outside the region (one Cast each saved); None when one must stay FP32."""
    removed = 0
    for name in node.output:
        if not name or info.types.get(name) != FLOAT:
            continue
        if name in info.graph_outputs and keep_io_types:
            return None
        outside = [(a, p) for a, p in info.consumers.get(name, []) if a not in members]
        if any(not _wants_low(info, prec, a, p, low_type) for a, p in outside):
            return None
        removed += bool(outside)
    return removed


def _input_casts_added(
    info: GraphInfo, prec: Mapping[str, Precision], members: set[str], node: Any, low_type: int
) -> set[str]:
    """Float inputs of ``node`` from outside the region that would need a new Cast to low."""
    added: set[str] = set()
    for i in info.slots(node, low_type).inputs:
        name = node.input[i]
        src = info.producer.get(name)
        if src in members or info.is_const(name) or info.types.get(name) != FLOAT:
            continue
        produced_low = src is not None and prec[src].is_low
        shared = any(
            a not in members and _wants_low(info, prec, a, p, low_type) for a, p in info.consumers.get(name, [])
        )
        if not produced_low and not shared:
            added.add(name)
    return added
