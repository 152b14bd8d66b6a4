"""Generation checks in ``convert --budget``: greedy decoding of the calibration prompts, candidate vs FP32.

A budget may hold generation figures (``token_agreement>=0.95``, ``ppl_ratio<=1.02``: the model-level metrics
of :data:`mpinfer.metrics.GENERATION_METRICS`). They apply to a decoder with a KV cache calibrated from prompts
(``--calibration prompts:FILE[:steps=N]``, or an .npz of ``input_ids`` for a KV model). The budget search and
the per-output verification read the rest of the budget (or, when the budget holds generation checks only,
the floor :data:`OUTPUTS_FLOOR`); once that holds on every calibration sample, the final verification decodes
every calibration prompt greedily with the FP32 model and with the candidate exactly as it will be written
(the prefill and the same ``N`` decode steps calibration ran, so ``N + 1`` tokens per prompt), computes the
generation figures as ``mpinfer compare --generate N+1`` does, and checks them. A failure goes through the same
repair loop as any budget failure (:func:`mpinfer.precision.budget.repair.verify_and_repair`: the worst groups back to
FP32, verify again) or, when even that cannot meet it, the same refusal, and nothing is written.

Generation always runs through ONNX Runtime (CPU), also under ``--numerics strict``: the strict emulator runs
the per-output verification, not the decode loop. The plan's ``summary.verification.generation`` says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from mpinfer.checks import Checks, parse_checks
from mpinfer.data.decode import kv_layout, load_prompts, wants_decode
from mpinfer.errors import InvalidInputError, format_message
from mpinfer.generation import Decoder, measure_candidate
from mpinfer.metrics import GENERATION_OUTPUT
from mpinfer.precision.numerics import evaluator_class
from mpinfer.specs import specs_from_onnx
from mpinfer.usermetric import metric_names

logger = logging.getLogger(__name__)

# The per-output budget when a budget holds generation checks only: no new NaN/Inf on any output (a NaN in the
# logits breaks generation anyway); everything else is the generation checks' to judge.
OUTPUTS_FLOOR = "nonfinite<=0"
# Prompts decoded together.
GENERATION_BATCH = 16


@dataclass
class GenerationBudget:
    """The generation checks of a budget and what they are measured on; the FP32 decode is kept once made."""

    text: str
    checks: Any  # mpinfer.checks.Checks: the generation checks alone
    baseline: str  # the FP32 model file
    source: str  # the calibration prompts
    prompts: Any  # mpinfer.data.decode.Prompts
    tokens: int
    reference: Any = field(default=None, repr=False)  # DecodeRun of the baseline
    last: dict[str, float] = field(default_factory=dict)

    def verify(self, candidate: Any) -> tuple[dict[str, float], list[str]]:
        """Greedy-decode the prompts with ``candidate`` (an ``onnx.ModelProto``); its figures and failures."""
        if self.reference is None:
            base = Decoder(self.baseline, "--budget").open(())
            self.reference = base.decode(self.prompts, self.tokens, GENERATION_BATCH)
            base.close()
        cand = Decoder(candidate, "--budget").open(())
        result = measure_candidate(cand, self.reference, self.prompts, self.tokens, GENERATION_BATCH,
                                   name="candidate")
        cand.close()
        self.last = result.metrics()
        return self.last, self.checks.failures({GENERATION_OUTPUT: self.last})

    def describe(self) -> dict[str, Any]:
        """The plan's ``summary.verification.generation``."""
        return {"budget": self.text, "prompts": self.prompts.count, "tokens": self.tokens, "source": self.source,
                "numerics": "ort", "figures": dict(self.last)}


def split_generation_budget(data: Any, opts: Any, model: Any) -> Any:
    """``opts`` with the budget's generation checks taken out of ``budget`` and put in ``generation``, ready to verify.

    Args:
        data: The CalibrationSettings (``source``: the prompts; ``model``: the FP32 file).
        opts: The resolved Options (``opts.budget``).
        model: The FP32 ``onnx.ModelProto`` (its inputs say whether it has a KV cache).

    Raises:
        InvalidInputError: Generation checks on a model without a KV cache or without prompt calibration; before
            anything runs. (With ``--plan`` there is no budget: options.resolve_options refuses one.)
    """
    if not opts.budget:
        return opts
    checks = parse_checks(opts.budget, metric_names(opts.metrics))
    gen = checks.generation
    if not gen:
        return opts
    text = ",".join(str(c) for c in gen)
    prompts, tokens = _prompts(data.source, text, model)
    rest = checks.without_generation()
    outputs = str(rest) if rest is not None else OUTPUTS_FLOOR
    if evaluator_class(opts.numerics).emulated:
        logger.info("The budget's generation checks (%s) are verified with ONNX Runtime's kernels: the strict "
                    "emulator verifies the outputs, not the decode loop.", text)
    budget = GenerationBudget(text, Checks(gen, text), str(data.model), str(data.source), prompts, tokens)
    return replace(opts, budget=outputs, generation=budget)


def _prompts(source: str | None, text: str, model: Any) -> tuple[Any, int]:
    """The calibration prompts and tokens per prompt (prefill + the calibration's decode steps)."""
    specs = specs_from_onnx(model)
    what = f"--budget '{text}'"
    if kv_layout(specs) is None:
        raise InvalidInputError(format_message(what, "generation checks on a model without a KV cache",
                                               "a decoder exported with past_key_values.*/present.*",
                                               "mpinfer export of a causal LM folder adds it (unless --no-past)"))
    if not wants_decode(source, specs):
        raise InvalidInputError(format_message(
            what, f"generation checks with --calibration {source}",
            "prompt calibration: --calibration prompts:FILE[:steps=N] (or an .npz of input_ids)",
            "generation figures come from greedy decoding of the calibration prompts"))
    vocab = next((int(s.value_range[1]) for s in specs if s.name == "input_ids" and s.value_range), None)
    prompts, spec = load_prompts(str(source), vocab)
    return prompts, spec.steps + 1
