"""The Evaluator protocol: how the budget search, its screening and the final verification run candidates.

The budget search, its screening and the final verification ask the same questions of whatever runs the
candidates: the FP32 reference outputs of the search batches, a candidate's outputs on them (and on a subset of
the samples, for screening), each group's local error (sensitivity), and a runner for a model as it will be
written. :class:`Evaluator` is that protocol; :func:`mpinfer.precision.numerics.registry.evaluator_class` is the one
place that maps a ``--numerics`` name to its class (strict: :mod:`.strict`; ONNX Runtime: :mod:`.ort`; TensorRT:
:mod:`.tensorrt`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from mpinfer.precision.graph.apply import AppliedRun
from mpinfer.specs import Precision

Outputs = dict[str, np.ndarray]
Runner = Callable[[Mapping[str, np.ndarray]], Outputs]

__all__ = ["AppliedRun", "Candidate", "Evaluator", "Outputs", "Runner", "float32_outputs", "has_all_outputs"]


class Candidate(Protocol):
    """One candidate precision assignment, ready to run."""

    def outputs(self) -> list[Outputs]:
        """Its outputs on every search batch (one dict per batch)."""

    def each(self) -> Iterator[Outputs]:
        """Its outputs batch by batch, each run when asked for (a caller that stops early runs no more)."""

    def outputs_on(self, feeds: Mapping[str, np.ndarray], rows: np.ndarray) -> Outputs:
        """Its outputs on the samples ``rows`` of the joined search batches (``feeds`` holds those rows)."""

    def ran_as(self) -> AppliedRun | None:
        """The candidate as applied, when that model computed every output so far (as the verification runs it)."""

    def judged(self, met: bool) -> None:
        """Told, after a full run, whether the candidate met the budget (an evaluator may keep its runs to reuse)."""


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


def has_all_outputs(model: Any, outputs: Sequence[Mapping[str, Any]]) -> bool:
    """True when ``outputs`` hold every graph output (calibration keeps only the float ones)."""
    return all(o.name in outputs[0] for o in model.graph.output)


def float32_outputs(names: Sequence[str], values: Sequence[Any]) -> Outputs:
    """Float outputs as float32, others as they come."""
    return {
        n: np.asarray(v, np.float32) if np.asarray(v).dtype.kind == "f" else v
        for n, v in zip(names, values, strict=False)
    }
