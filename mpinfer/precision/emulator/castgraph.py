"""Strict numerics at ONNX Runtime speed: a converted model as one float32 graph with rounding Cast pairs.

The emulator (:mod:`emulate`) runs a converted model node by node: a node with FP16/BF16 inputs reads them as
float32, computes, and stores its float outputs rounded to its dtype. For the ops of :data:`ROUNDED_OPS` the
computation is a single float32 operation (+, -, *, /: float32 carries more than twice the bits of either low
dtype, so float32-then-round is the correctly rounded low-precision result; Conv/ConvTranspose, MatMul/Gemm,
Tanh/Sigmoid: ONNX Runtime's own float32 kernel on the rounded inputs, see :mod:`kernels.ortexec`), and the ops
of :data:`EXACT_OPS` return values of their inputs, which need no rounding. For those ops the emulator's result
is, bit for bit, that of one float32 graph where every FP16/BF16 tensor becomes a float32 tensor holding the
same (representable) values:

- FP16/BF16 initializers become float32 (exact); the graph's FP16/BF16 inputs are fed, and its outputs
  returned, in their declared dtype (the runner casts them; exact, or rounded when float32 data is fed);
- a ``Cast`` to FP16/BF16 becomes a Cast pair (to the low dtype and back to float32): the rounding;
- a low node of :data:`ROUNDED_OPS` is followed by a Cast pair on each float output; one of :data:`EXACT_OPS`
  is left as it is (its inputs are representable, so are its outputs); ``Relu`` is written ``Max(x, 0)``,
  which gives numpy's bits (ONNX Runtime's Relu keeps -0.0, numpy's ``maximum(x, 0)`` gives +0.0);
- FP32 nodes are left as they are: ONNX Runtime computes them, as it computes the FP32 reference. The
  emulator's FP32 kernels match ONNX Runtime only to float32 rounding, so on FP32 nodes the two engines may
  differ by that much; on low nodes they agree bit for bit (``tests/precision/test_castgraph.py``). An FP32
  BatchNormalization is written as the emulator computes it (folded: ``x * a + b`` in float32), bit for bit too:
  ONNX Runtime's kernel differs from the fold by a float32 step, which the low nodes after it can turn into other
  verdicts (layout_cdla's repairs moved 92 nodes instead of 42 before this).

The session runs with every graph optimisation off (``ORT_DISABLE_ALL``): at ``ORT_ENABLE_ALL`` ONNX Runtime
moves a Conv with constant weights to its NCHWc kernel, whose sums land on other bits than the plain kernel
the emulator calls, and fusions could merge a node with its neighbour across a rounding. For the same reason its
weights are not prepacked (a prepacked MatMul/Gemm weight sums on other bits than the emulator's, which reads it as
an input). The Cast pairs are
checked bit for bit against numpy (:func:`kernels.ortexec.cast_matches_numpy`) once per process; a pair that
differs is never used.

:func:`cast_graph` says why a model does not qualify (each low op type no float32 graph computes bit for bit,
named once with the reason, from :data:`caststeps.EMULATOR_ONLY`; low tensors inside an If/Loop/Scan body, external
or too many weights, ...); the caller then runs the emulator, as before.
:class:`StrictModelRunner` picks the engine and says which one ran.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpinfer.memory import current_budget, usable_cpus
from mpinfer.modelio import ort_log_level
from mpinfer.precision.emulator.caststeps import BFLOAT16 as _BFLOAT16
from mpinfer.precision.emulator.caststeps import EMULATOR_ONLY, EXPANDED_OPS
from mpinfer.precision.emulator.caststeps import FLOAT as _FLOAT
from mpinfer.precision.emulator.caststeps import FLOAT16 as _FLOAT16
from mpinfer.precision.emulator.caststeps import LOW as _LOW
from mpinfer.precision.emulator.caststeps import Refused as _Refused
from mpinfer.precision.emulator.caststeps import Types as _Types
from mpinfer.precision.emulator.caststeps import expand as _expanded
from mpinfer.precision.emulator.caststeps import nan_kept_extreme as _nan_kept_extreme
from mpinfer.precision.emulator.caststeps import round_pair as _round_pair
from mpinfer.precision.emulator.emulate import SKIP_ROUNDING
from mpinfer.precision.emulator.kernels import ortexec

logger = logging.getLogger(__name__)

ENGINE_CASTS = "ort-casts"
ENGINE_EMULATOR = "emulator"

# Low-precision ops computed as one float32 op and rounded once, with ONNX Runtime's float32 kernel giving the
# emulator's bits (each tested bit for bit against the emulator, FP16 and BF16, with inf/NaN/subnormal/tie inputs).
# MatMul, Gemm, Tanh, Sigmoid, AveragePool, GlobalAveragePool: the emulator calls ONNX Runtime's float32 kernels
# for them (kernels/linalg.py, kernels/elementwise.py, kernels/pool.py). Sqrt and Reciprocal: correctly rounded in
# float32 by numpy and by ONNX Runtime alike (IEEE). LeakyRelu: x, or x times alpha rounded to the low dtype (as the
# emulator rounds its attribute), one float32 product; PRelu: x, or x times its (low) slope. Not Exp/Log/Erf
# (numpy's approximations in the emulator: see caststeps.EMULATOR_ONLY for every op left to the emulator, and why).
ROUNDED_OPS = frozenset(
    {"Conv", "ConvTranspose", "MatMul", "Gemm", "Tanh", "Sigmoid", "AveragePool", "GlobalAveragePool", "Add", "Sub",
     "Mul", "Div", "Sqrt", "Reciprocal", "LeakyRelu", "PRelu"}
)
# Low-precision ops whose outputs are values of their inputs (or 0, or integers they round to), or booleans:
# representable in, representable out. ReduceMax/ReduceMin: ONNX Runtime's kernel in both engines, the NaN it may
# drop put back (caststeps.nan_kept_extreme); an opset-2 Pad's float ``value`` attribute gets a Cast pair.
EXACT_OPS = frozenset(
    {"Relu", "MaxPool", "Max", "Min", "Abs", "Neg", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze",
     "Transpose", "Concat", "Slice", "Split", "ReduceMax", "ReduceMin", "Pad", "Gather", "GatherElements", "Tile",
     "Expand", "Floor", "Ceil", "Round", "Sign", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual",
     "Resize", "Upsample"}
)
# Resize/Upsample (nearest) gives the emulator's values only where ONNX Runtime picks the same source pixels: the
# emulator computes the source coordinates in float64, ONNX Runtime in float32. With constant integer scales and these
# coordinate modes both land on the same indices (a quotient by an integer scale is exact where it is a tie; elsewhere
# it stays farther than float32's error from a rounding boundary at any realistic size); other variants stay on the
# emulator.
RESIZE_COORDINATES = frozenset({"asymmetric", "half_pixel", "pytorch_half_pixel"})
# Resize attributes nearest sampling with those coordinates does not read (YOLO's exports carry cubic_coeff_a).
NEAREST_UNREAD = frozenset({"cubic_coeff_a", "exclude_outside", "extrapolation_value"})
# Ops whose outputs are never float: the same on the float32 copy of a low tensor as on the tensor itself.
SHAPE_OPS = frozenset({"Shape", "Size"})
# Ops that make a low tensor from no float input: its value, stored low, written as float32 (exact; :func:`_fp32_node`).
# A plan lowers them with their consumers (``rule:follow``): PP-OCRv4's recognizer has 327 low Constants, and a
# search that took them for ops off the lists judged every candidate on the emulator.
MADE_OPS = frozenset({"Constant", "ConstantOfShape"})
_ROUND_CAST = {_FLOAT16: "round_fp16", _BFLOAT16: "round_bf16"}
_ZERO = "mpinfer_castgraph_zero"


@dataclass(frozen=True)
class CastGraph:
    """The float32 graph of a converted model, and the low dtypes of its I/O.

    Attributes:
        model: The float32 ``onnx.ModelProto`` (Cast pairs where the converted model rounds).
        low_inputs: Graph input name -> the numpy dtype the converted model declares (FP16/BF16).
        low_outputs: Graph output name -> the numpy dtype the converted model declares (FP16/BF16).
        rounded: Low nodes followed by a Cast pair (Casts to a low dtype included).
    """

    model: Any
    low_inputs: dict[str, np.dtype]
    low_outputs: dict[str, np.dtype]
    rounded: int


def may_qualify(op_types: Iterable[str], model: Any) -> bool:
    """False when a plan cannot give a model with a cast graph: a low op off the lists, or external weights.

    A cheap check before applying a plan (``op_types``: those of its low nodes; ``model``: the FP32 model).
    """
    from onnx.external_data_helper import uses_external_data

    listed = ROUNDED_OPS | EXACT_OPS | EXPANDED_OPS | SHAPE_OPS | MADE_OPS | {"Cast"}
    return all(op in listed for op in op_types) and not any(uses_external_data(t) for t in model.graph.initializer)


def cast_graph(model: Any) -> tuple[CastGraph | None, str]:
    """The float32 cast graph of a converted model, or None and the reason it does not qualify.

    Args:
        model: The converted ``onnx.ModelProto`` (not modified), weights in the proto.
    """
    try:
        return _build(model), ""
    except _Refused as why:
        return None, str(why)
    except Exception as err:  # a model the translation did not foresee: the emulator still runs it, said loudly
        logger.warning("The cast graph of this model could not be built (%s: %s); the strict emulator runs it. "
                       "This is a bug in mpinfer: please report it with the model.", type(err).__name__, err)
        return None, f"{type(err).__name__}: {err}"


def _build(model: Any) -> CastGraph:
    from onnx import helper, numpy_helper
    from onnx.external_data_helper import uses_external_data

    graph = model.graph
    if model.functions or graph.sparse_initializer:
        raise _Refused("model-local functions or sparse initializers")
    if any(uses_external_data(t) for t in graph.initializer):
        raise _Refused("weights in external data")
    types = _elem_types(model)
    unknown = [o for n in graph.node for o in n.output if o and o not in types]
    if unknown:
        raise _Refused(f"tensors whose type inference cannot tell: {', '.join(unknown[:3])}")
    lows = {t for t in types.values() if t in _LOW}
    opset = next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 8 or (_BFLOAT16 in lows and opset < 13):  # (Max with a broadcast scalar: 8; BF16 Casts: 13)
        raise _Refused(f"default-domain opset {opset}")
    for t in lows:
        if not _pair_exact(_ROUND_CAST[t]):
            raise _Refused(f"ONNX Runtime's {_ROUND_CAST[t]} cast pair differs from numpy's")
    inits, weight_bytes = [], 0
    for t in graph.initializer:
        if t.data_type in _LOW:
            t = numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)
        weight_bytes += int(np.prod(t.dims, dtype=np.int64)) * 4
        inits.append(t)
    if weight_bytes > current_budget().weight_cache:
        raise _Refused(f"{weight_bytes / 1e9:.2f} GB of float32 weights (past the weight_cache slice)")
    nodes: list[Any] = []
    rounded = 0
    refused: dict[str, tuple[str, int]] = {}  # low op type -> (the first node's reason, count)
    for node in graph.node:
        try:
            rounded += _translate(node, types, nodes, inits)
        except _OffTheLists as why:
            first = refused.get(node.op_type, (str(why), 0))
            refused[node.op_type] = (first[0], first[1] + 1)
    if refused:  # every low op the cast graph cannot take, named once: the log's one line says what the emulator runs
        raise _Refused("; ".join(f"{why}{f' ({n} nodes)' if n > 1 else ''}" for why, n in refused.values()))
    # The inputs are declared without a shape: from a partly symbolic one ONNX Runtime's setup propagates shapes
    # through the graph at a cost that grows with its low tensors (the OCR recognizer's cast graph: 0.48 s to open,
    # 0.056 s without the input's shape; the kernels see the same tensors at run time: the same bits, as fast)
    inputs = [_unshaped(_as_float(vi, types)) for vi in graph.input]
    outputs = [_as_float(vi, types) for vi in graph.output]
    fast = helper.make_graph(nodes, graph.name or "castgraph", inputs, outputs, inits)
    out = helper.make_model(fast, opset_imports=list(model.opset_import))
    out.ir_version = model.ir_version
    low_in = {vi.name: _LOW[types[vi.name]].numpy_dtype for vi in graph.input if types.get(vi.name) in _LOW}
    low_out = {vi.name: _LOW[types[vi.name]].numpy_dtype for vi in graph.output if types.get(vi.name) in _LOW}
    return CastGraph(out, low_in, low_out, rounded)


def _elem_types(model: Any) -> _Types:
    """Tensor name -> ONNX element type of every main-graph tensor (type inference on a weightless copy)."""
    import onnx
    from onnx import helper

    graph = model.graph
    declared = {vi.name for vi in graph.input}
    weights = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in graph.initializer
               if t.name not in declared]
    skeleton = helper.make_graph(list(graph.node), "skeleton", list(graph.input) + weights, list(graph.output))
    light = helper.make_model(skeleton, opset_imports=list(model.opset_import))
    light.ir_version = model.ir_version
    try:
        inferred = onnx.shape_inference.infer_shapes(light).graph
    except Exception as err:  # onnx raises its own types
        raise _Refused(f"type inference failed ({err})") from err
    types = _Types({t.name: t.data_type for t in graph.initializer})
    types.ranks = {t.name: len(t.dims) for t in graph.initializer}
    types.opset = next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    types.casts = {n.output[0]: (n.input[0], a.i) for n in graph.node if n.op_type == "Cast" and n.output
                   for a in n.attribute if a.name == "to" and (a.i in _LOW or a.i == _FLOAT)}
    types.constants = {n.output[0]: a.t for n in graph.node if n.op_type == "Constant"
                       for a in n.attribute if a.name == "value" and a.type == a.TENSOR}
    for vi in list(inferred.input) + list(inferred.value_info) + list(inferred.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
            if vi.type.tensor_type.HasField("shape"):
                types.ranks[vi.name] = len(vi.type.tensor_type.shape.dim)
    return types


def _as_float(vi: Any, types: Mapping[str, int]) -> Any:
    """A graph input/output's value info, FP16/BF16 declared as float32 (the runner casts at the boundary)."""
    if types.get(vi.name) not in _LOW:
        return vi
    out = type(vi)()
    out.CopyFrom(vi)
    out.type.tensor_type.elem_type = _FLOAT
    return out


def _unshaped(vi: Any) -> Any:
    """A value info with its element type and no shape."""
    if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
        return vi
    out = type(vi)()
    out.CopyFrom(vi)
    out.type.tensor_type.ClearField("shape")
    return out


def _translate(node: Any, types: Mapping[str, int], nodes: list[Any], inits: list[Any]) -> int:
    """Append ``node``'s float32 form to ``nodes``; 1 when it got Cast pairs, 0 when not.

    Raises:
        _Refused: A low node of an op type off the lists, or a low tensor this translation cannot place.
    """
    from onnx import AttributeProto, helper

    if node.domain not in ("", "ai.onnx"):
        raise _Refused(f"node '{node.name}' of domain {node.domain}")
    if any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in node.attribute):
        _check_body(node, types)
        nodes.append(node)
        return 0
    skip = SKIP_ROUNDING.get(node.op_type, ())
    low = next((types[n] for i, n in enumerate(node.input) if n and i not in skip and types.get(n) in _LOW), None)
    if node.op_type == "Cast":
        to = next(a.i for a in node.attribute if a.name == "to")
        if to in _LOW:
            nodes.extend(_round_pair(node, to))
            return 1
        if low is not None and to != _FLOAT:
            raise _Refused(f"Cast '{node.name}' from a low dtype to element type {to}")
        nodes.append(node)
        return 0
    if low is not None and node.op_type in SHAPE_OPS:
        nodes.append(node)
        return 0
    if low is None and node.op_type == "BatchNormalization":  # (FP32: folded as the emulator folds it)
        try:
            nodes.extend(_expanded(node, types, _FLOAT, inits))
            return 0
        except _Refused:
            pass
    if low is None:  # an FP32 node: ONNX Runtime computes it (its float outputs must be float32)
        nodes.append(_fp32_node(node, types))
        return 0
    if node.op_type in EXPANDED_OPS:
        nodes.extend(_expanded(node, types, low, inits))
        return 1
    _check_low_node(node, types, low, skip)
    if node.op_type in ("Resize", "Upsample"):
        _check_resize(node, types, inits)
    if node.op_type in ("ReduceMax", "ReduceMin"):
        nodes.extend(_nan_kept_extreme(node, inits))
        return 0
    if node.op_type == "Pad" and types_opset(types) < 11:  # its float ``value`` attribute: rounded when stored
        nodes.extend(_round_pair(node, low))
        return 1
    if node.op_type == "LeakyRelu":  # (its alpha as the emulator reads it: rounded to the node's dtype)
        nodes.extend(_round_pair(_rounded_alpha(node, low), low))
        return 1
    if node.op_type == "Relu":
        if not any(t.name == _ZERO for t in inits):
            inits.append(helper.make_tensor(_ZERO, _FLOAT, [], [0.0]))
        nodes.append(helper.make_node("Max", [node.input[0], _ZERO], list(node.output), name=node.name))
        return 0
    if node.op_type in EXACT_OPS:
        nodes.append(node)
        return 0
    nodes.extend(_round_pair(node, low))
    return 1


def _check_low_node(node: Any, types: Mapping[str, int], low: int, skip: tuple[int, ...]) -> None:
    """Refuse a low node off the lists, or one whose float inputs and outputs are not all of its low dtype."""
    op = node.op_type
    if op in EMULATOR_ONLY:
        raise _OffTheLists(f"low {op} cannot be expressed as a float32 graph because {EMULATOR_ONLY[op]}")
    if op not in ROUNDED_OPS and op not in EXACT_OPS:
        raise _OffTheLists(f"low {op} (node '{node.name}'): no float32 form of the emulator's kernel yet")
    if op in ("ReduceMax", "ReduceMin") and types_opset(types) < 9:
        raise _Refused(f"{op} '{node.name}' at opset {types_opset(types)} (its NaN check needs IsNaN, opset 9)")
    if op == "MaxPool" and len(node.output) > 1 and node.output[1]:
        raise _Refused(f"MaxPool '{node.name}' with its Indices output (the emulator computes it in onnx.reference)")
    if op == "ConvTranspose" and any(a.name == "output_shape" for a in node.attribute):
        raise _Refused(f"ConvTranspose '{node.name}' with output_shape (the emulator computes it in numpy)")
    if op == "ConvTranspose" and _auto_pad(node) not in ("NOTSET", "VALID"):
        raise _Refused(f"ConvTranspose '{node.name}' with auto_pad (the emulator computes it in numpy)")
    floats = [n for i, n in enumerate(node.input) if n and i not in skip and _is_float(types.get(n))]
    floats += [n for n in node.output if n and _is_float(types.get(n))]
    if any(types.get(n) != low for n in floats) or any(n and n not in types for n in node.output):
        raise _Refused(f"low-precision {op} node '{node.name}' with tensors of mixed or unknown float types")


def _fp32_node(node: Any, types: Mapping[str, int]) -> Any:
    """An FP32 node as it goes into the float32 graph: a Constant of a low dtype becomes float32, exactly."""
    from onnx import helper, numpy_helper

    if not any(types.get(n) in _LOW for n in node.output if n):
        return node
    if node.op_type not in ("Constant", "ConstantOfShape"):
        raise _Refused(f"{node.op_type} node '{node.name}' that makes a low-precision tensor from FP32 inputs")
    attrs = {}
    for a in node.attribute:
        if a.name != "value" or a.type != a.TENSOR:
            raise _Refused(f"{node.op_type} node '{node.name}' with attribute {a.name}")
        attrs["value"] = numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32))
    return helper.make_node(node.op_type, list(node.input), list(node.output), name=node.name, **attrs)


def _check_body(node: Any, types: Mapping[str, int]) -> None:
    """Refuse an If/Loop/Scan whose bodies hold or read low-precision tensors (the emulator rounds inside them)."""
    for a in node.attribute:
        for body in [a.g] if a.type == a.GRAPH else list(a.graphs):
            if _holds_low(body) or any(types.get(n) in _LOW for n in _outer(body)):
                raise _Refused(f"{node.op_type} '{node.name}' with low-precision tensors in its bodies")


def _holds_low(graph: Any) -> bool:
    """True when a graph (or a body nested in it) stores, declares, casts to or makes an FP16/BF16 tensor."""
    declared = list(graph.input) + list(graph.output) + list(graph.value_info)
    if any(t.data_type in _LOW for t in graph.initializer) or any(
        vi.type.tensor_type.elem_type in _LOW for vi in declared
    ):
        return True
    for n in graph.node:
        for a in n.attribute:
            if (a.name == "to" and a.type == a.INT and a.i in _LOW) or (a.type == a.TENSOR and a.t.data_type in _LOW):
                return True
            if any(_holds_low(g) for g in ([a.g] if a.type == a.GRAPH else list(a.graphs))):
                return True
    return False


def _outer(body: Any) -> set[str]:
    """Names a body (and its nested bodies) reads from enclosing graphs."""
    defined = {t.name for t in body.initializer} | {vi.name for vi in body.input}
    defined |= {o for n in body.node for o in n.output}
    reads = {i for n in body.node for i in n.input if i}
    for n in body.node:
        for a in n.attribute:
            for g in [a.g] if a.type == a.GRAPH else list(a.graphs):
                reads |= _outer(g)
    return reads - defined


def _rounded_alpha(node: Any, low: int) -> Any:
    """A LeakyRelu with its ``alpha`` rounded to ``low`` (kernels/elementwise._leaky multiplies by that value)."""
    from onnx import helper

    alpha = next((a.f for a in node.attribute if a.name == "alpha"), 0.01)
    rounded = float(np.asarray(np.float32(alpha)).astype(_LOW[low].numpy_dtype).astype(np.float32))
    return helper.make_node("LeakyRelu", list(node.input), list(node.output), name=node.name, alpha=rounded)


def _check_resize(node: Any, types: _Types | Mapping[str, int], inits: list[Any]) -> None:
    """Refuse a Resize/Upsample the cast graph cannot compute on the emulator's pixels (see RESIZE_COORDINATES)."""
    from onnx import helper, numpy_helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    text = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    opset = types_opset(types)
    old = node.op_type == "Upsample" or opset < 11
    coord = "asymmetric" if old else text.get("coordinate_transformation_mode", "half_pixel")
    # (cubic_coeff_a, exclude_outside and extrapolation_value weigh cubic/linear samples or tf_crop_and_resize's
    # outside pixels: nearest pixels by the modes above never read them; torch's exporter writes cubic_coeff_a always)
    known = {"mode", "coordinate_transformation_mode", "nearest_mode", "scales", *NEAREST_UNREAD}
    where = len(node.input) > (1 if old else 2) and node.input[1 if old else 2]
    weights = {t.name: t for t in inits}
    weights.update(types.constants if isinstance(types, _Types) else {})
    scales = np.asarray(numpy_helper.to_array(weights[where])) if where in weights else None
    if old and "scales" in attrs:
        scales = np.asarray(attrs["scales"], np.float32)
    sizes = not old and len(node.input) > 3 and node.input[3]
    whole = scales is not None and scales.size and np.all(scales >= 1) and np.all(scales == np.round(scales))
    if text.get("mode", "nearest") != "nearest" or coord not in RESIZE_COORDINATES or not set(attrs) <= known:
        raise _OffTheLists(f"low {node.op_type} (node '{node.name}') with mode {text.get('mode', 'nearest')}, "
                           f"coordinates {coord} or attributes {sorted(attrs)}: the emulator computes it")
    if sizes or not whole:
        raise _OffTheLists(f"low {node.op_type} (node '{node.name}') with sizes, scales computed at run time or "
                           "scales that are not whole numbers: the emulator computes it")


class _OffTheLists(_Refused):
    """A low node of an op type the cast graph does not compute (collected: the reason names each such op once)."""


def types_opset(types: Mapping[str, int]) -> int:
    """The default domain's opset recorded with ``types`` (0 when not recorded)."""
    return types.opset if isinstance(types, _Types) else 0


def _auto_pad(node: Any) -> str:
    for a in node.attribute:
        if a.name == "auto_pad":
            return a.s.decode()
    return "NOTSET"


def _is_float(elem: int | None) -> bool:
    return elem in (_FLOAT, _FLOAT16, _BFLOAT16, 11)


@functools.lru_cache(maxsize=4)
def _pair_exact(name: str) -> bool:
    """True when the Cast pair ``name`` (round_fp16 / round_bf16) at ORT_DISABLE_ALL gives numpy's bits."""
    from onnx import helper

    to = _FLOAT16 if name == "round_fp16" else _BFLOAT16
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=to), helper.make_node("Cast", ["h"], ["y"], to=_FLOAT)]
    g = helper.make_graph(nodes, "pair", [helper.make_tensor_value_info("x", _FLOAT, [None])],
                          [helper.make_tensor_value_info("y", _FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    try:
        sess = _session(model)
        return ortexec.cast_matches_numpy(name, lambda v: sess.run(None, {"x": v})[0])
    except Exception as err:  # no ml_dtypes, or an ONNX Runtime without the cast
        logger.debug("cast graph: %s unavailable (%s)", name, err)
        return False


def _session(model: Any) -> Any:
    """An ONNX Runtime CPU session with every graph optimisation off (see the module docstring)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = ort_log_level()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = min(ortexec.MAX_THREADS, usable_cpus())  # (the emulator's Conv sessions' threads)
    # Spinning on (ONNX Runtime's default, as in the floor's own passes): a cast graph is thousands of short kernels
    # run back to back (the 600-node net's 1,800), and an intra-op thread that sleeps between them wakes late for the
    # next. Convert's per-sample cost on that net fell by a fifth (2.29 -> 1.83 ms a sample, `bench/convert_cost.py
    # --samples 192,576,1920`), the published set 0-10 % faster (layout_cdla most), the same bits (bench/RESULTS.md).
    # (Calibration's sessions keep it off: the statistics need the cores between its calls, capture._options.)
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    # No prepacked weights: the emulator's MatMul/Gemm (kernels.ortexec) reads its weight as a graph input, which ONNX
    # Runtime never prepacks, and the prepacked kernel sums on other bits (a MatMul over 256 or more: 4-6% of the FP16
    # outputs one step apart). Conv's kernel gives the same bits either way.
    so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


class CastGraphSession:
    """``feeds -> outputs`` of a converted model through its cast graph, in the converted model's declared dtypes.

    FP16/BF16 inputs take data in that dtype, or float32 data, which is rounded to it (as the emulator rounds it
    at the first low node); FP16/BF16 outputs come back in their dtype.
    """

    def __init__(self, built: CastGraph) -> None:
        self._built = built
        self._sess = _session(built.model)
        self._names = [o.name for o in built.model.graph.output]

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs on ``feeds`` (graph output name -> array)."""
        low_in, low_out = self._built.low_inputs, self._built.low_outputs
        fed = {k: np.asarray(v).astype(low_in[k]).astype(np.float32) if k in low_in else v for k, v in feeds.items()}
        values = self._sess.run(self._names, fed)
        return {n: v.astype(low_out[n]) if n in low_out else v for n, v in zip(self._names, values, strict=True)}


def open_cast_session(model: Any) -> tuple[CastGraphSession | None, str]:
    """A session of ``model``'s cast graph, or None and the reason it does not qualify (or ORT refused it)."""
    built, why = cast_graph(model)
    if built is None:
        return None, why
    try:
        return CastGraphSession(built), ""
    except Exception as err:  # onnxruntime raises its own types: an attribute set or shape it refuses
        return None, f"ONNX Runtime refused the cast graph ({type(err).__name__}: {err})"


class StrictModelRunner:
    """A converted model under strict numerics: its cast graph where it qualifies, else the emulator.

    ``engine`` says which ran: :data:`ENGINE_CASTS`, :data:`ENGINE_EMULATOR`, or both joined by ``+`` when a
    cast-graph run failed (ONNX Runtime refusing the data) and the emulator took over from there.

    Args:
        model: The converted ``onnx.ModelProto``, or its file (external weights: the emulator runs it).
        open_emulator: ``model -> (feeds -> outputs)``: the emulator's runner (opened only when needed).
        cast_graph: False runs the emulator whatever the model.
        session: ``model``'s cast graph session, already open (the budget search's, of this very model): taken
            instead of building the cast graph again.
    """

    def __init__(
        self,
        model: Any,
        open_emulator: Callable[[Any], Callable[..., dict[str, np.ndarray]]],
        *,
        cast_graph: bool = True,
        session: CastGraphSession | None = None,
    ) -> None:
        self._model, self._open_emulator = model, open_emulator
        self._emulator: Callable[..., dict[str, np.ndarray]] | None = None
        self._fast: CastGraphSession | None = session
        why = "asked for the emulator" if not cast_graph else "a model file (external weights)"
        if session is None and cast_graph and not isinstance(model, (str, os.PathLike)):
            self._fast, why = open_cast_session(model)
        self._used: list[str] = []
        if self._fast is None and not cast_graph:  # (a later pass of a convert whose first pass said why already)
            logger.debug("strict numerics: the emulator runs the model (%s)", why)
        elif self._fast is None:  # one line per convert: the passes after this one ask for the emulator
            logger.info("strict numerics: the emulator runs the model: %s", why)
        else:
            logger.info("strict numerics: ONNX Runtime runs the model as a float32 graph with rounding casts%s",
                        " (the search's session of this very model)" if session is not None else "")

    @property
    def engine(self) -> str:
        """The engines that ran so far (the planned one before any run)."""
        if not self._used:
            return ENGINE_CASTS if self._fast is not None else ENGINE_EMULATOR
        return "+".join(self._used)

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The converted model's outputs on ``feeds``."""
        if self._fast is not None:
            try:
                out = self._fast(feeds)
                self._note(ENGINE_CASTS)
                return out
            except Exception as err:  # onnxruntime's own types: data it refuses; the emulator decides (and names it)
                logger.info("strict numerics: the cast graph failed (%s); the emulator runs the rest", err)
                self._fast = None
        if self._emulator is None:
            self._emulator = self._open_emulator(self._model)
        self._note(ENGINE_EMULATOR)
        return self._emulator(feeds)

    def _note(self, engine: str) -> None:
        if engine not in self._used:
            self._used.append(engine)
