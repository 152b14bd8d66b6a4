"""Groups of low nodes the budget search and the repair loop switch as a unit, and their local errors.

Each compute node (Conv, MatMul, ...) with the follow-ops it feeds first is one group (a fused chain), so a
group switches precision as a unit and adds no Casts inside; its local error is its error run alone in the low
format on FP32 reference tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpinfer.precision.core import GraphInfo, NodeDecision, components
from mpinfer.precision.emulator import GraphEmulator
from mpinfer.precision.numerics import strict as evaluators
from mpinfer.precision.rules import Decision, Kind
from mpinfer.specs import Precision


@dataclass
class _Group:
    anchor: str
    members: list[str]
    flops: float
    error: float = 0.0
    # Nodes inside an If/Loop/Scan body: no sub-model or probe copy measures them alone, so they are ranked with
    # BODY_GROUP_ERROR and decided by the verifications.
    in_body: bool = False


def build_groups(info: GraphInfo, nodes: Sequence[NodeDecision], decisions: Mapping[str, Decision]) -> list[_Group]:
    """Fused chains of searchable low nodes (not forced by the user), each within one graph or body."""
    prec = {n.name: n.precision for n in nodes}
    searchable = [
        ref for ref in info.nodes if prec[ref.address].is_low and not decisions[ref.address].reason.startswith("user:")
    ]

    def first_source(ref: Any) -> str | None:
        """The producer a follow-op joins: the first of its inputs made by another searchable node of its graph."""
        for name in ref.node.input:
            src = info.producer.get(name)
            if src in addresses and src != ref.address and info.by_address[src].graph is ref.graph:
                return src
        return None

    addresses = {ref.address for ref in searchable}
    links = (
        (ref.address, src)
        for ref in searchable
        if decisions[ref.address].kind is Kind.FOLLOW and (src := first_source(ref)) is not None
    )
    groups: dict[str, _Group] = {}
    for anchor, members in components([ref.address for ref in searchable], links).items():
        flops = sum(float(info.flops(info.by_address[a])) for a in members)
        groups[anchor] = _Group(anchor, members, flops, in_body=info.by_address[anchor].depth > 0)
    return list(groups.values())


def group_errors(
    info: GraphInfo, groups: Sequence[_Group], batches: Sequence[Mapping[str, np.ndarray]], low: Precision
) -> dict[str, float]:
    """Each group's local error (run alone in ``low`` on the FP32 tensors of ``batches``), by anchor.

    Groups in control-flow bodies are left out, and so is every group when the emulator cannot run the model.
    """
    emu = GraphEmulator(info.model, base_dir=info.base_dir)
    if not batches or emu.unsupported_ops():
        return {}
    refs = [emu.run(dict(b), None, keep=True) for b in batches]
    return {g.anchor: evaluators.local_error(info.model, info, g, refs, low)[0] for g in groups if not g.in_body}
