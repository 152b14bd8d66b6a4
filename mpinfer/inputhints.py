"""What a model's graph says about the values and sizes its inputs can take, for random data.

* Index ranges: an integer input that indexes a tensor of known size can only take ``[0, N)``: token ids into
  an embedding table (a ``Gather`` whose data is an initializer of N rows), indices of ``GatherElements`` /
  ``ScatterElements`` / ``GatherND`` / ``ScatterND``, ``OneHot`` indices (``depth``), and the ``axes`` input of
  reductions and ``Squeeze``/``Unsqueeze`` (``[0, rank)``). Value-preserving ops in between (``Cast``,
  ``Identity``, ``Reshape``, ...) are followed.
* Pinned dims: a recurrent op's state fed from an input of fixed size (``initial_h [4, 1, 64]``) fixes the batch
  dim of its sequence input (``X [seq, batch, 32]``: ``batch`` = 1).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

# op type -> (index input, data input): the index input's values address the data input's dims
_INDEXES = {
    "Gather": (1, 0),
    "GatherElements": (1, 0),
    "ScatterElements": (1, 0),
    "GatherND": (1, 0),
    "ScatterND": (1, 0),
}
# ops whose ``axes`` input (index 1) names axes of input 0
_AXES_OPS = {"Squeeze", "Unsqueeze", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
             "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"}
# ops that pass input 0's values through unchanged (a reshape or a cast of token ids keeps them token ids)
_PASS = {"Cast", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Transpose"}
_RECURRENT = {"LSTM", "GRU", "RNN"}


def _static_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Shapes every dim of which is a fixed size: initializers and graph inputs."""
    out = {t.name: tuple(int(d) for d in t.dims) for t in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in out or vi.type.WhichOneof("value") != "tensor_type":
            continue
        dims = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            out[vi.name] = tuple(int(d.dim_value) for d in dims)
    return out


def _attr(node: Any, name: str, default: int) -> int:
    return next((int(a.i) for a in node.attribute if a.name == name), default)


def _bound(node: Any, shapes: dict[str, tuple[int, ...]], scalars: dict[str, int], ranks: Any) -> int | None:
    """The exclusive upper bound this node puts on its index/axes input's values, or None when unknown."""
    op = node.op_type
    if op in _INDEXES:
        shape = shapes.get(node.input[0]) if node.input else None
        if not shape:
            return None
        if op in ("GatherND", "ScatterND"):
            lead = shape[_attr(node, "batch_dims", 0):]
            return min(lead) if lead else None
        axis = _attr(node, "axis", 0)
        return shape[axis] if -len(shape) <= axis < len(shape) else None
    if op == "OneHot" and len(node.input) > 1:
        return scalars.get(node.input[1])
    if op in _AXES_OPS and node.input:
        rank = ranks(node.input[0])
        return rank if rank else None
    return None


class _Ranks:
    """Tensor ranks: from static shapes, then from ONNX shape inference, run once and only when asked."""

    def __init__(self, model: Any, shapes: dict[str, tuple[int, ...]]) -> None:
        self._model = model
        self._ranks: dict[str, int] | None = None
        self._known = {n: len(s) for n, s in shapes.items()}

    def __call__(self, name: str) -> int | None:
        if name in self._known:
            return self._known[name]
        if self._ranks is None:
            import onnx

            try:
                g = onnx.shape_inference.infer_shapes(self._model, strict_mode=False).graph
            except Exception:  # noqa: BLE001 - a model shape inference cannot take: ranks stay unknown
                g = self._model.graph
            self._ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in [*g.value_info, *g.output]
                           if vi.type.tensor_type.HasField("shape")}
        return self._ranks.get(name)


def index_ranges(model: Any) -> dict[str, tuple[int, int]]:
    """Graph input -> ``(0, N)`` for integer inputs whose every value must index something of N entries."""
    from onnx import numpy_helper

    inits = {t.name for t in model.graph.initializer}
    if not any(vi.name not in inits and vi.type.tensor_type.elem_type in (6, 7) for vi in model.graph.input):
        return {}  # (no integer input: nothing to bound, no graph walk)
    shapes = _static_shapes(model)
    scalars = {}
    for t in model.graph.initializer:
        # one-element INT32/INT64 tensors only: their size from dims, so no other tensor is read (an external one
        # of a graph-only proto has its data beside the model file, not here)
        if t.data_type in (6, 7) and len(t.dims) <= 1 and math.prod(t.dims) == 1:
            scalars[t.name] = int(numpy_helper.to_array(t).reshape(-1)[0])
    consumers: dict[str, list[tuple[Any, int]]] = defaultdict(list)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            consumers[name].append((node, i))
    ranks = _Ranks(model, shapes)
    out: dict[str, tuple[int, int]] = {}
    for vi in model.graph.input:
        if vi.name in inits or vi.type.tensor_type.elem_type not in (6, 7):
            continue
        bounds = _bounds_from(vi.name, consumers, shapes, scalars, ranks, depth=0)
        if bounds:
            out[vi.name] = (0, min(bounds))
    return out


def _bounds_from(name: str, consumers: dict[str, list[tuple[Any, int]]], shapes: dict[str, tuple[int, ...]],
                 scalars: dict[str, int], ranks: Any, depth: int) -> list[int]:
    found: list[int] = []
    for node, i in consumers.get(name, []):
        if i == 0 and node.op_type in _PASS and depth < 8:
            for out in node.output:
                found += _bounds_from(out, consumers, shapes, scalars, ranks, depth + 1)
        elif (node.op_type in _INDEXES and i == _INDEXES[node.op_type][0]) or (
            node.op_type == "OneHot" and i == 0) or (node.op_type in _AXES_OPS and i == 1):
            bound = _bound(node, shapes, scalars, ranks)
            if bound is not None and bound > 0:
                found.append(bound)
    return found


def pinned_dims(model: Any) -> dict[tuple[str, int], int]:
    """Dynamic dims the graph fixes, as (input, axis) -> size.

    A recurrent op's batch dim, when its state comes from a fixed-size input.
    """
    if not any(node.op_type in _RECURRENT for node in model.graph.node):
        return {}  # (no recurrent op: nothing fixes a dim)
    shapes = _static_shapes(model)
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in model.graph.input
             if vi.type.WhichOneof("value") == "tensor_type"}
    out: dict[tuple[str, int], int] = {}
    for node in model.graph.node:
        x = node.input[0] if node.input else ""
        if node.op_type not in _RECURRENT or ranks.get(x) != 3 or x in shapes:
            continue
        axis = 1 if _attr(node, "layout", 0) == 0 else 0  # X [seq, batch, in] / [batch, seq, in]; state alike
        for k in (5, 6):  # initial_h, initial_c
            shape = shapes.get(node.input[k] if len(node.input) > k else "")
            if shape and len(shape) == 3:
                out[(x, axis)] = shape[axis]
    return out
