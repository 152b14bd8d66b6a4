"""Evaluators: how a candidate precision assignment is run, one class per numerics.

The budget search, its screening and the final verification ask the same questions of whatever runs the
candidates: the FP32 reference outputs of the search batches, a candidate's outputs on them (and on a subset of
the samples, for screening), each group's local error (sensitivity), and a runner for a model as it will be
written. :class:`Evaluator` is that protocol; :func:`evaluator_class` is the one place that maps a
``--numerics`` name to its class.

- :class:`StrictEvaluator` (``strict``): the strict emulator
  (:class:`~mpinfer.precision.emulator.emulate.GraphEmulator`),
  incremental runs from kept FP32 reference runs.
- :class:`OrtEvaluator` (``ort``; ``ort-cuda`` for the CUDA provider): the candidate applied and run by ONNX
  Runtime; sensitivities from the one-session probe.
- :class:`TensorRtEvaluator` (``tensorrt``): the candidate applied, built into a strongly typed TensorRT engine
  and run on the GPU (TensorRT and torch are imported on first use).
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from mpinfer.backends.ort import OrtRunner, cuda_usable
from mpinfer.backends.trt_runner import TrtRunner
from mpinfer.engine.config import Backend, BuildConfig, ShapeProfile
from mpinfer.engine.trt_builder import build_trt_engine
from mpinfer.errors import BackendUnavailableError, InvalidInputError, format_message
from mpinfer.gpu import cuda_device_count, gpu_info, require_gpu, tensorrt_installed
from mpinfer.metrics import relative_l2
from mpinfer.modelio import ort_session, save_onnx
from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.emulator.castgraph import StrictModelRunner, may_qualify, open_cast_session
from mpinfer.precision.emulator.emulate import GraphEmulator
from mpinfer.precision.emulator.kernels.numerics import is_float, is_low_float
from mpinfer.precision.emulator.runner import StrictRunner
from mpinfer.precision.graph.apply import apply_plan
from mpinfer.precision.numerics import probe
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

# Strict numerics screen only models whose kept FP32 reference runs hold at least this many float values per
# node (CNNs: ~1e6; small transformers: ~1e4, where the per-node overhead dominates the emulator's time).
STRICT_SCREEN_MIN_VALUES = 100_000

Outputs = dict[str, np.ndarray]
Runner = Callable[[Mapping[str, np.ndarray]], Outputs]


class Candidate(Protocol):
    """One candidate precision assignment, ready to run."""

    def outputs(self) -> list[Outputs]:
        """Its outputs on every search batch (one dict per batch)."""

    def outputs_on(self, feeds: Mapping[str, np.ndarray], rows: np.ndarray) -> Outputs:
        """Its outputs on the samples ``rows`` of the joined search batches (``feeds`` holds those rows)."""

    def verified(self) -> tuple[dict[str, Precision], Any] | None:
        """(precisions, ApplyResult) when the candidate was applied and run as it would be written, else None."""


class Evaluator(Protocol):
    """Runs candidate precision assignments of one model on fixed search batches, and counts the cost.

    Class attributes say what the numerics can do: ``name`` (the ``--numerics`` value), ``supports_bf16``
    (verifies BF16 candidates), ``wants_fp32_tensors`` (takes every FP32 tensor of calibration's run as its
    reference, so calibration keeps them), ``emulated`` (runs on the strict emulator, so a model with ops it
    has no kernels for cannot be verified with it).
    """

    name: ClassVar[str]
    supports_bf16: ClassVar[bool]
    wants_fp32_tensors: ClassVar[bool]
    emulated: ClassVar[bool]
    evaluations: int  # node evaluations so far: the search's cost figure

    @classmethod
    def check_available(cls) -> None:
        """Refuse numerics this machine cannot run (a missing runtime or GPU), before any work."""

    def reference(self) -> list[Outputs]:
        """The FP32 model's outputs on the search batches (the reference every candidate is judged against)."""

    def candidate(self, low: Mapping[str, Precision]) -> Candidate:
        """The candidate whose low nodes (address → precision) are ``low``; every other node FP32."""

    def screen_rows(self, hardest: Callable[[], np.ndarray | None]) -> np.ndarray | None:
        """The samples to screen candidates on (``hardest()`` proposes them), or None: no screening."""

    def sensitivities(self, groups: Sequence[Any], batches: list[Outputs], subset: bool) -> dict[str, float]:
        """Each group's local error (only the group low, fed FP32 tensors), by anchor, on ``batches``.

        ``subset``: ``batches`` are the hardest samples rather than the search batches themselves.
        """

    @classmethod
    def model_runner(cls, model: Any, *, fast: bool = True) -> Runner:
        """``batch → outputs`` of a whole converted model under these numerics (the final verification).

        ``fast=False``: the numerics' own engine where they have a faster one (strict: the emulator, never the
        cast graph), so that passes compared with one another (the floor's noise, repairs) use one engine.
        """


# -- strict emulation ------------------------------------------------------------------------------------------
def open_emulator(model: Any, *, required: bool, base_dir: str = "") -> GraphEmulator | None:
    """The strict emulator of ``model``; None when it has ops the emulator cannot run and ``required`` is False.

    ``base_dir``: the model file's folder when its weights stay external (memory-mapped from there).

    Raises:
        InvalidInputError: ``required`` and the model has ops without strict kernels.
    """
    emu = GraphEmulator(model, base_dir=base_dir)
    missing = emu.unsupported_ops()
    if missing and required:
        raise InvalidInputError(
            format_message(
                "Strict numerics",
                f"a model with ops the emulator cannot run ({', '.join(sorted(missing))})",
                "ops with strict kernels",
                "use --numerics ort (not for bf16), or convert without --budget",
            )
        )
    return None if missing else emu


def local_error(model: Any, info: GraphInfo, group: Any, refs: list[Any], low: Precision) -> tuple[float, int]:
    """Relative L2 error at the group's outputs when only the group runs low, fed FP32 reference tensors.

    Returns the error and the node evaluations it cost.
    """
    built = probe.group_submodel(info, group.members)
    if built is None:
        return 0.0, 0
    sub, outs = built
    feeds_names = [vi.name for vi in sub.graph.input]
    emu = GraphEmulator(sub, base_dir=info.base_dir)
    noise = signal = 0.0
    for ref in refs:
        run = emu.run({n: ref.tensors[n] for n in feeds_names}, {a: low for a in group.members})
        for o in outs:
            want = np.asarray(ref.tensors[o], np.float64)
            got = np.asarray(run.outputs[o], np.float64)
            if not np.all(np.isfinite(got[np.isfinite(want)])):
                return math.inf, len(group.members) * len(refs)
            ok = np.isfinite(want)
            noise += float(((got - want)[ok] ** 2).sum())
            signal += float((want[ok] ** 2).sum())
    return relative_l2(noise, signal), len(group.members) * len(refs)


class _EmulatorRefs:
    """The strict emulator and its kept FP32 runs of the search batches (opened on first use)."""

    def __init__(self, model: Any, info: GraphInfo, batches: list[Outputs], *, required: bool) -> None:
        self.model, self.info, self.batches, self.required = model, info, batches, required
        self.emu: GraphEmulator | None = None
        self.refs: list[Any] = []
        self.opened = False
        self.evaluations = 0

    def emulator(self) -> GraphEmulator | None:
        """The emulator (compiled on first use; None when it cannot run the model and is not ``required``)."""
        if self.emu is None and not self.opened:
            self.emu = open_emulator(self.model, required=self.required, base_dir=self.info.base_dir)
            self.opened = self.emu is None
        return self.emu

    def open(self, known: list[Outputs] | None = None) -> None:
        """Open the emulator and run (or take from ``known``, one dict per batch) the FP32 reference runs."""
        if self.opened:
            return
        emu = self.emulator()
        self.opened = True
        if emu is not None:
            seeds = known if known is not None and len(known) == len(self.batches) else [None] * len(self.batches)
            self.refs = [emu.run(b, None, keep=True, known=k) for b, k in zip(self.batches, seeds, strict=True)]
            self.evaluations += len(self.info.nodes) * len(self.refs)

    def local_errors(self, groups: Sequence[Any], batches: list[Outputs], subset: bool, low: Precision) -> dict:
        """Every group's :func:`local_error` on the kept runs (or fresh FP32 runs of ``batches`` when ``subset``)."""
        self.open()
        if self.emu is None:
            return {}
        refs = self.refs
        if subset:
            refs = [self.emu.run(b, None, keep=True) for b in batches]
            self.evaluations += len(self.info.nodes) * len(refs)
        out = {}
        for g in groups:
            out[g.anchor], evals = local_error(self.model, self.info, g, refs, low)
            self.evaluations += evals
        return out


class StrictEvaluator:
    """Strict numerics: the emulator, each candidate an incremental run from the kept FP32 runs."""

    name: ClassVar[str] = "strict"
    supports_bf16: ClassVar[bool] = True
    wants_fp32_tensors: ClassVar[bool] = True
    emulated: ClassVar[bool] = True

    @classmethod
    def check_available(cls) -> None:
        """Strict emulation runs wherever mpinfer does (numpy and ONNX Runtime's CPU kernels)."""

    def __init__(
        self,
        model: Any,
        info: GraphInfo,
        batches: list[Outputs],
        precision: Precision,
        *,
        keep_io_types: bool = True,
        known_outputs: list[Outputs] | None = None,
        known_tensors: list[Outputs] | None = None,
    ) -> None:
        self.info, self.precision, self.keep_io_types = info, precision, keep_io_types
        self._emu = _EmulatorRefs(model, info, batches, required=True)
        self._emu.emulator()  # (refuses a model with ops the emulator cannot run, before any work)
        # The FP32 runs every candidate is an incremental run from are made when a candidate needs them. Without
        # calibration's tensors (too many bytes to keep) the first candidate (the rule plan, which most often passes)
        # runs whole, against calibration's FP32 outputs, and the runs are made only if a second candidate comes.
        self._known_tensors = known_tensors
        self._known_outputs = known_outputs if known_outputs is not None and len(known_outputs) == len(batches) \
            else None
        self._first_run = False  # whether the first candidate ran (whole runs, no kept FP32 runs needed)
        self._screen_ref: tuple[np.ndarray, Any] | None = None  # (screening rows, their kept FP32 run)
        self._values_per_node: float | None = None
        self._extra = 0

    @property
    def evaluations(self) -> int:
        """Node evaluations so far (emulator reference runs included)."""
        return self._emu.evaluations + self._extra

    @evaluations.setter
    def evaluations(self, value: int) -> None:
        self._extra = value - self._emu.evaluations

    def reference(self) -> list[Outputs]:
        """The FP32 outputs: calibration's (ONNX Runtime's) where it kept them, else those of the kept FP32 runs."""
        if self._known_outputs is not None:
            return self._known_outputs
        self._open()
        return [r.outputs for r in self._emu.refs]

    def _open(self) -> None:
        """The kept FP32 emulator runs, made (or taken from calibration's tensors) on first use."""
        if not self._emu.opened:
            self._emu.open(self._known_tensors)
            self._known_tensors = None  # (the runs hold them now)

    def candidate(self, low: Mapping[str, Precision]) -> Candidate:
        """A candidate run incrementally from the kept FP32 runs."""
        return _StrictCandidate(self, dict(low))

    def run_from_refs(self, low: dict[str, Precision]) -> list[Outputs]:
        """The candidate's outputs on every search batch, each an incremental run from the batch's FP32 run."""
        emu = self._emu.emu
        assert emu is not None
        first, self._first_run = not self._first_run, True
        if first and not self._emu.opened and self._known_tensors is None:
            # the first candidate, and no FP32 tensors from calibration to take the FP32 runs from: whole runs (an FP32
            # run of the search samples costs as much again, and is made only if a second candidate needs it), in
            # ONNX Runtime when the applied candidate qualifies for a cast graph (castgraph: the emulator's bits)
            fast = self._cast_graph_runs(low)
            if fast is not None:
                return fast
            outs = []
            for batch in self._emu.batches:
                outs.append(emu.run(batch, low).outputs)
                self.evaluations += len(self.info.nodes)
            return outs
        self._open()
        outs = []
        for ref in self._emu.refs:
            run = emu.run_from(ref, low, keep=False)
            self.evaluations += run.recomputed
            outs.append(run.outputs)
        return outs

    def _cast_graph_runs(self, low: dict[str, Precision]) -> list[Outputs] | None:
        """The candidate applied and run on every search batch as a cast graph; None where it does not qualify."""
        if not may_qualify((self.info.by_address[a].node.op_type for a in low), self._emu.model):
            return None
        precisions = {a: low.get(a, Precision.FP32) for a in self.info.by_address}
        applied = apply_plan(self._emu.model, self.info, precisions, self.precision, keep_io_types=self.keep_io_types)
        sess, why = open_cast_session(applied.model)
        if sess is None:
            logger.debug("search: the emulator judges the first candidate (no cast graph: %s)", why)
            return None
        outs = []
        try:
            for batch in self._emu.batches:  # (the FP32 model's outputs are float32: a low output comes back widened)
                outs.append({k: v.astype(np.float32) if is_low_float(v) else v for k, v in sess(batch).items()})
        except Exception as err:  # onnxruntime's own types: data it refuses; the emulator decides (and names it)
            logger.debug("search: the cast graph failed (%s); the emulator judges the first candidate", err)
            return None
        self.evaluations += len(self.info.nodes) * len(self._emu.batches)
        logger.info("search: the first candidate judged by ONNX Runtime as a float32 graph with rounding casts")
        return outs

    def strict_rows(self, feeds: Mapping[str, np.ndarray], rows: np.ndarray, low: Mapping[str, Precision]) -> Outputs:
        """Outputs of the candidate ``low`` on the samples ``rows`` (their ``feeds``).

        An incremental run from an FP32 run of those rows, made on the first call and kept (the rows are then
        fixed, see :meth:`screen_rows`).
        """
        assert self._emu.emu is not None
        if self._screen_ref is None:
            self._screen_ref = rows, self._emu.emu.run(dict(feeds), None, keep=True)
            self.evaluations += len(self.info.nodes)
        run = self._emu.emu.run_from(self._screen_ref[1], dict(low), keep=False)
        self.evaluations += run.recomputed
        return run.outputs

    def screen_rows(self, hardest: Callable[[], np.ndarray | None]) -> np.ndarray | None:
        """The screening rows, chosen once (from the first full verification) and kept.

        Each new set of rows costs an FP32 emulator run of them, so they stay fixed. Only for models whose
        emulation cost follows the data (``STRICT_SCREEN_MIN_VALUES`` float values per node in the kept
        reference runs, e.g. CNNs): where the per-node overhead dominates (small transformers), a run on an
        eighth of the samples costs almost what the full incremental run does, and screening would cost more
        than it saves.
        """
        if self._screen_ref is not None:
            return self._screen_ref[0]
        if not self._first_run:
            return None  # (before the first candidate's runs: no hardness to screen on yet)
        self._open()
        if self._values_per_node is None:
            values = sum(
                v.size
                for r in self._emu.refs
                for v in r.tensors.values()
                if isinstance(v, np.ndarray) and is_float(v)
            )
            self._values_per_node = values / max(len(self.info.nodes), 1)
        if self._values_per_node < STRICT_SCREEN_MIN_VALUES:
            return None
        return hardest()

    def sensitivities(self, groups: Sequence[Any], batches: list[Outputs], subset: bool) -> dict[str, float]:
        """Each group run alone as a small emulator sub-model on FP32 tensors."""
        self._open()
        return self._emu.local_errors(groups, batches, subset, self.precision)

    @classmethod
    def model_runner(cls, model: Any, *, fast: bool = True) -> Runner:
        """The converted model under strict numerics: its cast graph where it qualifies, else :class:`StrictRunner`.

        ``fast=False``: :class:`StrictRunner` whatever the model.

        The runner's ``engine`` says which ran (:class:`~mpinfer.precision.emulator.castgraph.StrictModelRunner`).
        """
        return StrictModelRunner(model, _emulator_runner, cast_graph=fast)


def _emulator_runner(model: Any) -> Runner:
    """The converted model as ``mpinfer compare --numerics strict`` runs it (:class:`StrictRunner`)."""
    runner = StrictRunner(model, name="candidate")
    runner.activate()
    return runner.infer


class _StrictCandidate:
    def __init__(self, ev: StrictEvaluator, low: dict[str, Precision]) -> None:
        self.ev, self.low = ev, low

    def outputs(self) -> list[Outputs]:
        return self.ev.run_from_refs(self.low)

    def outputs_on(self, feeds: Mapping[str, np.ndarray], rows: np.ndarray) -> Outputs:
        return self.ev.strict_rows(feeds, rows, self.low)

    def verified(self) -> tuple[dict[str, Precision], Any] | None:
        return None


# -- an applied model run by a runtime ---------------------------------------------------------------------------
class _AppliedEvaluator:
    """Numerics that run the candidate as it would be written: the plan applied, the model run by a runtime.

    Subclasses say how a model is run (:meth:`session`). Sensitivities come from the ONNX Runtime probe (all
    groups in one model), and from the strict emulator for groups the probe cannot copy.
    """

    name: ClassVar[str]
    supports_bf16: ClassVar[bool] = False
    wants_fp32_tensors: ClassVar[bool] = False
    emulated: ClassVar[bool] = False

    @classmethod
    def check_available(cls) -> None:
        """Nothing to check by default (ONNX Runtime's CPU provider is a dependency of mpinfer)."""

    def __init__(
        self,
        model: Any,
        info: GraphInfo,
        batches: list[Outputs],
        precision: Precision,
        *,
        keep_io_types: bool = True,
        known_outputs: list[Outputs] | None = None,
        known_tensors: list[Outputs] | None = None,
    ) -> None:
        del known_tensors  # the runtime computes every tensor; only the outputs are worth taking
        self.model, self.info, self.batches = model, info, batches
        self.precision, self.keep_io_types = precision, keep_io_types
        self._ref: list[Outputs] | None = None
        if known_outputs is not None and len(known_outputs) == len(batches) and _has_all_outputs(model, known_outputs):
            self._ref = known_outputs  # calibration keeps float outputs: an integer one needs a run of its own
        self._emu = _EmulatorRefs(model, info, batches, required=False)
        self._extra = 0

    @property
    def evaluations(self) -> int:
        """Node evaluations so far (emulator reference runs included)."""
        return self._emu.evaluations + self._extra

    @evaluations.setter
    def evaluations(self, value: int) -> None:
        self._extra = value - self._emu.evaluations

    @classmethod
    def session(cls, model: Any, base_dir: str = "") -> Runner:
        """``batch → outputs`` (floats as float32) of ``model`` in this runtime.

        ``base_dir``: the model file's folder when its weights stay external (memory-mapped from there).
        """
        raise NotImplementedError

    def reference(self) -> list[Outputs]:
        """The FP32 model run by this runtime (or the outputs calibration kept)."""
        if self._ref is None:
            run = self.session(self.model, self.info.base_dir)
            self._ref = [run(b) for b in self.batches]
        return self._ref

    def candidate(self, low: Mapping[str, Precision]) -> Candidate:
        """The plan applied (as it would be written) and loaded into a session of this runtime."""
        precisions = {a: low.get(a, Precision.FP32) for a in self.info.by_address}
        applied = apply_plan(self.model, self.info, precisions, self.precision, keep_io_types=self.keep_io_types)
        return _AppliedCandidate(self, precisions, applied, self.session(applied.model, self.info.base_dir))

    def screen_rows(self, hardest: Callable[[], np.ndarray | None]) -> np.ndarray | None:
        """The hardest samples: a session runs any subset at the cost of its rows."""
        return hardest()

    def sensitivities(self, groups: Sequence[Any], batches: list[Outputs], subset: bool) -> dict[str, float]:
        """All groups in one ONNX Runtime probe model; the emulator for groups the probe cannot copy."""
        del subset  # the probe runs on whatever samples it is given; the emulator fallback on the kept runs
        probed = probe.probe_errors(self.info, groups, batches, self.precision)
        self.evaluations += probed.evaluations
        errors = dict(probed.errors)
        todo = [g for g in groups if g.anchor not in errors]
        if todo:
            errors.update(self._emu.local_errors(todo, self.batches, False, self.precision))
        return errors

    @classmethod
    def model_runner(cls, model: Any, *, fast: bool = True) -> Runner:
        """The converted model in a session of this runtime (``fast``: no other engine to choose)."""
        return cls.session(model)


class _AppliedCandidate:
    def __init__(self, ev: _AppliedEvaluator, precisions: dict[str, Precision], applied: Any, run: Runner) -> None:
        self.ev, self.precisions, self.applied, self.run = ev, precisions, applied, run

    def outputs(self) -> list[Outputs]:
        outs = [self.run(b) for b in self.ev.batches]
        self.ev.evaluations += len(self.ev.info.nodes) * len(self.ev.batches)
        return outs

    def outputs_on(self, feeds: Mapping[str, np.ndarray], rows: np.ndarray) -> Outputs:
        self.ev.evaluations += len(self.ev.info.nodes)
        return self.run(feeds)

    def verified(self) -> tuple[dict[str, Precision], Any] | None:
        return self.precisions, self.applied


def _has_all_outputs(model: Any, outputs: Sequence[Mapping[str, Any]]) -> bool:
    """True when ``outputs`` hold every graph output (calibration keeps only the float ones)."""
    return all(o.name in outputs[0] for o in model.graph.output)


def float32_outputs(names: Sequence[str], values: Sequence[Any]) -> Outputs:
    """Float outputs as float32, others as they come."""
    return {
        n: np.asarray(v, np.float32) if np.asarray(v).dtype.kind == "f" else v
        for n, v in zip(names, values, strict=False)
    }


class OrtEvaluator(_AppliedEvaluator):
    """ONNX Runtime numerics on its CPU provider (the kernels a CPU deployment runs)."""

    name: ClassVar[str] = "ort"
    providers: ClassVar[tuple[str, ...]] = ("CPUExecutionProvider",)
    device: ClassVar[str] = "cpu"  # the OrtRunner device of the final verification

    @staticmethod
    def ort_run(sess: Any, batch: Mapping[str, np.ndarray]) -> Outputs:
        """Float outputs as float32 (others as they come) of one ONNX Runtime session run."""
        names = [o.name for o in sess.get_outputs()]
        low = {i.name for i in sess.get_inputs() if i.type == "tensor(float16)"}  # --no-keep-io-types: data cast
        feeds = {k: v.astype(np.float16) if k in low and v.dtype == np.float32 else v for k, v in batch.items()}
        return float32_outputs(names, sess.run(names, feeds))

    @classmethod
    def session(cls, model: Any, base_dir: str = "") -> Runner:
        """An ONNX Runtime session on :attr:`providers`."""
        sess = ort_session(model, providers=list(cls.providers), base_dir=base_dir or None)
        return lambda batch: cls.ort_run(sess, batch)

    @classmethod
    def model_runner(cls, model: Any, *, fast: bool = True) -> Runner:
        """The converted model as ``mpinfer compare --numerics ort`` runs it (:class:`OrtRunner`; no other engine)."""
        runner = OrtRunner(model, device=cls.device, name="candidate")
        runner.activate()
        return runner.infer


class OrtCudaEvaluator(OrtEvaluator):
    """ONNX Runtime numerics on its CUDA provider (a GPU's FP16/BF16 kernels; needs onnxruntime-gpu)."""

    name: ClassVar[str] = "ort-cuda"
    supports_bf16: ClassVar[bool] = True
    providers: ClassVar[tuple[str, ...]] = ("CUDAExecutionProvider",)
    device: ClassVar[str] = "cuda"

    @classmethod
    def check_available(cls) -> None:
        """Refuse an ONNX Runtime without a usable CUDA provider.

        Raises:
            BackendUnavailableError: No CUDA provider, or no visible GPU.
        """
        if not cuda_usable():  # never a silent fall back to the CPU provider: that would be other numerics
            raise BackendUnavailableError(
                format_message(
                    "--numerics ort-cuda",
                    "an ONNX Runtime without a usable CUDA provider (or no visible GPU)",
                    "onnxruntime-gpu with a visible GPU",
                    "install onnxruntime-gpu, or use --numerics ort",
                )
            )

    @classmethod
    def session(cls, model: Any, base_dir: str = "") -> Runner:
        """An ONNX Runtime session on the CUDA provider; refused where onnxruntime has none."""
        cls.check_available()
        return super().session(model, base_dir)


class TensorRtEvaluator(_AppliedEvaluator):
    """TensorRT numerics: each candidate applied, built into a strongly typed engine and run on the GPU.

    The engine is built by :func:`mpinfer.engine.trt_builder.build_trt_engine` (``OnnxParser``,
    ``STRONGLY_TYPED`` networks on TensorRT 10, ``build_serialized_network``) with one optimization profile
    spanning the batches' shapes, and run by :class:`mpinfer.backends.trt_runner.TrtRunner`
    (``set_input_shape``, ``set_tensor_address``, ``execute_async_v3``). An engine build takes seconds to
    minutes, so a search costs that per verification.
    """

    name: ClassVar[str] = "tensorrt"
    supports_bf16: ClassVar[bool] = True
    device_index: ClassVar[int] = 0
    # Largest batch the engine's profile takes (the search batches and the verification's batches).
    max_rows: ClassVar[int] = 64

    @classmethod
    def check_available(cls) -> None:
        """Refuse a machine without the ``tensorrt`` package or without the GPU (:attr:`device_index`).

        Raises:
            BackendUnavailableError: No TensorRT, or no such CUDA device.
        """
        hint = "run convert on a machine with an NVIDIA GPU and TensorRT, or use --numerics strict or ort"
        if not tensorrt_installed():
            raise BackendUnavailableError(
                format_message(
                    "--numerics tensorrt", "no `tensorrt` Python package", "TensorRT 10 or 11 and an NVIDIA GPU", hint
                )
            )
        if gpu_info(cls.device_index) is None:
            raise BackendUnavailableError(
                format_message(
                    "--numerics tensorrt",
                    f"no CUDA device {cls.device_index} (this machine has {cuda_device_count()} visible GPU(s))",
                    "an NVIDIA GPU",
                    hint,
                )
            )

    @classmethod
    def session(cls, model: Any, base_dir: str = "") -> Runner:
        """A strongly typed engine of ``model`` built in a temporary folder, loaded on the GPU."""
        del base_dir  # the model is written whole (weights included) into the temporary folder
        gpu = require_gpu(f"cuda:{cls.device_index}", "TensorRT numerics")
        with tempfile.TemporaryDirectory(prefix="mpinfer-trt-eval-") as folder:
            onnx_path, engine_path = Path(folder) / "candidate.onnx", Path(folder) / "candidate.engine"
            save_onnx(model, onnx_path)
            shapes = cls._profile(model)
            cfg = BuildConfig(model=onnx_path, output=engine_path, backend=Backend.TENSORRT, shapes=shapes)
            build_trt_engine(cfg, onnx_path, engine_path, gpu)
            runner = TrtRunner(engine_path, device_index=cls.device_index, name="candidate")
            runner.activate()  # reads the engine: the folder may go

        def run(batch: Mapping[str, np.ndarray]) -> Outputs:
            out = runner.infer(batch)
            return float32_outputs(list(out), list(out.values()))

        return run

    @classmethod
    def _profile(cls, model: Any) -> tuple[Any, ...]:
        """One profile per input: every symbolic dim from 1 to :attr:`max_rows` (fixed dims as they are)."""
        out = []
        for vi in model.graph.input:
            dims = vi.type.tensor_type.shape.dim
            lo = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in dims)
            hi = tuple(d.dim_value if d.HasField("dim_value") else cls.max_rows for d in dims)
            out.append(ShapeProfile(vi.name, lo, hi, hi))
        return tuple(out)


# -- the one place a --numerics name becomes a class -------------------------------------------------------------
EVALUATORS: dict[str, type[Any]] = {
    StrictEvaluator.name: StrictEvaluator,
    OrtEvaluator.name: OrtEvaluator,
    OrtCudaEvaluator.name: OrtCudaEvaluator,
    TensorRtEvaluator.name: TensorRtEvaluator,
}


def evaluator_class(numerics: str) -> type[Any]:
    """The evaluator class of a ``--numerics`` value (``strict``, ``ort``, ``ort-cuda``, ``tensorrt``).

    Raises:
        InvalidInputError: An unknown name.
    """
    try:
        return EVALUATORS[numerics]
    except KeyError:
        raise InvalidInputError(format_message("--numerics", repr(numerics), " or ".join(EVALUATORS))) from None


def check_numerics(numerics: str) -> None:
    """Refuse an unknown ``--numerics`` name, or numerics this machine cannot run; before any work.

    Raises:
        InvalidInputError: An unknown name.
        BackendUnavailableError: The numerics' runtime or GPU is missing here (``ort-cuda``, ``tensorrt``).
    """
    evaluator_class(numerics).check_available()
