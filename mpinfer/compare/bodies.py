"""Body coverage for the divergence: the tensors inside If/Loop/Scan bodies.

onnxruntime can only return main-graph tensors, so body tensors come from the strict emulator: the baseline runs in FP32
and the candidate with each node in its input dtype (``follow_input_dtypes``), on the same batches. An ``observe``
callback sees every body tensor under its qualified name (``If_3/then_branch/`` + name). Per batch the baseline's
observations are held (at most the memory budget's ``body`` slice, :mod:`mpinfer.memory`) and each is paired with the
candidate's observation of the same name and occurrence (a Loop body tensor is seen once per iteration), then freed;
only the running sums of :class:`~mpinfer.compare.tensoracc.TensorAcc` are kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpinfer.compare.tensoracc import SKIP_OPS, TensorAcc
from mpinfer.errors import BackendUnavailableError
from mpinfer.memory import current_budget
from mpinfer.precision.emulator import GraphEmulator, is_float

logger = logging.getLogger(__name__)



@dataclass
class BodyCoverage:
    """Per qualified body tensor name, the accumulated error; plus what was not compared and why."""

    accs: dict[str, TensorAcc] = field(default_factory=dict)
    not_float: set[str] = field(default_factory=set)
    skipped: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def body_graphs(graph: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(prefix, body)`` for every If/Loop/Scan body under ``graph``, depth first (the emulator's prefixes)."""
    import onnx

    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                inner = f"{prefix}{node.name}/{attr.name}/"
                yield inner, attr.g
                yield from body_graphs(attr.g, inner)


def _body_tensors(model: Any, *, skip_ops: bool) -> list[str]:
    names: list[str] = []
    for prefix, g in body_graphs(model.graph):
        names += [prefix + i.name for i in g.input]
        names += [prefix + o for n in g.node if not (skip_ops and n.op_type in SKIP_OPS) for o in n.output if o]
    return names


class _Pairing:
    """One batch: hold the baseline's observations, then compare the candidate's against them."""

    def __init__(self, names: set[str], accs: dict[str, TensorAcc], not_float: set[str]) -> None:
        self.names, self.accs, self.not_float = names, accs, not_float
        self.held: dict[str, list[Any]] = {}
        self.seen: dict[str, int] = {}
        self.nbytes = 0
        self.dropped = 0
        self.limit = current_budget().body

    def observe_baseline(self, prefix: str, name: str, value: Any) -> None:
        key = prefix + name
        if not prefix or key not in self.names:
            return
        if not is_float(value):
            self.not_float.add(key)  # booleans, indices, sequences: nothing to compare
            return
        # held until the candidate's run pairs them: bounds Loops with many iterations; past it, not compared
        if self.nbytes + value.nbytes > self.limit:
            self.dropped += 1
            self.held.setdefault(key, []).append(None)  # keeps the occurrence count; never compared
            return
        self.nbytes += value.nbytes
        self.held.setdefault(key, []).append(value)

    def observe_candidate(self, prefix: str, name: str, value: Any) -> None:
        key = prefix + name
        if not prefix or key not in self.names or not is_float(value):
            return
        index = self.seen.get(key, 0)
        self.seen[key] = index + 1
        held = self.held.get(key, [])
        if index >= len(held):  # more occurrences than the baseline: a different trip count or branch
            self.accs[key].mismatch(str(value.dtype))
            return
        b, held[index] = held[index], None
        if b is not None:
            self.nbytes -= b.nbytes
            self.accs[key].update(b, value)

    def finish(self) -> None:
        for key, held in self.held.items():  # fewer occurrences in the candidate than in the baseline
            if self.seen.get(key, 0) < len(held):
                self.accs[key].mismatch("float32")
        self.held.clear()


def measure_body_tensors(
    base: Any, cand: Any, batches: Sequence[Mapping[str, np.ndarray]], dirs: tuple[str, str] = ("", "")
) -> BodyCoverage:
    """Accumulate the error of every body tensor both models share, over the batches (and Loop iterations).

    Args:
        base: The FP32 model (nodes named).
        cand: The converted model (same node and tensor names).
        batches: The divergence batches.
        dirs: The folders of the two models' external weights (memory-mapped per node).

    Returns:
        The accumulated errors by qualified name (``Loop_2/body/Add_1_out``), what was not compared and why.
    """
    cov = BodyCoverage()
    base_names = _body_tensors(base, skip_ops=True)
    if not base_names:
        return cov
    cand_names = set(_body_tensors(cand, skip_ops=False))
    shared = [n for n in base_names if n in cand_names]
    base_all = set(_body_tensors(base, skip_ops=False))
    cov.skipped = {
        "candidate_only_tensors": len(cand_names - base_all),
        "baseline_only_tensors": len(base_names) - len(shared),
    }
    eb = GraphEmulator(base, base_dir=dirs[0])
    ec = GraphEmulator(cand, follow_input_dtypes=True, base_dir=dirs[1])
    unsupported = sorted(eb.unsupported_ops() | ec.unsupported_ops())
    if unsupported:
        cov.notes.append(_skip_note(f"the strict emulator cannot run {', '.join(unsupported)}"))
        return cov
    t0 = time.perf_counter()
    logger.info("divergence: %d body tensors through the strict emulator", len(shared))
    accs = {n: TensorAcc() for n in shared}
    names, dropped = set(shared), 0
    try:
        for feeds in batches:
            pairing = _Pairing(names, accs, cov.not_float)
            eb.run(feeds, observe=pairing.observe_baseline)
            ec.run(feeds, observe=pairing.observe_candidate)
            pairing.finish()
            dropped += pairing.dropped
    except BackendUnavailableError as err:
        cov.notes.append(_skip_note(str(err)))
        return cov
    cov.accs = {n: a for n, a in accs.items() if a.dtype}
    cov.skipped["body_values_over_memory_limit"] = dropped
    cov.notes.append(
        f"{len(cov.accs)} tensor(s) inside If/Loop/Scan bodies were compared in the strict emulator "
        "(baseline FP32, candidate in its own dtypes), accumulated over Loop/Scan iterations."
    )
    logger.info("divergence: body tensors done in %.1f s", time.perf_counter() - t0)
    return cov


def _skip_note(why: str) -> str:
    why = why.rstrip(".")
    return f"Nodes inside If/Loop/Scan bodies were not compared (only the strict emulator sees them): {why}."
