"""``mpinfer convert``'s inputs and result: :class:`ConvertConfig` and :class:`ConvertResult`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpinfer.precision.core import PrecisionPlan
from mpinfer.specs import Precision
from mpinfer.usermetric import as_metrics


@dataclass(frozen=True)
class ConvertConfig:
    """Everything ``mpinfer convert`` needs.

    Attributes:
        model: The FP32 .onnx file.
        output: Where to write the converted model (the plan goes next to it).
        precision: FP16 or BF16; None = FP16 (with ``plan``: the plan's; a different one is refused).
        calibration: Data for the reference run (.npz, folder, ``random[:N]``, ``none``); None = seeded
            random data from the input specs (with a warning).
        budget: Accuracy budget in the check grammar of :mod:`mpinfer.checks`, e.g.
            ``cosine>=0.9999,logits:top1>=0.999``, verified on every calibration sample before anything is
            written; None = the default floor (``options.DEFAULT_BUDGET``) with real calibration data, none with
            random data; ``"none"`` = no budget at all.
        class_outputs: The outputs that hold class scores (top-k applies to them alone); None guesses each
            (:func:`mpinfer.metrics.guess_class_output`), ``()`` says none does.
        plan: Re-apply this plan file instead of planning.
        keep_ops / low_ops: Op types forced FP32 / low.
        keep_nodes / low_nodes: Node-address regexes forced FP32 / low.
        keep_fp32_from: An overflow.json from ``mpinfer train``: its modules stay FP32.
        numerics: The evaluator that verifies candidates and the final model (``strict``: the GraphEmulator;
            ``ort``/``ort-cuda``: ONNX Runtime's CPU/CUDA kernels; ``tensorrt``: an engine per candidate;
            :data:`mpinfer.precision.numerics.registry.EVALUATORS`); None = strict.
        keep_io_types: Graph inputs/outputs stay FP32; None = True (with ``plan``: the plan's; a different
            value is applied and recorded in the plan written beside the output).
        opset: Upgrade the model to this default-domain opset first (ONNX's version converter), e.g. 22, where
            Conv, pooling and most activations take bfloat16; None = as it is (BF16 still raises it to 13), or 23
            for a model whose RMSNorm chains fuse there when ONNX Runtime runs RMSNormalization
            (:func:`mpinfer.precision.graph.fusion.fusion_opset`). With ``plan``: None = the plan's opset.
        force: Overwrite the output; re-plan an already-FP16 model.
        seed: Seed for random calibration data; None = 0.
        max_batches: Cap on calibration batches.
        batch_size: Calibration batch size.
        dims: Sizes of symbolic dims for random calibration data (``{"height": 48}``).
        image_preprocess: Preprocessing of a calibration folder of images (``size=HxW,mean=..,std=..,mode=L``;
            :class:`mpinfer.data.ImagePreprocess`).
        search_samples: Calibration samples the budget search reads (None = ``DEFAULT_SEARCH_SAMPLES``, fewer
            when their FP32 tensors pass the memory budget's ``search`` slice).
        verify_samples: Calibration samples the final verification reads (None = all of them).
        input_ranges: Value ranges of random calibration data per input, ``("input_ids=0..30522",)``.
        progress: Show progress bars.
        memory_limit: ``--memory-limit`` (a size or a share of the available memory; :mod:`mpinfer.memory`);
            None = the default budget.
        metrics: The user's own metrics (``--metric``, :mod:`mpinfer.usermetric`): ``UserMetric`` objects,
            ``NAME=PATH.py:FUNC`` strings or a mapping of name to callable or ``PATH.py:FUNC``. Their figures
            may be budget terms, are verified with the rest and recorded in the plan with the file's sha256.
    """

    model: Path
    output: Path
    precision: Precision | None = None
    calibration: str | None = None
    budget: str | None = None
    class_outputs: tuple[str, ...] | None = None
    plan: Path | None = None
    keep_ops: tuple[str, ...] = ()
    keep_nodes: tuple[str, ...] = ()
    low_ops: tuple[str, ...] = ()
    low_nodes: tuple[str, ...] = ()
    keep_fp32_from: Path | None = None
    numerics: str | None = None
    keep_io_types: bool | None = None
    opset: int | None = None
    force: bool = False
    seed: int | None = None
    max_batches: int | None = None
    batch_size: int | None = None
    dims: Mapping[str, int] = field(default_factory=dict)
    image_preprocess: str | None = None
    search_samples: int | None = None
    verify_samples: int | None = None
    input_ranges: tuple[str, ...] = ()
    progress: bool = True
    memory_limit: str | int | None = None
    metrics: Any = ()

    def __post_init__(self) -> None:
        """Load the user metrics once (a pipeline.toml table, the API's callables), refusing name clashes."""
        object.__setattr__(self, "metrics", as_metrics(self.metrics))


@dataclass(frozen=True)
class ConvertResult:
    """What ``convert_precision`` wrote."""

    output: Path
    plan_path: Path
    plan: PrecisionPlan
