"""Rewrite a graph from a plan: each node computes in its planned precision.

Casts go only where a tensor's dtype and its consumer's disagree.

* Casts are shared per (tensor, dtype) and named ``<tensor>__cast_to_fp16`` (node and output); a cast
  that narrows a tensor which is itself a widening cast of a low tensor reuses the low tensor instead
  (redundant pair folded).
* Initializers are converted once, in place, when every consumer wants the low dtype, and duplicated
  (``<name>__fp16``) only when consumers disagree. Constant nodes are converted like nodes.
* dtype-carrying attributes of low nodes are patched: ``Cast.to``, ``ConstantOfShape.value``,
  ``RandomNormal/RandomUniform(Like).dtype``, ``EyeLike.dtype``, ``Constant.value``.
* If/Loop/Scan bodies are rewritten like the main graph; values from the outer scope are cast inside the
  body where they enter, and body outputs are cast back so the container's interface keeps its types.
* ``value_info`` is retyped; graph inputs/outputs keep FP32 with ``keep_io_types`` (but those the user's model had
  in the low dtype before ``--force`` brought it back to FP32 keep that dtype: ``GraphInfo.low_io``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpinfer.modelio import tensor_array
from mpinfer.precision.core import FLOAT, FLOAT16, LOW_MAX, GraphInfo, Slots, clampable, constant_tensor
from mpinfer.precision.emulator import ortexec
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

CAST_TAG = {FLOAT: "fp32", FLOAT16: "fp16", 16: "bf16"}
# Ops whose output dtype is set by a ``dtype`` attribute (absent = FLOAT for the first two).
DTYPE_ATTR_OPS = {
    "RandomNormal": True,
    "RandomUniform": True,
    "RandomNormalLike": False,
    "RandomUniformLike": False,
    "EyeLike": False,
    "Bernoulli": False,
}


def low_array(arr: np.ndarray, low: Precision) -> np.ndarray:
    """``arr`` in the low dtype (FP16 or BF16); large float32 arrays to FP16 through ONNX Runtime's Cast.

    The conversion is exact (round to nearest even), the same bits as numpy's ``astype`` (checked on first
    use, see :mod:`mpinfer.precision.emulator.kernels.ortexec`), and 15x faster: every verification of the budget
    search converts the model's weights again. Finite values past the format's range are clamped to its largest
    finite value (``LOW_MAX``), never turned into inf; inf and NaN stay what they are, and so do float32's own
    extremes (``finfo(float32).min``: an additive mask's minus infinity).
    """
    out = None
    if low is Precision.FP16 and arr.dtype == np.float32:
        out = ortexec.cast(arr, "to_fp16")
    if out is None:
        with np.errstate(over="ignore"):
            out = arr.astype(low.numpy_dtype)
    if out.size and arr.dtype.kind == "f":
        overflow = np.isinf(out) if out.dtype.kind == "f" else np.isinf(out.astype(np.float32))  # (BF16: kind "V")
        if overflow.any():
            overflow &= clampable(arr)
            if overflow.any():
                fixed = np.array(arr, copy=True)
                fixed[overflow] = np.copysign(LOW_MAX[low], arr[overflow])
                with np.errstate(over="ignore"):  # (float32's extremes: to inf, as they mean)
                    out = fixed.astype(low.numpy_dtype)
    return out


def to_low_tensor(tensor: Any, low: Precision, base_dir: str = "") -> Any:
    """A TensorProto with the same name and shape in the low dtype (external data read from ``base_dir``)."""
    from onnx import numpy_helper

    arr = tensor_array(tensor, base_dir)  # external data memory-mapped: read once, never held in FP32
    out = numpy_helper.from_array(low_array(np.asarray(arr), low), tensor.name)
    return out


class GraphRewriter:
    """Applies node precisions to a (named) model.

    Args:
        info: Analysis of the model as planned (FP32 types).
        precisions: Node address → precision.
        low: FP16 or BF16.
        keep_io_types: Main-graph inputs and outputs keep their FP32 type.
    """

    def __init__(
        self,
        info: GraphInfo,
        precisions: Mapping[str, Precision],
        low: Precision,
        *,
        keep_io_types: bool = True,
    ) -> None:
        self.info = info
        self.precisions = precisions
        self.low = low
        self.low_type = low.onnx_dtype
        self.keep_io_types = keep_io_types
        self.types: dict[str, int] = dict(info.types)
        self.used: set[str] = set(info.types) | set(info.producer) | set(info.consumers)
        self.used |= {ref.node.name for ref in info.nodes}  # Cast nodes are named after their outputs
        self.copies: dict[str, str] = {}
        self.cast_count = 0
        self._slots: dict[str, Slots] = {}

    # -- entry ----------------------------------------------------------------------------------------
    def rewrite(self, model: Any) -> Any:
        """Return a rewritten copy of ``model`` (which must be the model ``info`` was built from)."""
        import onnx

        m = onnx.ModelProto()
        m.CopyFrom(model)
        graph = m.graph
        inits = {i.name for i in graph.initializer}
        for vi in graph.input:
            if self._low_io(vi.name) and vi.name not in inits and vi.type.tensor_type.elem_type == FLOAT:
                vi.type.tensor_type.elem_type = self.low_type
                self.types[vi.name] = self.low_type
        self._rewrite_graph(graph, "", [], main=True)
        return m

    def _low_io(self, name: str) -> bool:
        """Whether main-graph input or output ``name`` takes the low dtype.

        All of them without ``keep_io_types``; with it, those the user's model had in this low dtype before
        ``--force`` brought it back to FP32 (``info.low_io``: the user's low-precision I/O is kept, as AutoCast does).
        """
        return not self.keep_io_types or self.info.low_io.get(name) == self.low_type

    # -- graphs ---------------------------------------------------------------------------------------
    def _rewrite_graph(
        self, graph: Any, prefix: str, caches: list[dict[tuple[str, int], str]], *, main: bool
    ) -> None:
        import onnx

        cache: dict[tuple[str, int], str] = {}
        chain = [*caches, cache]
        self._convert_initializers(graph, main=main)
        new_nodes: list[Any] = []
        producers: dict[str, Any] = {}
        for node in graph.node:
            addr = prefix + node.name
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    self._rewrite_graph(attr.g, f"{addr}/{attr.name}/", chain, main=False)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for i, g in enumerate(attr.graphs):
                        self._rewrite_graph(g, f"{addr}/{attr.name}_{i}/", chain, main=False)
            is_low = self.precisions.get(addr, Precision.FP32).is_low
            slots = self._slots_of(addr, node) if is_low else Slots()
            for i, name in enumerate(node.input):
                if not name:
                    continue
                want = self.low_type if i in slots.inputs else self.info.types.get(name)
                node.input[i] = self._fetch(name, want, chain, new_nodes, producers)
            for i, name in enumerate(node.output):
                if name and name in self.info.types:
                    self.types[name] = self.low_type if i in slots.outputs else self.info.types[name]
            if is_low and slots.outputs:
                self._patch_attributes(node)
            new_nodes.append(node)
            for name in node.output:
                producers[name] = node
        self._fix_outputs(graph, new_nodes, main=main)
        del graph.node[:]
        graph.node.extend(new_nodes)
        self._retype_value_info(graph)

    def _slots_of(self, addr: str, node: Any) -> Slots:
        """``node``'s slots, asked of ``info`` with its own node where it has it.

        ``info`` caches slots per node object: the rules asked it already, the copy's node would miss.
        """
        known = self._slots.get(addr)
        if known is None:
            ref = self.info.by_address.get(addr)
            known = self._slots[addr] = self.info.slots(ref.node if ref is not None else node, self.low_type)
        return known

    def _wanted(self, name: str) -> set[int]:
        """The dtypes the consumers of ``name`` want (graph outputs included)."""
        wants = set()
        for addr, pos in self.info.consumers.get(name, []):
            node = self.info.by_address[addr].node
            if self.precisions.get(addr, Precision.FP32).is_low and pos in self._slots_of(addr, node).inputs:
                wants.add(self.low_type)
            else:
                wants.add(FLOAT)
        if name in self.info.graph_outputs:
            wants.add(self.low_type if self._low_io(name) else FLOAT)
        return wants

    def _convert_initializers(self, graph: Any, *, main: bool) -> None:
        inputs = {vi.name for vi in graph.input}
        extra = []
        for init in graph.initializer:
            if init.data_type != FLOAT or init.name in inputs:
                continue
            wants = self._wanted(init.name)
            if wants == {self.low_type}:
                init.CopyFrom(to_low_tensor(init, self.low, self.info.base_dir))
                self.types[init.name] = self.low_type
            elif self.low_type in wants:
                copy_name = self._unique(f"{init.name}__{CAST_TAG[self.low_type]}")
                t = to_low_tensor(init, self.low, self.info.base_dir)
                t.name = copy_name
                extra.append(t)
                self.copies[init.name] = copy_name
                self.types[copy_name] = self.low_type
        graph.initializer.extend(extra)

    # -- casts ----------------------------------------------------------------------------------------
    def _fetch(
        self,
        name: str,
        want: int | None,
        chain: list[dict[tuple[str, int], str]],
        new_nodes: list[Any],
        producers: Mapping[str, Any],
    ) -> str:
        """The name under which ``name`` is available in dtype ``want`` (inserting a Cast if needed)."""
        have = self.types.get(name)
        floats = (FLOAT, self.low_type)
        if want is None or have is None or have == want or want not in floats or have not in floats:
            return name
        if self.copies.get(name) and want == self.low_type:
            return self.copies[name]
        for cache in reversed(chain):
            if (name, want) in cache:
                return cache[(name, want)]
        src = producers.get(name)
        if (
            src is not None
            and src.op_type == "Cast"
            and src.input
            and self.types.get(src.input[0]) == want
            and want == self.low_type
            and have == FLOAT
        ):
            chain[-1][(name, want)] = src.input[0]  # low -> fp32 -> low is the identity: fold the pair
            return src.input[0]
        out = self._unique(f"{name}__cast_to_{CAST_TAG[want]}")
        new_nodes.append(_cast_node(name, out, want))
        self.types[out] = want
        self.cast_count += 1
        chain[-1][(name, want)] = out
        return out

    def _fix_outputs(self, graph: Any, new_nodes: list[Any], *, main: bool) -> None:
        for vi in graph.output:
            name = vi.name
            have = self.types.get(name)
            orig = self.info.types.get(name)
            if orig != FLOAT or have is None:
                continue
            want = self.low_type if (main and self._low_io(name)) else FLOAT
            if have == want:
                if main:
                    vi.type.tensor_type.elem_type = want
                continue
            if not main:
                out = self._unique(f"{name}__cast_to_{CAST_TAG[want]}")
                new_nodes.append(_cast_node(name, out, want))
                self.cast_count += 1
                self.types[out] = want
                vi.name = out
                continue
            renamed = self._unique(f"{name}__{CAST_TAG[have]}")
            _rename_tensor(new_nodes, name, renamed)
            self.types[renamed] = have
            node_name = self._unique(f"{name}__cast_to_{CAST_TAG[want]}")  # a consumer's cast may hold the name
            new_nodes.append(_cast_node(renamed, name, want, node_name=node_name))
            self.cast_count += 1
            self.types[name] = want
            vi.type.tensor_type.elem_type = want

    def _retype_value_info(self, graph: Any) -> None:
        produced = {o for n in graph.node for o in n.output}
        keep = []
        for vi in graph.value_info:
            if vi.name not in produced:
                continue
            t = self.types.get(vi.name)
            if t is not None and vi.type.HasField("tensor_type"):
                vi.type.tensor_type.elem_type = t
            keep.append(vi)
        del graph.value_info[:]
        graph.value_info.extend(keep)

    def _unique(self, name: str) -> str:
        out, n = name, 1
        while out in self.used:
            out = f"{name}_{n}"
            n += 1
        self.used.add(out)
        return out

    # -- attributes -------------------------------------------------------------------------------------
    def _patch_attributes(self, node: Any) -> None:
        from onnx import helper, numpy_helper

        op = node.op_type
        if op == "Cast":
            for a in node.attribute:
                if a.name == "to" and a.i == FLOAT:
                    a.i = self.low_type
        elif op in ("Constant", "ConstantOfShape"):

            t = (
                constant_tensor(node)
                if op == "Constant"
                else next((a.t for a in node.attribute if a.name == "value"), None)
            )
            if t is None:
                t = helper.make_tensor("value", FLOAT, [1], [0.0])
            if t.data_type != FLOAT:
                return
            new = numpy_helper.from_array(low_array(numpy_helper.to_array(t), self.low), t.name or "value")
            keep = [a for a in node.attribute if not a.name.startswith("value")]
            del node.attribute[:]
            node.attribute.extend(keep)
            node.attribute.append(helper.make_attribute("value", new))
        elif op in DTYPE_ATTR_OPS:
            found = False
            for a in node.attribute:
                if a.name == "dtype":
                    found = True
                    if a.i == FLOAT:
                        a.i = self.low_type
            if not found and DTYPE_ATTR_OPS[op]:
                node.attribute.append(helper.make_attribute("dtype", self.low_type))


def _cast_node(src: str, dst: str, to: int, node_name: str | None = None) -> Any:
    from onnx import helper

    return helper.make_node("Cast", [src], [dst], name=node_name or dst, to=to)


def _rename_tensor(nodes: list[Any], old: str, new: str) -> None:
    """Rename tensor ``old`` to ``new`` in ``nodes`` and in the bodies they hold (outer-scope uses)."""
    import onnx

    for node in nodes:
        for i, n in enumerate(node.input):
            if n == old:
                node.input[i] = new
        for i, n in enumerate(node.output):
            if n == old:
                node.output[i] = new
        for attr in node.attribute:
            graphs = (
                [attr.g]
                if attr.type == onnx.AttributeProto.GRAPH
                else (list(attr.graphs) if attr.type == onnx.AttributeProto.GRAPHS else [])
            )
            for g in graphs:
                _rename_tensor(list(g.node), old, new)
                for vi in g.output:
                    if vi.name == old:
                        vi.name = new


@dataclass(frozen=True)
class ApplyResult:
    """The rewritten model, the Casts inserted and the FP32 weights now stored in the low dtype.

    ``gated``: the SHA-256 of the bytes :func:`mpinfer.modelio.save_onnx` writes for ``model``, when every check of
    the validity gate ran on the model parsed from those bytes and passed (None: not gated that way).

    ``load``: the gate's ONNX Runtime load of those bytes, still running on a thread beside the final verification
    (:class:`~mpinfer.precision.graph.validate.PendingLoad`; ``gated`` is set once it passed:
    :func:`~mpinfer.precision.graph.validate.settle_load`). None: no load pending.
    """

    model: Any
    cast_count: int
    converted_weights: tuple[str, ...]
    gated: str | None = None
    load: Any = None  # (a validate.PendingLoad: validate imports this module, not the other way)


@dataclass(frozen=True)
class AppliedRun:
    """A candidate as applied and run: what convert takes from the search instead of doing it again.

    The search hands on the run of its final candidate (:attr:`SearchOutcome.applied
    <mpinfer.precision.budget.search.SearchOutcome>`), and it is the one record of it: the final apply takes
    ``result`` when the plan's precisions are ``precisions`` (:func:`~mpinfer.precision.graph.apply_validated`), and the
    final verification takes the search's outputs only when the model written is ``result.model`` itself, with
    ``open()`` as its runner (no second build). Made by the numerics (:meth:`Candidate.ran_as
    <mpinfer.precision.numerics.base.Candidate.ran_as>`).

    Attributes:
        precisions: Every node's precision (address -> precision).
        result: The :class:`ApplyResult` of ``precisions``: the model as it will be written.
        open: ``() -> Runner``: the numerics' runner of ``result.model`` (the one that computed the outputs).
        loaded: The numerics' runtime (ONNX Runtime, TensorRT) loaded and ran ``result.model`` itself, so the validity
            gate takes its load check as done; False for a cast graph (ONNX Runtime ran a float32 graph made from it).
    """

    precisions: dict[str, Precision]
    result: Any
    open: Callable[[], Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]]
    loaded: bool = False

    @property
    def model(self) -> Any:
        """The converted ``onnx.ModelProto``."""
        return self.result.model


def apply_plan(
    model: Any,
    info: GraphInfo,
    precisions: Mapping[str, Precision],
    low: Precision,
    *,
    keep_io_types: bool = True,
) -> ApplyResult:
    """Rewrite ``model`` (not modified) so each node computes in its planned precision.

    Args:
        model: The named FP32 model ``info`` describes.
        info: Its analysis.
        precisions: Node address → precision.
        low: FP16 or BF16.
        keep_io_types: Keep graph inputs/outputs FP32.

    Returns:
        The new model, the number of Casts inserted, and the converted weights.
    """
    rw = GraphRewriter(info, precisions, low, keep_io_types=keep_io_types)
    out = rw.rewrite(model)
    converted = tuple(
        sorted(
            n
            for n, t in info.types.items()
            if t == FLOAT and info.is_const(n) and (rw.types.get(n) == rw.low_type or n in rw.copies)
        )
    )
    return ApplyResult(out, rw.cast_count, converted)
