"""Accuracy-budget search: as much low precision (by FLOPs) as the budget allows, with few Casts.

1. Group the rule plan's low nodes into fused chains: each compute node (Conv, MatMul, ...) with the
   follow-ops it feeds first, so a group switches precision as a unit and adds no Casts inside.
2. Sensitivity, O(model size) in total: each group is run alone on the FP32 reference tensors of its
   inputs and its local relative error measured: with ORT numerics all groups at once in one ONNX Runtime
   probe model (``probe.py``: about two model runs), with strict numerics as small sub-models in the
   emulator (also for groups the probe cannot copy); on the quarter of the samples the whole candidate got
   most wrong, when the samples can be split (the errors only rank the groups).
   Before that, when calibration shows groups making or reading values above ``groups.MAGNITUDE_LIMIT`` (FP16;
   together under ``MAGNITUDE_FLOPS_SHARE`` of the candidate's FLOPs), the candidate without them is verified
   (ModelOpt AutoCast's data-magnitude rule as a second candidate): when it meets the budget the search ends there
   (the flagged groups tried back one by one when there are several), with no sensitivities measured. The whole
   candidate is then previewed on a spread eighth of the samples (``screening.PREVIEW_SHARE``): when they prove it
   fails, its other samples run only if the search goes on to the sensitivities, which rank on its full run.
3. Greedy by FLOPs per unit of error: groups sorted by ``flops / error``; the whole candidate is verified
   with one incremental emulator run (``GraphEmulator.run_from``); when it fails, bisection over the
   sorted prefix finds the largest prefix that meets the budget (log2(groups) verifications); the group
   that broke it stays FP32 and the rest is tried whole (one sensitive group: done), else a few skipped
   groups are tried one by one.
4. Screening: once a full verification has shown which samples each candidate gets most wrong, a
   candidate first runs on the hardest eighth of them (strict numerics: incrementally, from a kept FP32
   run of those samples); when even the best outputs on the others could not meet the budget
   (:meth:`mpinfer.metrics.ModelAccumulator.optimistic`, a bound per metric), it is rejected there.
   Candidates that may pass run on every sample, so each decision and the final error are those of full runs.
   On the cast graph (which computes each sample alone) a candidate that passed screening then runs the hardest
   half of the samples, is rejected there when they prove the budget fails, else runs the rest, and its outputs
   are assembled in sample order (``screening.STAGE_SHARE``): each sample is run once.

The cost (emulator node evaluations, verifications, wall time) goes into the plan summary.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpinfer.checks import Checks, parse_checks
from mpinfer.errors import AccuracyMismatchError, BackendUnavailableError, InvalidInputError, format_message
from mpinfer.metrics import ModelAccumulator, worst_values
from mpinfer.precision.budget.groups import MAGNITUDE_LIMIT, _Group, build_groups, magnitude_groups
from mpinfer.precision.budget.screening import SearchConfig, _batch_rows, _Verifier
from mpinfer.precision.core import GraphInfo, NodeDecision
from mpinfer.precision.numerics import AppliedRun, evaluator_class, has_all_outputs
from mpinfer.precision.numerics import strict as evaluators
from mpinfer.precision.rules import Decision
from mpinfer.progress import progress_bar
from mpinfer.specs import Precision
from mpinfer.usermetric import metric_names

logger = logging.getLogger(__name__)

# Skipped groups tried one by one after the bisection (when the rest does not fit whole): enough to recover
# groups a single bad neighbour pushed out of the prefix, few enough that the cost stays O(log groups) runs.
MAX_REFINE = 8
# Top-ranked groups the bisection may leave FP32 one at a time when the top one alone breaks the budget (the local
# error mis-ranked it: a small error where it enters, a large one at the outputs), each followed by a new bisection of
# the rest. layout_cdla: its first group (a Conv+BatchNorm+HardSwish, local error 6.7e-4) alone gives range_err
# 0.0118 at one box output, and a single bisection left 8 of 964 groups low.
MAX_HEAD_DROPS = 4
# The magnitude candidate (the rule candidate less the groups above ``groups.MAGNITUDE_LIMIT``) is tried only while
# those groups hold at most this share of the rule candidate's searchable FLOPs: the plan it ends with then gives up
# at most that share against a search that might keep some of them low (DNSMOS: 0.24%, its STFT power spectrum).
MAGNITUDE_FLOPS_SHARE = 0.01
# The figures a plan summary's expected error shows (each the worst output's; top-k from class-score outputs
# alone), besides any metric the budget names.
SUMMARY_METRICS = ("cosine", "cosine_min", "max_abs", "mean_abs", "rel_l2", "range_err", "snr_db", "top1", "top5",
                   "nonfinite", "mismatch")
# Floor of the error used in the FLOPs-per-error score (a group with zero local error is not infinitely good).
ERROR_FLOOR = 1e-7
# The local error a group inside an If/Loop/Scan body is ranked with (none is measured there): as bad as any,
# so measured groups go first and the body groups follow by FLOPs.
BODY_GROUP_ERROR = 1.0


@dataclass
class SearchOutcome:
    """The searched plan entries, the error the final plan showed, and what the search cost."""

    nodes: list[NodeDecision]
    expected_error: dict[str, Any]
    cost: dict[str, Any] = field(default_factory=dict)
    # The final plan's outputs on the search batches (one dict per batch), when the search measured that very
    # candidate on all of them; the final verification takes them instead of running those samples again.
    outputs: list[dict[str, np.ndarray]] | None = None
    # That candidate as applied, when its model computed ``outputs`` (Candidate.ran_as): the final apply takes its
    # ApplyResult, and the final verification its runner for a written model equal to it.
    applied: AppliedRun | None = None
    # The outputs the search treated as class scores (given, or guessed once on the reference): a later
    # verification passes them to its ModelAccumulator so it judges top-k on the same outputs.
    class_outputs: list[str] | None = None


def _measure(groups: Sequence[_Group], ver: _Verifier, bar: Any) -> None:
    """Set each group's local error (the evaluator's sensitivities; groups in bodies get ``BODY_GROUP_ERROR``).

    The errors are measured on the samples the whole candidate got most wrong, when they can be split.
    """
    for g in groups:
        if g.in_body:
            g.error = BODY_GROUP_ERROR
    todo = [g for g in groups if not g.in_body]
    if not todo:
        return
    sens = bar.add_task("sensitivity", total=len(todo))
    subset = ver.probe_batches()
    errors = ver.ev.sensitivities(todo, subset, subset is not ver.batches)
    for g in todo:
        if g.anchor in errors:
            g.error = errors[g.anchor]
        bar.advance(sens)


def _take_batches(feeds: Any, count: int) -> list[dict[str, np.ndarray]]:
    out = []
    for batch in feeds:
        out.append(batch)
        if len(out) >= count:
            break
    if not out:
        raise InvalidInputError("The calibration data has no batches to search with.")
    return out


def _labels_for(
    feeds: Any, batches: list[dict[str, np.ndarray]], budget: Checks, user: bool = False
) -> np.ndarray | None:
    """The search samples' labels: needed by label metrics, given to user metrics where the data has them."""
    labels = getattr(feeds, "labels", None)
    if user and not budget.needs_labels:
        return None if labels is None else np.asarray(labels)[: sum(_batch_rows(b) for b in batches)]
    if not budget.needs_labels:
        return None
    if labels is None:
        raise InvalidInputError(
            format_message(
                "Budget term 'accuracy'",
                "calibration data without labels",
                "an .npz with a '_labels' array",
                "add _labels to the .npz, or use agreement metrics such as top1>=0.999",
            )
        )
    n = sum(_batch_rows(b) for b in batches)
    return np.asarray(labels)[:n]


def search_plan(
    model: Any,
    info: GraphInfo,
    decisions: Mapping[str, Decision],
    nodes: Sequence[NodeDecision],
    feeds: Any,
    cfg: SearchConfig,
    *,
    reference_outputs: list[dict[str, np.ndarray]] | None = None,
    reference_tensors: list[dict[str, np.ndarray]] | None = None,
) -> SearchOutcome:
    """Search the low-precision node set that meets ``cfg.budget`` with the most FLOPs in low precision.

    Args:
        model: The named FP32 model.
        info: Its analysis.
        decisions: Rule verdicts per node.
        nodes: The rule plan (its low nodes are the candidates).
        feeds: Calibration batches (the first ``cfg.batches`` are used).
        cfg: Budget, precision and numerics.
        reference_outputs: ORT numerics: the FP32 model's float outputs on the first ``cfg.batches``
            batches, when the caller has them (calibration keeps them); else the search runs the model.
        reference_tensors: Strict numerics: every float32 tensor of the FP32 model on those batches, as ONNX
            Runtime computed them (calibration keeps them): the emulator's FP32 reference run takes them
            instead of computing them, and its candidates recompute only what their low nodes change.

    Returns:
        The plan entries after the search, the final error and the search cost.

    Raises:
        AccuracyMismatchError: The budget fails even with the whole model in FP32.
        InvalidInputError: Labels missing for ``accuracy``, or ops strict numerics cannot run.
    """
    start = time.perf_counter()
    ver = _reference(model, info, feeds, cfg, reference_outputs, reference_tensors)
    groups = build_groups(info, nodes, decisions)
    members = {a for g in groups for a in g.members}
    forced = {n.name: n.precision for n in nodes if n.precision.is_low and n.name not in members}
    # (FP16 only: BF16 keeps FP32's range, and its relative precision does not depend on the magnitude)
    flagged = magnitude_groups(info, groups, nodes) if cfg.precision is Precision.FP16 else []
    accepted, metrics, how = _choose_groups(groups, forced, ver, cfg, flagged)
    cost = _cost(ver, groups, accepted, how, time.perf_counter() - start)
    chosen = {a for g in accepted for a in g.members}
    final = _finalize(nodes, groups if how == "searched" else flagged if how == "magnitude" else [], chosen,
                      measured=how == "searched")
    final_low = {n.name: n.precision for n in final if n.precision.is_low}
    passing = ver.passing if ver.passing is not None and ver.passing.low == final_low else None
    return SearchOutcome(
        final, summary_figures(metrics, ver.budget), cost, outputs=None if passing is None else passing.outputs,
        applied=None if passing is None else passing.run, class_outputs=ver.class_outputs,
    )


def _choose_groups(
    groups: list[_Group],
    forced: Mapping[str, Precision],
    ver: _Verifier,
    cfg: SearchConfig,
    flagged: Sequence[_Group] = (),
) -> tuple[list[_Group], dict[str, dict[str, float | None]], str]:
    """The groups that stay low, the metrics of that candidate, and how they were chosen.

    The whole candidate first: when it meets the budget there is nothing to search ("whole"), and the sensitivity
    pass (and, with ORT numerics, the emulator's FP32 reference run) is skipped. Next the magnitude candidate, the
    whole one less the ``flagged`` groups (:func:`_magnitude_first`: "magnitude" when it meets the budget). Else the
    groups are ranked by FLOPs per unit of local error and the largest passing prefix is bisected for ("searched").
    """
    with progress_bar(enabled=cfg.progress) as bar:
        task = bar.add_task("verify", total=None)
        # (previewed when the magnitude candidate waits: a whole candidate its first samples reject costs no more)
        metrics = ver.metrics(_low_of(groups, forced, cfg.precision), preview=_magnitude_tried(groups, flagged))
        bar.advance(task)
        if ver.budget.met(metrics):
            return list(groups), metrics, "whole"
        by_magnitude = _magnitude_first(groups, flagged, forced, ver, cfg)
        bar.advance(task)
        if by_magnitude is not None:
            return by_magnitude[0], by_magnitude[1], "magnitude"
        ver.finish_preview()  # (the sensitivities' samples are the hardest of the whole candidate's full run)
        measure_start = time.perf_counter()
        _measure(groups, ver, bar)
        ver.sensitivity_s = time.perf_counter() - measure_start
        ver.stop_early = True  # (the groups are ranked: a failing candidate's full run may stop once it is proved)
        order = sorted(
            (g for g in groups if math.isfinite(g.error)), key=lambda g: -g.flops / max(g.error, ERROR_FLOOR)
        )
        # Groups whose local error is not finite (overflow) left the order: the rest may pass whole.
        rest = ver.metrics(_low_of(order, forced, cfg.precision)) if len(order) < len(groups) else metrics
        bar.advance(task)
        if ver.budget.met(rest):
            return order, rest, "searched"
        accepted, metrics = _bisect(order, forced, ver, bar, task, cfg)
        return accepted, metrics, "searched"


def _magnitude_first(
    groups: Sequence[_Group],
    flagged: Sequence[_Group],
    forced: Mapping[str, Precision],
    ver: _Verifier,
    cfg: SearchConfig,
) -> tuple[list[_Group], dict[str, dict[str, float | None]]] | None:
    """The groups low and the metrics when the candidate without the ``flagged`` groups meets the budget, else None.

    Tried only when the flagged groups are some, not all, of the groups and hold at most
    :data:`MAGNITUDE_FLOPS_SHARE` of their FLOPs. With several flagged groups, each is then tried back on its own
    (largest FLOPs first, at most :data:`MAX_REFINE`, screened), kept low when the budget still holds (one flagged
    group: the whole candidate, known to fail). The candidate's run is read into no sample's hardness: when it fails,
    the search goes on (sensitivities on the hardest samples, bisection) exactly as it would have without it.
    """
    if not _magnitude_tried(groups, flagged):
        return None
    ver.magnitude_groups = len(flagged)
    out = {id(g) for g in flagged}
    accepted = [g for g in groups if id(g) not in out]
    # Not screened: it is tried because it is expected to pass, and one run of every sample then costs less than the
    # screening run, the staged runs (and, strict, the emulator's FP32 run of a sample that decides whether screening
    # pays) of a candidate that passes. DNSMOS: 1.4 CPU s less.
    metrics = ver.metrics(_low_of(accepted, forced, cfg.precision), screen=False, record=False)
    if not ver.budget.met(metrics):
        return None  # (the search goes on as without this candidate)
    ver.magnitude_met = True
    ver.stop_early = True  # (a failing add-back's run may stop once it is proved)
    if len(flagged) > 1:
        for g in sorted(flagged, key=lambda g: -g.flops)[:MAX_REFINE]:
            m = ver.metrics(_low_of([*accepted, g], forced, cfg.precision), record=False)
            if ver.budget.met(m):
                accepted.append(g)
                metrics = m
    return accepted, metrics


def _magnitude_tried(groups: Sequence[_Group], flagged: Sequence[_Group]) -> bool:
    """Whether the magnitude candidate is tried.

    Only when ``flagged`` are some, not all, of the groups, with at most :data:`MAGNITUDE_FLOPS_SHARE` of their FLOPs.
    """
    total = sum(g.flops for g in groups)
    share = sum(g.flops for g in flagged)
    return bool(flagged) and len(flagged) < len(groups) and share <= MAGNITUDE_FLOPS_SHARE * total


def _cost(ver: _Verifier, groups: list[_Group], accepted: list[_Group], how: str, wall: float) -> dict:
    """The search's cost for the plan summary (and the log line that says it)."""
    cost = {
        "node_evaluations": int(ver.ev.evaluations),
        "verifications": int(ver.verifications),
        # Of those, candidates rejected after a run on the hardest samples only.
        "screened": int(ver.screened),
        # ... and full runs stopped once the batches run proved the budget missed, with the batches not run
        "stopped_early": int(ver.stopped),
        "batches_skipped": int(ver.batches_skipped),
        # bisection prefixes taken as passing on the hardest half of the samples alone, and searches that had to
        # start again on every sample (a steered prefix, the plan, failed on the others)
        "steered": int(ver.steers),
        "unsteered": int(ver.unsteered),
        "groups": len(groups),
        "groups_low": len(accepted),
        "batches": len(ver.batches),
        "wall_s": round(wall, 3),
        "sensitivity_s": round(ver.sensitivity_s, 3),  # of which measuring the groups' local errors
        "numerics": ver.cfg.numerics,
        "model_nodes": len(ver.info.nodes),
        # False: the whole rule candidate met the budget, so no group was measured or bisected.
        "searched": how != "whole",
        # groups the magnitude candidate left FP32 (0: not tried), and whether it met the budget (the search ended
        # there, no group measured)
        "magnitude_groups": int(ver.magnitude_groups),
        "magnitude_met": bool(ver.magnitude_met),
        # strict numerics: candidate runs started from a kept candidate run, the node evaluations that saved, and the
        # candidates (and screening runs) judged on the cast graph and on the emulator
        **getattr(ver.ev, "reuse", {}),
    }
    logger.info(
        "search: %d/%d groups low%s, %d verifications (%d screened, %d stopped early, %d steered, %d runs from a "
        "kept candidate run; candidates judged: %d on the cast graph, %d on the emulator), %d node evaluations, %.1fs "
        "(%.1fs measuring groups)",
        len(accepted),
        len(groups),
        "" if not ver.magnitude_groups else
        f" (magnitude candidate: {ver.magnitude_groups} group(s) FP32, {'met' if ver.magnitude_met else 'missed'})",
        ver.verifications,
        ver.screened,
        ver.stopped,
        ver.steers,
        cost.get("reused_runs", 0),
        cost.get("cast_graph_candidates", 0),
        cost.get("emulator_candidates", 0),
        ver.ev.evaluations,
        cost["wall_s"],
        cost["sensitivity_s"],
    )
    return cost


def _reference(
    model: Any,
    info: GraphInfo,
    feeds: Any,
    cfg: SearchConfig,
    reference_outputs: list[dict[str, np.ndarray]] | None = None,
    reference_tensors: list[dict[str, np.ndarray]] | None = None,
) -> _Verifier:
    """The FP32 reference outputs, and the check that the FP32 model meets the budget.

    With strict numerics the emulator's FP32 runs are kept (``run_from`` starts from them); with ORT
    numerics the emulator opens only if the search needs sensitivities. The FP32 model's outputs are the
    reference itself, so the check costs no run: only label terms (``accuracy``) can fail it.

    Raises:
        AccuracyMismatchError: The budget fails even with every node in FP32.
        InvalidInputError: Strict numerics on a model with ops the emulator cannot run.
    """
    budget = parse_checks(cfg.budget, metric_names(cfg.metrics))
    batches = _take_batches(feeds, max(cfg.batches, 1))
    labels = _labels_for(feeds, batches, budget, bool(cfg.metrics))
    evaluator = evaluator_class(cfg.numerics)(
        model,
        info,
        batches,
        cfg.precision,
        keep_io_types=cfg.keep_io_types,
        known_outputs=reference_outputs,
        known_tensors=reference_tensors,
        **({"kept_batches": cfg.tensor_batches} if cfg.tensor_batches is not None else {}),
    )
    ver = _Verifier(model, info, batches, budget, cfg, labels, evaluator)
    budget.check_outputs(ver.float_names())
    ver.fp32_acc = ver.accumulate(ver.reference_outputs())
    ver.class_outputs = ver.fp32_acc.class_outputs  # the guess, made once: every candidate is judged alike
    ver.fp32_metrics = base_metrics = ver.fp32_acc.finalize()
    inapplicable = budget.inapplicable(base_metrics)
    if inapplicable:
        raise InvalidInputError(
            format_message(
                f"Budget '{cfg.budget}'",
                "checks that apply to no output: " + "; ".join(inapplicable),
                "checks each output they select can be measured with",
                "name class-score outputs with --class-outputs, or check them with cosine/max_abs",
            )
        )
    if not budget.met(base_metrics):
        raise AccuracyMismatchError(
            format_message(
                f"Budget '{cfg.budget}'",
                "a budget the model misses even with every node in FP32: " + "; ".join(budget.failures(base_metrics)),
                "a budget the FP32 model meets",
                "loosen the budget (agreement metrics such as cosine/top1 compare with the FP32 model)",
            )
        )
    return ver


def _low_of(groups: Sequence[_Group], forced: Mapping[str, Precision], precision: Precision) -> dict[str, Precision]:
    """The low node set of a candidate: the forced nodes and every member of ``groups``."""
    low = dict(forced)
    low.update({a: precision for g in groups for a in g.members})
    return low


def _bisect(
    order: list[_Group],
    forced: Mapping[str, Precision],
    ver: _Verifier,
    bar: Any,
    task: Any,
    cfg: SearchConfig,
) -> tuple[list[_Group], dict[str, dict[str, float | None]]]:
    """The largest prefix of ``order`` that meets the budget, then the rest whole or a few groups one by one.

    When even the top group alone breaks the budget, it stays FP32 and the rest is tried whole, then bisected
    again (at most :data:`MAX_HEAD_DROPS` times): one mis-ranked group no longer leaves every prefix failing.

    The prefixes are steered (:data:`~mpinfer.precision.budget.screening.STEER`): one that meets the budget on the
    hardest half of the samples is taken as passing without its other samples. The plan returned is measured on
    every sample: a later candidate holding the prefix, or the prefix itself once settled by a full run; when that
    full run fails (the other samples broke it), the prefixes are searched again, each on every sample.

    The whole ``order`` is known to fail. The empty prefix (only the forced nodes low) is the FP32
    reference when nothing is forced, so it is verified only when something is.
    """

    def low_of(groups: Sequence[_Group]) -> dict[str, Precision]:
        return _low_of(groups, forced, cfg.precision)

    base = ver.metrics(low_of([]), screen=False) if forced else ver.fp32_metrics
    if not ver.budget.met(base):
        raise AccuracyMismatchError(
            format_message(
                f"Budget '{cfg.budget}'",
                "a budget the nodes forced low by --low-op/--low-node already break: "
                + "; ".join(ver.budget.failures(base)),
                "a budget those nodes meet",
                "drop some --low-op/--low-node overrides or loosen the budget",
            )
        )
    found = _prefixes(order, low_of, base, ver, lambda: bar.advance(task), steer=True)
    if found is None:  # a steered prefix failed on every sample: the exact search
        ver.unsteered += 1
        found = _prefixes(order, low_of, base, ver, lambda: bar.advance(task), steer=False)
    assert found is not None  # (unsteered, every verdict is a full run's)
    return found


def _prefixes(
    order: list[_Group],
    low_of: Callable[[Sequence[_Group]], dict[str, Precision]],
    base: dict[str, dict[str, float | None]],
    ver: _Verifier,
    advance: Callable[[], None],
    *,
    steer: bool,
) -> tuple[list[_Group], dict[str, dict[str, float | None]]] | None:
    """:func:`_bisect`'s search, its prefixes steered or not; None: a steered prefix, the plan, failed its full run."""

    def bisect(order: list[_Group]) -> tuple[int, int, dict[str, dict[str, float | None]], bool]:
        lo, hi, best, steered = 0, len(order), base, False  # (``order`` whole is known to fail)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            m = ver.metrics(low_of(order[:mid]), steer=steer)
            advance()
            if ver.budget.met(m):
                lo, best, steered = mid, m, ver.steered
            else:
                hi = mid
        return lo, hi, best, steered

    lo, hi, best, steered = bisect(order)
    for _ in range(MAX_HEAD_DROPS):
        if lo or len(order) < 2:
            break
        order = order[1:]  # the top group alone breaks the budget: it stays FP32, and the rest is searched again
        m = ver.metrics(low_of(order))
        advance()
        if ver.budget.met(m):
            return list(order), m
        lo, hi, best, steered = bisect(order)
    accepted, rest = list(order[:lo]), order[hi:]
    if len(rest) > 1:  # order[lo] broke the prefix; with one culprit, everything after it fits at once
        m = ver.metrics(low_of([*accepted, *rest]))
        advance()
        if ver.budget.met(m):
            return [*accepted, *rest], m
    for g in rest[:MAX_REFINE]:
        m = ver.metrics(low_of([*accepted, g]))
        advance()
        if ver.budget.met(m):
            accepted.append(g)
            best, steered = m, False
    if steered:  # the plan is the steered prefix: settled on every sample
        best = ver.metrics(low_of(accepted), screen=False)
        advance()
        if not ver.budget.met(best):
            return None
    return accepted, best


def _finalize(
    nodes: Sequence[NodeDecision], groups: Sequence[_Group], chosen: set[str], *, measured: bool = True
) -> list[NodeDecision]:
    """The plan entries: members of ``groups`` not ``chosen`` FP32 (reason ``sensitivity``), the rest as planned.

    ``measured``: the groups' local errors were measured (each member's stats get them); else ``groups`` are the
    magnitude candidate's flagged groups.
    """
    group_of = {a: g for g in groups for a in g.members}
    out = []
    for n in nodes:
        g = group_of.get(n.name)
        if g is None:
            out.append(n)
            continue
        if not measured:
            if n.name in chosen:
                out.append(n)
            else:
                detail = (f"kept FP32 by the budget search: its group reaches |{g.peak:.4g}| in calibration (above "
                          f"{MAGNITUDE_LIMIT:g}), and the candidate without such groups met the budget")
                out.append(NodeDecision(n.name, n.op_type, Precision.FP32, "sensitivity", detail, dict(n.stats)))
            continue
        stats = {**n.stats, "sensitivity": "not measured (in a control-flow body)" if g.in_body else _clean(g.error)}
        if n.name in chosen:
            out.append(NodeDecision(n.name, n.op_type, n.precision, n.reason, n.detail, stats))
        else:
            why = "its group (in a control-flow body)" if g.in_body else f"its group's local error {g.error:.3g}"
            detail = f"kept FP32 by the budget search: {why} did not fit the budget"
            out.append(NodeDecision(n.name, n.op_type, Precision.FP32, "sensitivity", detail, stats))
    return out


def summary_figures(
    per_output: Mapping[str, Mapping[str, float | None]], budget: Checks | None = None
) -> dict[str, Any]:
    """A plan summary's expected error: the worst output's value of each figure it shows (JSON-safe).

    :data:`SUMMARY_METRICS` and the budget's metrics; a figure no output has (top-k without class-score
    outputs, mismatch without integer outputs) is left out.
    """
    keep = set(SUMMARY_METRICS) | (set(budget.metrics) if budget is not None else set())
    worst = worst_values(per_output)
    return {k: _clean(v) for k, v in worst.items() if k in keep}


def _clean(v: float) -> float | str:
    """JSON-safe number (inf/nan as strings)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return float(v)


def measure_plan(
    model: Any,
    nodes: Sequence[NodeDecision],
    feeds: Any,
    *,
    batches: int = 1,
    reference_outputs: list[dict[str, np.ndarray]] | None = None,
    class_outputs: tuple[str, ...] | None = None,
    base_dir: str = "",
) -> dict[str, Any]:
    """Expected error of a plan without a budget: strict emulation of the plan vs the FP32 reference.

    ``reference_outputs``: the FP32 model's float outputs on the first ``batches`` batches when the caller has
    them (calibration keeps them), else the emulator computes them. ``class_outputs``: the outputs top-k reads
    (None: guessed). The figures are the metrics core's (:func:`summary_figures`). ``base_dir``: the model file's
    folder when its weights are external (memory-mapped from there).

    Returns an empty dict when the emulator cannot run the model (the plan is still valid).
    """
    try:
        emu = evaluators.open_emulator(model, required=False, base_dir=base_dir)
    except BackendUnavailableError:
        return {}
    if emu is None:
        return {}
    low = {n.name: n.precision for n in nodes if n.precision.is_low}
    taken = _take_batches(feeds, batches)
    if reference_outputs is not None and len(reference_outputs) >= len(taken) and has_all_outputs(
        model, reference_outputs
    ):
        refs = list(reference_outputs[: len(taken)])
    else:
        refs = [emu.run(batch, None).outputs for batch in taken]
    outs = [emu.run(batch, low).outputs for batch in taken]
    names = [n for n, v in outs[0].items() if isinstance(v, np.ndarray)]  # sequence values: no figures
    acc = ModelAccumulator(names, class_outputs=class_outputs, quantiles=False)
    for ref, out in zip(refs, outs, strict=True):
        acc.update(ref, out)
    return summary_figures(acc.finalize())
