"""Accuracy-budget search: as much low precision (by FLOPs) as the budget allows, with few Casts.

1. Group the rule plan's low nodes into fused chains: each compute node (Conv, MatMul, ...) with the
   follow-ops it feeds first, so a group switches precision as a unit and adds no Casts inside.
2. Sensitivity, O(model size) in total: each group is run alone on the FP32 reference tensors of its
   inputs and its local relative error measured: with ORT numerics all groups at once in one ONNX Runtime
   probe model (``probe.py``: about two model runs), with strict numerics as small sub-models in the
   emulator (also for groups the probe cannot copy); on the quarter of the samples the whole candidate got
   most wrong, when the samples can be split (the errors only rank the groups).
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
from mpinfer.metrics import QUANTILE_METRICS, ModelAccumulator, worst_values
from mpinfer.precision import evaluators
from mpinfer.precision.emulator.emulate import GraphEmulator
from mpinfer.precision.evaluators import Evaluator, evaluator_class
from mpinfer.precision.graphinfo import GraphInfo, components
from mpinfer.precision.plan import NodeDecision
from mpinfer.precision.rules import Decision, Kind
from mpinfer.progress import progress_bar
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

# Skipped groups tried one by one after the bisection (when the rest does not fit whole): enough to recover
# groups a single bad neighbour pushed out of the prefix, few enough that the cost stays O(log groups) runs.
MAX_REFINE = 8
# Screening (``_Verifier.metrics``): a candidate first runs on this share of the search samples,
# the ones the earlier candidates got most wrong (at least SCREEN_MIN_ROWS, and only with SCREEN_MIN_TOTAL
# samples or more); when even a perfect result on the other samples could not meet the budget, it is
# rejected without running them. A candidate that may pass runs on every sample, as without screening.
SCREEN_SHARE = 1 / 8
SCREEN_MIN_ROWS = 2
SCREEN_MIN_TOTAL = 8
# Sensitivity (``_measure``): the groups' local errors are measured on this share of the search samples (at
# least PROBE_MIN_ROWS), the ones the whole candidate got most wrong: they only rank the groups, every candidate
# is still verified on all samples, and the ORT probe costs about two model runs per sample (the strict
# emulator one FP32 run plus one run of every group).
PROBE_SHARE = 1 / 4
PROBE_MIN_ROWS = 4
# The figures a plan summary's expected error shows (each the worst output's; top-k from class-score outputs
# alone), besides any metric the budget names.
SUMMARY_METRICS = ("cosine", "cosine_min", "max_abs", "mean_abs", "rel_l2", "range_err", "snr_db", "top1", "top5",
                   "nonfinite", "mismatch")
# Floor of the error used in the FLOPs-per-error score (a group with zero local error is not infinitely good).
ERROR_FLOOR = 1e-7
# The local error a group inside an If/Loop/Scan body is ranked with (none is measured there): as bad as any,
# so measured groups go first and the body groups follow by FLOPs.
BODY_GROUP_ERROR = 1.0


@dataclass(frozen=True)
class SearchConfig:
    """Settings of one search."""

    budget: str
    precision: Precision
    numerics: str = "strict"
    class_outputs: tuple[str, ...] | None = None
    keep_io_types: bool = True
    batches: int = 2
    progress: bool = True
    # False for a model that takes its samples in groups (rows reshaped 4 at a time: CalibrationStats.row_multiple):
    # a sample's outputs depend on its group, so the search never runs a subset of the samples (no screening on the
    # hardest, no probe of them), only the batches as they are.
    samples_independent: bool = True


@dataclass
class SearchOutcome:
    """The searched plan entries, the error the final plan showed, and what the search cost."""

    nodes: list[NodeDecision]
    expected_error: dict[str, Any]
    cost: dict[str, Any] = field(default_factory=dict)
    # ORT numerics: (precisions, ApplyResult) of the last candidate that met the budget, which ONNX Runtime
    # loaded and ran; the final apply reuses it when the plan's precisions are the same.
    verified: tuple[dict[str, Precision], Any] | None = None
    # The final plan's outputs on the search batches (one dict per batch), when the search measured that very
    # candidate on all of them; the final verification takes them instead of running those samples again.
    outputs: list[dict[str, np.ndarray]] | None = None
    # The outputs the search treated as class scores (given, or guessed once on the reference): a later
    # verification passes them to its ModelAccumulator so it judges top-k on the same outputs.
    class_outputs: list[str] | None = None


@dataclass
class _Group:
    anchor: str
    members: list[str]
    flops: float
    error: float = 0.0
    # Nodes inside an If/Loop/Scan body: no sub-model or probe copy measures them alone, so they are ranked with
    # BODY_GROUP_ERROR and decided by the verifications.
    in_body: bool = False


class _Verifier:
    """Judges candidate low-node sets against the FP32 reference: metrics, screening, per-sample hardness.

    How a candidate is run (the numerics) is the :class:`~mpinfer.precision.evaluators.Evaluator`'s business.
    """

    def __init__(
        self, model: Any, info: GraphInfo, batches: list[dict], budget: Checks, cfg: SearchConfig,
        labels: np.ndarray | None, evaluator: Evaluator,
    ) -> None:
        self.model, self.info, self.batches = model, info, batches
        self.budget, self.cfg, self.labels, self.ev = budget, cfg, labels, evaluator
        self.verifications = 0
        self.names: list[str] = []
        # Metrics of the FP32 model itself (its outputs are the reference), and its accumulator (the whole
        # reference's sums, which screening bounds read): set by _reference, with the class-score outputs.
        self.fp32_metrics: dict[str, dict[str, float | None]] = {}
        self.fp32_acc: ModelAccumulator | None = None
        self.class_outputs: list[str] | None = None if cfg.class_outputs is None else list(cfg.class_outputs)
        self.passing: tuple[dict[str, Precision], Any] | None = None  # see SearchOutcome.verified
        # The low nodes and outputs (per search batch) of the last candidate measured on every sample that met the
        # budget: the final verification takes them for these samples when the plan is that candidate.
        self.passing_outputs: tuple[dict[str, Precision], list[dict[str, np.ndarray]]] | None = None
        # Screening: per-sample hardness over the search samples (batches concatenated),
        # the worst relative error each sample showed in a full verification; None until one ran, or
        # when the samples cannot be split (see _screen_rows). ``screened``: candidates rejected early.
        self._hardness: np.ndarray | None = None
        self._unread: list[dict[str, np.ndarray]] | None = None  # a full verification's outputs not yet in hardness
        self.screened = 0
        self._splittable: bool | None = None
        self._joined: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None  # (feeds, reference)

    def reference_outputs(self) -> list[dict[str, np.ndarray]]:
        return self.ev.reference()

    def metrics(self, low: Mapping[str, Precision], *, screen: bool = True) -> dict[str, dict[str, float | None]]:
        """Per-output metrics of the candidate whose low nodes are ``low``.

        With ``screen``, a candidate that cannot meet the budget is rejected after a run on the hardest samples
        only; the metrics returned then are bounds (:meth:`ModelAccumulator.optimistic`) that already break the
        budget. Any candidate that may meet it is measured on every sample.
        """
        self.verifications += 1
        cand = self.ev.candidate(low)
        rows = self.ev.screen_rows(self._screen_rows) if screen else None
        rejected = None if rows is None else self._screen(lambda f: cand.outputs_on(f, rows), rows)
        if rejected is not None:
            return rejected
        outs = cand.outputs()
        metrics = self.compare(outs)
        if self._unread is not None:
            self._update_hardness(self._unread)
        self._unread = outs  # read into the hardness when a later candidate screens (the first often passes)
        if self.budget.met(metrics):
            self.passing_outputs = (dict(low), outs)
            verified = cand.verified()
            if verified is not None:
                self.passing = verified
        return metrics

    def compare(self, outs: list[dict[str, np.ndarray]]) -> dict[str, dict[str, float | None]]:
        """Per-output metrics of candidate outputs (one dict per batch) against the FP32 reference."""
        return self.accumulate(outs).finalize()

    def accumulate(self, outs: list[dict[str, np.ndarray]]) -> ModelAccumulator:
        """The metrics core's accumulator fed every batch of ``outs`` against the reference (with labels)."""
        acc = self.accumulator()
        offset = 0
        for batch, ref, out in zip(self.batches, self.reference_outputs(), outs, strict=True):
            n = _batch_rows(batch)
            labels = None if self.labels is None else self.labels[offset : offset + n]
            offset += n
            acc.update(ref, out, labels if labels is not None and len(labels) == n else None)
        return acc

    def accumulator(self) -> ModelAccumulator:
        """An empty accumulator of the compared outputs, with the budget's topK and the fixed class outputs."""
        return ModelAccumulator(
            self.float_names(),
            class_outputs=self.class_outputs,
            topk=self.budget.topk,
            quantiles=bool(self.budget.metrics & QUANTILE_METRICS),
        )

    def float_names(self) -> list[str]:
        """The outputs compared: every output of the FP32 reference, as compare does (found once, kept)."""
        if not self.names:
            self.names = list(self.reference_outputs()[0])
        return self.names

    # -- screening ---------------------------------------------------------------------------------
    @staticmethod
    def _rows_of(batch: Mapping[str, np.ndarray]) -> int | None:
        """Samples in a batch when every input holds them along axis 0, else None."""
        sizes = {len(v) if np.ndim(v) else -1 for v in batch.values()}
        return sizes.pop() if len(sizes) == 1 and min(sizes) > 0 else None

    def splittable(self) -> bool:
        """True when the search samples can run in any subset: a batch axis 0 on every input and float output.

        The model's inputs must not fix axis 0, every batch must hold the same trailing shapes (so rows of
        different batches can run together), and each float reference output must have one row per sample.
        """
        if self._splittable is None:
            self._splittable = self._check_splittable()
        return self._splittable

    def _check_splittable(self) -> bool:
        if not self.cfg.samples_independent:
            return False
        for vi in self.model.graph.input:
            dims = vi.type.tensor_type.shape.dim
            if vi.name in self.batches[0] and (not dims or dims[0].HasField("dim_value")):
                return False
        refs = self.reference_outputs()
        names = self.float_names()
        first = self.batches[0]
        for batch, ref in zip(self.batches, refs, strict=True):
            n = self._rows_of(batch)
            if n is None or set(batch) != set(first):
                return False
            if any(np.shape(batch[k])[1:] != np.shape(first[k])[1:] for k in batch):
                return False
            if any(np.ndim(ref[name]) == 0 or len(ref[name]) != n for name in names):
                return False
        return True

    def _screen_rows(self) -> np.ndarray | None:
        """The hardest samples to run first (indices into the concatenated batches), or None."""
        if self.hardness is None or len(self.hardness) < SCREEN_MIN_TOTAL or not self.splittable():
            return None
        return self._hardest(max(SCREEN_MIN_ROWS, math.ceil(len(self.hardness) * SCREEN_SHARE)))

    def _hardest(self, k: int) -> np.ndarray:
        """Indices (ascending) of the ``k`` samples with the largest hardness (ties: the earlier sample)."""
        assert self.hardness is not None
        return np.sort(np.argsort(-self.hardness, kind="stable")[:k])

    def probe_batches(self) -> list[dict[str, np.ndarray]]:
        """The samples group sensitivities are measured on: the hardest ``PROBE_SHARE`` when they can be split.

        Falls back to every search batch before the first full verification, or when the samples cannot
        run in subsets (see :meth:`splittable`).
        """
        if self.hardness is None or not self.splittable():
            return self.batches
        k = max(PROBE_MIN_ROWS, math.ceil(len(self.hardness) * PROBE_SHARE))
        if k >= len(self.hardness):
            return self.batches
        rows = self._hardest(k)
        feeds = self._joined_samples()[0]
        return [{name: v[rows] for name, v in feeds.items()}]

    def _screen(
        self, run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]], rows: np.ndarray
    ) -> dict[str, dict[str, float | None]] | None:
        """Screen a candidate on ``rows``: its optimistic metrics when they already break the budget, else None.

        ``run`` maps the rows' feeds to the candidate's outputs. A rejection is counted in ``screened``; None
        means the candidate must run on every sample (also when the outputs do not come back one row per
        sample: screening is then off for good).
        """
        names = self.names
        feeds, joined_ref = self._joined_samples()
        got = run({k: v[rows] for k, v in feeds.items()})
        if any(np.ndim(got[n]) == 0 or len(got[n]) != len(rows) for n in names):
            self._splittable = False
            return None
        sub = self.accumulator()
        labels = None
        if self.labels is not None and int(rows.max()) < len(self.labels):
            labels = np.asarray(self.labels)[rows]
        sub.update({n: joined_ref[n][rows] for n in names}, got, labels)
        assert self.fp32_acc is not None  # set by _reference
        bound = sub.optimistic(self.fp32_acc)
        if self.budget.met(bound):
            return None
        self.screened += 1
        return bound

    def _joined_samples(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every search sample in one array per input, and the FP32 reference in one array per float output."""
        if self._joined is None:
            refs = self.reference_outputs()
            feeds = {k: np.concatenate([b[k] for b in self.batches]) for k in self.batches[0]}
            self._joined = feeds, {n: np.concatenate([r[n] for r in refs]) for n in self.names}
        return self._joined

    @property
    def hardness(self) -> np.ndarray | None:
        """Per sample, the largest error relative to its output's scale in any full verification so far."""
        if self._unread is not None:
            outs, self._unread = self._unread, None
            self._update_hardness(outs)
        return self._hardness

    def _update_hardness(self, outs: list[dict[str, np.ndarray]]) -> None:
        """Per sample, the largest error relative to its output's scale seen in a full verification."""
        if not self.splittable():
            return
        joined_ref = self._joined_samples()[1]
        worst = None
        for name in self.names:
            if np.asarray(joined_ref[name]).dtype.kind != "f":
                continue
            ref = np.asarray(joined_ref[name], np.float64).reshape(len(joined_ref[name]), -1)
            got = np.concatenate([np.asarray(o[name], np.float64).reshape(len(o[name]), -1) for o in outs])
            ok = np.isfinite(ref)
            scale = float(np.abs(ref[ok]).max()) if ok.any() else 1.0
            err = np.where(ok, np.abs(got - ref), 0.0) / max(scale, 1e-30)
            err[~np.isfinite(err)] = np.inf  # NaN/Inf where the reference is finite: the hardest
            row = err.max(axis=1) if err.shape[1] else np.zeros(len(err))
            worst = row if worst is None else np.maximum(worst, row)
        if worst is not None:
            self._hardness = worst if self._hardness is None else np.maximum(self._hardness, worst)


def build_groups(info: GraphInfo, nodes: Sequence[NodeDecision], decisions: Mapping[str, Decision]) -> list[_Group]:
    """Fused chains of searchable low nodes (not forced by the user), each within one graph or body."""
    prec = {n.name: n.precision for n in nodes}
    searchable = [
        ref for ref in info.nodes if prec[ref.address].is_low and not decisions[ref.address].reason.startswith("user:")
    ]

    def first_source(ref: Any) -> str | None:
        """The producer a follow-op joins: the first of its inputs made by another searchable node of its graph."""
        for name in ref.node.input:
            src = info.producer.get(name)
            if src in addresses and src != ref.address and info.by_address[src].graph is ref.graph:
                return src
        return None

    addresses = {ref.address for ref in searchable}
    links = (
        (ref.address, src)
        for ref in searchable
        if decisions[ref.address].kind is Kind.FOLLOW and (src := first_source(ref)) is not None
    )
    groups: dict[str, _Group] = {}
    for anchor, members in components([ref.address for ref in searchable], links).items():
        flops = sum(float(info.flops(info.by_address[a])) for a in members)
        groups[anchor] = _Group(anchor, members, flops, in_body=info.by_address[anchor].depth > 0)
    return list(groups.values())


def group_errors(
    info: GraphInfo, groups: Sequence[_Group], batches: Sequence[Mapping[str, np.ndarray]], low: Precision
) -> dict[str, float]:
    """Each group's local error (run alone in ``low`` on the FP32 tensors of ``batches``), by anchor.

    Groups in control-flow bodies are left out, and so is every group when the emulator cannot run the model.
    """
    emu = GraphEmulator(info.model, base_dir=info.base_dir)
    if not batches or emu.unsupported_ops():
        return {}
    refs = [emu.run(dict(b), None, keep=True) for b in batches]
    return {g.anchor: evaluators.local_error(info.model, info, g, refs, low)[0] for g in groups if not g.in_body}


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


def _has_all_outputs(model: Any, outputs: Sequence[Mapping[str, Any]]) -> bool:
    """True when ``outputs`` hold every graph output (calibration keeps only the float ones)."""
    return all(o.name in outputs[0] for o in model.graph.output)


def _batch_rows(batch: Mapping[str, Any]) -> int:
    """Samples in a batch: axis 0 of its first input (a scalar input: one)."""
    first = next(iter(batch.values()), None)
    return 0 if first is None else (len(first) if np.ndim(first) else 1)


def _labels_for(feeds: Any, batches: list[dict[str, np.ndarray]], budget: Checks) -> np.ndarray | None:
    if not budget.needs_labels:
        return None
    labels = getattr(feeds, "labels", None)
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
    accepted, metrics, measured = _choose_groups(groups, forced, ver, cfg)
    cost = _cost(ver, groups, accepted, measured, time.perf_counter() - start)
    final = _finalize(nodes, groups if measured else [], {a for g in accepted for a in g.members})
    verified = ver.passing if ver.passing and ver.passing[0] == {n.name: n.precision for n in final} else None
    final_low = {n.name: n.precision for n in final if n.precision.is_low}
    outputs = ver.passing_outputs[1] if ver.passing_outputs and ver.passing_outputs[0] == final_low else None
    return SearchOutcome(
        final, summary_figures(metrics, ver.budget), cost, verified, outputs=outputs, class_outputs=ver.class_outputs
    )


def _choose_groups(
    groups: list[_Group], forced: Mapping[str, Precision], ver: _Verifier, cfg: SearchConfig
) -> tuple[list[_Group], dict[str, dict[str, float | None]], bool]:
    """The groups that stay low, the metrics of that candidate, and whether the groups were measured.

    The whole candidate first: when it meets the budget there is nothing to search, and the sensitivity pass
    (and, with ORT numerics, the emulator's FP32 reference run) is skipped. Else the groups are ranked by
    FLOPs per unit of local error and the largest passing prefix is bisected for.
    """
    with progress_bar(enabled=cfg.progress) as bar:
        task = bar.add_task("verify", total=None)
        metrics = ver.metrics(_low_of(groups, forced, cfg.precision))
        bar.advance(task)
        if ver.budget.met(metrics):
            return list(groups), metrics, False
        _measure(groups, ver, bar)
        order = sorted(
            (g for g in groups if math.isfinite(g.error)), key=lambda g: -g.flops / max(g.error, ERROR_FLOOR)
        )
        # Groups whose local error is not finite (overflow) left the order: the rest may pass whole.
        rest = ver.metrics(_low_of(order, forced, cfg.precision)) if len(order) < len(groups) else metrics
        bar.advance(task)
        if ver.budget.met(rest):
            return order, rest, True
        accepted, metrics = _bisect(order, forced, ver, bar, task, cfg)
        return accepted, metrics, True


def _cost(ver: _Verifier, groups: list[_Group], accepted: list[_Group], measured: bool, wall: float) -> dict:
    """The search's cost for the plan summary (and the log line that says it)."""
    cost = {
        "node_evaluations": int(ver.ev.evaluations),
        "verifications": int(ver.verifications),
        # Of those, candidates rejected after a run on the hardest samples only.
        "screened": int(ver.screened),
        "groups": len(groups),
        "groups_low": len(accepted),
        "batches": len(ver.batches),
        "wall_s": round(wall, 3),
        "numerics": ver.cfg.numerics,
        "model_nodes": len(ver.info.nodes),
        # False: the whole rule candidate met the budget, so no group was measured or bisected.
        "searched": measured,
    }
    logger.info(
        "search: %d/%d groups low, %d verifications, %d node evaluations, %.1fs",
        len(accepted),
        len(groups),
        ver.verifications,
        ver.ev.evaluations,
        cost["wall_s"],
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
    budget = parse_checks(cfg.budget)
    batches = _take_batches(feeds, max(cfg.batches, 1))
    labels = _labels_for(feeds, batches, budget)
    evaluator = evaluator_class(cfg.numerics)(
        model,
        info,
        batches,
        cfg.precision,
        keep_io_types=cfg.keep_io_types,
        known_outputs=reference_outputs,
        known_tensors=reference_tensors,
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
    lo, hi, best = 0, len(order), base
    while hi - lo > 1:
        mid = (lo + hi) // 2
        m = ver.metrics(low_of(order[:mid]))
        bar.advance(task)
        if ver.budget.met(m):
            lo, best = mid, m
        else:
            hi = mid
    accepted, rest = list(order[:lo]), order[hi:]
    if len(rest) > 1:  # order[lo] broke the prefix; with one culprit, everything after it fits at once
        m = ver.metrics(low_of([*accepted, *rest]))
        bar.advance(task)
        if ver.budget.met(m):
            return [*accepted, *rest], m
    for g in rest[:MAX_REFINE]:
        m = ver.metrics(low_of([*accepted, g]))
        bar.advance(task)
        if ver.budget.met(m):
            accepted.append(g)
            best = m
    return accepted, best


def _finalize(nodes: Sequence[NodeDecision], groups: Sequence[_Group], chosen: set[str]) -> list[NodeDecision]:
    group_of = {a: g for g in groups for a in g.members}
    out = []
    for n in nodes:
        g = group_of.get(n.name)
        if g is None:
            out.append(n)
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
    if reference_outputs is not None and len(reference_outputs) >= len(taken) and _has_all_outputs(
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
