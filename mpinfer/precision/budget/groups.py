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

# The magnitude candidate (``magnitude_groups``): a group any of whose members makes, or reads from another node, a
# tensor whose calibrated |value| passes this is left FP32 in the search's second candidate. ModelOpt AutoCast's
# ``data_max`` default: on DNSMOS its power spectrum (Square, Add: |587|) is what breaks the floor, and the local
# error (relative, at the group's own outputs: 3e-4) ranks it among the safest groups.
MAGNITUDE_LIMIT = 512.0


@dataclass
class _Group:
    anchor: str
    members: list[str]
    flops: float
    error: float = 0.0
    # Nodes inside an If/Loop/Scan body: no sub-model or probe copy measures them alone, so they are ranked with
    # BODY_GROUP_ERROR and decided by the verifications.
    in_body: bool = False
    # The largest calibrated |value| the group makes or reads from another node (set by ``magnitude_groups``).
    peak: float = 0.0


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


def magnitude_groups(
    info: GraphInfo, groups: Sequence[_Group], nodes: Sequence[NodeDecision], limit: float = MAGNITUDE_LIMIT
) -> list[_Group]:
    """The groups (outside control-flow bodies) that make, or read from a node outside them, a value above ``limit``.

    The magnitudes are the plan entries' calibrated ``absmax`` (of each node's first float output); each group
    flagged gets its ``peak``. A node without calibration figures flags nothing.
    """
    peaks = {n.name: _absmax(n.stats) for n in nodes}
    flagged = []
    for g in groups:
        if g.in_body:
            continue
        inside = set(g.members)
        read = (
            src
            for a in g.members
            for name in info.by_address[a].node.input
            if (src := info.producer.get(name)) is not None and src not in inside
        )
        g.peak = max([peaks.get(a, 0.0) for a in g.members] + [peaks.get(src, 0.0) for src in read])
        if g.peak > limit:
            flagged.append(g)
    return flagged


def _absmax(stats: Mapping[str, object]) -> float:
    """A plan entry's calibrated ``absmax`` (``inf`` kept; missing or NaN: 0)."""
    value = stats.get("absmax")
    try:
        peak = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return peak if peak == peak else 0.0


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
