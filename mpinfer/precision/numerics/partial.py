"""Partial cast-graph runs: a candidate recomputes only what its low nodes change, fed FP32 tensors at the cut.

A candidate's cast graph (:mod:`~mpinfer.precision.emulator.castgraph`) holds, upstream of and beside its low nodes,
the very nodes of the FP32 model's cast graph: same op, attributes, inputs and weights, computed by the same ONNX
Runtime kernels (every graph optimisation off). Their outputs are therefore the FP32 cast graph's, bit for bit. A
candidate's *partial graph* keeps only the other nodes (the *changed* ones: a node that differs from the FP32 cast
graph's, or reads a tensor a changed node makes) and takes the tensors they read from unchanged nodes (the *cut*) from
one run of the FP32 cast graph that kept every tensor (:class:`FP32Tensors`). Its outputs are those of the whole cast
graph, bit for bit (``tests/precision/test_partial_runs.py``), at the cost of the changed nodes alone.

The FP32 tensors are computed by the cast graph itself, not taken from calibration: calibration's ONNX Runtime session
runs with its graph optimisations on (a Conv on the NCHWc kernel lands on other bits), and the partial runs must give
the whole run's bits.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpinfer.precision.emulator.castgraph import CastGraph, graph_reads, plain_session

logger = logging.getLogger(__name__)

Outputs = dict[str, np.ndarray]
_ROWS = "\x00rows"  # (a kept batch's sample count, under a name no tensor has)


class FP32Tensors:
    """Every tensor of the FP32 model's cast graph on the leading search batches (one dict per batch).

    Args:
        fp32: The FP32 model's cast graph.
        batches: The search batches whose tensors to keep (the leading ones, while they fit ``limit`` bytes).
        limit: Bytes the kept tensors may hold (the memory budget's ``search`` slice).
    """

    def __init__(self, fp32: CastGraph, batches: Sequence[Mapping[str, np.ndarray]], limit: int) -> None:
        from onnx import helper

        self.graph = fp32
        model = fp32.model
        names = [o for n in model.graph.node for o in n.output if o]
        every = helper.make_graph(list(model.graph.node), "fp32", list(model.graph.input),
                                  [helper.make_empty_tensor_value_info(n) for n in names],
                                  list(model.graph.initializer))
        full = helper.make_model(every, opset_imports=list(model.opset_import))
        full.ir_version = model.ir_version
        sess = self._sess = plain_session(full)
        self._names = names
        self.batches: list[Outputs] = []
        held = 0
        for batch in batches:
            fed = _fed(fp32, batch)
            values = dict(zip(names, sess.run(names, fed), strict=True))
            values.update(fed)
            values[_ROWS] = np.asarray(min(len(v) for v in fed.values() if np.ndim(v)))
            size = sum(v.nbytes for v in values.values() if isinstance(v, np.ndarray))
            if held + size > limit:
                break
            held += size
            self.batches.append(values)
        self.bytes = held
        self._sample_axis: set[str] | None = None
        self._shared: set[str] = set()
        logger.debug("partial runs: FP32 tensors of %d search batch(es) kept (%.0f MB)", len(self.batches), held / 1e6)

    def rows(self, names: Sequence[str], rows: np.ndarray) -> Outputs | None:
        """``names`` at the samples ``rows`` of the kept batches joined.

        None: a row past them, or a tensor whose axis 0 is not the samples'.
        """
        sizes = [_rows(b) for b in self.batches]
        if not self.batches or rows.size == 0 or int(rows.max()) >= sum(sizes):
            return None
        samples, shared = self._samples()
        if not set(names) <= samples | shared:
            return None
        first = self.batches[0]
        out = {n: first[n] for n in names if n in shared}
        if len(self.batches) == 1:
            out.update({n: first[n][rows] for n in names if n not in shared})
        else:
            out.update({n: np.concatenate([b[n] for b in self.batches])[rows] for n in names if n not in shared})
        return out

    def _samples(self) -> tuple[set[str], set[str]]:
        """Tensors whose axis 0 holds the samples, and those the samples do not change (found once).

        By one run of the first batch's first sample: a tensor with one row there, and the other axes as on every
        kept batch, whose rows it holds, holds the samples; one with the same shape and bits there as on every kept
        batch (weights made by nodes, shapes) is shared by all samples.
        """
        if self._sample_axis is None:
            self._sample_axis, self._shared = set(), set()
            first, rows = self.batches[0], _rows(self.batches[0])
            if rows > 1:
                inputs = [vi.name for vi in self.graph.model.graph.input]
                one = dict(zip(self._names, self._sess.run(self._names, {k: first[k][:1] for k in inputs}),
                               strict=True))
                one.update({k: first[k][:1] for k in inputs})
                for n, v in one.items():
                    if not isinstance(v, np.ndarray):
                        continue
                    if all(v.shape == np.shape(b[n]) and v.dtype == b[n].dtype and v.tobytes() == b[n].tobytes()
                           for b in self.batches):
                        self._shared.add(n)
                    elif v.ndim and len(v) == 1 and all(
                        np.ndim(b[n]) == v.ndim and len(b[n]) == _rows(b) and np.shape(b[n])[1:] == v.shape[1:]
                        for b in self.batches
                    ):
                        self._sample_axis.add(n)
        return self._sample_axis, self._shared


def _rows(batch: Outputs) -> int:
    """Samples in a kept batch: the rows of its graph inputs (the search's batches hold them on axis 0)."""
    return int(batch[_ROWS])


def _fed(graph: CastGraph, feeds: Mapping[str, np.ndarray]) -> Outputs:
    """Feeds as the cast graph takes them (FP16/BF16 inputs rounded, as CastGraphSession feeds them)."""
    low = graph.low_inputs
    return {k: np.asarray(v).astype(low[k]).astype(np.float32) if k in low else v for k, v in feeds.items()}


@dataclass(frozen=True)
class PartialGraph:
    """The changed nodes of a candidate's cast graph, and what they read from the FP32 tensors.

    Attributes:
        changed: Nodes kept (those that differ from the FP32 cast graph's, or read what those make).
        total: Nodes of the candidate's cast graph.
        cut: Tensors the kept nodes read from unchanged nodes or the graph inputs (fed from :class:`FP32Tensors`).
        taken: Graph outputs an unchanged node makes (taken from the FP32 tensors as they are).
    """

    built: CastGraph
    session: Any
    changed: int
    total: int
    cut: tuple[str, ...]
    taken: tuple[str, ...]

    def run(self, kept: Outputs) -> Outputs:
        """The candidate's outputs, fed ``kept`` (the cut and taken tensors of the samples to run)."""
        names = [o.name for o in self.built.model.graph.output]
        ran = set(names) - set(self.taken)
        order = [n for n in names if n in ran]
        values = dict(zip(order, self.session.run(order, {n: kept[n] for n in self.cut}), strict=True))
        values.update({n: kept[n] for n in self.taken})
        low = self.built.low_outputs
        return {n: values[n].astype(low[n]) if n in low else values[n] for n in names}


def partial_graph(built: CastGraph, fp32: FP32Tensors) -> PartialGraph | None:
    """The candidate's partial graph against the FP32 cast graph; None when no node stays unchanged (or ORT refuses).

    A node is unchanged when the FP32 cast graph holds an equal node (name, op, attributes, inputs, outputs) and
    every tensor it reads (its bodies' outer reads included) is a graph input, an equal initializer, or an
    unchanged node's output.
    """
    from onnx import helper

    model, base = built.model, fp32.graph.model
    same_nodes = {n.name: n for n in base.graph.node}
    base_inits = {t.name: t for t in base.graph.initializer}
    inits = {t.name: t for t in built.model.graph.initializer}
    clean = {vi.name for vi in model.graph.input}  # (fed as the FP32 tensors were: low ones rounded alike)
    kept, equal_inits = [], {}
    for node in model.graph.node:
        reads = graph_reads(node)
        twin = same_nodes.get(node.name)
        ok = twin is not None and twin == node
        for name in reads:
            if not ok:
                break
            if name in inits:
                if name not in equal_inits:
                    equal_inits[name] = name in base_inits and base_inits[name] == inits[name]
                ok = equal_inits[name]
            else:
                ok = name in clean
        if ok:
            clean.update(o for o in node.output if o)
        else:
            kept.append(node)
    if len(kept) == len(model.graph.node):
        return None
    made = {o for n in kept for o in n.output if o}
    reads = [r for n in kept for r in graph_reads(n)]
    cut = tuple(dict.fromkeys(r for r in reads if r not in made and r not in inits))
    outputs = [vi for vi in model.graph.output if vi.name in made]
    taken = tuple(vi.name for vi in model.graph.output if vi.name not in made)
    first = fp32.batches[0]
    if any(not isinstance(first.get(c), np.ndarray) for c in cut):
        return None
    types = {c: helper.np_dtype_to_tensor_dtype(first[c].dtype) for c in cut}
    graph = helper.make_graph(
        kept, "partial", [helper.make_tensor_value_info(c, types[c], None) for c in cut], outputs,
        [inits[r] for r in dict.fromkeys(reads) if r in inits],
    )
    sub = helper.make_model(graph, opset_imports=list(model.opset_import))
    sub.ir_version = model.ir_version
    try:
        session = plain_session(sub) if outputs else None
    except Exception as err:  # onnxruntime's own types: the whole cast graph runs instead
        logger.debug("partial runs: ONNX Runtime refused a partial graph (%s)", err)
        return None
    return PartialGraph(built, session, len(kept), len(model.graph.node), cut, taken)
