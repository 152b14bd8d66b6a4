"""Screening: a candidate judged against the FP32 reference, first on the samples earlier candidates got most wrong.

:class:`_Verifier` holds the search batches, the reference and the metrics; once a full verification has shown
which samples each candidate gets most wrong, a candidate first runs on the hardest eighth of them, and when even
the best outputs on the others could not meet the budget (a bound per metric), it is rejected there.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpinfer.checks import Checks
from mpinfer.metrics import QUANTILE_METRICS, ModelAccumulator
from mpinfer.precision.core import GraphInfo
from mpinfer.precision.numerics import Evaluator
from mpinfer.precision.numerics.base import AppliedRun, Outputs
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

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
# A candidate's full run (every search batch) stops after a batch once the samples run prove the budget fails on the
# whole search set (the same bound as screening's); off, every full run reads every batch. The decisions are the same.
STOP_EARLY = True
# Staged full runs: a candidate that passed screening and whose engine runs any subset of the samples bit for bit as
# its full run does (strict numerics on the cast graph) runs next the hardest STAGE_SHARE of the samples (those not
# screened yet), is rejected there when they prove the budget fails, and else runs the rest; its outputs are
# assembled in sample order, so a candidate that passes is judged on exactly what one full run gives. Basic Pitch
# (16 samples in one batch) has failures the 2 screened samples miss but the hardest 8 show.
STAGE_SHARE = 1 / 2
# Steering (``_Verifier.metrics(..., steer=True)``, the bisection's prefixes): a staged candidate that meets the budget
# on the hardest STAGE_SHARE of the samples is taken as passing without running the rest. Its verdict only steers the
# bisection (a failure there is still proved by a bound); the plan the search returns is always one measured on every
# sample (``_Verifier.steered`` says whether the last verdict was steered, and the search settles it with a full run).
STEER = True
# Previewing (``_Verifier.metrics(..., preview=True)``): the whole candidate, before any run has shown which samples are
# hard, runs first on this share of the samples spread evenly over them (at least SCREEN_MIN_ROWS), when a second
# candidate is waiting (the magnitude one): when those samples prove the budget fails, the second candidate runs
# without the whole candidate's other samples, which run only if the search then needs them (its sensitivities rank on
# the hardness of a full run, :meth:`_Verifier.finish_preview`). On the cast graph only (any subset bit for bit as the
# full run). DNSMOS: its whole candidate is rejected on 2 of 8 samples.
PREVIEW_SHARE = SCREEN_SHARE


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
    # strict numerics: the leading batches whose FP32 tensors fit the search slice (None: every batch)
    tensor_batches: int | None = None
    metrics: tuple[Any, ...] = ()  # the user's own metrics (mpinfer.usermetric.UserMetric): budget terms too


@dataclass(frozen=True)
class Passing:
    """A candidate measured on every search sample that met the budget.

    Attributes:
        low: Its low nodes (address -> precision).
        outputs: Its outputs, one dict per search batch.
        run: The candidate as applied, when that model computed ``outputs`` (:meth:`Candidate.ran_as`); else None.
    """

    low: dict[str, Precision]
    outputs: list[Outputs]
    run: AppliedRun | None


class _Verifier:
    """Judges candidate low-node sets against the FP32 reference: metrics, screening, per-sample hardness.

    How a candidate is run (the numerics) is the :class:`~mpinfer.precision.numerics.base.Evaluator`'s business.
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
        # The last candidate measured on every sample that met the budget: convert takes its run when the plan is
        # that candidate (SearchOutcome.applied and .outputs)
        self.passing: Passing | None = None
        # Screening: per-sample hardness over the search samples (batches concatenated),
        # the worst relative error each sample showed in a full verification; None until one ran, or
        # when the samples cannot be split (see _screen_rows). ``screened``: candidates rejected early.
        self._hardness: np.ndarray | None = None
        self._unread: list[dict[str, np.ndarray]] | None = None  # a full verification's outputs not yet in hardness
        self.screened = 0
        # Full runs stopped after some batches, once the samples seen proved the budget fails on the whole search set
        # (only after the groups were measured: the whole candidate's run ranks them, so it runs on every sample),
        # and the batches they did not run.
        self.stop_early = False
        self.sensitivity_s = 0.0  # seconds the search spent measuring the groups' local errors
        self.magnitude_groups = 0  # groups the magnitude candidate left FP32 (0: not tried), and whether it met
        self.magnitude_met = False
        # Candidates taken as passing on the hardest samples alone (see STEER), and whether the last verdict was one.
        self.steers = 0
        self.steered = False
        self.unsteered = 0  # searches started again unsteered (a steered prefix failed its full run)
        self.stopped = 0
        self.batches_skipped = 0
        self._splittable: bool | None = None
        self._joined: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None  # (feeds, reference)
        self._screened_out: tuple[np.ndarray, Outputs] | None = None  # the rows and outputs screening last passed
        # A previewed candidate rejected on its preview rows: its low nodes, runner and the (rows, outputs) run so far
        self._preview: tuple[dict[str, Precision], Callable[[Outputs], Outputs], list[tuple[np.ndarray, Outputs]]] \
            | None = None

    def reference_outputs(self) -> list[dict[str, np.ndarray]]:
        return self.ev.reference()

    def metrics(
        self, low: Mapping[str, Precision], *, screen: bool = True, record: bool = True, steer: bool = False,
        preview: bool = False,
    ) -> dict[str, dict[str, float | None]]:
        """Per-output metrics of the candidate whose low nodes are ``low``.

        With ``screen``, a candidate that cannot meet the budget is rejected after a run on the hardest samples
        only; the metrics returned then are bounds (:meth:`ModelAccumulator.optimistic`) that already break the
        budget. Any candidate that may meet it is measured on every sample. ``record``: False reads a full run into
        no sample's hardness (the samples screened, staged and probed next are those the runs before it chose).
        ``steer`` (with :data:`STEER`): a staged run that meets the budget on the hardest samples ends there, and the
        metrics returned are those samples' bounds (``steered`` is then True). ``preview``: before any hardness is
        known, the candidate runs first on a spread share of the samples (:data:`PREVIEW_SHARE`) and is rejected there
        when they prove the budget fails (:meth:`finish_preview` runs the rest when the search needs it).
        """
        self.verifications += 1
        self.steered = False
        cand = self.ev.candidate(low)
        rows = self.ev.screen_rows(self._screen_rows) if screen else None
        rejected = None if rows is None else self._screen(lambda f: cand.outputs_on(f, rows), rows)
        if rejected is not None:
            return rejected
        staged = self._staged(cand, rows, steer and STEER) if rows is not None and STOP_EARLY and self.stop_early \
            else None
        if preview and staged is None and rows is None and STOP_EARLY and self._hardness is None:
            staged = self._previewed(cand, low)
            if isinstance(staged, dict):  # (the preview rows prove the budget fails)
                cand.judged(False)
                return staged
        if isinstance(staged, dict):  # (rejected on the hardest samples, or passed them when steering)
            cand.judged(False)  # (a steered pass is no base to grow from: its runs did not cover every sample)
            if self.budget.met(staged):
                self.steers += 1
                self.steered = True
            return staged
        acc = self.accumulator()
        outs: list[dict[str, np.ndarray]] = []
        for out in cand.each() if staged is None else staged:
            self._add(acc, len(outs), out)
            outs.append(out)
            if screen and STOP_EARLY and self.stop_early and len(outs) < len(self.batches):
                assert self.fp32_acc is not None  # set by _reference
                bound = acc.optimistic(self.fp32_acc, self.budget.targets())
                if not self.budget.met(bound):  # the samples seen prove the budget fails on the whole set
                    self.stopped += 1
                    self.batches_skipped += len(self.batches) - len(outs)
                    cand.judged(False)
                    return bound
        metrics = acc.finalize()
        if record:
            if self._unread is not None:
                self._update_hardness(self._unread)
            self._unread = outs  # read into the hardness when a later candidate screens (the first often passes)
        cand.judged(self.budget.met(metrics))
        if self.budget.met(metrics):
            self.passing = Passing(dict(low), outs, cand.ran_as())
        return metrics

    def accumulate(self, outs: list[dict[str, np.ndarray]]) -> ModelAccumulator:
        """The metrics core's accumulator fed every batch of ``outs`` against the reference (with labels)."""
        if len(outs) != len(self.batches):
            raise ValueError(f"{len(outs)} batches of outputs for {len(self.batches)} search batches")
        acc = self.accumulator()
        for index, out in enumerate(outs):
            self._add(acc, index, out)
        return acc

    def _add(self, acc: ModelAccumulator, index: int, out: dict[str, np.ndarray]) -> None:
        """Search batch ``index``'s candidate outputs ``out`` into ``acc``, against the reference (with labels)."""
        batch, ref = self.batches[index], self.reference_outputs()[index]
        offset = sum(_batch_rows(b) for b in self.batches[:index])
        n = _batch_rows(batch)
        labels = None if self.labels is None else self.labels[offset : offset + n]
        acc.update(ref, out, labels if labels is not None and len(labels) == n else None, inputs=batch)

    def accumulator(self) -> ModelAccumulator:
        """An empty accumulator of the compared outputs, with the budget's topK and the fixed class outputs."""
        return ModelAccumulator(
            self.float_names(),
            class_outputs=self.class_outputs,
            topk=self.budget.topk,
            quantiles=bool(self.budget.metrics & QUANTILE_METRICS),
            user_metrics=self.cfg.metrics,
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
        feeds = self._joined_samples()[0]
        got = run({k: v[rows] for k, v in feeds.items()})
        bound = self._bound([(rows, got)])
        if bound is None:
            self._splittable = False
            return None
        if self.budget.met(bound):
            self._screened_out = (rows, got)
            return None
        self.screened += 1
        return bound

    def _staged(
        self, cand: Any, rows: np.ndarray, steer: bool = False
    ) -> dict[str, dict[str, float | None]] | list[Outputs] | None:
        """A full run in stages after screening passed on ``rows`` (see :data:`STAGE_SHARE`).

        Returns the optimistic metrics when the hardest samples prove the budget fails (counted in ``stopped``), or,
        with ``steer``, when they meet it (the rest is not run); the candidate's outputs per search batch when it ran
        every sample, or None: the engine cannot run subsets bit for bit (the candidate then runs its batches as they
        are).
        """
        runner = getattr(cand, "rows_runner", None)
        screened, self._screened_out = self._screened_out, None
        if runner is None or screened is None or screened[0] is not rows:
            return None
        run = runner()
        if run is None:
            return None
        feeds, joined_ref = self._joined_samples()
        total = len(next(iter(joined_ref.values())))
        stage = np.setdiff1d(self._hardest(math.ceil(total * STAGE_SHARE)), rows)
        parts = [screened]
        try:
            if len(stage):
                parts.append((stage, run({k: v[stage] for k, v in feeds.items()})))
                bound = self._bound(parts)
                if bound is not None and not self.budget.met(bound):
                    self.stopped += 1
                    return bound
                if bound is not None and steer:
                    return bound
            rest = np.setdiff1d(np.arange(total), np.concatenate([p[0] for p in parts]))
            if len(rest):
                parts.append((rest, run({k: v[rest] for k, v in feeds.items()})))
        except Exception as err:  # onnxruntime's own types: data it refuses; the batches run as they are
            logger.debug("search: a staged run failed (%s); the candidate runs its batches", err)
            return None
        return self._assemble(parts, total)

    def _previewed(
        self, cand: Any, low: Mapping[str, Precision]
    ) -> dict[str, dict[str, float | None]] | list[Outputs] | None:
        """The candidate run on the preview rows first, then, unless they reject it, on the other samples.

        Returns the optimistic metrics when the preview rows prove the budget fails (its runner and runs kept for
        :meth:`finish_preview`), else its outputs per search batch with every sample run; None when the engine cannot
        run subsets bit for bit (the candidate then runs its batches as they are).
        """
        runner = getattr(cand, "rows_runner", None)
        if runner is None or not self.splittable():
            return None
        feeds, joined_ref = self._joined_samples()
        total = len(next(iter(joined_ref.values())))
        k = max(SCREEN_MIN_ROWS, math.ceil(total * PREVIEW_SHARE))
        if k >= total:
            return None
        run = runner()
        if run is None:
            return None
        rows = np.unique(np.linspace(0, total - 1, k).round().astype(np.int64))  # (spread: data sorted by class)
        try:
            parts = [(rows, run({n: v[rows] for n, v in feeds.items()}))]
            bound = self._bound(parts)
            if bound is not None and not self.budget.met(bound):
                self.screened += 1
                self._preview = dict(low), run, parts
                return bound
            rest = np.setdiff1d(np.arange(total), rows)
            parts.append((rest, run({n: v[rest] for n, v in feeds.items()})))
        except Exception as err:  # onnxruntime's own types: data it refuses; the batches run as they are
            logger.debug("search: a preview run failed (%s); the candidate runs its batches", err)
            return None
        return self._assemble(parts, total)

    def finish_preview(self) -> None:
        """The rest of the samples of a candidate rejected on its preview rows, its outputs read into the hardness.

        The search calls it before anything ranks on the hardness (the sensitivities' samples): the hardness is then
        that of the candidate's full run, as without the preview. Nothing to do when no preview was rejected.
        """
        if self._preview is None:
            return
        (low, run, parts), self._preview = self._preview, None
        feeds, joined_ref = self._joined_samples()
        total = len(next(iter(joined_ref.values())))
        rest = np.setdiff1d(np.arange(total), np.concatenate([r for r, _ in parts]))
        try:
            if len(rest):
                parts.append((rest, run({n: v[rest] for n, v in feeds.items()})))
            outs = self._assemble(parts, total)
        except Exception as err:  # onnxruntime's own types: data it refuses; the batches run as they are
            logger.debug("search: the rest of a preview failed (%s); the candidate runs its batches", err)
            outs = list(self.ev.candidate(low).each())
        if outs is not None:
            if self._unread is not None:
                self._update_hardness(self._unread)
            self._unread = outs

    def _bound(self, parts: list[tuple[np.ndarray, Outputs]]) -> dict[str, dict[str, float | None]] | None:
        """The optimistic metrics of the samples run so far (None: outputs without one row per sample)."""
        if any(np.ndim(got[n]) == 0 or len(got[n]) != len(r) for r, got in parts for n in self.names):
            return None
        feeds, joined_ref = self._joined_samples()
        sub = self.accumulator()
        for r, got in parts:
            labels = None
            if self.labels is not None and int(r.max()) < len(self.labels):
                labels = np.asarray(self.labels)[r]
            ref = {n: joined_ref[n][r] for n in self.names}
            sub.update(ref, got, labels, inputs={k: v[r] for k, v in feeds.items()})
        assert self.fp32_acc is not None  # set by _reference
        return sub.optimistic(self.fp32_acc, self.budget.targets())

    def _assemble(self, parts: list[tuple[np.ndarray, Outputs]], total: int) -> list[Outputs] | None:
        """Every output in sample order from the runs of ``parts`` (rows, outputs), cut into the search batches.

        None when an output does not come back as an array with one row per sample.
        """
        first = parts[0][1]
        joined: Outputs = {}
        for name, value in first.items():
            if not all(isinstance(got.get(name), np.ndarray) and len(got[name]) == len(r) for r, got in parts):
                return None
            arr = np.empty((total, *np.shape(value)[1:]), dtype=np.asarray(value).dtype)
            for r, got in parts:
                arr[r] = got[name]
            joined[name] = arr
        outs, offset = [], 0
        for batch in self.batches:
            n = _batch_rows(batch)
            outs.append({k: v[offset : offset + n] for k, v in joined.items()})
            offset += n
        return outs

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
            got = np.concatenate([np.asarray(o[name]).reshape(len(o[name]), -1) for o in outs])
            row = sample_errors(np.asarray(joined_ref[name]).reshape(len(joined_ref[name]), -1), got)
            worst = row if worst is None else np.maximum(worst, row)
        if worst is not None:
            self._hardness = worst if self._hardness is None else np.maximum(self._hardness, worst)


# Values per block of rows :func:`sample_errors` converts to float64 at a time (its temporaries stay in cache).
HARDNESS_BLOCK = 1 << 16


def sample_errors(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Per sample (row), the largest ``|got - ref|`` where ``ref`` is finite, over the largest finite ``|ref|``.

    inf for a sample with NaN/Inf where the reference is finite (the hardest). The float64 figures of
    ``max_j(where(ok, |got - ref|, 0) / scale)``: dividing by the positive scale after the row's maximum gives the
    same bits (correctly rounded division is monotone), so the float64 differences go through in blocks of
    :data:`HARDNESS_BLOCK` values, not as a handful of whole-array temporaries (PP-OCRv4's recognizer: 8.5 M values
    an output, 0.7 s before).
    """
    rows = len(ref)
    if not ref.shape[1]:
        return np.zeros(rows)
    step = max(1, HARDNESS_BLOCK // ref.shape[1])
    top = np.zeros(rows)
    scale = 0.0
    for lo in range(0, rows, step):
        with np.errstate(invalid="ignore"):  # (inf - inf where both are: left out below, as NaN is made inf)
            d = got[lo : lo + step].astype(np.float64)
            r = ref[lo : lo + step].astype(np.float64)
            np.subtract(d, r, out=d)
        ok = np.isfinite(r)
        whole = bool(ok.all())
        np.abs(d, out=d)
        np.abs(r, out=r)
        if not whole:
            d[~ok] = 0.0
            r[~ok] = 0.0
        scale = max(scale, float(r.max()))
        block = d.max(axis=1)
        block[np.isnan(block)] = np.inf  # (a NaN where the reference is finite)
        top[lo : lo + step] = block
    return top / max(scale if scale > 0 or np.isfinite(ref).any() else 1.0, 1e-30)


def _batch_rows(batch: Mapping[str, Any]) -> int:
    """Samples in a batch: axis 0 of its first input (a scalar input: one)."""
    first = next(iter(batch.values()), None)
    return 0 if first is None else (len(first) if np.ndim(first) else 1)
