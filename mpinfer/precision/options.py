"""Convert's options resolved once: what the user gave, the plan being re-applied, and the defaults.

``ConvertConfig`` fields that have a default in the CLI (``--precision``, ``--keep-io-types``,
``--numerics``, ``--budget``, ``--search-samples``, ``--verify-samples``) are None when not given, so an
explicit value can be told from a default. :func:`resolve_options` is the one place they become values:

* planning: the defaults below, and with any calibration data (the user's, or mpinfer's own seeded random data)
  and no ``--budget`` the default floor (:data:`DEFAULT_BUDGET`); ``--budget none`` opts out, ``--calibration
  none`` plans by the rules alone (nothing measured);
* re-applying a plan (``--plan``): the plan's precision, ``keep_io_types`` and opset, unless given. An
  explicit ``--keep-io-types``/``--no-keep-io-types`` or ``--opset`` that differs from the plan's is applied
  and the plan written with the output says so; ``--precision`` that differs is refused (the plan's node
  decisions were made for its own precision); options that only shape planning (data, budget, numerics, search
  and verification samples, class outputs, overflow.json) are refused with ``--plan``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.checks import parse_checks
from mpinfer.errors import InvalidInputError, format_message
from mpinfer.metrics import guess_class_output
from mpinfer.precision.config import ConvertConfig
from mpinfer.precision.core import float_outputs
from mpinfer.precision.emulator.emulate import unsupported_op_types
from mpinfer.precision.numerics import EVALUATORS, OrtEvaluator, check_numerics, evaluator_class
from mpinfer.specs import Precision
from mpinfer.usermetric import metric_names

logger = logging.getLogger(__name__)

# The samples the budget search reads by default: two batches of 16. The search verifies each candidate on
# them (about log2(groups) runs) and, with strict numerics, keeps every FP32 tensor of them for its incremental
# runs, so its cost and memory grow with this count; the final verification then covers every sample.
DEFAULT_SEARCH_SAMPLES = 32
# The default floor's per-sample term: every calibration sample keeps cosine >= 0.999 against FP32 (the worst
# sample, not the mean: one ruined sample among hundreds must not pass). The repo's models convert to (almost)
# all FP16 with their worst sample at cosine 0.99999+ (bench/verify_cost.py); below 0.999 an output has lost real
# information (compare's default check uses the same 0.999). Only on outputs with more than one value per
# sample: the cosine of one value is its sign (floor_budget).
FLOOR_COSINE = "cosine_min>=0.999"
# The default floor's terms on every output: the worst error at most 1% of the output's own range over the data
# (range_err: sees a score, a probability or a logit whatever its row length, and an error riding on a large
# constant offset), and no NaN/Inf where FP32 is finite. 1%: FP16 keeps issue 27's scores (a saturating
# probability: 0.4%, a ReLU'd score: 0.1%) inside it; a 1-5 score off by 0.1 or a score on an offset of 1000
# rounded to steps of 0.5 (4%) are outside it (bench/RESULTS.md, issue 27).
FLOOR_RANGE = "range_err<=0.01"
# The same for BF16, 8x looser: BF16's unit roundoff (2^-8) is 8x FP16's (2^-11), and rounding an output alone
# moves it by up to 0.4% of its magnitude. An offset of 1000 rounds to steps of 4 there (31% of the range).
FLOOR_RANGE_BF16 = "range_err<=0.08"
FLOOR_NONFINITE = "nonfinite<=0"
FLOOR_OUTPUTS = f"{FLOOR_RANGE},{FLOOR_NONFINITE}"
# The default floor's term on the class-score outputs the user names (--class-outputs), in place of range_err: at
# most 1% of the class decisions (argmax per row) change; the decision is what a class-score output is read for.
FLOOR_TOP1 = "top1>=0.99"
# The budget convert applies with calibration data (the user's, or its own random data) and no --budget
# (docs/convert.md, "The default floor"), on a model whose outputs all hold more than one value per sample
# (floor_budget fits it to the model's outputs).
DEFAULT_BUDGET = f"{FLOOR_COSINE},{FLOOR_OUTPUTS}"
# ``--budget none``: no budget at all, not even the default floor.
NO_BUDGET = "none"
# The ``--numerics`` names: the evaluator registry's (mpinfer.precision.numerics.registry), the one list of them.
NUMERICS = tuple(EVALUATORS)
# Calibration source meaning "no data at all": rules only, no range statistics, no search.
NO_CALIBRATION = "none"
# What a plan of ``--calibration none`` says in its summary (``not_measured``) and on the console.
NOT_MEASURED = (
    "nothing was measured: --calibration none plans by the rules alone (no range statistics, no search, no "
    "verification); measure the written model with `mpinfer compare`, or convert with data to have it verified"
)
# What the floor was judged on without --calibration (the console and the errors say so).
RANDOM_INPUTS = "mpinfer's own random inputs"


@dataclass(frozen=True)
class Options:
    """Convert's settings after :func:`resolve_options`: every default applied, every conflict settled.

    Attributes:
        precision: FP16 or BF16.
        keep_io_types: Graph inputs/outputs stay FP32.
        numerics: An :data:`~mpinfer.precision.numerics.registry.EVALUATORS` name (``strict``, ``ort``, ``ort-cuda``,
            ``tensorrt``), checked runnable here.
        opset: The opset to upgrade to first, or None.
        budget: The budget the plan must meet on the calibration data, or None (no budget at all).
        default_budget: True when ``budget`` is the default floor (no ``--budget`` given).
        search_samples: Samples the budget search reads.
        verify_samples: Samples the final verification reads (None: all).
        changed: With ``--plan``: the plan fields an explicit option changed (``{"keep_io_types": False}``).
        class_outputs: The outputs that hold class scores (None: guessed per output, ``()``: none).
        progress: Show progress bars.
        generation: The budget's generation checks, split from ``budget`` by
            :func:`mpinfer.precision.budget.genbudget.split_generation_budget` (verified by greedy decoding), or None.
        metrics: The user's own metrics (:class:`mpinfer.usermetric.UserMetric`): measured with the budget and
            recorded in the plan; their figures may be budget terms.
    """

    precision: Precision
    keep_io_types: bool
    numerics: str
    opset: int | None
    budget: str | None
    default_budget: bool
    search_samples: int
    verify_samples: int | None
    changed: dict[str, Any]
    class_outputs: tuple[str, ...] | None = None
    progress: bool = True
    generation: Any = None
    metrics: tuple[Any, ...] = ()


def check_budget(text: str, user: Sequence[str] = ()) -> None:
    """Refuse a malformed ``--budget`` (``none`` is no budget; anything else is the check grammar).

    ``user``: the names of the user's own metrics (``--metric``), whose figures the budget may name.

    Raises:
        InvalidInputError: From :func:`mpinfer.checks.parse_checks`.
    """
    if text.strip().lower() != NO_BUDGET:

        parse_checks(text, user)


def has_data(calibration: str | None) -> bool:
    """True when convert has data to judge a plan by: the user's, or its own seeded random data (not ``none``)."""
    return calibration is None or calibration.strip().lower() != NO_CALIBRATION


def resolve_options(cfg: Any, plan: Any = None) -> Options:
    """Resolve ``cfg`` (a ConvertConfig) against the re-applied ``plan`` (or None) and the defaults.

    Raises:
        InvalidInputError: An explicit option that conflicts with the plan, or options that mean nothing
            with ``--plan``.
    """
    numerics = cfg.numerics if cfg.numerics is not None else "strict"
    check_numerics(numerics)  # an unknown name, or numerics this machine cannot run (no CUDA provider, no GPU)
    search = cfg.search_samples if cfg.search_samples is not None else DEFAULT_SEARCH_SAMPLES
    for flag, value in (("--search-samples", search), ("--verify-samples", cfg.verify_samples)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidInputError(format_message(flag, repr(value), "a number of samples >= 1"))
    if plan is not None:
        return _resolve_with_plan(cfg, plan, numerics, search)
    precision = cfg.precision if cfg.precision is not None else Precision.FP16
    budget, default = cfg.budget, False
    if budget is not None and budget.strip().lower() == NO_BUDGET:
        budget = None
    elif budget is None and has_data(cfg.calibration):
        budget, default = DEFAULT_BUDGET, True
        if precision is Precision.BF16 and not evaluator_class(numerics).supports_bf16:
            logger.warning(
                "No default floor for --precision bf16 with --numerics %s: ONNX Runtime's CPU provider cannot "
                "run BF16 MatMul/Conv to verify it. Use --numerics strict (the default) to have it verified.",
                numerics,
            )
            budget, default = None, False
    elif budget is not None and not budget.strip():
        budget = None
    if cfg.metrics and budget is None:
        logger.warning("--metric %s: measured only when convert verifies (a --budget, or the default floor with "
                       "calibration data); this run verifies nothing. Measure it with `mpinfer compare --metric`.",
                       ", ".join(m.name for m in cfg.metrics))
    return Options(
        precision=precision,
        keep_io_types=cfg.keep_io_types if cfg.keep_io_types is not None else True,
        numerics=numerics,
        opset=cfg.opset,
        budget=budget,
        default_budget=default,
        search_samples=search,
        verify_samples=cfg.verify_samples,
        changed={},
        class_outputs=None if cfg.class_outputs is None else tuple(cfg.class_outputs),  # a pipeline.toml: a list
        progress=cfg.progress,
        metrics=tuple(cfg.metrics),
    )


def _resolve_with_plan(cfg: Any, plan: Any, numerics: str, search: int) -> Options:
    planning = {
        "--calibration": cfg.calibration,
        "--numerics": cfg.numerics,
        "--search-samples": cfg.search_samples,
        "--verify-samples": cfg.verify_samples,
        "--budget": cfg.budget,
        "--class-outputs": cfg.class_outputs,
        "--keep-fp32-from": cfg.keep_fp32_from,
        "--seed": cfg.seed,
        "--max-batches": cfg.max_batches,
        "--batch-size": cfg.batch_size,
        "--dim": cfg.dims or None,
        "--image-preprocess": cfg.image_preprocess,
    }
    given = [flag for flag, value in planning.items() if value is not None]
    if given:
        raise InvalidInputError(
            format_message(
                "--plan",
                f"together with {'/'.join(given)}, which only shape planning",
                "--plan alone (with --keep-io-types/--opset if you want those changed)",
                "re-plan without --plan to use them, or measure the model with `mpinfer compare`",
            )
        )
    if cfg.precision is not None and cfg.precision is not plan.precision:
        raise InvalidInputError(
            format_message(
                f"--precision {cfg.precision.value}",
                f"a plan made for {plan.precision.value} ('{cfg.plan}')",
                f"--precision {plan.precision.value} or no --precision",
                "the plan's node decisions were made for its own precision: re-plan without --plan "
                f"for {cfg.precision.value}",
            )
        )
    changed: dict[str, Any] = {}
    keep_io = plan.keep_io_types
    if cfg.keep_io_types is not None and cfg.keep_io_types != plan.keep_io_types:
        keep_io = changed["keep_io_types"] = bool(cfg.keep_io_types)
    if cfg.opset is not None and cfg.opset != plan.opset:
        changed["opset"] = cfg.opset
    _say_metric_files(plan, cfg.metrics, cfg.plan)
    return Options(
        precision=plan.precision,
        keep_io_types=keep_io,
        numerics=numerics,
        opset=cfg.opset if cfg.opset is not None else plan.opset,
        budget=None,
        default_budget=False,
        search_samples=search,
        verify_samples=None,
        changed=changed,
        progress=cfg.progress,
    )


def _say_metric_files(plan: Any, metrics: Sequence[Any], plan_path: Any) -> None:
    """``--metric`` with ``--plan``: say whether each file is the one the plan's figures were verified with.

    The plan records each user metric's file and sha256 (``summary.verification.metrics``); a plan re-applied
    with another file (or an edited one) keeps figures that are not this file's, and a warning says so.
    """
    recorded = ((plan.summary or {}).get("verification") or {}).get("metrics") or {}
    for m in metrics:
        rec = recorded.get(m.name)
        if rec is None:
            logger.warning("--metric %s: plan '%s' holds no figures of a metric '%s' (verified: %s); nothing is "
                           "measured with --plan: run `mpinfer compare --metric` to measure it.",
                           m.name, plan_path, m.name, ", ".join(recorded) or "none")
        elif rec.get("sha256") != m.sha256:
            logger.warning("--metric %s: plan '%s' was verified with %s (sha256 %s), not with %s (sha256 %s): its "
                           "'%s' figures are not this file's. Re-plan without --plan to verify this one.",
                           m.name, plan_path, rec.get("file"), str(rec.get("sha256"))[:12], m.path,
                           str(m.sha256)[:12], m.name)
        else:
            logger.info("--metric %s: the file plan '%s' was verified with (sha256 %s).", m.name, plan_path,
                        str(m.sha256)[:12])


def floor_for_model(opts: Options, model: Any) -> Options:
    """The default floor where it can apply, fitted to the model's outputs (:func:`floor_budget`).

    None on a model without float outputs; ORT numerics where strict emulation cannot run the model.
    """
    if not opts.default_budget:
        return opts
    if not float_outputs(model):
        logger.info("No float outputs: the default floor (%s) has nothing to measure; none applied.", opts.budget)
        return replace(opts, budget=None, default_budget=False)
    return _floor_numerics(replace(opts, budget=_for_precision(floor_budget(model), opts.precision)), model)


def _for_precision(floor: str, precision: Precision) -> str:
    """The floor's range term for ``precision`` (:data:`FLOOR_RANGE_BF16` for BF16)."""
    return floor.replace(FLOOR_RANGE, FLOOR_RANGE_BF16) if precision is Precision.BF16 else floor


def floor_budget(
    model: Any, class_outputs: Collection[str] = (), softmax: Collection[str] = (), empty: Collection[str] = ()
) -> str:
    """The default floor for ``model``'s outputs: :data:`DEFAULT_BUDGET`, each term where it means something.

    ``cosine_min`` reads the float outputs with more than one value per sample (or a shape not known); an
    output with one value per sample (``[N]``, ``[N, 1]``, ``[1, 1]``) is judged by ``range_err`` alone, since
    the cosine of one value is its sign (0 when FP32 gives a value and the candidate 0). ``class_outputs``
    (the user's class scores) are judged by their decisions (:data:`FLOOR_TOP1`) instead of ``range_err``, and
    ``softmax`` outputs (rows of probabilities) by ``cosine_min`` alone; ``empty`` outputs (no elements on the
    data) by nothing: they have no values to measure.
    """
    floats = [o for o in float_outputs(model) if o.name not in empty]
    many = [o.name for o in floats if not _one_value_per_sample(o)]
    classes = [o.name for o in floats if o.name in class_outputs]
    rows = [o.name for o in floats if o.name in softmax and o.name not in classes and o.name in many]
    if any("," in o.name for o in floats):  # a name with a comma cannot be selected
        return DEFAULT_BUDGET
    if not classes and not rows and not empty:
        if len(many) == len(floats):
            return DEFAULT_BUDGET
        return ",".join([*(f"{n}:{FLOOR_COSINE}" for n in many), FLOOR_OUTPUTS])
    terms = [f"{o.name}:{FLOOR_COSINE}" for o in floats if o.name in many]
    terms += [f"{o.name}:{FLOOR_TOP1 if o.name in classes else FLOOR_RANGE}" for o in floats if o.name not in rows]
    return ",".join([*terms, FLOOR_NONFINITE])


def floor_for_classes(opts: Options, model: Any, reference: Sequence[Mapping[str, Any]] | None) -> Options:
    """The default floor once calibration has the FP32 outputs: class scores and probability rows.

    The user's class-score outputs (``--class-outputs``) are judged by their decisions (:data:`FLOOR_TOP1`);
    the outputs the metrics core guesses to hold class scores (:func:`mpinfer.metrics.guess_class_output`) on
    the first calibration batch and whose values are probabilities (softmax rows: a classifier's, an OCR
    recognizer's, attention weights) by ``cosine_min`` per sample, as before ``range_err``: FP16 moves single
    probabilities of a softmax over thousands of classes by a few hundredths while every row keeps its
    direction, and a guess is not trusted with decisions (attention rows have near-ties BF16 flips).
    """
    if not opts.default_budget or not reference:
        return opts
    first = reference[0]
    floats = [o.name for o in float_outputs(model)]
    empty = tuple(n for n in floats if isinstance(first.get(n), np.ndarray) and not first[n].size)
    if empty and len(empty) == len(floats):
        logger.info("Every float output is empty on the data: the default floor has nothing to measure; none applied.")
        return replace(opts, budget=None, default_budget=False)
    classes = tuple(opts.class_outputs or ())
    rows = tuple(n for n, v in first.items() if isinstance(v, np.ndarray) and _softmax_scores(n, v))
    if not classes and not rows and not empty:
        return opts
    return replace(opts, budget=_for_precision(floor_budget(model, classes, rows, empty), opts.precision))


def _softmax_scores(name: str, value: np.ndarray) -> bool:
    """True for an output guessed to hold class probabilities (rows in [0, 1] that sum to 1).

    The floor trusts the guess only there: a few scores per sample on another scale (a 1-5 quality score, a
    state) can pass for class scores, and their values, not an argmax, are what they are read for.
    """
    if not guess_class_output(name, value) or not value.size:
        return False
    return float(np.min(value)) >= 0.0 and float(np.max(value)) <= 1.0


def _one_value_per_sample(output: Any) -> bool:
    """True when an output's declared shape holds one value per sample (rank <= 1, or every dim but the first 1)."""
    tensor = output.type.tensor_type
    if not tensor.HasField("shape"):
        return False
    dims = tensor.shape.dim
    return all(d.HasField("dim_value") and d.dim_value == 1 for d in dims[1:])


def _floor_numerics(opts: Options, model: Any) -> Options:
    """The default floor's numerics on a model strict emulation cannot run (custom-domain ops).

    ONNX Runtime numerics verify it then (FP16; BF16 has none on the CPU provider: no floor), said in a warning.
    An explicit budget is refused there by the search, which names ``--numerics ort``.
    """
    if not opts.default_budget or not evaluator_class(opts.numerics).emulated:
        return opts
    missing = unsupported_op_types(model)  # (GraphEmulator(model).unsupported_ops() without compiling the model)
    if not missing:
        return opts
    if opts.precision is Precision.BF16:
        logger.warning(
            "No default floor: strict emulation cannot run %s and ONNX Runtime's CPU provider has no BF16 "
            "MatMul/Conv to verify it with.", ", ".join(sorted(missing))
        )
        return replace(opts, budget=None, default_budget=False)
    logger.warning(
        "The default floor is verified with ONNX Runtime numerics: strict emulation cannot run %s (ORT's CPU "
        "provider computes many FP16 ops in FP32 and understates the error a GPU shows).", ", ".join(sorted(missing))
    )
    return replace(opts, numerics=OrtEvaluator.name)


def refuse_in_place_changes(options: Options, plan_path: Path, plan_out: Path) -> None:
    """A plan re-applied in place is an input and is not rewritten: options that change it are refused there."""
    if options.changed and Path(plan_path).resolve() == Path(plan_out).resolve():
        flags = ", ".join(f"{k}={v}" for k, v in options.changed.items())
        raise InvalidInputError(
            format_message(
                f"--plan '{plan_path}'",
                f"options that change the plan ({flags}) while it is re-applied in place",
                "an -o whose plan file is not the input plan",
                "write the output elsewhere (its plan records the change), or edit the plan file",
            )
        )


def check_config(cfg: ConvertConfig, opts: Options) -> None:
    """Options that contradict each other or the numerics asked for, refused before any work.

    Raises:
        InvalidInputError: What cannot go together, and what to pass instead.
    """
    if not opts.precision.is_low:
        raise InvalidInputError(format_message("--precision", opts.precision.value, "fp16 or bf16"))
    evaluator = evaluator_class(opts.numerics)
    if opts.precision is Precision.BF16 and not evaluator.supports_bf16 and opts.budget and not opts.default_budget:
        raise InvalidInputError(
            format_message(
                f"--numerics {opts.numerics} with --precision bf16",
                "a request to verify BF16 with ONNX Runtime",
                "--numerics strict",
                "ONNX Runtime's CPU provider has no BF16 MatMul/Conv; BF16 is checked only through strict emulation",
            )
        )
    if cfg.plan is not None and (cfg.keep_ops or cfg.low_ops or cfg.keep_nodes or cfg.low_nodes):
        raise InvalidInputError(
            format_message(
                "--plan",
                "together with planning options (--keep-*/--low-*)",
                "--plan alone",
                'edit the plan\'s "precision" fields instead, or re-plan without --plan',
            )
        )
    if opts.budget:
        parse_checks(opts.budget, metric_names(opts.metrics))
