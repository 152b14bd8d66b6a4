"""Strict candidates judged on ONNX Runtime as cast graphs, where they qualify and it is cheaper than the emulator.

A candidate's cast graph (:mod:`~mpinfer.precision.emulator.castgraph`: a float32 graph with rounding Cast pairs)
computes its low nodes bit for bit as the strict emulator does, and its FP32 nodes with ONNX Runtime's float32
kernels: exactly what the final verification runs for a model that qualifies. :class:`CastJudge` picks, for each
candidate, the cast graph or the emulator's incremental run from kept runs by the nodes the emulator would recompute
(:data:`EMULATOR_BELOW`; counts, not seconds, so the plan does not follow the machine's load), and remembers the
plans ONNX Runtime refused (a larger plan holding one of them is refused too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpinfer.precision.core import GraphInfo
from mpinfer.precision.emulator import (
    CastGraphSession,
    StrictModelRunner,
    is_low_float,
    may_qualify,
    open_cast_session,
)
from mpinfer.precision.graph import apply_plan
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

# The emulator judges a candidate whose incremental run recomputes under this share of the nodes of whole runs; the
# cast graph (a whole ONNX Runtime run, plus its build and session) judges the rest. Measured on DNSMOS, Basic Pitch
# and the synthetic chains: a cast graph's build and run cost about what the emulator spends recomputing half a graph.
EMULATOR_BELOW = 0.5


@dataclass
class EngineCounts:
    """Candidates (full runs) and screening runs each engine judged, for the search's cost record."""

    cast_graph: int = 0
    emulator: int = 0
    cast_graph_screens: int = 0
    emulator_screens: int = 0
    refused: int = 0  # candidates the cast graph refused (the emulator judged them)

    def record(self) -> dict[str, int]:
        """The counts under the search cost record's keys."""
        return {
            "cast_graph_candidates": self.cast_graph,
            "emulator_candidates": self.emulator,
            "cast_graph_screens": self.cast_graph_screens,
            "emulator_screens": self.emulator_screens,
            "cast_graph_refused": self.refused,
        }


@dataclass
class CastJudge:
    """The cast graphs of a search's candidates: chosen per candidate, sessions kept for the last candidate.

    Args:
        model: The FP32 model (weights in the proto: a model with external weights never qualifies).
        info: Its graph.
        precision: The low precision.
        keep_io_types: As the converted model keeps them.
    """

    model: Any
    info: GraphInfo
    precision: Precision
    keep_io_types: bool = True
    counts: EngineCounts = field(default_factory=EngineCounts)
    _refused: list[frozenset[str]] = field(default_factory=list)
    _last: tuple[frozenset, JudgedGraph | None] | None = None  # (candidate key, its cast graph or None: refused)

    def prefers(self, low: Mapping[str, Precision], emulator_evaluations: int | None, whole: int) -> bool:
        """Whether the cast graph should judge ``low`` (it may still refuse).

        ``emulator_evaluations``: node evaluations the emulator's run would cost (None: unknown, e.g. its FP32
        runs are not made yet; those alone cost a whole run, more than the cast graph); ``whole``: those of whole
        runs of the batches. The cast graph judges unless the emulator would recompute under
        :data:`EMULATOR_BELOW` of every node. The choice is made on these counts alone, never on measured seconds:
        the two engines compute FP32 nodes a float32 rounding apart, so a choice that followed the machine's load
        could judge a candidate at the budget's edge one way on one run and the other way on the next (the plan
        would not be reproducible).
        """
        key = _key(low)
        if self._last is not None and self._last[0] == key:
            return self._last[1] is not None
        if not may_qualify((self.info.by_address[a].node.op_type for a in low), self.model):
            return False
        if any(r <= key for r in self._refused):
            return False
        if emulator_evaluations is None:
            return True
        return emulator_evaluations >= EMULATOR_BELOW * whole

    def session(self, low: Mapping[str, Precision]) -> JudgedGraph | None:
        """The cast graph of the candidate ``low``, its session open (kept for its next runs); None when refused."""
        key = _key(low)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        self._last = None  # (the last candidate's session and model go before this one's are made)
        precisions = {a: low.get(a, Precision.FP32) for a in self.info.by_address}
        applied = apply_plan(self.model, self.info, precisions, self.precision, keep_io_types=self.keep_io_types)
        sess, why = open_cast_session(applied.model)
        if sess is None:
            logger.debug("search: the emulator judges this candidate (no cast graph: %s)", why)
            self._refused.append(key)
            self.counts.refused += 1
        self._last = key, None if sess is None else JudgedGraph(precisions, applied, sess)
        return self._last[1]

    def run(self, judged: JudgedGraph, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``judged``'s session on one batch ``feeds``, low outputs widened to float32 as the FP32 model gives them.

        Raises whatever ONNX Runtime raises on data it refuses (the caller's emulator then judges).
        """
        return {k: v.astype(np.float32) if is_low_float(v) else v for k, v in judged.session(feeds).items()}

    def each(
        self, judged: JudgedGraph, batches: list[Any], fallback: Callable[[Any], dict[str, np.ndarray]]
    ) -> Iterator[dict[str, np.ndarray]]:
        """The candidate's outputs on each batch through ``judged``; ``fallback(batch)`` where ONNX Runtime fails."""
        for batch in batches:
            try:
                out = self.run(judged, batch)
            except Exception as err:  # onnxruntime's own types: data it refuses; the emulator decides (and names it)
                logger.debug("search: the cast graph failed (%s); the emulator runs this batch", err)
                out = fallback(batch)
            yield out


@dataclass(frozen=True)
class JudgedGraph:
    """A candidate as the search judged it on ONNX Runtime: the model as applied, and its cast graph's session.

    Attributes:
        precisions: Every node's precision (address -> precision).
        applied: The :class:`~mpinfer.precision.graph.ApplyResult` of ``precisions`` (the model as it will be written).
        session: The session of its cast graph (:class:`~mpinfer.precision.emulator.castgraph.CastGraphSession`).
    """

    precisions: dict[str, Precision]
    applied: Any
    session: CastGraphSession

    @property
    def model(self) -> Any:
        """The converted ``onnx.ModelProto``."""
        return self.applied.model

    def runner(self, fallback: Callable[[Any], Any]) -> StrictModelRunner:
        """The final verification's runner of ``model`` on this session (no second build).

        ``fallback``: ``model -> Runner``, what runs it where ONNX Runtime refuses a batch (the strict emulator).
        """
        return StrictModelRunner(self.model, fallback, session=self.session)


def _key(low: Mapping[str, Precision]) -> frozenset:
    return frozenset((a, p) for a, p in low.items() if p is not Precision.FP32)
