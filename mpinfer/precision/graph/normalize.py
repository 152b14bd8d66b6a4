"""Prepare an input model for planning.

Refuse (or, with --force, undo) an earlier low-precision conversion, and raise the opset where BF16 needs it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.modelio import default_opset, iter_graphs, name_nodes, subgraphs
from mpinfer.precision.core import BFLOAT16, FLOAT, FLOAT16, GraphInfo
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

LOW_TYPES = (FLOAT16, BFLOAT16)
# Cast to/from bfloat16 and bfloat16 kernels of the common ops arrive with opset 13.
BF16_MIN_OPSET = 13




def low_tensor_count(model: Any) -> tuple[int, int]:
    """(low-precision, FP32) counts over initializers, graph inputs/outputs and Cast targets."""
    low = high = 0
    for g in iter_graphs(model.graph):
        for t in g.initializer:
            low += t.data_type in LOW_TYPES
            high += t.data_type == FLOAT
        for vi in list(g.input) + list(g.output):
            et = vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else 0
            low += et in LOW_TYPES
            high += et == FLOAT
        for node in g.node:
            if node.op_type == "Cast":
                low += any(a.name == "to" and a.i in LOW_TYPES for a in node.attribute)
    return low, high


def low_io_types(model: Any) -> dict[str, int]:
    """The main graph's FP16/BF16 inputs and outputs (name -> element type), initializers aside."""
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for vi in list(model.graph.input) + list(model.graph.output):
        if vi.name in inits or not vi.type.HasField("tensor_type"):
            continue
        if vi.type.tensor_type.elem_type in LOW_TYPES:
            out[vi.name] = vi.type.tensor_type.elem_type
    return out


def check_not_low(model: Any, path: str, *, force: bool) -> Any:
    """Refuse an already FP16/BF16 model, or with ``force`` return it brought back to FP32.

    Raises:
        InvalidInputError: The model already has low-precision tensors and ``force`` is off.
    """
    low, high = low_tensor_count(model)
    if not low:
        return model
    what = "already FP16/BF16" if not high else "already mixed precision"
    if not force:
        raise InvalidInputError(
            format_message(
                f"ONNX model '{path}'",
                f"a model that is {what} ({low} low-precision tensors or casts)",
                "an FP32 model",
                "nothing was converted; pass --force to bring it back to FP32 and re-plan it",
            )
        )
    logger.warning(
        "Model '%s' is %s: --force brings it back to FP32 (inputs and outputs included) and re-plans it.",
        path,
        what,
    )
    return upcast_to_fp32(model)


def upcast_to_fp32(model: Any) -> Any:
    """A copy of ``model`` with every FP16/BF16 tensor, cast target and dtype attribute made FP32.

    The Casts between float types that the earlier conversion put at its precision boundaries are identities
    once everything is FP32: they are removed (an Identity where the Cast made a graph output), so re-planning
    sees the model's own nodes and sets its own Casts, never a Cast of a Cast.
    """
    import onnx
    from onnx import numpy_helper

    float_casts = _float_casts(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for g in iter_graphs(m.graph):
        for t in g.initializer:
            if t.data_type in LOW_TYPES:
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type in LOW_TYPES:
                vi.type.tensor_type.elem_type = FLOAT
        for node in g.node:
            for a in node.attribute:
                if a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i in LOW_TYPES:
                    a.i = FLOAT
                elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type in LOW_TYPES:
                    a.t.CopyFrom(
                        numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name)
                    )
    graphs = list(iter_graphs(m.graph))
    for gi, g in enumerate(graphs):
        _drop_casts(g, [g.node[ni] for gj, ni in sorted(float_casts) if gj == gi])
    return m


def _float_casts(model: Any) -> set[tuple[int, int]]:
    """(graph, node) positions, in :func:`iter_graphs` order, of the Casts from a float tensor to a float type."""
    types = GraphInfo(model).types
    floats = (FLOAT, *LOW_TYPES)
    out = set()
    for gi, g in enumerate(iter_graphs(model.graph)):
        for ni, node in enumerate(g.node):
            if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or not node.input:
                continue
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            if to in floats and types.get(node.input[0]) in floats:
                out.add((gi, ni))
    return out


def _drop_casts(graph: Any, casts: list[Any]) -> None:
    """Remove ``casts`` (FP32->FP32 now) from ``graph``, their consumers reading their inputs instead.

    A Cast that makes one of the graph's outputs hands the output's name to the node that computes its
    input (an Identity instead when that is a graph input, an initializer or another output).
    """
    outputs = {o.name for o in graph.output}
    inputs = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    dropped = {id(c) for c in casts}
    # the live producers (a dropped Cast produces nothing once it is gone: a chain of Casts resolves through it)
    produced = {o: n for n in graph.node if id(n) not in dropped for o in n.output if o}
    renames: dict[str, str] = {}  # tensor name -> the name its uses read instead

    def resolve(name: str) -> str:
        seen = set()
        while name in renames and name not in seen:
            seen.add(name)
            name = renames[name]
        return name

    for cast in casts:
        dst = cast.output[0]
        if dst not in outputs:
            renames[dst] = cast.input[0]
            graph.node.remove(cast)  # a Cast has no bodies: the other nodes (and their bodies) stay as they are
    for cast in casts:
        src, dst = resolve(cast.input[0]), cast.output[0]
        if dst not in outputs:
            continue
        if src in produced and src not in outputs and src not in inputs:
            producer = produced.pop(src)
            producer.output[list(producer.output).index(src)] = dst
            produced[dst] = producer
            renames[src] = dst
            graph.node.remove(cast)
        else:
            cast.op_type = "Identity"
            del cast.attribute[:]
            cast.input[0] = src
            produced[dst] = cast
    if not renames:
        return

    for g in iter_graphs(graph):  # outer-scope uses inside bodies too
        for node in g.node:
            for i, name in enumerate(node.input):
                if name in renames:
                    node.input[i] = resolve(name)
    stale = [vi for vi in graph.value_info if vi.name in renames]
    for vi in stale:
        graph.value_info.remove(vi)


def sort_nodes(model: Any) -> Any:
    """``model`` with the nodes of every graph in topological order (the same model when they already are).

    ONNX Runtime loads a graph whose node list is out of order (keras2onnx writes such graphs); the ONNX checker
    refuses it, and so would the validity gate refuse the converted model. The sort is stable (nodes keep their
    relative order wherever the data allows it); a body's reads of outer-scope values count as its node's inputs.
    A graph with a cycle or a value nothing produces is left as it is (the checker names what is wrong).
    """
    import onnx

    if all(_sorted(g) for g in iter_graphs(model.graph)):
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    moved = 0
    for g in iter_graphs(m.graph):
        order = _topological(g)
        if order is not None and order != list(range(len(g.node))):
            nodes = [g.node[i] for i in order]
            copies = [onnx.NodeProto() for _ in nodes]
            for c, n in zip(copies, nodes):
                c.CopyFrom(n)
            del g.node[:]
            g.node.extend(copies)
            moved += 1
    if moved:
        logger.info("The model's node lists were not in topological order: sorted (%d graph(s)).", moved)
    return m


def _reads(node: Any) -> set[str]:
    """The values ``node`` reads: its inputs and the outer-scope values its bodies read."""
    out = {n for n in node.input if n}
    for body in subgraphs(node):
        local = {i.name for i in body.input} | {t.name for t in body.initializer}
        for g in iter_graphs(body):
            local |= {i.name for i in g.input} | {t.name for t in g.initializer}
            local |= {o for n in g.node for o in n.output if o}
        for g in iter_graphs(body):
            out |= {n for b in g.node for n in b.input if n and n not in local}
        out |= {o.name for o in body.output if o.name not in local}
    return out


def _sorted(graph: Any) -> bool:
    order = _topological(graph)
    return order is None or order == list(range(len(graph.node)))


def _topological(graph: Any) -> list[int] | None:
    """A stable topological order of ``graph.node`` (indices), or None when there is none."""
    import heapq

    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    needs: list[set[int]] = []
    users: dict[int, list[int]] = {}
    for i, node in enumerate(graph.node):
        deps = {producer[r] for r in _reads(node) if r in producer and producer[r] != i}
        needs.append(deps)
        for d in deps:
            users.setdefault(d, []).append(i)
    ready = [i for i, d in enumerate(needs) if not d]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users.get(i, []):
            needs[u].discard(i)
            if not needs[u]:
                heapq.heappush(ready, u)
    return order if len(order) == len(graph.node) else None


def ensure_opset(model: Any, precision: Precision, *, opset: int | None = None, reason: str | None = None) -> Any:
    """Raise the default-domain opset to ``opset`` (when given) and to what ``precision`` needs (BF16: 13).

    Uses ONNX's version converter; nodes it adds get names (``mpinfer.modelio.name_nodes``). ``reason``: why
    ``opset`` is asked for, for the one line that says the model was upgraded (default: ``--opset``).

    Raises:
        InvalidInputError: ``opset`` is below the model's, or the converter cannot upgrade the model.
    """
    current = default_opset(model)
    if not current:
        # No ai.onnx op in the model (only ai.onnx.ml / training ops): import the default domain so that
        # the Casts the rewrite may insert are defined.
        import onnx
        from onnx import helper

        out = onnx.ModelProto()
        out.CopyFrom(model)
        out.opset_import.append(helper.make_opsetid("", max(BF16_MIN_OPSET, opset or 0)))
        return out
    if opset is not None and opset < current:
        raise InvalidInputError(
            format_message(
                "--opset",
                f"{opset}, below the model's opset {current}",
                f"{current} or later (mpinfer upgrades, never downgrades)",
                "drop --opset, or re-export the model at the opset you need",
            )
        )
    needed = BF16_MIN_OPSET if precision is Precision.BF16 else 0
    target = max(needed, opset or 0)
    if target <= current:
        return model
    from onnx import version_converter

    why = (reason or "--opset") if opset is not None and opset >= needed else f"{precision.value.upper()} needs it"
    try:
        out = version_converter.convert_version(model, target)
    except Exception as err:  # noqa: BLE001 - the converter raises several private types
        raise InvalidInputError(
            format_message(
                f"Upgrading the model to opset {target} ({why})",
                f"a model at opset {current} that the ONNX version converter cannot upgrade ({err})",
                f"a model the converter can take to opset {target}",
                "re-export the model at that opset" if opset is not None else
                "re-export the model with --opset 17, or convert to fp16",
            )
        ) from err
    logger.warning("The model was upgraded from opset %d to %d (%s).", current, target, why)
    return name_nodes(out)
