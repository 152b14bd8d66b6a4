"""``convert_precision``: FP32 ONNX model → mixed FP16/BF16 model + plan, behind the validity gate.

Orchestration only: load and check the model, plan (rules, calibration ranges, budget search) or read a
plan, apply it, gate the result, write model and plan atomically.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mpinfer import __version__
from mpinfer.backends.ort import fit_runtime
from mpinfer.claim import OutputClaim, claim_outputs
from mpinfer.errors import AccuracyMismatchError, InvalidInputError, format_message
from mpinfer.fileio import check_output_path, sha256_file
from mpinfer.memory import budgeted, current_budget, release_memory
from mpinfer.modelio import (
    data_file,
    external_data_files,
    iter_nodes,
    load_onnx,
    name_nodes,
    require_file,
    save_onnx,
    save_streamed,
    uses_external_data,
)
from mpinfer.precision.budget import (
    SearchConfig,
    SearchOutcome,
    VerificationAborted,
    measure_plan,
    search_plan,
    split_generation_budget,
    verification_record,
    verify_and_repair,
)
from mpinfer.precision.config import ConvertConfig, ConvertResult
from mpinfer.precision.core import GraphInfo, NodeDecision, PrecisionPlan
from mpinfer.precision.emulator import may_qualify
from mpinfer.precision.graph import (
    FUSED_SUFFIXES,
    ApplyResult,
    apply_validated,
    check_not_low,
    ensure_opset,
    fuse_norms,
    fusion_opset,
    gate,
    gate_published,
    low_io_types,
    settle_load,
    sort_nodes,
)
from mpinfer.precision.notices import (
    _warn_broken,
    _warn_foreign,
    _warn_opset_blocked,
    fp64_nodes,
    note_measures,
    unmeasured_outputs,
)
from mpinfer.precision.numerics import AppliedRun
from mpinfer.precision.options import (
    NO_CALIBRATION,
    NOT_MEASURED,
    RANDOM_INPUTS,
    Options,
    check_config,
    floor_for_classes,
    floor_for_model,
    refuse_in_place_changes,
    resolve_options,
)
from mpinfer.precision.plandata import (
    MANY,
    Calibrated,
    CalibrationSettings,
    SearchRows,
    VerifyInputs,
    calibrate_for_plan,
    count_rows,
    search_data,
    verify_inputs,
)
from mpinfer.precision.rules import (
    CONTROL_FLOW_OPS,
    RuleOptions,
    check_overrides,
    overflow_nodes,
    rewrite_planned_masks,
    rule_plan,
    summarize,
    warn_quantized,
)
from mpinfer.precision.weights import _embed_weights, embedded_bytes
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)


def lazy_threshold() -> int:
    """Embedded weight bytes above which convert reads the weights from a scratch copy in external data (``_load``).

    The memory budget's probe slice (the limit / 24: 500 MB at the default 12 GB cap, less with a smaller
    ``--memory-limit``): in memory, convert peaks at about 6x the weights (the proto, its copies in the search's and
    the rewrite's models, the serialized output: bench/RESULTS.md, issue 22), and above that slice the budget search
    already gives up its ONNX Runtime probe (a second copy of the converted weights) and measures with the emulator,
    as it does for external weights, so a model planned from the copy gets the plan it gets in memory. The copy costs
    one sequential write of the weights and their size in temporary disk space beside the output.
    """
    return current_budget().probe


def plan_path_for(output: Path) -> Path:
    """``out/model.fp16.onnx`` → ``out/model.fp16.plan.json``."""
    name = output.name[:-5] if output.name.endswith(".onnx") else output.name
    return output.with_name(name + ".plan.json")


@budgeted
def convert_precision(cfg: ConvertConfig) -> ConvertResult:
    """Convert an FP32 ONNX model to mixed precision and write it with its plan.

    With a budget (or the default floor), the model as written is verified on every calibration sample
    (``verify_samples``) before anything is written, and nodes go back to FP32 until the budget holds.

    The model, its external data and its plan are claimed before any work (a second run on the same output
    fails at once) and published as one unit: both or neither.

    Args:
        cfg: The conversion settings.

    Returns:
        The output model path, the plan path and the plan.

    Raises:
        MpinferError: For bad input (model, data, budget, plan), a budget the model cannot meet on the
            calibration data (AccuracyMismatchError), or an output another run is writing; nothing is written
            then.
        InternalError: If the rewritten model fails the validity gate (a bug); nothing is written.
    """
    out = check_output_path(cfg.output, [cfg.model, cfg.plan, cfg.keep_fp32_from], force=cfg.force)
    plan_out = plan_path_for(out)
    rewrites_plan = cfg.plan is None or Path(cfg.plan).resolve() != plan_out.resolve()
    with claim_outputs([out, data_file(out), *([plan_out] if rewrites_plan else [])], force=cfg.force) as claim:
        return _convert(cfg, claim)


def _convert(cfg: ConvertConfig, claim: OutputClaim) -> ConvertResult:
    """convert_precision's work, with its outputs claimed (written under ``claim.stage``, then published).

    The recipe: resolve the options → load → plan (rules → calibrate → search, or the ``--plan`` re-applied) →
    apply behind the validity gate → verify on every sample (repairing) → summarise → write.
    """
    start = time.perf_counter()
    out, plan_out = _check_outputs(cfg)
    opts, in_place, given_plan = _resolve(cfg, plan_out)
    # a plan made before chains were fused (an earlier mpinfer) names their nodes: it is applied to them as they are
    fuse = given_plan is None or any(n.name.endswith(FUSED_SUFFIXES) for n in given_plan.nodes)
    loaded = _load(Path(cfg.model), opts, force=cfg.force, scratch=claim.scratch, fuse=fuse)
    info, sha = loaded.info, loaded.sha
    if given_plan is not None:
        made = _reapply(given_plan, Path(str(cfg.plan)), opts, info, sha, force=cfg.force)
    else:
        data = CalibrationSettings.of(cfg)
        opts = split_generation_budget(data, opts, info.model)  # token_agreement... verified by decoding
        made = _make_plan(opts, info, sha, _rule_options(cfg, info.model), data)
    release_memory()  # the search's emulator and its rounded weights (reference cycles) go before the rewrite
    # External weights: each candidate is written (streamed, tensor by tensor) at the claim's staged path and gated
    # and verified there, like a small model in memory; publishing moves model and data into place.
    staged = (claim.stage(out), loaded.weights) if loaded.weights is not None else None
    # (verified: the gate's ONNX Runtime load of the model runs beside the verification, see _verified)
    result = _apply(made, info, opts.precision, staged=staged, defer_load=made.verify is not None)
    verification = None
    if made.verify is not None:
        release_memory()  # the rewrite's converted weights, now in the staged file
        result, verification = _verified(made, info, result, staged, opts.precision)
    plan = _summarize(made, info, result, verification, opts.precision)
    if staged is None:
        save_onnx(result.model, claim.stage(out))
    elif loaded.copied:
        _embed_weights(staged[0])  # the user's model was one file: so is the output, where it fits one
    # the gate on the very bytes published (apply_validated gated the model in memory or a candidate's file)
    gate_published(claim.stage(out), baseline_model=info.model if loaded.weights is None else None,
                   baseline_path=loaded.weights, gated=result.gated if staged is None else None)
    if not in_place:
        plan.save(claim.stage(plan_out))
    claim.publish()  # model, data and plan: both or neither
    logger.info(
        "convert: %d/%d nodes in %s, %d casts, %.1fs",
        plan.summary["nodes_low"],
        plan.summary["nodes_total"],
        opts.precision.value,
        result.cast_count,
        time.perf_counter() - start,
    )
    return ConvertResult(out, plan_out, plan)


def _check_outputs(cfg: ConvertConfig) -> tuple[Path, Path]:
    """The output model and its plan path, refused when they would overwrite an input (or exist, without force)."""
    out = check_output_path(cfg.output, [cfg.model, cfg.plan, cfg.keep_fp32_from], force=cfg.force)
    if out.suffix != ".onnx":
        raise InvalidInputError(format_message(f"Output '{cfg.output}'", f"suffix '{out.suffix}'", "'.onnx'",
                                               "its plan is written beside it as <name>.plan.json"))
    # the output's external data file: never the input's own (a model may keep its weights in "<out>.data")
    inputs_data = external_data_files(cfg.model) if Path(cfg.model).is_file() else []
    check_output_path(data_file(out), [cfg.model, *inputs_data], force=cfg.force)
    return out, plan_path_for(out)


def _resolve(cfg: ConvertConfig, plan_out: Path) -> tuple[Options, bool, PrecisionPlan | None]:
    """The options resolved against the defaults and ``--plan``; whether the plan is re-applied in place."""
    loaded = None
    if cfg.plan is not None:
        require_file(cfg.plan, "Plan")
        loaded = PrecisionPlan.load(cfg.plan)
    opts = resolve_options(cfg, loaded)  # the one place defaults, the plan and explicit options meet
    check_config(cfg, opts)
    if cfg.plan is not None:
        refuse_in_place_changes(opts, cfg.plan, plan_out)
    in_place = cfg.plan is not None and Path(cfg.plan).resolve() == plan_out.resolve()
    if not in_place:  # (re-applied in place: not rewritten)
        # an existing plan may hold a user's edits: replaced only with --force, like the model beside it
        check_output_path(plan_out, [cfg.model, cfg.keep_fp32_from], force=cfg.force)
    return opts, in_place, loaded


def _load(
    model_path: Path, opts: Options, *, force: bool, scratch: Callable[[], Path], fuse: bool = True
) -> _Loaded:
    """Load, check and name the model; its weights stay on disk when external, or copied there when big.

    External weights stay where they are: calibration's ONNX Runtime sessions and the strict emulator memory-map
    them from the model's folder, so the proto in memory is the graph alone however big the weights. Weights
    embedded in the .onnx that pass :func:`lazy_threshold` are written once as external data into ``scratch()`` (a
    private folder of the run's staging folder, removed with it) and the model is converted from that copy.
    """
    model: Any = load_onnx(model_path, load_external_data=False)
    weights = model_path if uses_external_data(model) else None
    sha = sha256_file(model_path)
    model = fit_runtime(model, str(model_path))  # an IR version ONNX Runtime reads; an opset it cannot: refused
    low_io = low_io_types(model)
    normalized = check_not_low(model, str(model_path), force=force)
    if normalized is not model:  # --force's return to FP32 is a rewrite too: gated against the model as read
        gate(normalized, baseline_model=model, stage="--force's return to FP32")
    model = sort_nodes(normalized)  # (ONNX Runtime takes an unsorted node list; the checker does not)
    embedded = embedded_bytes(model) if weights is None else 0
    if embedded > lazy_threshold():
        weights = scratch() / "input.onnx"
        logger.info("Weights embedded in '%s' (%.0f MB): converted from a copy in external data in the run's scratch "
                    "folder, memory-mapped", model_path, embedded / 1e6)
        ir_version = model.ir_version
        save_streamed(model, weights, data_file(weights).name)  # (clears the weights out of this proto as it goes)
        del model
        release_memory()  # the whole proto, before the graph alone is read back
        model = load_onnx(weights, load_external_data=False)
        model.ir_version = ir_version  # (save_streamed wrote the IR version it writes outputs at)
    addresses = [ref.address for ref in iter_nodes(model.graph)]
    if any(not a or a.endswith("/") for a in addresses) or len(set(addresses)) != len(addresses):
        model = name_nodes(model)  # (a copy with every node named: a model already named is this run's own proto)
    # no --opset (nor a plan's): a decoder is upgraded to the opset where its RMSNorm chains fuse, when they would
    upgrade = fusion_opset(model) if opts.opset is None and fuse else None
    model = ensure_opset(model, opts.precision, opset=upgrade[0] if upgrade else opts.opset,
                         reason=upgrade[1] if upgrade else None)
    if fuse:  # normalization chains become their ONNX op (LayerNorm from opset 17, RMSNorm from 23): no FP32 island
        fuse_norms(model)
    base_dir = str(weights.resolve().parent) if weights is not None else None
    info = GraphInfo(model, base_dir=base_dir)
    info.low_io = low_io
    return _Loaded(info, sha, weights, weights is not None and weights != model_path)


@dataclass(frozen=True)
class _Loaded:
    """The input model as convert reads it.

    Attributes:
        info: Its GraphInfo (the graph alone when ``weights`` is set: ``info.base_dir`` is that file's folder).
        sha: The sha256 of the user's file.
        weights: The .onnx file whose external data holds the weights (the user's file, or ``copied`` into the
            run's scratch folder); None = in memory.
        copied: Whether ``weights`` is the scratch copy of an input with embedded weights.
    """

    info: GraphInfo
    sha: str
    weights: Path | None
    copied: bool


def _rule_options(cfg: ConvertConfig, model: Any) -> RuleOptions:
    """The user's overrides of the rules: --keep-*/--low-* and the modules an overflow.json keeps FP32."""
    overflow = overflow_nodes(model, cfg.keep_fp32_from) if cfg.keep_fp32_from else {}
    return RuleOptions(cfg.keep_ops, cfg.low_ops, cfg.keep_nodes, cfg.low_nodes, overflow)


@dataclass
class _Planned:
    """A plan before it is applied, with what the final verification needs (``verify``: None = no budget)."""

    plan: PrecisionPlan
    expected: dict[str, Any] = field(default_factory=dict)
    search_cost: dict[str, Any] | None = None
    verify: VerifyInputs | None = None
    unmeasured: list[str] = field(default_factory=list)  # float outputs with no values on the data
    # the search's final candidate as applied and run (SearchOutcome.applied): the final apply takes its rewrite,
    # the verification its outputs (``verify.known_candidate``) and runner, see _apply and _verify
    applied: AppliedRun | None = None
    not_measured: str | None = None  # why nothing was measured (``--calibration none``)


def _make_plan(
    opts: Options, info: GraphInfo, sha: str, rules: RuleOptions, data: CalibrationSettings
) -> _Planned:
    """Rules → calibration → search (with a budget): the plan, its figures and the final verification's inputs."""
    opts = floor_for_model(opts, info.model)  # the default floor where it can apply, under numerics that can run
    check_overrides(info, rules)
    calibrated = calibrate_for_plan(data, opts, info.model, info.types, base_dir=info.base_dir or "")
    stats = calibrated.stats
    opts = floor_for_classes(opts, info.model, stats.reference_outputs if stats is not None else None)
    if stats is not None and stats.sample_shapes:
        info.observe_shapes(stats.sample_shapes)  # FLOPs at the sizes the data has, not 1 per unknown dim
    decisions, nodes = rule_plan(info, opts.precision, rules, keep_io_types=opts.keep_io_types, stats=stats)
    _warn_foreign(nodes)
    made = _Planned(_new_plan(data.model, sha, opts, calibrated.description))
    made.unmeasured = unmeasured_outputs(info.model, stats, own_data=data.own_data, source=data.source)
    if data.source == NO_CALIBRATION:
        made.not_measured = NOT_MEASURED
    if opts.budget and calibrated.feeds is not None:
        outcome, searched = _search(opts, info, decisions, nodes, calibrated)
        nodes = outcome.nodes
        made.expected, made.search_cost, made.applied = outcome.expected_error, outcome.cost, outcome.applied
        made.search_cost["samples"] = count_rows(info.model, searched)
        made.verify = _verify_inputs(data, opts, decisions, calibrated, outcome)
    elif calibrated.feeds is not None:
        made.expected = _expected_error(opts, info, nodes, calibrated)
    made.plan.nodes = list(nodes)
    warn_quantized(made.plan.nodes)  # an int8/QDQ model: say what was left as it was, and why
    return made


def _new_plan(source: Path, sha: str, opts: Options, calibration: dict[str, Any] | None) -> PrecisionPlan:
    """The plan's header (its nodes come later)."""
    return PrecisionPlan(
        source_path=str(source),
        source_sha256=sha,
        precision=opts.precision,
        numerics=opts.numerics,
        keep_io_types=opts.keep_io_types,
        nodes=[],
        budget=opts.budget,
        calibration=calibration,
        mpinfer_version=__version__,
    )


def _search(
    opts: Options, info: GraphInfo, decisions: Any, nodes: list[NodeDecision], calibrated: Calibrated
) -> tuple[SearchOutcome, Any]:
    """The budget search on the first ``--search-samples``: its outcome and the samples it searched on."""
    # (a first batch past the search slice is split only where the candidates may run as cast graphs)
    qualifies = may_qualify((n.op_type for n in nodes if n.precision.is_low), info.model)
    search_feeds, refs, tensors = search_data(opts, info.model, calibrated.feeds, calibrated.stats,
                                              cast_graph=qualifies)
    search_cfg = SearchConfig(
        metrics=opts.metrics,
        budget=opts.budget or "",
        precision=opts.precision,
        numerics=opts.numerics,
        class_outputs=opts.class_outputs,
        keep_io_types=opts.keep_io_types,
        batches=len(search_feeds) if isinstance(search_feeds, SearchRows) else MANY,
        progress=opts.progress,
        samples_independent=calibrated.stats is None or calibrated.stats.row_multiple == 1,
        tensor_batches=getattr(search_feeds, "tensor_batches", None),
    )
    try:
        outcome = search_plan(
            info.model, info, decisions, nodes, search_feeds, reference_outputs=refs, reference_tensors=tensors,
            cfg=search_cfg,
        )
        if isinstance(search_feeds, SearchRows):  # (a split first batch's pieces joined: the verification's batches)
            outcome = replace(outcome, outputs=search_feeds.per_calibration_batch(outcome.outputs))
    except AccuracyMismatchError as err:
        if not opts.default_budget:
            raise
        random = calibrated.stats is not None and calibrated.stats.is_random
        raise AccuracyMismatchError(
            f"{err} (No --budget was given: '{opts.budget}' is the default floor on "
            f"{RANDOM_INPUTS if random else 'the calibration data'}; pass --budget none to skip it.)"
        ) from err
    return outcome, search_feeds


def _verify_inputs(
    data: CalibrationSettings, opts: Options, decisions: Any, calibrated: Calibrated, outcome: SearchOutcome
) -> VerifyInputs:
    """The final verification's inputs, with what the search already measured of its last candidate."""
    class_outputs = opts.class_outputs
    if class_outputs is None and outcome.class_outputs is not None:  # top-k on the outputs the search judged
        class_outputs = tuple(outcome.class_outputs)
    inputs = verify_inputs(data, opts, decisions, calibrated, class_outputs=class_outputs)
    if outcome.outputs is not None:
        # the search measured the final plan on its samples: the verification takes those outputs (a batch the
        # search read only the first rows of is split there: verify._split)
        inputs.known_candidate = ({n.name: n.precision for n in outcome.nodes if n.precision.is_low}, outcome.outputs)
    return inputs


def _expected_error(opts: Options, info: GraphInfo, nodes: list[NodeDecision], calibrated: Calibrated) -> dict:
    """Without a budget: the plan's error measured on the first calibration batch (a warning when it is broken)."""
    measured, refs, _ = search_data(
        replace(opts, search_samples=1), info.model, calibrated.feeds, calibrated.stats, whole_batch=True
    )
    expected = measure_plan(
        info.model, nodes, measured, reference_outputs=refs, class_outputs=opts.class_outputs, base_dir=info.base_dir
    )
    _warn_broken(expected, nodes)
    return expected


def _reapply(
    plan: PrecisionPlan, plan_path: Path, opts: Options, info: GraphInfo, sha: str, *, force: bool
) -> _Planned:
    """The plan of ``--plan``, with explicit ``--keep-io-types``/``--opset`` applied to it."""
    _check_plan(plan, plan_path, info, sha, force=force)
    rewrite_planned_masks(info, plan.nodes, plan.precision)  # the attention masks the plan rewrites
    plan.keep_io_types = opts.keep_io_types
    expected, search_cost = plan.summary.get("expected_error", {}), plan.summary.get("search")
    edited = plan.mark_edits()
    if edited is not None or opts.changed:  # its numbers are the plan's as written: not this model's
        expected, search_cost = {}, None
        logger.warning(
            "Plan '%s' %s since `mpinfer convert` wrote it (%s): its expected error and search cost "
            "were for the plan as written and are dropped; measure this model with `mpinfer compare`.",
            plan_path,
            "was edited" if edited is not None else "is applied with changed options",
            f"{len(edited)} node(s) now 'user:plan', e.g. {', '.join(edited[:3])}"
            if edited
            else ("precisions" if edited is not None else ", ".join(f"{k}={v}" for k, v in opts.changed.items())),
        )
    if opts.changed:
        plan.summary.pop("verification", None)
        plan.calibration = dict(plan.calibration or {}, applied_with=dict(opts.changed))
    return _Planned(plan, expected, search_cost)


def _check_plan(plan: PrecisionPlan, plan_path: Path, info: GraphInfo, sha: str, *, force: bool) -> None:
    """``--plan`` (as :func:`_resolve` read it) against this model: its nodes, low only where they can be."""
    plan.check_matches([ref.address for ref in info.nodes], sha, str(plan_path), force=force)
    for n in plan.nodes:
        if not n.precision.is_low:
            continue
        ref = info.by_address[n.name]
        slots = info.slots(ref.node, plan.precision.onnx_dtype)
        if slots.blocked or not slots.has_float or ref.node.op_type in CONTROL_FLOW_OPS:
            why = slots.blocked or ("it has no float tensors" if not slots.has_float else "it is control flow")
            raise InvalidInputError(
                format_message(
                    f"Plan '{plan_path}': node '{n.name}' ({n.op_type})",
                    f"precision {n.precision.value}",
                    "fp32 for this node",
                    f'{why}; set its "precision" to "fp32"',
                )
            )


def _apply(
    made: _Planned,
    info: GraphInfo,
    precision: Precision,
    *,
    staged: tuple[Path, Path] | None,
    defer_load: bool = False,
) -> ApplyResult:
    """The plan applied behind the validity gate (ORT refusals go FP32 in ``made.plan``).

    ``staged``: (where to write, the input model's file) for external weights, see :func:`apply_validated`.
    ``defer_load``: the gate's ONNX Runtime load may still run when this returns (``result.load``, see
    :func:`_verified`).
    """
    plan = made.plan
    result, plan.nodes = apply_validated(
        info, plan.nodes, precision, keep_io_types=plan.keep_io_types, applied=made.applied, staged=staged,
        defer_load=defer_load,
    )
    return result


def _verified(
    made: _Planned, info: GraphInfo, result: ApplyResult, staged: tuple[Path, Path] | None, precision: Precision
) -> tuple[ApplyResult, dict]:
    """The final verification (:func:`_verify`), and the verdict of the gate's ONNX Runtime load that ran beside it.

    The load of the model as written (``result.load``: the gate's largest cost, ~0.27 s on the OCR recognizer) runs on
    a thread while the verification runs the model in memory. When ONNX Runtime refuses that model (rare: a kernel or a
    function body lacks the low dtype, BF16 mostly), the verification stops at its next batch (or has ended), the plan
    is applied again with the gate in line, which keeps the refused nodes FP32 as it always did
    (:func:`apply_validated`), and that model is verified in its turn.
    """
    pending = result.load
    abort = pending.refused if pending is not None else None
    try:  # (stopped between two batches once the load refused the model: no more time on a model not written)
        verified, nodes, verification = _verify(made, info, result, staged, abort=abort)
    except VerificationAborted:
        assert pending is not None  # (only its abort stops a verification)
        refused = pending.failures()
    else:
        settled, refused = settle_load(result, verified)
        if not refused:
            made.plan.nodes = nodes
            return settled, verification
    logger.info("validity gate: ONNX Runtime refused the model under verification (%s); applied again with the "
                "nodes it refuses kept FP32, and verified again", refused[0].message.strip()[:200])
    result = _apply(made, info, precision, staged=staged)
    verified, made.plan.nodes, verification = _verify(made, info, result, staged)
    return verified, verification


def _verify(
    made: _Planned,
    info: GraphInfo,
    result: ApplyResult,
    staged: tuple[Path, Path] | None = None,
    abort: Callable[[], bool] | None = None,
) -> tuple[ApplyResult, list[NodeDecision], dict]:
    """The final verification on the calibration data, repairing the plan until the budget holds.

    ``staged``: see :func:`apply_validated` (the candidate as written there is what is verified).
    ``abort``: see :func:`verify_and_repair` (raises VerificationAborted).

    Where the search measured this very model (its final candidate's cast graph, or its ONNX Runtime session, ran the
    model equal to the one written: ``made.applied``), the verification takes the search's outputs for those
    samples and runs the others on the same runner (no second cast graph build or session). Outputs the emulator
    computed are never taken: the emulator runs the FP32 model with low nodes, not the model written.
    """
    inputs = made.verify
    assert inputs is not None
    start = time.perf_counter()
    nodes = made.plan.nodes
    given = runner = None
    low = {n.name: n.precision for n in nodes if n.precision.is_low}
    ran, made.applied = made.applied, None  # (its session and model go with this pass)
    if inputs.known_candidate is not None and inputs.known_candidate[0] == low:
        # (apply_validated takes the record's very rewrite whenever it can: any other model is not the one it ran)
        if ran is not None and ran.model is result.model:
            given, runner = inputs.known_candidate[1], ran.open()  # the search ran the model as written
        else:
            logger.info("verify: every sample is run (the search's outputs of this plan are not the written model's%s)",
                        "" if ran is None else ": it differs from the one the search ran")
    del ran
    repaired = verify_and_repair(
        info, nodes, result, inputs.decisions, inputs.feeds, inputs.settings, known_reference=inputs.known_reference,
        rank_rows=inputs.rank_rows, known_candidate=given, staged=staged, runner=runner, abort=abort,
    )
    record = verification_record(repaired.verification, inputs.settings, repaired)
    record["wall_s"] = round(time.perf_counter() - start, 3)  # every pass and the repairs' ranking
    record["data"] = (made.plan.calibration or {}).get("kind")  # "random": judged on mpinfer's own random inputs
    if made.search_cost is not None:
        record["searched_samples"] = made.search_cost.get("samples")
    if repaired.rounds:  # the search's figures were for the candidate the verification rejected
        made.expected = {}
    return repaired.result, repaired.nodes, record


def _summarize(
    made: _Planned, info: GraphInfo, result: ApplyResult, verification: dict | None, precision: Precision
) -> PrecisionPlan:
    """The plan's summary (shares, casts, expected error, search cost, verification) and opset, set in place."""
    plan = made.plan
    plan.summary = summarize(
        info,
        plan.nodes,
        cast_count=result.cast_count,
        converted_weights=result.converted_weights,
        expected_error=made.expected,
        search=made.search_cost,
    )
    if verification is not None:
        plan.summary["verification"] = verification
    plan.opset = info.opsets.get("") or None  # what the plan was made for (and is applied at)
    note_measures(plan.summary, plan.nodes, info, precision, made.unmeasured, made.not_measured)
    _warn_opset_blocked(plan.nodes, info, precision)
    double = fp64_nodes(info)
    if double:
        plan.summary["fp64_nodes"] = len(double)
        logger.warning(
            "%d node(s) compute in FP64 (double), left as they are (mpinfer converts FP32 alone): %s. Cast them "
            "to float32 in the model if they should run in %s.",
            len(double), ", ".join(f"{op} x{k}" for op, k in Counter(double.values()).most_common()),
            precision.value,
        )
    return plan


@dataclass(frozen=True)
class ModelConversion:
    """An in-memory conversion: the new model, its plan entries and summary."""

    model: Any
    nodes: list[NodeDecision]
    summary: dict[str, Any]


def convert_model(
    model: Any,
    precision: Precision = Precision.FP16,
    *,
    keep_ops: tuple[str, ...] = (),
    low_ops: tuple[str, ...] = (),
    keep_nodes: tuple[str, ...] = (),
    low_nodes: tuple[str, ...] = (),
    keep_io_types: bool = True,
    stats: Any = None,
) -> ModelConversion:
    """Rules-only conversion of an in-memory FP32 model (no data, no search), behind the validity gate.

    Args:
        model: The ``onnx.ModelProto`` (not modified).
        precision: FP16 or BF16.
        keep_ops: Op types kept FP32.
        low_ops: Op types forced low.
        keep_nodes: Node-address regexes kept FP32.
        low_nodes: Node-address regexes forced low.
        keep_io_types: Keep graph inputs/outputs FP32.
        stats: Optional calibration statistics for the range rules.

    Returns:
        The converted model, the plan entries and the summary.

    Raises:
        InternalError: The rewritten model fails the validity gate.
    """
    named = ensure_opset(name_nodes(sort_nodes(model)), precision)
    fuse_norms(named)
    info = GraphInfo(named)
    options = RuleOptions(keep_ops, low_ops, keep_nodes, low_nodes)
    _, nodes = rule_plan(info, precision, options, keep_io_types=keep_io_types, stats=stats)
    result, nodes = apply_validated(info, nodes, precision, keep_io_types=keep_io_types)
    summary = summarize(info, nodes, cast_count=result.cast_count, converted_weights=result.converted_weights)
    return ModelConversion(result.model, nodes, summary)


__all__ = [
    "apply_validated",
    "ConvertConfig",
    "ConvertResult",
    "ModelConversion",
    "NodeDecision",
    "PrecisionPlan",
    "convert_model",
    "convert_precision",
]
