"""What the planner and the rewriter need to know about a graph.

Tensor types and shapes, producers and consumers (across If/Loop/Scan bodies), op schemas, which
inputs of a node may be lowered, and FLOPs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpinfer.errors import ModelLoadError
from mpinfer.modelio import (
    NodeRef,
    iter_graphs,
    iter_nodes,
    ort_log_level,
    ort_session,
    small_enough_to_size,
    tensor_array,
)

logger = logging.getLogger(__name__)

FLOAT = 1  # onnx.TensorProto.FLOAT
FLOAT16 = 10  # onnx.TensorProto.FLOAT16
BFLOAT16 = 16  # onnx.TensorProto.BFLOAT16
DEFAULT_DOMAINS = ("", "ai.onnx")
# Inputs that stay FP32 even when their node runs in low precision: coordinates and scale factors, where
# FP16 rounding moves pixels (onnxconverter-common writes FP16 Resize scales, which ORT then refuses).
PINNED_INPUTS: dict[str, tuple[int, ...]] = {"Resize": (1, 2)}
# Contrib ops (no ONNX schema) that may run low: (inputs, outputs) of their type T. The others (mean and inverse
# standard deviation, type U) stay float32.
CONTRIB_SLOTS: dict[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...]]] = {
    ("com.microsoft", "SkipLayerNormalization"): ((0, 1, 2, 3, 4), (0, 3)),
}
# Inputs that carry shapes, axes, sizes or counts: whatever computes them is index-like, never converted.
SHAPE_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,),
    "Expand": (1,),
    "Slice": (1, 2, 3, 4),
    "Tile": (1,),
    "ConstantOfShape": (0,),
    "Range": (0, 1, 2),
    "Resize": (1, 2, 3),
    "Upsample": (1,),
    "Pad": (1, 3),
    "TopK": (1,),
    "Unsqueeze": (1,),
    "Squeeze": (1,),
    "Split": (1,),
    "OneHot": (1,),
    "CumSum": (1,),
    "NonMaxSuppression": (2, 3, 4),
    "ReduceSum": (1,),
    "ReduceMean": (1,),
    "ReduceMax": (1,),
    "ReduceMin": (1,),
    "ReduceProd": (1,),
    "ReduceL1": (1,),
    "ReduceL2": (1,),
    "ReduceLogSum": (1,),
    "ReduceLogSumExp": (1,),
    "ReduceSumSquare": (1,),
    "RoiAlign": (2,),
    "GatherElements": (1,),
    "Gather": (1,),
    "GatherND": (1,),
    "ScatterElements": (1,),
    "ScatterND": (1,),
    "Trilu": (1,),
    "CenterCropPad": (1,),
    "Col2Im": (1, 2),
    "DFT": (1, 2),
    "STFT": (1, 2, 3),
}


class TensorTypes(dict):
    """Tensor name -> ONNX element type, counting its changes (:attr:`version`).

    :meth:`GraphInfo.slots` caches each node's slots under the version they were computed at: while it stands, no
    type has changed and the cached slots hold without reading the node's tensor types again.
    """

    version = 0

    def __setitem__(self, key: str, value: int) -> None:
        super().__setitem__(key, value)
        self.version += 1

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.version += 1

    def __ior__(self, other: Any) -> TensorTypes:  # type: ignore[override,misc]
        self.update(other)
        return self

    def update(self, *args: Any, **kwargs: Any) -> None:
        """As ``dict.update`` (counted)."""
        super().update(*args, **kwargs)
        self.version += 1

    def pop(self, *args: Any) -> Any:
        """As ``dict.pop`` (counted)."""
        self.version += 1
        return super().pop(*args)

    def popitem(self) -> tuple[str, int]:
        """As ``dict.popitem`` (counted)."""
        self.version += 1
        return super().popitem()

    def setdefault(self, key: str, default: Any = None) -> Any:
        """As ``dict.setdefault`` (counted)."""
        self.version += 1
        return super().setdefault(key, default)

    def clear(self) -> None:
        """As ``dict.clear`` (counted)."""
        super().clear()
        self.version += 1


@dataclass
class Slots:
    """Which inputs/outputs of a node switch to the low dtype when the node runs low.

    Attributes:
        inputs: Input positions to lower.
        outputs: Output positions to lower.
        blocked: Why the node cannot run low (None when it can, or when it has no float tensors).
        has_float: Whether the node touches FP32 tensors at all.
    """

    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    blocked: str | None = None
    has_float: bool = False


class GraphInfo:
    """Types, shapes, producers and consumers of every tensor of a model, its subgraphs included.

    Args:
        model: A model whose nodes are all named (``mpinfer.modelio.name_nodes``).
        base_dir: Folder of the model file, for tensors whose data is still external (large models).
        ask_runtime: Ask ONNX Runtime for the types ONNX inference cannot give (one session; see
            :meth:`_types_from_ort`). Off for the small sub-models built from a parent's typed info.
    """

    def __init__(self, model: Any, base_dir: str | None = None, *, ask_runtime: bool = True) -> None:
        self.model = model
        self.base_dir = base_dir or ""
        self.opsets = {(imp.domain or ""): imp.version for imp in model.opset_import}
        inferred = _infer_types(model)
        self.types: dict[str, int] = TensorTypes()
        self._slot_cache: dict[tuple[int, int], list[Any]] = {}  # -> [node, types version, its tensor types, Slots]
        self._param_cache: dict[tuple[int, int, int], tuple[Any, Any]] = {}
        self._slot_kinds: dict[tuple[Any, ...], Slots] = {}  # (op, types, empty slots) -> its unblocked Slots
        self.shapes: dict[str, tuple[int | None, ...] | None] = {}
        self.initializers: dict[str, Any] = {}
        self.non_tensor: set[str] = set()  # sequence / optional / map values
        self._collect(inferred.graph)
        if ask_runtime:
            self._types_from_ort(model)
        # Values come from the model itself (the inferred copy may hold detached or copied tensors).
        self.initializers = {t.name: t for g in iter_graphs(model.graph) for t in g.initializer}
        self.nodes: list[NodeRef] = list(iter_nodes(model.graph))
        self.by_address = {ref.address: ref for ref in self.nodes}
        self.producer: dict[str, str] = {}
        self.consumers: dict[str, list[tuple[str, int]]] = {}
        self.graph_inputs = {vi.name for vi in model.graph.input} - set(self.initializers)
        self.graph_outputs = [vi.name for vi in model.graph.output]
        for ref in self.nodes:
            for i, name in enumerate(ref.node.input):
                if name:
                    self.consumers.setdefault(name, []).append((ref.address, i))
            for name in ref.node.output:
                if name:
                    self.producer[name] = ref.address
        self._schemas: dict[str, Any] = {}
        # main-graph inputs/outputs the user's model had in FP16/BF16 before --force brought it back to FP32
        # (name -> element type): the rewrite gives them that type again
        self.low_io: dict[str, int] = {}

    def _collect(self, graph: Any) -> None:
        import onnx

        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            if vi.type.WhichOneof("value") not in (None, "tensor_type"):
                self.non_tensor.add(vi.name)
            if vi.type.HasField("tensor_type"):
                tt = vi.type.tensor_type
                if tt.elem_type:
                    self.types[vi.name] = tt.elem_type
                if tt.HasField("shape"):
                    self.shapes[vi.name] = tuple(
                        d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None for d in tt.shape.dim
                    )
        for init in graph.initializer:
            self.types[init.name] = init.data_type
            self.shapes[init.name] = tuple(init.dims)
            self.initializers[init.name] = init
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS and node.output:
                t = constant_tensor(node)
                if t is not None:
                    self.types[node.output[0]] = t.data_type
                    self.shapes[node.output[0]] = tuple(t.dims)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    self._collect(attr.g)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        self._collect(g)

    def _types_from_ort(self, model: Any) -> None:
        """Types and shapes ONNX inference cannot give, from ONNX Runtime.

        ONNX has no schema for contrib ops (``com.microsoft``: an ORT-optimized transformer's
        SkipLayerNormalization, BiasGelu, Attention), so their outputs and everything downstream are untyped,
        and would be kept FP32 for that alone, their FLOPs uncounted. ONNX Runtime knows those ops: one
        session (no graph optimizations) returning the untyped main-graph tensors reports them. Best effort:
        skipped for models with external data and when ONNX Runtime cannot load the model.
        """
        missing = [
            o for n in model.graph.node for o in n.output if o and o not in self.types and o not in self.non_tensor
        ]
        if not missing or not _in_memory(model):
            return
        import onnx

        query = onnx.ModelProto()
        query.CopyFrom(model)
        del query.graph.output[:]
        query.graph.output.extend(onnx.ValueInfoProto(name=n) for n in missing)
        try:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            options.log_severity_level = ort_log_level()
            outputs = ort_session(query, options=options).get_outputs()
        except (ImportError, ModelLoadError) as err:
            logger.debug("ONNX Runtime cannot type the tensors ONNX inference left untyped: %s", err)
            return
        # ONNX Runtime names a type "tensor(<onnx.TensorProto.DataType name, lower case>)".
        elem_types = {f"tensor({name.lower()})": value for name, value in onnx.TensorProto.DataType.items()}
        filled = 0
        for out in outputs:
            elem = elem_types.get(out.type)
            if elem is None:
                continue
            self.types[out.name] = elem
            self.shapes[out.name] = tuple(d if isinstance(d, int) else None for d in out.shape or ())
            filled += 1
        logger.info("types of %d tensor(s) ONNX inference does not know taken from ONNX Runtime", filled)

    # -- schema and slots ---------------------------------------------------------------------------
    def opset_of(self, node: Any) -> int:
        """The opset version imported for the node's domain."""
        domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
        return self.opsets.get(domain, 0)

    def schema(self, node: Any) -> Any:
        """The node's ``OpSchema`` at the model's opset, or None for unknown/custom ops."""
        import onnx

        domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
        key = f"{domain}::{node.op_type}"
        if key not in self._schemas:
            try:
                self._schemas[key] = onnx.defs.get_schema(node.op_type, self.opset_of(node), domain)
            except Exception:  # noqa: BLE001 - onnx raises SchemaError, a private type
                self._schemas[key] = None
        return self._schemas[key]

    def slots(self, node: Any, low_type: int) -> Slots:
        """Which float inputs/outputs of ``node`` become ``low_type`` when it runs low.

        Computed once per node and types of its tensors: the rules, the planner and apply ask about each node
        several times (callers only read the result).
        """
        key = (id(node), low_type)
        known = self._slot_cache.get(key)
        version = getattr(self.types, "version", None)  # (None: a plain dict put in its place)
        if known is not None and known[0] is node:  # (the node is held: its id stays its own)
            if version is not None and known[1] == version:
                return known[3]  # no type has changed since
        get = self.types.get
        types = (*map(get, node.input), None, *map(get, node.output))  # (None: where the inputs end)
        if known is not None and known[0] is node and known[2] == types:
            known[1] = version
            return known[3]
        # nodes of one op with the same tensor types (and the same optional slots left empty) have the same slots:
        # a 600-node model has a dozen such kinds (a blocked node's reason names its tensors: computed for it alone)
        kind = (node.domain, node.op_type, low_type, types, tuple(map(bool, node.input)), tuple(map(bool, node.output)))
        same = self._slot_kinds.get(kind)
        if same is not None:
            out = Slots(list(same.inputs), list(same.outputs), None, same.has_float)
        else:
            out = self._compute_slots(node, low_type)
            if out.blocked is None:
                self._slot_kinds[kind] = out
        self._slot_cache[key] = [node, version, types, out]
        return out

    def _compute_slots(self, node: Any, low_type: int) -> Slots:
        schema = self.schema(node)
        float_in = [i for i, n in enumerate(node.input) if n and self.types.get(n) == FLOAT]
        float_out = [i for i, n in enumerate(node.output) if n and self.types.get(n) == FLOAT]
        out = Slots(has_float=bool(float_in or float_out))
        contrib = CONTRIB_SLOTS.get((node.domain, node.op_type)) if schema is None else None
        if contrib is not None:
            out.inputs = [i for i in float_in if i in contrib[0]]
            out.outputs = [i for i in float_out if i in contrib[1]]
        if not out.has_float or schema is None:
            return out
        self._schema_slots(node, schema, low_type, float_in, float_out, out)
        return out

    def _schema_slots(
        self, node: Any, schema: Any, low_type: int, float_in: list[int], float_out: list[int], out: Slots
    ) -> None:
        """Fill ``out`` from the schema: one precision per type variable (else blocked).

        The one rule for every op and opset: the inputs and outputs a schema binds to one type variable (``T`` of
        BatchNormalization before opset 15 holds all five inputs and the output) take one dtype. A variable goes
        low when it allows ``low_type`` and every tensor bound to it is FP32 (a pinned input, an integer or an
        untyped tensor bound to it keeps it FP32); the float tensors of fixed types or of other variables stay.
        """
        in_params, out_params, allowed = self._schema_params(node, schema)
        low_str = "tensor(float16)" if low_type == FLOAT16 else "tensor(bfloat16)"
        pinned = set(PINNED_INPUTS.get(node.op_type, ()))
        bound: dict[str, list[tuple[str, bool]]] = {}  # variable -> (tensor, pinned) of every slot bound to it
        for i, name in enumerate(node.input):
            if name:
                bound.setdefault(in_params[i], []).append((name, i in pinned))
        for i, name in enumerate(node.output):
            if name:
                bound.setdefault(out_params[i], []).append((name, False))
        float_vars = {in_params[i] for i in float_in if i not in pinned} | {out_params[i] for i in float_out}
        lowered = {
            v
            for v in float_vars
            if _base(v) in allowed
            and low_str in allowed[_base(v)]
            and all(self.types.get(n) == FLOAT and not pin for n, pin in bound[v])
        }
        if float_vars and not lowered:
            out.blocked = self._why_not_low(node, float_vars, allowed, low_str, bound)
            return
        out.inputs = [i for i in float_in if in_params[i] in lowered and i not in pinned]
        out.outputs = [i for i in float_out if out_params[i] in lowered]
        if not out.inputs and not out.outputs:
            out.blocked = f"{node.op_type} has only fixed-type float tensors"

    def _schema_params(self, node: Any, schema: Any) -> tuple[list[str], list[str], dict[str, set[str]]]:
        """The type variable of each input and output slot of ``node``, and each variable's allowed types.

        Read once per op and arity (the schema's Python bindings build new objects on every access).
        """
        key = (id(schema), len(node.input), len(node.output))
        known = self._param_cache.get(key)
        if known is None or known[0] is not schema:
            params = (
                _formal(schema.inputs, len(node.input), self._bound_key),
                _formal(schema.outputs, len(node.output), self._bound_key),
                {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints},
            )
            known = self._param_cache[key] = (schema, params)
        return known[1]

    def _why_not_low(
        self, node: Any, float_vars: set[str], allowed: Mapping[str, set[str]], low_str: str,
        bound: Mapping[str, list[tuple[str, bool]]],
    ) -> str:
        """Why no type variable of ``node``'s float tensors can take ``low_str``."""
        if not any(_base(v) in allowed and low_str in allowed[_base(v)] for v in float_vars):
            return f"{node.op_type} (opset {self.opset_of(node)}) has no {low_str[7:-1]} type for its float tensors"
        for v in sorted(float_vars):
            for name, pin in bound[v]:
                if pin:
                    return f"{node.op_type} binds its pinned input '{name}' to type {_base(v)} with its float tensors"
                if name not in self.types:
                    return (
                        f"{node.op_type}: '{name}' shares type {_base(v)} with its float tensors and its type is "
                        "unknown (downstream of an op ONNX type inference does not know)"
                    )
                if self.types[name] != FLOAT:
                    return (
                        f"{node.op_type} binds '{name}' (element type {self.types[name]}) to type {_base(v)} with its "
                        "float tensors: one dtype for all of them, and that one is not FP32"
                    )
        return f"{node.op_type} has no type variable its float tensors can share in {low_str[7:-1]}"

    @staticmethod
    def _bound_key(param: Any, position: int) -> str:
        """The type variable of an actual slot; a heterogeneous variadic's slots each get their own."""
        from onnx import defs

        if param.option == defs.OpSchema.FormalParameterOption.Variadic and not param.is_homogeneous:
            return f"{param.type_str}#{position}"
        return str(param.type_str)

    # -- values ---------------------------------------------------------------------------------------
    def const_array(self, name: str) -> np.ndarray | None:
        """The value of an initializer (external data: memory-mapped, read-only) or a Constant output, else None."""
        from onnx import numpy_helper

        if name in self.initializers:
            return np.asarray(tensor_array(self.initializers[name], self.base_dir))
        addr = self.producer.get(name)
        if addr is not None:
            node = self.by_address[addr].node
            if node.op_type == "Constant":
                t = constant_tensor(node)
                return None if t is None else numpy_helper.to_array(t)
        return None

    def is_const(self, name: str) -> bool:
        """True for initializers and Constant outputs."""
        if name in self.initializers:
            return True
        addr = self.producer.get(name)
        return addr is not None and self.by_address[addr].node.op_type == "Constant"

    def observe_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Take the shapes a run measured (calibration's probe) for tensors static inference left unsized.

        A symbolic or unknown dim (``batch``, ``height``, a Paddle export's ``?`` or ``-1``) otherwise counts
        as 1 in :meth:`flops`, which skews the FLOP shares between nodes at different image sides.
        """
        for name, shape in shapes.items():
            known = self.shapes.get(name)
            if known is None or len(known) != len(shape) or any(d is None for d in known):
                self.shapes[name] = tuple(int(d) for d in shape)

    def numel(self, name: str) -> int:
        """Element count from inferred shapes (unknown dims count as 1)."""
        shape = self.shapes.get(name)
        if not shape:
            return 1
        return math.prod(int(d) if d else 1 for d in shape)

    def flops(self, ref: NodeRef) -> int:
        """Approximate FLOPs of a node: 2*MACs for Conv/ConvTranspose/MatMul/Gemm/Einsum, else output size."""
        node = ref.node
        outs = [o for o in node.output if o]
        if not outs:
            return 0
        y = self.numel(outs[0])
        formula = _FLOP_FORMULAS.get(node.op_type)
        return y if formula is None else formula(self, node, y)

    def weight_bytes(self, ref: NodeRef) -> int:
        """FP32 bytes of the initializers and Constant values a node reads."""
        total = 0
        for name in ref.node.input:
            if name in self.initializers and self.types.get(name) == FLOAT:
                total += 4 * self.numel(name)
            elif name and self.is_const(name) and self.types.get(name) == FLOAT:
                total += 4 * self.numel(name)
        return total

    def walk(self) -> Iterator[NodeRef]:
        """Every node, subgraphs included, in graph order."""
        return iter(self.nodes)




def _conv_flops(info: GraphInfo, node: Any, y: int) -> int:
    """Conv: 2 x output size x the weight's fan-in (input channels per group x kernel size)."""
    if len(node.input) < 2:
        return y
    w = info.shapes.get(node.input[1]) or ()
    return 2 * y * (int(np.prod([d or 1 for d in w[1:]])) if w else 1)


def _conv_transpose_flops(info: GraphInfo, node: Any, y: int) -> int:
    """ConvTranspose: 2 x input size x the weight's per-input-element fan-out; output size without a weight shape."""
    if len(node.input) < 2:
        return y
    w = info.shapes.get(node.input[1]) or ()
    return 2 * info.numel(node.input[0]) * int(np.prod([d or 1 for d in w[1:]])) if w else y


def _matmul_flops(info: GraphInfo, node: Any, y: int) -> int:
    """MatMul/Gemm/MatMulInteger: 2 x output size x the reduced dimension (A's last, or first with Gemm transA)."""
    a = info.shapes.get(node.input[0]) or ()
    if not a:
        return 2 * y
    trans_a = any(a_.name == "transA" and a_.i for a_ in node.attribute)
    kdim = a[0] if (node.op_type == "Gemm" and trans_a) else a[-1]
    return 2 * y * int(kdim or 1)


def _einsum_flops(info: GraphInfo, node: Any, y: int) -> int:
    """Einsum: 2 x the largest of its output and input sizes."""
    return 2 * max(y, max((info.numel(i) for i in node.input if i), default=1))


# Op type -> FLOPs of a node from its output size; other ops count their output size.
_FLOP_FORMULAS: dict[str, Callable[[GraphInfo, Any, int], int]] = {
    "Conv": _conv_flops,
    "ConvTranspose": _conv_transpose_flops,
    "MatMul": _matmul_flops,
    "Gemm": _matmul_flops,
    "MatMulInteger": _matmul_flops,
    "Einsum": _einsum_flops,
}


# Initializers bigger than this are detached while type inference runs: inference never reads their values,
# and a proto with them attached may exceed protobuf's 2 GB limit.
DETACH_BYTES = 1 << 20


def _in_memory(model: Any) -> bool:
    """No external data, and small enough to serialize."""
    return small_enough_to_size(model) and not any(
        t.data_location == 1 for g in iter_graphs(model.graph) for t in g.initializer  # TensorProto.EXTERNAL
    )


def _infer_types(model: Any) -> Any:
    """Best-effort type/shape inference (with data propagation, then without) on ``model``.

    Large initializer payloads are detached for the call and put back afterwards.
    """
    import onnx
    from onnx import TensorProto

    stash = []
    for t in model.graph.initializer:
        if len(t.raw_data) > DETACH_BYTES:
            stash.append((t, t.raw_data))
            t.ClearField("raw_data")
            t.data_location = TensorProto.EXTERNAL
            t.external_data.add(key="location", value="__detached__")
    try:
        for data_prop in (True, False):
            try:
                return onnx.shape_inference.infer_shapes(
                    model, check_type=False, strict_mode=False, data_prop=data_prop
                )
            except Exception as err:  # noqa: BLE001 - best effort; the validity gate is strict
                logger.debug("shape inference (data_prop=%s) failed: %s", data_prop, err)
        return model
    finally:
        for t, raw in stash:
            del t.external_data[:]
            t.data_location = TensorProto.DEFAULT
            t.raw_data = raw


def _formal(params: Any, count: int, key: Callable[[Any, int], str] | None = None) -> list[str]:
    """Type-parameter string of each actual position, expanding a trailing variadic formal."""
    out = []
    for i in range(count):
        j = min(i, len(params) - 1) if params else -1
        out.append((key(params[j], i) if key else params[j].type_str) if j >= 0 else "")
    return out


def _base(var: str) -> str:
    """The schema's name of a slot key of :func:`_formal` (a heterogeneous variadic's ``V#3`` is ``V``)."""
    return var.split("#", 1)[0]


def constant_tensor(node: Any) -> Any:
    """The TensorProto a Constant node produces (value, or value_float(s)/value_int(s) made into one)."""
    from onnx import helper

    for attr in node.attribute:
        if attr.name == "value":
            return attr.t
        if attr.name == "value_float":
            return helper.make_tensor("value", FLOAT, [], [attr.f])
        if attr.name == "value_floats":
            return helper.make_tensor("value", FLOAT, [len(attr.floats)], list(attr.floats))
        if attr.name == "value_int":
            return helper.make_tensor("value", 7, [], [attr.i])
        if attr.name == "value_ints":
            return helper.make_tensor("value", 7, [len(attr.ints)], list(attr.ints))
    return None


def components(addresses: Sequence[str], links: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """Connected components of ``addresses`` joined by ``links`` (union-find with path halving).

    A link ``(a, b)`` moves ``a``'s component under ``b``'s root. Returns root -> members, both in the
    order of ``addresses``; links naming an address outside ``addresses`` are ignored.
    """
    parent = {a: a for a in addresses}

    def root(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a, b in links:
        if a in parent and b in parent:
            parent[root(a)] = root(b)
    out: dict[str, list[str]] = {}
    for a in addresses:
        out.setdefault(root(a), []).append(a)
    return out
