"""Where it went wrong: per-node error along the graph, and the first node where the error jumps.

The converter keeps tensor and node names, so the baseline and an ONNX candidate share their intermediate
tensors by name (Cast-inserted tensors exist only in the candidate and are skipped). Both models are run in
onnxruntime with those tensors added as graph outputs, :data:`CHUNK_SIZE` tensors at a time, on a few
batches; per tensor only running sums are kept (never all intermediates of all batches).

A tensor's error is its relative L2 error ``||c - b|| / ||b||`` over the batches (infinite when the candidate
has NaN/Inf where the baseline is finite). A node *adds* ``error(output) - error(inputs)``; the first node in
graph order whose output error is at least :data:`JUMP_MIN_ERROR` and :data:`JUMP_FACTOR` times its inputs'
error is where the error jumps.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.compare.result import Divergence, NodeError

logger = logging.getLogger(__name__)

# Intermediate tensors fetched per onnxruntime session: bounds the memory of one batch's extra outputs.
CHUNK_SIZE = 64
# The strict emulator recomputes the whole graph per chunk, so it takes bigger chunks (one batch's tensors).
STRICT_CHUNK_SIZE = 512
# A node's output relative error must reach 1 % to count as a jump (FP16 rounding alone gives ~1e-3).
JUMP_MIN_ERROR = 1e-2
# ... and be at least 10x the error already present in its inputs.
JUMP_FACTOR = 10.0
# Nodes listed in the ranking (largest added error first).
RANK_TOP = 10
# Ops whose outputs carry no numeric error worth ranking (shape plumbing, constants).
_SKIP_OPS = {"Constant", "Shape", "Size", "ConstantOfShape", "NonZero"}


class _TensorAcc:
    __slots__ = ("sum_d2", "sum_b2", "max_abs", "nonfinite", "dtype")

    def __init__(self) -> None:
        self.sum_d2 = self.sum_b2 = self.max_abs = 0.0
        self.nonfinite = 0
        self.dtype = ""

    def update(self, b: np.ndarray, c: np.ndarray) -> None:
        self.dtype = str(c.dtype)
        b64, c64 = np.asarray(b, np.float64), np.asarray(c, np.float64)
        if b64.shape != c64.shape:
            self.nonfinite += 1  # a shape change is as wrong as NaN; counted, never compared
            return
        fb, fc = np.isfinite(b64), np.isfinite(c64)
        self.nonfinite += int(np.count_nonzero(fb & ~fc))
        both = fb & fc
        d = c64[both] - b64[both]
        self.sum_d2 += float(np.dot(d, d))
        self.sum_b2 += float(np.dot(b64[both], b64[both]))
        if d.size:
            self.max_abs = max(self.max_abs, float(np.abs(d).max()))

    @property
    def error(self) -> float:
        if self.nonfinite:
            return math.inf
        if self.sum_d2 == 0:
            return 0.0
        return math.sqrt(self.sum_d2 / max(self.sum_b2, 1e-30))


def _precision_of(dtype: str) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}.get(
        dtype, dtype or "?"
    )


def _shared_tensors(base: Any, cand: Any) -> tuple[list[str], dict[str, int]]:
    from mpinfer.modelio import iter_nodes

    cand_main = {o for n in cand.graph.node for o in n.output if o}
    base_main = [o for n in base.graph.node if n.op_type not in _SKIP_OPS for o in n.output if o]
    inputs = {i.name for i in base.graph.input}
    shared = [t for t in base_main if t in cand_main and t not in inputs]
    base_all = {o for n in base.graph.node for o in n.output}
    skipped = {
        "subgraph_nodes": sum(1 for r in iter_nodes(base.graph) if r.depth > 0),
        "candidate_only_tensors": len(cand_main - base_all),
        "baseline_only_tensors": len([t for t in base_main if t not in cand_main]),
    }
    return shared, skipped


def _with_outputs(model: Any, names: Sequence[str]) -> Any:
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in have)
    return m


def _candidate_fetcher(cand: Any, chunk: list[str], providers: list[str], strict: bool) -> Any:
    """A function feeds -> candidate arrays of ``chunk`` (onnxruntime, or the strict emulator)."""
    from mpinfer.modelio import ort_session

    if strict:
        from mpinfer.precision.emulate import GraphEmulator

        emu = GraphEmulator(cand, follow_input_dtypes=True)
        keep = set(chunk)

        def run_strict(feeds: Mapping[str, np.ndarray]) -> list[Any]:
            tensors = emu.run(feeds, keep=keep).tensors
            return [tensors.get(n) for n in chunk]

        return run_strict
    session: Any = ort_session(_with_outputs(cand, chunk), providers)
    return lambda feeds: session.run(chunk, dict(feeds))


def measure_tensors(
    base: Any,
    cand: Any,
    names: Sequence[str],
    batches: Sequence[Mapping[str, np.ndarray]],
    providers: list[str],
    *,
    strict: bool = False,
    show_progress: bool = False,
) -> dict[str, _TensorAcc]:
    """Run both models with ``names`` as extra outputs, chunk by chunk, and accumulate per-tensor error.

    The baseline always runs in onnxruntime (FP32); the candidate in onnxruntime or, with ``strict``, in the
    strict FP16/BF16 emulator (which keeps only the chunk's tensors).
    """
    from mpinfer.modelio import ort_session
    from mpinfer.progress import progress_bar

    accs = {n: _TensorAcc() for n in names}
    size = STRICT_CHUNK_SIZE if strict else CHUNK_SIZE
    chunks = [list(names[i : i + size]) for i in range(0, len(names), size)]
    with progress_bar(enabled=show_progress) as progress:
        task = progress.add_task("divergence: intermediate tensors", total=len(chunks) * len(batches))
        for chunk in chunks:
            sb: Any = ort_session(_with_outputs(base, chunk), providers)
            fetch = _candidate_fetcher(cand, chunk, providers, strict)
            for feeds in batches:
                rb = sb.run(chunk, dict(feeds))
                rc = fetch(feeds)
                for n, b, c in zip(chunk, rb, rc, strict=True):
                    if c is None:
                        continue
                    if np.asarray(b).dtype.kind == "f" and np.asarray(c).dtype.kind == "f":
                        accs[n].update(b, c)
                progress.advance(task)
            del sb, fetch
    return {n: a for n, a in accs.items() if a.dtype}


def rank_nodes(
    base: Any, accs: Mapping[str, _TensorAcc], plan_nodes: Mapping[str, Mapping[str, Any]]
) -> list[NodeError]:
    """Per-node output error, input error and added error, in the baseline's graph order."""
    eff: dict[str, float] = {}  # effective error of every tensor (measured, or inherited from producers)
    nodes: list[NodeError] = []
    for node in base.graph.node:
        in_err = max((eff.get(t, 0.0) for t in node.input if t), default=0.0)
        measured = [(accs[o].error, o) for o in node.output if o in accs]
        for o in node.output:
            eff[o] = accs[o].error if o in accs else in_err
        if not measured or node.op_type in _SKIP_OPS:
            continue
        err, out = max(measured, key=lambda x: x[0])
        acc = accs[out]
        plan = plan_nodes.get(node.name, {})
        added = err - in_err if math.isfinite(err) or math.isfinite(in_err) else 0.0
        nodes.append(
            NodeError(
                address=node.name,
                op_type=node.op_type,
                precision=str(plan.get("precision") or _precision_of(acc.dtype)),
                output=out,
                error=err,
                input_error=in_err,
                added=added if not math.isnan(added) else 0.0,
                max_abs=acc.max_abs if not acc.nonfinite else math.inf,
                nonfinite=acc.nonfinite,
                reason=plan.get("reason"),
                detail=plan.get("detail"),
            )
        )
    return nodes


def first_jump(nodes: Sequence[NodeError]) -> NodeError | None:
    """The first node whose output error is >= JUMP_MIN_ERROR and >= JUMP_FACTOR x its inputs' error."""
    for n in nodes:
        if math.isinf(n.input_error):
            continue
        if n.error >= JUMP_MIN_ERROR and n.error >= JUMP_FACTOR * n.input_error:
            return n
    return None


def load_plan_nodes(candidate: str | Path) -> dict[str, dict[str, Any]]:
    """Nodes of the plan file next to an ONNX candidate (``<stem>.plan.json``), by address; {} when absent."""
    import json

    path = Path(str(candidate)[: -len(".onnx")] + ".plan.json") if str(candidate).endswith(".onnx") else None
    if path is None or not path.is_file():
        return {}
    try:
        plan = json.loads(path.read_text())
        return {n["name"]: n for n in plan.get("nodes", []) if isinstance(n, dict) and "name" in n}
    except (OSError, ValueError) as err:
        logger.warning("plan file '%s' is unreadable (%s); precisions come from the model", path, err)
        return {}


def find_divergence(
    baseline: str | Path,
    candidate: str | Path,
    batches: Sequence[Mapping[str, np.ndarray]],
    *,
    device: str = "cpu",
    numerics: str = "ort",
    show_progress: bool = False,
) -> Divergence:
    """Compare the intermediate tensors of two ONNX models on a few batches and locate the error jump.

    Args:
        baseline: The FP32 ONNX model.
        candidate: The converted ONNX model (same node and tensor names).
        batches: A few input batches (kept small: both models run once per batch per chunk).
        device: ``cpu``, ``cuda`` or ``auto`` (onnxruntime providers).
        numerics: ``ort`` or ``strict`` (the candidate's tensors from the strict FP16/BF16 emulator).
        show_progress: Show a progress bar.

    Returns:
        The Divergence (nodes in graph order, ranking by added error, the first jump).
    """
    from mpinfer.backends.ort import resolve_providers
    from mpinfer.modelio import load_onnx, name_nodes

    t0 = time.perf_counter()
    base, cand = name_nodes(load_onnx(baseline)), name_nodes(load_onnx(candidate))
    shared, skipped = _shared_tensors(base, cand)
    providers = resolve_providers(device)
    strict = numerics == "strict"
    accs = measure_tensors(base, cand, shared, batches, providers, strict=strict, show_progress=show_progress)
    nodes = rank_nodes(base, accs, load_plan_nodes(candidate))
    ranking = [
        n.address
        for n in sorted(nodes, key=lambda n: -n.added if not math.isnan(n.added) else 0)
        if n.added > 0
    ][:RANK_TOP]
    jump = first_jump(nodes)
    note = (
        "no node adds a jump in error"
        if jump is None
        else f"error jumps at {jump.op_type} '{jump.address}' ({jump.precision})"
    )
    logger.info(
        "divergence: %d tensors on %d batches in %.1f s; %s",
        len(accs),
        len(batches),
        time.perf_counter() - t0,
        note,
    )
    label = "strict" if strict else ("ort-cuda" if providers[0].startswith("CUDA") else "ort-cpu")
    return Divergence(
        numerics=label,
        batches=len(batches),
        tensors_compared=len(accs),
        nodes=nodes,
        first_jump=jump,
        ranking=ranking,
        skipped=skipped,
        note=note,
    )
