"""CompareConfig: what ``mpinfer compare`` compares, and how."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mpinfer.usermetric import as_metrics

# Batches kept for the per-layer divergence: enough for a stable relative error, few enough that both models
# run only (tensors / CHUNK_SIZE) x 2 times per batch.
DIVERGENCE_BATCHES = 2


@dataclass(frozen=True)
class CompareConfig:
    """What to compare and how.

    Attributes:
        baseline: FP32 reference: ``.onnx``, engine or ``file.py:factory[@weights]``.
        candidates: One or more models to compare against it.
        data: Data source (``.npz``, folder, ``random[:N]``; None = random).
        checks: Thresholds in the check grammar of :mod:`mpinfer.checks`, e.g.
            ``"cosine>=0.9999,logits:top1>=0.999"`` (None = DEFAULT_CHECKS).
        class_outputs: The outputs that hold class scores (top-k applies to them alone); None guesses each
            (:func:`mpinfer.metrics.guess_class_output`), ``()`` says none does.
        latency: Measure latency too.
        batch_sizes: Latency batch sizes (default: the data's batch size).
        iterations: Timed latency runs per runner and batch size (the cap when time_budget_s is set).
        warmup: Untimed runs first.
        time_budget_s: Stop timing a runner after this many seconds.
        numerics: ``ort`` or ``strict`` (strict FP16/BF16 emulation for ONNX candidates).
        device: ``cpu``, ``cuda`` or ``auto``.
        batch_size: Samples per batch of the data.
        num_batches: Cap on the batches compared.
        dims: Sizes for symbolic dims of random data, ``("seq=32",)``.
        input_ranges: Value ranges of random data per input, ``("input_ids=0..30522",)``.
        image_preprocess: Preprocessing of a ``data`` folder of images (``size=HxW,mean=..,std=..,mode=L``).
        divergence: Locate the node where the error jumps (ONNX baseline and candidate).
        divergence_batches: Batches used for it.
        seed: Seed for random data.
        show_progress: Show rich progress bars.
        memory_limit: ``--memory-limit`` (a size or a share of the available memory; :mod:`mpinfer.memory`);
            None = the default budget.
        generate: Decoders with a KV cache: greedily generate this many tokens for every prompt of ``data``
            with each model (:mod:`mpinfer.generation`); its figures are checkable (``token_agreement``...).
        metrics: The user's own metrics (:mod:`mpinfer.usermetric`): ``UserMetric`` objects, ``NAME=PATH.py:FUNC``
            strings or a mapping of name to callable or ``PATH.py:FUNC``; their figures are checkable.
    """

    baseline: str
    candidates: tuple[str, ...]
    data: str | None = None
    checks: str | None = None
    class_outputs: tuple[str, ...] | None = None
    latency: bool = False
    batch_sizes: tuple[int, ...] = ()
    iterations: int = 50
    warmup: int = 5
    time_budget_s: float | None = None
    numerics: str = "ort"
    device: str = "cpu"
    batch_size: int | None = None
    num_batches: int | None = None
    dims: tuple[str, ...] = ()
    image_preprocess: str | None = None
    input_ranges: tuple[str, ...] = ()
    divergence: bool = True
    divergence_batches: int = DIVERGENCE_BATCHES
    seed: int = 0
    show_progress: bool = True
    memory_limit: str | int | None = None
    generate: int | None = None
    metrics: Any = ()

    def __post_init__(self) -> None:
        """Accept ``pathlib.Path`` models and data (as the README's API example passes them)."""
        # The API takes paths as str or os.PathLike (a single candidate too); runners and reports use str.
        cands = (self.candidates,) if isinstance(self.candidates, (str, os.PathLike)) else self.candidates
        object.__setattr__(self, "baseline", os.fspath(self.baseline))
        object.__setattr__(self, "candidates", tuple(os.fspath(c) for c in cands))
        if self.data is not None:
            object.__setattr__(self, "data", os.fspath(self.data))
        if self.class_outputs is not None:  # a TOML list, or one name
            names = (self.class_outputs,) if isinstance(self.class_outputs, str) else self.class_outputs
            object.__setattr__(self, "class_outputs", tuple(names))
        object.__setattr__(self, "metrics", as_metrics(self.metrics))  # loaded (and clashes refused) once
