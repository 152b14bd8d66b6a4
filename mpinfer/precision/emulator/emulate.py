"""Strict mixed-precision emulation: a numpy node-by-node executor of ONNX graphs.

:class:`GraphEmulator` runs a graph (If/Loop/Scan bodies included) with a chosen precision per node. A
low-precision node rounds its float inputs to FP16/BF16, computes with every elementary step rounded to
that dtype (matrix products accumulate in FP32, as tensor cores do) and stores its float outputs in the
low dtype, so a downstream FP32 node reads the rounded values. ONNX Runtime's CPU provider, by contrast,
computes most FP16 ops in FP32 and understates the error a GPU shows.

Incremental runs make the precision search cheap: :meth:`GraphEmulator.run_from` reuses a kept reference
run and recomputes only the nodes downstream of the nodes whose precision changed.
"""

from __future__ import annotations

import logging
from collections import ChainMap
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpinfer.errors import BackendUnavailableError, InternalError, InvalidInputError, MpinferError, format_message
from mpinfer.memory import current_budget
from mpinfer.modelio import iter_nodes, name_nodes
from mpinfer.precision.emulator.compiled import (
    _addresses_under,
    _External,
    _Graph,
    _last_uses,
    _resolved,
    _Step,
    _toposort,
)
from mpinfer.precision.emulator.kernels import (
    NodeInfo,
    Numerics,
    RejectedInput,
    UnsupportedVariant,
    is_float,
    is_low_float,
    kernel_table,
    reference_available,
    reference_kernel,
)
from mpinfer.precision.emulator.kernels.control import CONTROL_FLOW_KERNELS
from mpinfer.specs import Precision, is_float_dtype

logger = logging.getLogger(__name__)

CONTROL_FLOW = ("If", "Loop", "Scan")
# Inputs that do not decide a node's precision: Resize roi and scales (float32 by the ONNX spec), BatchNorm's
# scale, bias, mean and variance (a low BatchNormalization is low because of its data input).
SKIP_ROUNDING = {"Resize": (1, 2), "Upsample": (1,), "BatchNormalization": (1, 2, 3, 4)}
# Inputs never rounded to the node's precision: Resize roi and scales stay float32 in the converted model. A low
# BatchNormalization's parameters are rounded like any input: the converted model stores them in the node's dtype
# (one type variable with the data before opset 15, lowered with it after), the cast graph folds the rounded values
# (caststeps), and the fold itself is FP32 (kernels/norm.py). Read unrounded, a candidate of the search scored a
# layout detector's BatchNorms by parameters the written model does not hold (an FP32 Constant feeding a low
# BatchNormalization: its Cast to FP16 in the written model rounds them).
KEPT_FP32 = {"Resize": (1, 2), "Upsample": (1,)}
# Ops whose output dtype comes from an attribute or a constant, not from the node's precision.
EXPLICIT_DTYPE_OPS = frozenset(
    {
        "Cast",
        "CastLike",
        "Constant",
        "ConstantOfShape",
        "EyeLike",
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Shape",
        "Size",
    }
)
Observer = Callable[[str, str, np.ndarray], None]


@dataclass
class EmulatorRun:
    """The result of one emulated run.

    Attributes:
        outputs: Graph output name -> array (float outputs in the declared graph dtype).
        tensors: Tensor name -> array of the main graph, for the names kept (all of them with ``keep=True``).
        low: The node address -> precision map the run used.
        complete: True when every main-graph tensor was kept (it can seed :meth:`GraphEmulator.run_from`).
        recomputed: Number of main-graph nodes executed.
    """

    outputs: dict[str, np.ndarray]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    low: dict[str, Precision] = field(default_factory=dict)
    complete: bool = False
    recomputed: int = 0


def unsupported_op_types(model: Any) -> set[str]:
    """What ``GraphEmulator(model).unsupported_ops()`` says, without compiling the model (nor reading a weight).

    The op types, in the main graph and in the bodies the emulator compiles, that neither an mpinfer kernel nor
    onnx.reference runs (``domain::op`` outside the default domain): the default floor's question before
    calibration (:func:`mpinfer.precision.options.floor_for_model`), 17 ms of compiling on a 600-node net.
    """
    from onnx import AttributeProto

    opsets = {imp.domain or "": int(imp.version) for imp in model.opset_import}
    kernels = kernel_table()
    out: set[str] = set()
    seen: set[str] = set()  # (an op's verdict is its domain's and type's: asked once)
    todo = [model.graph]
    while todo:
        for node in todo.pop().node:
            todo.extend(a.g for a in node.attribute if a.type == AttributeProto.GRAPH)
            domain = node.domain if node.domain not in ("", "ai.onnx") else ""
            name = node.op_type if not domain else f"{domain}::{node.op_type}"
            if (node.op_type in CONTROL_FLOW and not domain) or name in seen:
                continue
            seen.add(name)
            if not (not domain and node.op_type in kernels) and f"{domain}::{node.op_type}" not in kernels:
                if not reference_available(domain, node.op_type, opsets.get(domain, 1)):
                    out.add(name)
    return out


@dataclass
class _State:
    low: Mapping[str, Precision]
    observe: Observer | None


class GraphEmulator:
    """Numpy executor of an ONNX model with a per-node compute precision.

    Args:
        model: The ``onnx.ModelProto`` (not modified; unnamed nodes get ``name_nodes`` addresses).
        base_dir: The model file's folder, for weights kept in external data: they are memory-mapped when a node
            reads them (:func:`mpinfer.modelio.tensor_array`) and unmapped after, never all held at once; their
            FP16/BF16 roundings are cached up to the memory budget's ``weight_cache`` slice, the rest rounded per
            node as it runs.
        follow_input_dtypes: Nodes not named in ``low`` compute in the dtype of their float inputs
            (FP16 inputs -> FP16 arithmetic) instead of FP32; this is how a converted model is run.
    """

    def __init__(self, model: Any, *, follow_input_dtypes: bool = False, base_dir: str = "") -> None:
        addresses = [ref.address for ref in iter_nodes(model.graph)]  # type: ignore[attr-defined]
        unnamed = any(a == "" or a.endswith("/") for a in addresses)
        if unnamed or len(set(addresses)) != len(addresses):  # addresses must be the planner's, and unique
            model = name_nodes(model)
        self.follow_input_dtypes = follow_input_dtypes
        self._opsets = {imp.domain or "": int(imp.version) for imp in model.opset_import}
        self._kernels = kernel_table()
        self._numerics = {p: Numerics(p) for p in Precision}
        self._owner: dict[str, int] = {}
        self._op_types: dict[str, str] = {}
        self._unsupported: set[str] = set()
        self._fallback: dict[str, str] = {}
        self._rounded: dict[tuple[str, Precision], np.ndarray] = {}
        self._rounded_bytes = 0
        self._cache_limit = current_budget().weight_cache
        self._base_dir = base_dir
        self._main = self._compile(model.graph, "", top=True)
        self._last_use = _last_uses(self._main)

    # -- public API -------------------------------------------------------------------------------
    def unsupported_ops(self) -> set[str]:
        """Op types neither an mpinfer kernel nor onnx.reference can run (custom domains, mostly)."""
        return set(self._unsupported)

    def fallback_ops(self) -> dict[str, str]:
        """Node address -> op type of nodes computed by the onnx.reference fallback (FP32, output rounded)."""
        return dict(self._fallback)

    def node_addresses(self) -> dict[str, str]:
        """Every node address (main graph and bodies, graph order) -> its op type."""
        return dict(self._op_types)

    def run(
        self,
        feeds: Mapping[str, np.ndarray],
        low: Mapping[str, Precision] | None = None,
        *,
        keep: bool | set[str] = False,
        observe: Observer | None = None,
        known: Mapping[str, np.ndarray] | None = None,
    ) -> EmulatorRun:
        """Run the whole graph.

        Args:
            feeds: Input name -> array.
            low: Node address -> FP16/BF16; other nodes compute in FP32 (or their input dtype when
                ``follow_input_dtypes``).
            keep: True keeps every main-graph tensor (needed by :meth:`run_from`); a set keeps those names.
            observe: Called as ``observe(prefix, tensor name, array)`` for every tensor computed, subgraph
                tensors included (prefix ``""`` in the main graph, ``"If_3/then_branch/"`` in a body; once
                per loop iteration).
            known: Main-graph float32 tensors already computed in FP32 for these feeds (calibration's ONNX
                Runtime run): a main-graph node computed in FP32 whose outputs are all here is not executed,
                its outputs are taken from ``known``. Nodes computed low, and nodes with any other output
                (shapes, indices), still run.

        Returns:
            The run's outputs and kept tensors.

        Raises:
            InvalidInputError: Missing feeds or unknown node addresses in ``low``.
            BackendUnavailableError: The graph uses an op the emulator cannot run.
            InternalError: A kernel failed (the message names the node).
        """
        state = _State(self._check_low(low), observe)
        env = self._main_env(feeds)
        keep_all = keep is True
        keep_set = keep if isinstance(keep, set) else set()
        with np.errstate(all="ignore"):
            for idx, step in enumerate(self._main.steps):
                if not (known and self._take_known(step, known, env, state)):
                    self._exec_step(step, env, env, state)
                if not keep_all:
                    self._free_read(idx, step, env, keep_set)
        outputs = self._collect_outputs(env)
        tensors = env if keep_all else {k: env[k] for k in keep_set if k in env}
        return EmulatorRun(outputs, tensors, dict(state.low), keep_all, len(self._main.steps))

    def run_from(
        self, reference: EmulatorRun, low: Mapping[str, Precision] | None = None, *, keep: bool = True
    ) -> EmulatorRun:
        """Recompute only the nodes downstream of the nodes whose precision differs from ``reference``.

        Args:
            reference: A run made with ``keep=True`` (any precision map).
            low: The new node address -> precision map.
            keep: True keeps every tensor (the run can seed another ``run_from``); False frees each
                recomputed tensor after its last reader, so only about one live set is held on top of
                the reference, and the run has outputs only.

        Returns:
            A run equal to ``run(feeds, low)``; with ``keep`` its ``tensors`` share the reference's
            unchanged arrays.

        Raises:
            InvalidInputError: ``reference`` was not kept, or ``low`` names unknown nodes.
        """
        if not reference.complete:
            raise InvalidInputError(
                format_message(
                    "Reference run for run_from", "a run without kept tensors", "a run made with keep=True"
                )
            )
        new_low = self._check_low(low)
        rerun = self._rerun(reference.low, new_low)
        env: dict[str, Any] = dict(reference.tensors)
        state = _State(new_low, None)
        count = 0
        with np.errstate(all="ignore"):
            for idx, step in enumerate(self._main.steps):
                if rerun[idx]:
                    self._exec_step(step, env, env, state)
                    count += 1
                if not keep:  # drop tensors no later step reads (the reference keeps its own)
                    self._free_read(idx, step, env)
        if not keep:
            return EmulatorRun(self._collect_outputs(env), {}, dict(new_low), False, count)
        return EmulatorRun(self._collect_outputs(env), env, dict(new_low), True, count)

    @property
    def initializer_names(self) -> frozenset[str]:
        """The main graph's initializers (a kept run holds them too, shared by every run)."""
        return frozenset(self._main.initializers)

    def rerun_count(self, reference_low: Mapping[str, Precision], low: Mapping[str, Precision] | None) -> int:
        """Main-graph nodes :meth:`run_from` a run made with ``reference_low`` would execute for ``low`` (none run).

        Lets a caller holding several kept runs start each candidate from the one it shares most with.
        """
        return sum(self._rerun(reference_low, self._check_low(low)))

    def _rerun(self, reference_low: Mapping[str, Precision], new_low: Mapping[str, Precision]) -> list[bool]:
        """Per main-graph step: True when its precision differs from ``reference_low`` or it reads a changed tensor."""
        changed = {
            a
            for a in set(reference_low) | set(new_low)
            if reference_low.get(a, Precision.FP32) != new_low.get(a, Precision.FP32)
        }
        seeds = {self._owner[a] for a in changed}
        dirty: set[str] = set()
        out = []
        for idx, step in enumerate(self._main.steps):
            again = idx in seeds or not dirty.isdisjoint(step.reads)
            if again:
                dirty.update(step.outputs)
            out.append(again)
        return out

    def _main_env(self, feeds: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """The main graph's initializers and the feeds of its inputs (refused when a graph input has no feed)."""
        missing = [n for n in self._main.inputs if n not in feeds and n not in self._main.initializers]
        if missing:
            raise InvalidInputError(
                format_message(
                    "Feeds for the strict emulator",
                    f"names {sorted(feeds)}",
                    f"every graph input {self._main.inputs}",
                    "missing: " + ", ".join(missing),
                )
            )
        env: dict[str, Any] = dict(self._main.initializers)
        for name in self._main.inputs:
            if name in feeds:
                value = feeds[name]
                env[name] = value if isinstance(value, (list, type(None))) else np.asarray(value)
        return env

    def _free_read(
        self, idx: int, step: _Step, env: MutableMapping[str, Any], keep: set[str] | frozenset[str] = frozenset()
    ) -> None:
        """Drop from ``env`` the tensors ``step`` (main-graph step ``idx``) is the last reader of, except ``keep``."""
        for name in step.reads:
            if self._last_use.get(name) == idx and name not in keep:
                env.pop(name, None)

    # -- compilation ------------------------------------------------------------------------------
    def _compile(self, graph: Any, prefix: str, *, top: bool = False) -> _Graph:
        from onnx import numpy_helper
        from onnx.external_data_helper import uses_external_data

        inits = {
            t.name: _External(t, self._base_dir) if uses_external_data(t) else numpy_helper.to_array(t)
            for t in graph.initializer
        }
        inputs = [vi.name for vi in graph.input]
        steps = []
        for index, node in enumerate(_toposort(graph, inits)):
            steps.append(self._compile_node(node, prefix, index))
            if top:
                for addr in _addresses_under(steps[-1]):
                    self._owner[addr] = len(steps) - 1
        defined = set(inits) | {vi.name for vi in graph.input} | {o for s in steps for o in s.outputs}
        outer = {r for s in steps for r in s.reads if r and r not in defined}
        types = [vi.type.tensor_type.elem_type for vi in graph.output]
        return _Graph(prefix, steps, inputs, [vi.name for vi in graph.output], types, inits, outer)

    def _compile_node(self, node: Any, prefix: str, index: int) -> _Step:
        from onnx import AttributeProto, helper, numpy_helper

        address = f"{prefix}{node.name}"
        attrs: dict[str, Any] = {}
        bodies: dict[str, _Graph] = {}
        for a in node.attribute:
            if a.type == AttributeProto.GRAPH:
                bodies[a.name] = self._compile(a.g, f"{address}/{a.name}/")
            elif a.type == AttributeProto.TENSOR:
                attrs[a.name] = numpy_helper.to_array(a.t)
            elif a.type == AttributeProto.GRAPHS:
                attrs[a.name] = list(a.graphs)
            else:
                value = helper.get_attribute_value(a)
                attrs[a.name] = value.decode() if isinstance(value, bytes) else value
        domain = node.domain if node.domain not in ("", "ai.onnx") else ""
        info = NodeInfo(address, node.op_type, domain, self._opsets.get(domain, 1), attrs, node)
        self._op_types[address] = node.op_type
        kernel: Callable[..., list[np.ndarray]] | None = None
        if node.op_type not in CONTROL_FLOW or domain:
            if not domain and node.op_type in self._kernels:
                kernel = self._kernels[node.op_type]  # type: ignore[assignment]
            elif f"{domain}::{node.op_type}" in self._kernels:  # contrib ops mpinfer runs (com.microsoft)
                kernel = self._kernels[f"{domain}::{node.op_type}"]  # type: ignore[assignment]
            elif reference_available(domain, node.op_type, info.opset):
                kernel = reference_kernel
                self._fallback[address] = node.op_type
            else:
                self._unsupported.add(node.op_type if not domain else f"{domain}::{node.op_type}")
        reads = {i for i in node.input if i}
        for body in bodies.values():
            reads |= body.outer_reads
        return _Step(info, list(node.input), list(node.output), kernel, bodies, reads)

    def _check_low(self, low: Mapping[str, Precision] | None) -> dict[str, Precision]:
        out: dict[str, Precision] = {}
        unknown = []
        for addr, prec in (low or {}).items():
            if addr not in self._owner:
                unknown.append(addr)
                continue
            p = Precision.parse(prec)
            if p.is_low:
                out[addr] = p
        if unknown:
            raise InvalidInputError(
                format_message(
                    "Low-precision node addresses",
                    ", ".join(sorted(unknown)[:5]),
                    "addresses of nodes in the model (mpinfer.modelio.iter_nodes)",
                )
            )
        return out

    # -- execution --------------------------------------------------------------------------------
    def _precision(self, step: _Step, ins: list[Any], state: _State) -> Precision:
        p = state.low.get(step.info.address)
        if p is not None:
            return p
        if self.follow_input_dtypes:
            skip = SKIP_ROUNDING.get(step.info.op_type, ())
            for i, v in enumerate(ins):
                if i not in skip and is_low_float(v):
                    return Precision.FP16 if v.dtype == np.float16 else Precision.BF16
        return Precision.FP32

    def _load(self, step: _Step, ins: list[Any], num: Numerics, weights: set[int]) -> list[Any]:
        """The inputs rounded to the node's precision; ``weights``: positions holding main-graph initializers."""
        skip = KEPT_FP32.get(step.info.op_type, ())
        out = []
        for i, v in enumerate(ins):
            if not is_float(v):
                out.append(v)
            elif i in skip:
                out.append(v.astype(np.float32) if is_low_float(v) else v)
            elif num.low and i in weights:
                out.append(self._rounded_weight(step.inputs[i], v, num))
            else:
                out.append(num.load(v))
        return out

    def _rounded_weight(self, name: str, value: np.ndarray, num: Numerics) -> np.ndarray:
        """A weight as a low node reads it (rounded, held in float32).

        FP32 weights are rounded once and cached in the low dtype itself (half the bytes of the float32 they are
        read as, widened per node as it runs) while the cache stays within the budget's ``weight_cache`` slice;
        past it they are rounded on every run. ``num.store`` then ``num.load`` is bit for bit ``num.load``.
        """
        if value.dtype != np.float32:
            return num.load(value)
        key = (name, num.precision)
        cached = self._rounded.get(key)
        if cached is None:
            need = value.size * np.dtype(num.dtype).itemsize
            if self._rounded_bytes + need > self._cache_limit:
                return num.load(value)  # past the cache: rounded straight from float32, nothing stored
            cached = self._rounded[key] = num.store(value)
            self._rounded_bytes += cached.nbytes
        return num.load(cached)

    def _exec_step(
        self,
        step: _Step,
        local: MutableMapping[str, Any],
        scope: Mapping[str, Any],
        state: _State,
        prefix: str = "",
    ) -> None:
        """Run one node: read its inputs from ``scope``, compute at its precision, store its outputs in ``local``."""
        ins, weights = self._gather_inputs(step, scope)
        prec = self._precision(step, ins, state)
        num = self._numerics[prec]
        outs = self._compute(step, ins, weights, num, scope, state)
        self._store_outputs(step, outs, num, local, state, prefix)

    def _gather_inputs(self, step: _Step, scope: Mapping[str, Any]) -> tuple[list[Any], set[int]]:
        """The node's input values (external weights mapped) and the positions holding main-graph initializers."""
        try:
            raw = [scope[name] if name else None for name in step.inputs]
        except KeyError as err:
            raise InternalError(
                f"Strict emulation: node '{step.info.address}' reads tensor {err} that no node produced"
            ) from err
        inits = self._main.initializers
        weights = {i for i, v in enumerate(raw) if v is not None and v is inits.get(step.inputs[i])}
        ins = [_resolved(v) for v in raw]
        del raw
        return ins, weights

    def _compute(
        self, step: _Step, ins: list[Any], weights: set[int], num: Numerics, scope: Mapping[str, Any], state: _State
    ) -> list[Any]:
        """The node's outputs; a kernel's failure becomes a user error (data the model refuses) or a named bug."""
        info = step.info
        try:
            return self._run_kernel(step, ins, weights, num, scope, state)
        except (MpinferError, InternalError):
            raise
        except RejectedInput as err:  # the data does not fit the model (ONNX Runtime refuses it too)
            raise InvalidInputError(
                format_message(
                    f"Node '{info.address}' ({info.op_type})",
                    f"inputs it cannot take: {err}",
                    "data of the sizes the model is used at",
                    "check the input shapes (for random data, set dynamic dims with --dim NAME=N)",
                )
            ) from err
        except Exception as err:  # a kernel failing on a valid model is a bug; name the node
            raise InternalError(
                f"Strict emulation failed at node '{info.address}' ({info.op_type}) in "
                f"{num.precision.value}: {type(err).__name__}: {err}"
            ) from err

    def _run_kernel(
        self, step: _Step, ins: list[Any], weights: set[int], num: Numerics, scope: Mapping[str, Any], state: _State
    ) -> list[Any]:
        """The node's outputs from its control-flow runner, its kernel, or the onnx.reference fallback."""
        info = step.info
        if step.kernel is None and info.op_type in CONTROL_FLOW and not info.domain:
            try:
                return self._control(step, ins, scope, state)
            except UnsupportedVariant:
                self._fallback[info.address] = info.op_type
                return reference_kernel(info, num, ins)
        if step.kernel is None:
            raise BackendUnavailableError(
                format_message(
                    f"Strict emulation of node '{info.address}'",
                    f"op {info.domain or 'ai.onnx'}::{info.op_type}",
                    "an op with an mpinfer or onnx.reference kernel",
                    "use ONNX Runtime numerics (--numerics ort)",
                )
            )
        loaded = self._load(step, ins, num, weights)
        try:
            return step.kernel(info, num, loaded)
        except UnsupportedVariant:
            self._fallback[info.address] = info.op_type
            return reference_kernel(info, num, loaded)

    def _store_outputs(
        self,
        step: _Step,
        outs: list[Any],
        num: Numerics,
        local: MutableMapping[str, Any],
        state: _State,
        prefix: str,
    ) -> None:
        """Put the node's outputs in ``local``, float ones stored in the node's dtype, and show them to the observer."""
        info = step.info
        explicit = info.op_type in EXPLICIT_DTYPE_OPS and (self.follow_input_dtypes or not num.low)
        for name, value in zip(step.outputs, outs, strict=False):
            if not name:
                continue
            if not isinstance(value, (list, type(None))):  # sequences and empty optionals pass through
                value = np.asarray(value)
            if is_float(value) and not explicit and (num.low or info.op_type not in CONTROL_FLOW):
                value = num.store(value)
            local[name] = value
            if state.observe is not None:
                state.observe(prefix, name, value)

    def _take_known(
        self, step: _Step, known: Mapping[str, np.ndarray], env: MutableMapping[str, Any], state: _State
    ) -> bool:
        """Set ``step``'s outputs from ``known`` when it computes in FP32 and all of them are float32 there."""
        names = [n for n in step.outputs if n]
        values = [v for n in names if isinstance(v := known.get(n), np.ndarray) and v.dtype == np.float32]
        if not names or len(values) < len(names):
            return False
        if self._precision(step, [_resolved(env.get(i)) for i in step.inputs], state) is not Precision.FP32:
            return False
        for name, value in zip(names, values, strict=True):
            env[name] = value
            if state.observe is not None:
                state.observe("", name, value)
        return True

    def _collect_outputs(self, env: Mapping[str, Any]) -> dict[str, np.ndarray]:
        from onnx import helper

        out = {}
        for name, elem in zip(self._main.outputs, self._main.output_types, strict=False):
            value = _resolved(env[name])
            if is_float(value) and elem:
                want = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
                if want != value.dtype and is_float_dtype(want):
                    value = value.astype(want)
            out[name] = value
        return out

    def _body(
        self, graph: _Graph, bindings: Mapping[str, Any], outer: Mapping[str, Any], state: _State
    ) -> list[np.ndarray]:
        local: dict[str, Any] = dict(graph.initializers)
        local.update(bindings)
        scope = ChainMap(local, outer)  # type: ignore[arg-type]
        for step in graph.steps:
            self._exec_step(step, local, scope, state, graph.prefix)
        if state.observe is not None:
            for name, value in bindings.items():
                state.observe(graph.prefix, name, value)
        return [_resolved(scope[o]) for o in graph.outputs]

    def _control(
        self, step: _Step, ins: list[Any], scope: Mapping[str, Any], state: _State
    ) -> list[np.ndarray]:
        def run_body(body: _Graph, bindings: Mapping[str, Any]) -> list[np.ndarray]:
            return self._body(body, bindings, scope, state)

        return CONTROL_FLOW_KERNELS[step.info.op_type](step.info, step.bodies, ins, run_body)


