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

from mpinfer.memory import current_budget
from mpinfer.precision.core import GraphInfo
from mpinfer.precision.emulator import (
    CastGraph,
    CastGraphSession,
    StrictModelRunner,
    cast_graph,
    is_low_float,
    may_qualify,
)
from mpinfer.precision.graph import apply_plan
from mpinfer.precision.numerics.partial import FP32Tensors, PartialGraph, partial_graph
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

# The emulator judges a candidate whose incremental run recomputes under this share of the nodes of whole runs; the
# cast graph (a whole ONNX Runtime run, plus its build and session) judges the rest. Measured on DNSMOS, Basic Pitch
# and the synthetic chains: a cast graph's build and run cost about what the emulator spends recomputing half a graph.
EMULATOR_BELOW = 0.5
# Partial runs (:mod:`.partial`: from the second candidate on, only what a candidate's low nodes change, fed the FP32
# cast graph's kept tensors). Off: measured on Basic Pitch, DNSMOS and the OCR recognizer they save nothing (bench/
# RESULTS.md, "Issue 37, searches that reuse"): the search's runs are mostly row subsets (screening, staged runs) that
# fall past the kept samples or read tensors without a sample axis, and where they apply (Basic Pitch) the changed
# nodes hold most of the time, so the FP32 run that keeps the tensors costs what the partial runs save.
PARTIAL_RUNS = False


@dataclass
class EngineCounts:
    """Candidates (full runs) and screening runs each engine judged, for the search's cost record."""

    cast_graph: int = 0
    emulator: int = 0
    cast_graph_screens: int = 0
    emulator_screens: int = 0
    refused: int = 0  # candidates the cast graph refused (the emulator judged them)
    partial: int = 0  # candidates with a partial graph (they run only what their low nodes change)
    nodes_run: int = 0  # the partial graphs' nodes, and their whole cast graphs' (the share a partial run computes)
    nodes_whole: int = 0

    def record(self) -> dict[str, int | float]:
        """The counts under the search cost record's keys."""
        return {
            "cast_graph_candidates": self.cast_graph,
            "emulator_candidates": self.emulator,
            "cast_graph_screens": self.cast_graph_screens,
            "emulator_screens": self.emulator_screens,
            "cast_graph_refused": self.refused,
            "cast_graph_partial": self.partial,
            **({"partial_nodes_share": round(self.nodes_run / self.nodes_whole, 3)} if self.nodes_whole else {}),
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
    _fp32: FP32Tensors | None = None  # the kept FP32 tensors (keep_fp32; see _fp32_asked)
    _fp32_asked: bool = False

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

    def keep_fp32(self, batches: list[Any]) -> None:
        """Keep every tensor of the FP32 model's cast graph on ``batches`` (the leading search batches).

        Only while they fit the memory budget's ``search`` slice; later candidates' runs of them are partial
        (:mod:`.partial`). Made once (a later call does nothing); nothing is kept when the FP32 model has no cast graph.
        """
        if self._fp32_asked:
            return
        self._fp32_asked = True
        fp32 = apply_plan(self.model, self.info, dict.fromkeys(self.info.by_address, Precision.FP32), self.precision,
                          keep_io_types=self.keep_io_types)
        built, why = cast_graph(fp32.model)
        if built is None:
            logger.debug("partial runs: none (the FP32 model has no cast graph: %s)", why)
            return
        try:
            tensors = FP32Tensors(built, batches, current_budget().search)
        except Exception as err:  # onnxruntime's own types: the whole cast graphs run, as before
            logger.debug("partial runs: none (the FP32 cast graph failed: %s)", err)
            return
        self._fp32 = tensors if tensors.batches else None

    def session(self, low: Mapping[str, Precision]) -> JudgedGraph | None:
        """The cast graph of the candidate ``low``, ready to run (kept for its next runs); None when refused.

        With the FP32 tensors kept (:meth:`keep_fp32`), the candidate's partial graph runs the batches and samples
        they hold; its whole cast graph's session is then opened only for what they do not hold.
        """
        key = _key(low)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        self._last = None  # (the last candidate's session and model go before this one's are made)
        precisions = {a: low.get(a, Precision.FP32) for a in self.info.by_address}
        applied = apply_plan(self.model, self.info, precisions, self.precision, keep_io_types=self.keep_io_types)
        built, why = cast_graph(applied.model)
        judged = None
        if built is not None:
            fp32 = self._fp32
            judged = JudgedGraph(applied.model, built, None if fp32 is None else partial_graph(built, fp32), fp32)
            if judged.partial is None:
                why = judged.open()
                judged = judged if not why else None
            else:
                self.counts.partial += 1
                self.counts.nodes_run += judged.partial.changed
                self.counts.nodes_whole += judged.partial.total
        if judged is None:
            logger.debug("search: the emulator judges this candidate (no cast graph: %s)", why)
            self._refused.append(key)
            self.counts.refused += 1
        self._last = key, judged
        return judged

    def run(
        self, judged: JudgedGraph, feeds: Mapping[str, np.ndarray], *, batch: int | None = None,
        rows: np.ndarray | None = None,
    ) -> dict[str, np.ndarray]:
        """``judged`` on ``feeds``, low outputs widened to float32 as the FP32 model gives them.

        ``batch``: the search batch ``feeds`` is; ``rows``: the samples of the joined search batches it holds (either
        lets a partial graph run it from the kept FP32 tensors). Raises whatever ONNX Runtime raises on data it
        refuses (the caller's emulator then judges).
        """
        return {k: v.astype(np.float32) if is_low_float(v) else v for k, v in judged(feeds, batch, rows).items()}

    def each(
        self, judged: JudgedGraph, batches: list[Any], fallback: Callable[[Any], dict[str, np.ndarray]]
    ) -> Iterator[dict[str, np.ndarray]]:
        """The candidate's outputs on each search batch through ``judged`` (``fallback(batch)`` where ORT fails)."""
        for index, batch in enumerate(batches):
            try:
                out = self.run(judged, batch, batch=index)
            except Exception as err:  # onnxruntime's own types: data it refuses; the emulator decides (and names it)
                logger.debug("search: the cast graph failed (%s); the emulator runs this batch", err)
                out = fallback(batch)
            yield out


class JudgedGraph:
    """A candidate as the search judges it on ONNX Runtime: the model as applied, and its cast graph.

    Args:
        model: The converted ``onnx.ModelProto`` (:func:`~mpinfer.precision.graph.apply_plan` of the candidate).
        built: Its cast graph.
        partial: Its partial graph against the kept FP32 tensors (None: whole runs only).
        fp32: Those tensors.
    """

    def __init__(self, model: Any, built: CastGraph, partial: PartialGraph | None, fp32: FP32Tensors | None) -> None:
        self.model, self.built, self.partial, self.fp32 = model, built, partial, fp32
        self._session: CastGraphSession | None = None

    def open(self) -> str:
        """Open the whole cast graph's session (once); the reason when ONNX Runtime refuses it, else ''."""
        if self._session is None:
            try:
                self._session = CastGraphSession(self.built)
            except Exception as err:  # onnxruntime raises its own types: an attribute set or shape it refuses
                return f"ONNX Runtime refused the cast graph ({type(err).__name__}: {err})"
        return ""

    def __call__(
        self, feeds: Mapping[str, np.ndarray], batch: int | None = None, rows: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        """The outputs on ``feeds`` (search batch ``batch``, or the samples ``rows`` of the joined search batches).

        The partial graph's where the kept FP32 tensors hold them, else the whole cast graph's.
        """
        part, fp32 = self.partial, self.fp32
        if part is not None and fp32 is not None:
            kept = None
            if batch is not None and batch < len(fp32.batches):
                kept = fp32.batches[batch]
            elif rows is not None:
                kept = fp32.rows(part.cut + part.taken, rows)
            if kept is not None:
                return part.run(kept)
        why = self.open()
        if why:
            raise RuntimeError(why)
        assert self._session is not None
        return self._session(feeds)

    def runner(self) -> StrictModelRunner:
        """The final verification's runner of ``model`` on this cast graph (no second build)."""
        from mpinfer.precision.numerics.strict import emulator_runner

        self.open()
        return StrictModelRunner(self.model, emulator_runner, session=self._session)


def _key(low: Mapping[str, Precision]) -> frozenset:
    return frozenset((a, p) for a, p in low.items() if p is not Precision.FP32)
