"""ONNX Runtime numerics (``ort``, ``ort-cuda``): the candidate applied and run by ONNX Runtime.

Sensitivities come from the one-session probe (:mod:`mpinfer.precision.numerics.probe`), and from the strict
emulator for groups the probe cannot copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from mpinfer.backends.ort import OrtRunner, cuda_usable
from mpinfer.errors import BackendUnavailableError, format_message
from mpinfer.modelio import ort_session
from mpinfer.precision.core import GraphInfo
from mpinfer.precision.graph import apply_plan
from mpinfer.precision.numerics import probe
from mpinfer.precision.numerics.base import (
    AppliedRun,
    Candidate,
    Outputs,
    Runner,
    float32_outputs,
    has_all_outputs,
)
from mpinfer.precision.numerics.strict import _EmulatorRefs
from mpinfer.specs import Precision


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
        if known_outputs is not None and len(known_outputs) == len(batches) and has_all_outputs(model, known_outputs):
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

    def each(self) -> Iterator[Outputs]:
        for b in self.ev.batches:
            self.ev.evaluations += len(self.ev.info.nodes)
            yield self.run(b)

    def outputs_on(self, feeds: Mapping[str, np.ndarray], rows: np.ndarray) -> Outputs:
        self.ev.evaluations += len(self.ev.info.nodes)
        return self.run(feeds)

    def ran_as(self) -> AppliedRun | None:
        return AppliedRun(self.precisions, self.applied, lambda: self.run, loaded=True)  # (the runtime ran it)

    def judged(self, met: bool) -> None:
        """Nothing is kept: each candidate is a whole run of the applied model."""


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
