"""PrecisionPlan: every node's precision with its reason and numbers; JSON, stable order, re-appliable.

The JSON layout is the contract in CONTRACTS.md (``schema_version`` 1). Nodes are listed in graph order
(depth first through If/Loop/Scan bodies), so a diff of two plans reads like a diff of two graphs, and a
user can edit ``"precision"`` of any node and re-apply the plan with ``mpinfer convert --plan``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.fileio import read_json, write_text_atomic
from mpinfer.precision.core.jsontext import dumps_indented
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
# Reasons that only ever come with FP32, or only with the low precision: a node of the plan file whose
# precision contradicts its reason was edited by hand (rule:follow says which way in its detail).
FP32_REASONS = frozenset(
    {
        "rule:keep-fp32",
        "rule:qdq",
        "range:overflow",
        "range:underflow",
        "weights:out-of-range",
        "sensitivity",
        "user:keep-op",
        "user:keep-node",
        "overflow-json",
        "unknown-op",
        "custom-domain",
    }
)
LOW_REASONS = frozenset(
    {"rule:fp16-safe", "rule:fp32-accumulate", "rewrite:mask", "user:low-op", "user:low-node"}
)
# Every reason a plan node may carry: those, the ones that allow either precision, and a hand edit.
REASON_CODES = FP32_REASONS | LOW_REASONS | {"rule:follow", "rule:index-like", "user:plan"}


def counts_as_float(reason: str, low: bool) -> bool:
    """Whether a plan node counts among the float nodes of the low share: all but index-like ones left FP32."""
    return reason != "rule:index-like" or low


def precisions_digest(nodes: Sequence[NodeDecision]) -> str:
    """A short digest of every node's precision: the summary records it, so an edited plan file is known."""
    import hashlib

    text = "".join(f"{n.name}={n.precision.value}\n" for n in nodes)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class NodeDecision:
    """One node of the plan.

    Attributes:
        name: The node's address (``If_3/then_branch/Add_1`` inside bodies).
        op_type: Its op type.
        precision: The precision it computes in.
        reason: A reason code (see :data:`REASON_CODES`).
        detail: A human sentence behind the reason.
        stats: Numbers behind it (flops, weight bytes, absmax, sensitivity...).
    """

    name: str
    op_type: str
    precision: Precision
    reason: str
    detail: str = ""
    stats: dict[str, float | str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "name": self.name,
            "op_type": self.op_type,
            "precision": self.precision.value,
            "reason": self.reason,
            "detail": self.detail,
            "stats": dict(self.stats),
        }


@dataclass
class PrecisionPlan:
    """The whole plan: where it comes from, how it was made, every node, and a summary."""

    source_path: str
    source_sha256: str
    precision: Precision
    numerics: str
    keep_io_types: bool
    nodes: list[NodeDecision]
    budget: str | None = None
    calibration: dict[str, Any] | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    mpinfer_version: str = ""
    # The default-domain opset the plan was made at; applying the plan upgrades the model to it first.
    opset: int | None = None

    # -- queries ----------------------------------------------------------------------------------------
    def low_nodes(self) -> dict[str, Precision]:
        """Address → low precision for the nodes that run low (the emulator's ``low`` argument)."""
        return {n.name: n.precision for n in self.nodes if n.precision.is_low}

    def precisions(self) -> dict[str, Precision]:
        """Address → precision for every node."""
        return {n.name: n.precision for n in self.nodes}

    def mark_edits(self) -> list[str] | None:
        """Relabel the nodes whose precision was edited in the file since ``mpinfer convert`` wrote it.

        Returns:
            None when the precisions are those the plan was written with (or the plan predates the digest),
            else the nodes now labelled ``user:plan`` (those whose reason contradicts their precision; an edit
            of a node whose reason allows both is known only from the digest).
        """
        recorded = self.summary.get("precisions_digest")
        if not recorded or recorded == precisions_digest(self.nodes):
            return None
        edited = []
        for n in self.nodes:
            if n.reason == "rule:follow":
                contradicts = n.detail.endswith("inputs are low precision") != n.precision.is_low
            else:
                contradicts = (n.reason in FP32_REASONS and n.precision.is_low) or (
                    n.reason in LOW_REASONS and not n.precision.is_low
                )
            if contradicts:
                n.detail = f"set to {n.precision.value} in the plan file (was {n.reason}: {n.detail})"
                n.reason = "user:plan"
                edited.append(n.name)
        return edited

    def reasons(self) -> dict[str, int]:
        """Count of nodes per reason code."""
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.reason] = out.get(n.reason, 0) + 1
        return dict(sorted(out.items()))

    # -- JSON -------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON form of the contract."""
        return {
            "schema_version": SCHEMA_VERSION,
            "mpinfer_version": self.mpinfer_version,
            "source": {"path": self.source_path, "sha256": self.source_sha256},
            "precision": self.precision.value,
            "numerics": self.numerics,
            "keep_io_types": self.keep_io_types,
            "opset": self.opset,
            "budget": self.budget,
            "calibration": self.calibration,
            "nodes": [n.to_dict() for n in self.nodes],
            "summary": self.summary,
        }

    def to_json(self) -> str:
        """Stable, indented JSON text (same plan → same bytes)."""
        # (json.dumps(indent=1, allow_nan=False, default=_default), the same bytes, 3x faster: core/jsontext.py)
        return dumps_indented(self.to_dict(), 1, _default) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write the plan atomically."""
        return write_text_atomic(path, self.to_json())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "plan") -> PrecisionPlan:
        """Parse the JSON form.

        Raises:
            InvalidInputError: For a malformed plan, naming the field.
        """
        if not isinstance(data, Mapping) or data.get("schema_version") != SCHEMA_VERSION:
            raise InvalidInputError(
                format_message(
                    f"Plan '{origin}'",
                    f"schema_version {data.get('schema_version') if isinstance(data, Mapping) else None}",
                    f"{SCHEMA_VERSION}",
                    "write plans with `mpinfer convert`",
                )
            )
        try:
            precision = Precision.parse(data["precision"])
            entries = data["nodes"]
            if not isinstance(entries, list) or not all(isinstance(n, Mapping) for n in entries):
                raise TypeError("'nodes' is not a list of node entries")
            nodes = [_node_from_dict(n, precision, origin) for n in entries]
            seen: dict[str, NodeDecision] = {}
            for n in nodes:
                if n.name in seen:
                    raise InvalidInputError(
                        format_message(
                            f"Plan '{origin}': node '{n.name}'",
                            f"two entries ({seen[n.name].precision.value} and {n.precision.value})",
                            "one entry per node",
                            "delete one of them",
                        )
                    )
                seen[n.name] = n
            src = data.get("source") or {}
            opset = data.get("opset")
            if opset is not None and (isinstance(opset, bool) or not isinstance(opset, int) or opset < 1):
                raise TypeError(f"opset {opset!r} is not a positive integer")
            return cls(
                source_path=str(src.get("path", "")),
                source_sha256=str(src.get("sha256", "")),
                precision=precision,
                numerics=str(data.get("numerics", "strict")),
                keep_io_types=bool(data.get("keep_io_types", True)),
                nodes=nodes,
                budget=data.get("budget"),
                calibration=data.get("calibration"),
                summary=dict(data.get("summary") or {}),
                mpinfer_version=str(data.get("mpinfer_version", "")),
                opset=opset,
            )
        except (KeyError, TypeError) as err:
            raise InvalidInputError(
                format_message(
                    f"Plan '{origin}'",
                    f"a missing or malformed field ({err})",
                    "the layout written by `mpinfer convert`",
                )
            ) from err

    @classmethod
    def load(cls, path: str | Path) -> PrecisionPlan:
        """Read a plan file.

        Raises:
            InvalidInputError: Unreadable, not JSON, or malformed.
        """
        data = read_json(path, "Plan", "a .plan.json written by `mpinfer convert`")
        return cls.from_dict(data, str(path))

    def check_matches(
        self, addresses: Sequence[str], sha256: str, origin: str, *, force: bool = False
    ) -> None:
        """Refuse a plan made for another model.

        Args:
            addresses: The model's node addresses in graph order.
            sha256: The model file's sha256.
            origin: The plan's path, for messages.
            force: Accept a sha256 mismatch when every node matches.

        Raises:
            InvalidInputError: Unknown or missing nodes, or a sha256 mismatch without ``force``.
        """
        known, listed = set(addresses), {n.name for n in self.nodes}
        unknown = [n.name for n in self.nodes if n.name not in known]
        missing = [a for a in addresses if a not in listed]
        if unknown or missing:
            detail = []
            if unknown:
                detail.append(f"{len(unknown)} nodes the model does not have (e.g. {unknown[:3]})")
            if missing:
                detail.append(f"{len(missing)} model nodes it does not list (e.g. {missing[:3]})")
            raise InvalidInputError(
                format_message(
                    f"Plan '{origin}'",
                    "a plan for another model: " + "; ".join(detail),
                    "a plan made for this model",
                    "re-plan without --plan, or pass the model the plan was made for",
                )
            )
        if self.source_sha256 and self.source_sha256 != sha256 and not force:
            raise InvalidInputError(
                format_message(
                    f"Plan '{origin}'",
                    f"a plan for a model with sha256 {self.source_sha256[:12]}...",
                    f"this model's sha256 {sha256[:12]}...",
                    "its node names match: pass --force to apply it anyway, or re-plan without --plan",
                )
            )


def _node_from_dict(d: Mapping[str, Any], precision: Precision, origin: str) -> NodeDecision:
    try:
        p = Precision.parse(d["precision"])
    except InvalidInputError as err:
        raise InvalidInputError(f"Plan '{origin}': node '{d.get('name')}': {err}") from err
    if p.is_low and p is not precision:
        raise InvalidInputError(
            format_message(
                f"Plan '{origin}': node '{d['name']}'",
                f"precision {p.value}",
                f"{precision.value} or fp32 (the plan's precision)",
                'edit the node\'s "precision" field',
            )
        )
    return NodeDecision(
        name=str(d["name"]),
        op_type=str(d["op_type"]),
        precision=p,
        reason=str(d.get("reason", "")),
        detail=str(d.get("detail", "")),
        stats=dict(d.get("stats") or {}),
    )


def _default(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, Precision):
        return obj.value
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")
