"""Final verification: the model as written, on every calibration sample, against the FP32 reference.

The budget search reads a slice of the calibration data (``--search-samples``); the guarantee never does.
After the search, :func:`verify_and_repair` streams every calibration sample (or ``--verify-samples``),
batch by batch, through the converted model exactly as it will be written, under the chosen numerics
(strict emulation: :class:`mpinfer.precision.emulator.runner.StrictRunner`; or ONNX Runtime), against the FP32
model run by ONNX Runtime — the same computation ``mpinfer compare --numerics strict|ort`` does. Only the
running sums of the metrics core are kept, never the outputs, so memory is one batch whatever the data.

When the budget fails, the groups of low nodes that contribute most (their local error, measured on the
batch the candidate got most wrong) go back to FP32 — 1, 2, 4, ... of them — and the new candidate is
verified again, until the budget holds. If it fails even with every group FP32 (what stays low then is the
user's ``--low-*`` overrides and the casts at kept low I/O), convert raises and writes nothing.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.checks import parse_checks
from mpinfer.data.feeds import sample_axes
from mpinfer.errors import AccuracyMismatchError, format_message
from mpinfer.metrics import GENERATION_OUTPUT, ModelAccumulator, json_number, relative_l2, worst_values
from mpinfer.modelio import ort_session
from mpinfer.precision.budget.noisefloor import floor_from_noise
from mpinfer.precision.budget.search import build_groups, group_errors
from mpinfer.precision.calib.calibrate import BatchSlicer, float_outputs
from mpinfer.precision.core.plan import NodeDecision
from mpinfer.precision.emulator.castgraph import ENGINE_EMULATOR
from mpinfer.precision.graph.validate import apply_validated
from mpinfer.precision.numerics.strict import evaluator_class
from mpinfer.progress import progress_bar
from mpinfer.specs import Precision, specs_from_onnx

logger = logging.getLogger(__name__)

# Samples per run of the candidate: consecutive calibration batches are joined up to this many (and at most the
# memory budget's ``verify_run`` bytes of FP32 tensors). The numpy emulator's cost per node is mostly fixed: 64
# samples a run verify transformer_small twice as fast as 16; more add memory, not speed.
RUN_ROWS = 64
# Rounds of "move the worst groups back to FP32 and verify again"; group counts double each round, so this
# covers 2**MAX_REPAIR_ROUNDS groups before the last round takes every group back to FP32.
MAX_REPAIR_ROUNDS = 12


@dataclass(frozen=True)
class VerifySettings:
    """What the final verification checks, on which data and under which numerics."""

    budget: str
    precision: Precision
    numerics: str = "strict"
    keep_io_types: bool = True
    samples: int | None = None
    default_budget: bool = False
    class_outputs: tuple[str, ...] | None = None
    run_rows: int = 0
    progress: bool = True
    generation: Any = None  # the budget's generation checks (mpinfer.precision.budget.genbudget.GenerationBudget)


@dataclass
class Verification:
    """The outcome of one verification pass over the data.

    Attributes:
        figures: Output name → metric → value (None where a metric does not apply), over every verified sample.
        samples: Samples verified.
        batches: Batches verified.
        numerics: ``strict`` or ``ort``.
        fingerprint: ``sha256:<hex>`` over the verified feed arrays (see :func:`fingerprint_update`).
        failures: The budget terms the figures break (empty: the budget holds).
        worst_batch: The batch the candidate got most wrong (kept for ranking the groups to repair).
        wall_s: Seconds the pass took.
        complete: False when the pass stopped early, once the samples seen proved the budget cannot hold on the
            whole set (``failures`` are then those bounds': :meth:`mpinfer.metrics.ModelAccumulator.optimistic`).
        engine: What ran the candidate under strict numerics: ``ort-casts`` (its cast graph in ONNX Runtime),
            ``emulator``, or both joined by ``+`` (see :mod:`mpinfer.precision.emulator.castgraph`); else empty.
    """

    figures: dict[str, dict[str, float | None]]
    samples: int
    batches: int
    numerics: str
    fingerprint: str
    failures: list[str] = field(default_factory=list)
    worst_batch: dict[str, np.ndarray] | None = field(default=None, repr=False)
    wall_s: float = 0.0
    complete: bool = True
    engine: str = ""

    @property
    def passed(self) -> bool:
        """True when the budget holds on every verified sample."""
        return not self.failures


# -- the metrics (the one place verification computes them: the metrics core) ------------------------------------
def _accumulator(names: Sequence[str], settings: VerifySettings) -> Any:
    """An empty :class:`mpinfer.metrics.ModelAccumulator` set up as ``mpinfer compare`` sets up its own."""
    return ModelAccumulator(names, class_outputs=settings.class_outputs, topk=parse_checks(settings.budget).topk)


def budget_failures(budget_text: str, figures: Mapping[str, Mapping[str, float | None]]) -> list[str]:
    """The budget checks ``figures`` break (``"max_abs<=0.001 on 'y' (got 0.0074)"``)."""
    return parse_checks(budget_text).failures(figures)


# -- data ------------------------------------------------------------------------------------------------------
def fingerprint_update(hashers: dict[str, Any], batch: Mapping[str, np.ndarray]) -> None:
    """Add one batch to per-input sha256 hashers (the bytes of each input, in order, batch after batch)."""
    for name, value in batch.items():
        arr = np.ascontiguousarray(value)
        if name not in hashers:
            hashers[name] = (hashlib.sha256(), str(arr.dtype), tuple(arr.shape[1:]))
        hashers[name][0].update(arr.data.cast("B") if arr.size else b"")


def fingerprint_digest(hashers: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of the inputs' names, dtypes, per-sample shapes and byte digests (batching-independent)."""
    top = hashlib.sha256()
    for name in sorted(hashers):
        h, dtype, shape = hashers[name]
        top.update(f"{name}|{dtype}|{shape}|{h.hexdigest()}\n".encode())
    return "sha256:" + top.hexdigest()


class FingerprintedFeeds:
    """Feeds that fingerprint the batches read through them (``mpinfer compare`` records the data it compared on).

    Everything else (``labels``, ``description``, ``len``...) is the wrapped feeds'.
    """

    def __init__(self, feeds: Any) -> None:
        self._feeds = feeds
        self._hashers: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._feeds, name)

    def __len__(self) -> int:
        return len(self._feeds)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self._hashers = {}
        for batch in self._feeds:
            fingerprint_update(self._hashers, batch)
            yield batch

    def fingerprint(self) -> str:
        """``sha256:<hex>`` of the batches of the last pass (same as the plan's for the same samples)."""
        return fingerprint_digest(self._hashers)


def iter_samples(feeds: Any, model: Any, limit: int | None) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """The batches of ``feeds`` up to ``limit`` samples (the last one cut), each with its sample count."""
    slicer = BatchSlicer(model)
    seen = 0
    for batch in feeds:
        if limit is not None and seen >= limit:
            return
        rows = slicer.rows(batch)
        if limit is not None and seen + rows > limit:
            batch, rows = slicer.slice(batch, 0, limit - seen), limit - seen
        yield batch, rows
        seen += rows


def _runs(
    feeds: Any,
    model: Any,
    settings: VerifySettings,
    known: Sequence[Mapping[str, np.ndarray]] | None,
    names: list[str],
    given: Sequence[Mapping[str, np.ndarray]] | None = None,
) -> Iterator[tuple[dict[str, np.ndarray], int, Any, Any]]:
    """The runs of a verification: consecutive batches joined up to ``settings.run_rows`` samples.

    Batches join only along axis 0 with the same trailing shapes. Each run comes with calibration's FP32 outputs
    for it when it kept them all (else None), and the candidate's outputs when ``given`` holds them (the search
    measured this very candidate on those batches; else None).
    """
    pending: list[tuple[dict[str, np.ndarray], int, Any, Any]] = []
    axis0 = _joinable(model)
    for index, (whole, whole_rows) in enumerate(iter_samples(feeds, model, settings.samples)):
        kept = known[index] if known is not None and index < len(known) else None
        if kept is not None and (not set(names) <= set(kept) or any(_rows(kept[n]) != whole_rows for n in names)):
            kept = None  # a cut batch (calibration kept the whole one), or outputs it did not keep
        out = given[index] if given is not None and index < len(given) else None
        for batch, rows, ref, cand in _split(model, whole, whole_rows, kept, out, names, axis0):
            full = sum(p[1] for p in pending) + rows > settings.run_rows
            joins = (cand is None) == (pending[0][3] is None) if pending else True
            if pending and (not axis0 or full or not _same(pending, batch) or not joins):
                yield _join(pending, names)
                pending = []
            pending.append((batch, rows, ref, cand))
    if pending:
        yield _join(pending, names)


def _split(
    model: Any, batch: dict[str, np.ndarray], rows: int, kept: Any, out: Any, names: list[str], axis0: bool
) -> list[tuple[dict[str, np.ndarray], int, Any, Any]]:
    """One batch as (batch, rows, FP32 outputs, candidate outputs) pieces.

    The candidate's outputs are used only against the same reference (``kept``). When the search measured
    the candidate on the first rows of this batch only (its slice ended inside it), the batch splits: those
    rows take the search's outputs, the rest are run — every sample is still verified, none twice.
    """
    if out is None or kept is None:
        return [(batch, rows, kept, None)]
    head = {_rows(out[n]) for n in names}
    if head == {rows}:
        return [(batch, rows, kept, out)]
    if not axis0 or len(head) != 1 or not 0 < min(head) < rows:
        return [(batch, rows, kept, None)]
    cut, slicer = min(head), BatchSlicer(model)
    return [
        (slicer.slice(batch, 0, cut), cut, {n: kept[n][:cut] for n in names}, out),
        (slicer.slice(batch, cut, rows), rows - cut, {n: kept[n][cut:] for n in names}, None),
    ]


def _rows(value: Any) -> int:
    return len(value) if np.ndim(value) else 1


def _joinable(model: Any) -> bool:
    """True when every graph input holds its samples along axis 0 (a symbolic first dim), so batches join."""
    specs = specs_from_onnx(model)
    axes = sample_axes(specs)
    return bool(specs) and all(axes[s.name] == 0 and isinstance(s.shape[0], str) for s in specs)


def _same(pending: list[tuple[dict[str, np.ndarray], int, Any, Any]], batch: Mapping[str, np.ndarray]) -> bool:
    first = pending[0][0]
    return set(first) == set(batch) and all(np.shape(first[k])[1:] == np.shape(batch[k])[1:] for k in batch)


def _join(pending: list[tuple[dict[str, np.ndarray], int, Any, Any]], names: list[str]) -> tuple[Any, int, Any, Any]:
    if len(pending) == 1:
        return pending[0]
    batch = {k: np.concatenate([p[0][k] for p in pending]) for k in pending[0][0]}

    def joined(slot: int) -> dict[str, np.ndarray] | None:
        parts: list[Any] = [p[slot] for p in pending]
        if any(x is None for x in parts) or any(_rows(x[n]) != p[1] for x, p in zip(parts, pending) for n in names):
            return None
        return {n: np.concatenate([x[n] for x in parts]) for n in names}

    return batch, sum(p[1] for p in pending), joined(2), joined(3)


# -- one verification pass -------------------------------------------------------------------------------------
def verify_model(
    candidate: Any,
    reference: Any,
    feeds: Any,
    settings: VerifySettings,
    *,
    known_reference: Sequence[Mapping[str, np.ndarray]] | None = None,
    known_candidate: Sequence[Mapping[str, np.ndarray]] | None = None,
    reference_dir: str = "",
    candidate_path: Path | None = None,
    bound: Any = None,
    probe: Mapping[str, np.ndarray] | None = None,
    fast: bool = True,
) -> Verification:
    """Stream the data through ``candidate`` (as written) and the FP32 ``reference``; check the budget.

    Args:
        candidate: The converted ``onnx.ModelProto``, as it will be written.
        reference: The FP32 ``onnx.ModelProto`` it was converted from.
        feeds: The calibration batches (re-iterable), with ``labels`` when the data has them.
        settings: Budget, numerics and the sample limit.
        known_reference: FP32 outputs of the first batches when calibration kept them (taken, not recomputed).
        known_candidate: ``candidate``'s outputs on the first batches when the search measured it there (taken,
            not recomputed; only where ``known_reference`` holds those batches too).
        reference_dir: The folder ``reference``'s external weights are relative to (memory-mapped from there).
        candidate_path: ``candidate`` as written to a file (external weights): the runner loads that file, its
            weights memory-mapped, instead of the proto.
        bound: The reference against itself on every sample (:func:`reference_sums`): the pass then stops after
            the first run whose figures prove the budget fails on the whole set, whatever the rest gives.
        probe: With ``bound``: a batch to run first, alone (the last round's worst): when it proves the budget
            fails, the pass ends there; else its figures are dropped and the data streams as without it.
        fast: False runs the numerics' own engine where they have a faster one (strict: the emulator, not the
            cast graph), as an earlier pass this one is compared with did.

    Returns:
        The figures per output, what was verified, and the failures.
    """
    start = time.perf_counter()
    names = [o.name for o in reference.graph.output]
    floats = [o.name for o in float_outputs(reference)]
    runner = evaluator_class(settings.numerics).model_runner(
        candidate if candidate_path is None else candidate_path, fast=fast
    )
    run = _fed_as_declared(candidate, runner)
    ref_run = _ReferenceRunner(reference, reference_dir, names)
    if bound is not None and probe is not None and (proved := _probe(reference, probe, run, ref_run, settings, bound)):
        proved.wall_s, proved.engine = round(time.perf_counter() - start, 3), getattr(runner, "engine", "")
        return proved
    figures = _accumulator(names, settings)
    hashers: dict[str, Any] = {}
    labels = getattr(feeds, "labels", None)
    tally, early = _Tally(), list[str]()
    with progress_bar("Verifying", enabled=settings.progress) as bar:
        task = bar.add_task("", total=None)
        for batch, rows, kept, given in _runs(feeds, reference, settings, known_reference, names, known_candidate):
            fingerprint_update(hashers, batch)
            ref = kept if kept is not None else ref_run(batch)
            cand = given if given is not None else run(batch)
            figures.update(ref, cand, _batch_labels(labels, tally.samples, rows))
            tally.add(batch, rows, _batch_error(ref, cand, floats))
            bar.advance(task)
            if bound is not None and (early := budget_failures(settings.budget, figures.optimistic(bound))):
                break
    figs = figures.finalize()
    return _with_generation(candidate, settings, Verification(
        figures=figs,
        samples=tally.samples,
        batches=tally.batches,
        numerics=settings.numerics,
        fingerprint=fingerprint_digest(hashers),
        failures=early or budget_failures(settings.budget, figs),
        worst_batch=tally.worst_batch,
        wall_s=round(time.perf_counter() - start, 3),
        complete=not early,
        engine=getattr(runner, "engine", ""),
    ))


def _probe(
    reference: Any,
    batch: Mapping[str, np.ndarray],
    run: Any,
    ref_run: _ReferenceRunner,
    settings: VerifySettings,
    bound: Any,
) -> Verification | None:
    """``batch`` alone through the candidate: a failed Verification when it proves the budget fails, else None."""
    ref, cand = ref_run(batch), run(batch)
    acc = _accumulator(list(ref), settings)
    acc.update(ref, cand, None)
    failures = budget_failures(settings.budget, acc.optimistic(bound))
    if not failures:
        return None
    return Verification(figures=acc.finalize(), samples=BatchSlicer(reference).rows(batch), batches=1,
                        numerics=settings.numerics, fingerprint="", failures=failures, worst_batch=dict(batch),
                        complete=False)


def reference_sums(
    reference: Any,
    feeds: Any,
    settings: VerifySettings,
    known_reference: Sequence[Mapping[str, np.ndarray]] | None = None,
    reference_dir: str = "",
) -> Any:
    """The FP32 reference against itself on every sample a verification reads: the whole set's sums.

    With them a repair round's pass stops as soon as the samples it has seen fail the budget's bound on the whole
    set (:meth:`mpinfer.metrics.ModelAccumulator.optimistic`); a candidate that meets the budget is still run on
    every sample. Calibration's kept FP32 outputs are read, not recomputed.
    """
    names = [o.name for o in reference.graph.output]
    ref_run = _ReferenceRunner(reference, reference_dir, names)
    full, labels, seen = _accumulator(names, settings), getattr(feeds, "labels", None), 0
    for batch, rows, kept, _ in _runs(feeds, reference, settings, known_reference, names):
        ref = kept if kept is not None else ref_run(batch)
        full.update(ref, ref, _batch_labels(labels, seen, rows))
        seen += rows
    return full


def _fed_as_declared(candidate: Any, run: Any) -> Any:
    """``run`` fed float32 data cast to the candidate's FP16/BF16 graph inputs.

    With ``--no-keep-io-types`` (or FP16 I/O kept under ``--force``) the calibration data is the FP32 model's, and
    the converted model takes it cast.
    """
    low = {
        vi.name: (np.dtype(np.float16) if vi.type.tensor_type.elem_type == 10 else Precision.BF16.numpy_dtype)
        for vi in candidate.graph.input
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type in (10, 16)
    }
    if not low:
        return run

    def cast_run(batch: Mapping[str, np.ndarray]) -> Any:
        return run({k: v.astype(low[k]) if k in low and v.dtype == np.float32 else v for k, v in batch.items()})

    return cast_run


class _ReferenceRunner:
    """FP32 outputs of the reference by ONNX Runtime, its session opened for the first batch that needs one.

    Calibration often kept every batch's FP32 outputs, and then no session is opened at all.
    """

    def __init__(self, reference: Any, reference_dir: str, names: list[str]) -> None:
        self._reference, self._dir, self._names = reference, reference_dir, names
        self._session: Any = None

    def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Output name -> FP32 array of the reference on ``batch``."""
        if self._session is None:
            self._session = ort_session(self._reference, base_dir=self._dir or None)
        return dict(zip(self._names, self._session.run(self._names, dict(batch)), strict=True))


@dataclass
class _Tally:
    """What a verification pass has counted so far: samples, batches and the batch it got most wrong."""

    samples: int = 0
    batches: int = 0
    worst_score: float = -1.0
    worst_batch: dict[str, np.ndarray] | None = None

    def add(self, batch: dict[str, np.ndarray], rows: int, score: float) -> None:
        """Count one run of ``rows`` samples whose error score is ``score``."""
        if score > self.worst_score:
            self.worst_score, self.worst_batch = score, batch
        self.samples += rows
        self.batches += 1


def _batch_labels(labels: Any, first: int, rows: int) -> Any:
    """The labels of samples ``first`` to ``first + rows``, or None when the data has none for them all."""
    return labels[first : first + rows] if labels is not None and first + rows <= len(labels) else None


def _with_generation(candidate: Any, settings: VerifySettings, ver: Verification) -> Verification:
    """The budget's generation checks, once the outputs meet theirs: greedy decoding of the calibration prompts.

    Their figures join ``ver.figures`` under ``generate`` and their failures ``ver.failures``, so the repair
    loop and the plan treat them as any budget term (see :mod:`mpinfer.precision.budget.genbudget`).
    """
    if settings.generation is None or not ver.passed:
        return ver
    start = time.perf_counter()
    figures, failures = settings.generation.verify(candidate)
    ver.figures[GENERATION_OUTPUT] = dict(figures)
    ver.failures += failures
    ver.wall_s = round(ver.wall_s + time.perf_counter() - start, 3)
    return ver




def _batch_error(ref: Mapping[str, np.ndarray], cand: Mapping[str, np.ndarray], names: Sequence[str]) -> float:
    """How wrong a batch is, to pick the one to rank groups on: the worst relative L2 error of its outputs."""
    worst = 0.0
    for name in names:
        r_all, c_all = np.asarray(ref[name]).reshape(-1), np.asarray(cand[name]).reshape(-1)
        noise = signal = 0.0
        for start in range(0, r_all.size, _ERROR_CHUNK):  # (in float64 a chunk at a time: a segmentation map is big)
            r = r_all[start : start + _ERROR_CHUNK].astype(np.float64)
            c = c_all[start : start + _ERROR_CHUNK].astype(np.float64)
            ok = np.isfinite(r)
            if not ok.all():
                r, c = r[ok], c[ok]
            if not np.isfinite(c).all():
                return math.inf
            d = c - r
            noise += float(np.square(d, out=d).sum())  # (numpy's pairwise sums: BLAS dot threads wait on a busy box)
            signal += float(np.square(r, out=r).sum())
        worst = max(worst, relative_l2(noise, signal))
    return worst


# Values _batch_error converts to float64 at a time (1 MB of float32: stays in cache).
_ERROR_CHUNK = 1 << 18


# -- verify, and repair until the budget holds -------------------------------------------------------------------
@dataclass
class Repaired:
    """The verified candidate: its ApplyResult, plan entries and the last verification."""

    result: Any
    nodes: list[NodeDecision]
    verification: Verification
    rounds: int = 0
    demoted: list[str] = field(default_factory=list)
    wall_s: float = 0.0  # every verification pass, repairs included
    noise: dict[str, Any] | None = None  # the default floor judged from the evaluator's noise (noisefloor)


def verify_and_repair(
    info: Any,
    nodes: list[NodeDecision],
    result: Any,
    decisions: Mapping[str, Any],
    feeds: Any,
    settings: VerifySettings,
    *,
    known_reference: Sequence[Mapping[str, np.ndarray]] | None = None,
    rank_rows: int | None = None,
    known_candidate: Sequence[Mapping[str, np.ndarray]] | None = None,
    staged: tuple[Path, Path] | None = None,
) -> Repaired:
    """Verify the applied candidate on the data; move the worst groups back to FP32 until the budget holds.

    Args:
        info: The FP32 model's GraphInfo (``info.model`` is the reference).
        nodes: The plan entries ``result`` was applied from.
        result: Their ApplyResult (``result.model`` is the model as it will be written).
        decisions: The rule verdicts per node (which nodes the user forced).
        feeds: The calibration batches.
        settings: Budget, numerics, samples.
        known_reference: FP32 outputs of the first batches, when calibration kept them.
        rank_rows: At most this many samples of the worst batch rank the groups (their FP32 tensors are kept).
        known_candidate: ``result.model``'s outputs on the first batches (the search's), for the first pass.
        staged: (file, input model file) for external weights: every candidate is written to the file and verified
            from it (:func:`mpinfer.precision.graph.validate.apply_validated`).

    Returns:
        The candidate that meets the budget, its plan entries and its verification.

    Raises:
        AccuracyMismatchError: The budget fails even with every node it may change in FP32.
    """
    where = {"reference_dir": info.base_dir, "candidate_path": staged[0] if staged is not None else None}
    ver = verify_model(
        result.model, info.model, feeds, settings, known_reference=known_reference, known_candidate=known_candidate,
        **where,
    )
    _log(ver, settings, 0)
    rounds, demoted, spent = 0, list[str](), ver.wall_s
    noise, ranks = None, _RankCache()
    # the passes after the first run on its engine: the noise and the repaired candidates are judged as it was
    where["fast"] = ENGINE_EMULATOR not in ver.engine.split("+")
    if not ver.passed and settings.default_budget:  # the floor's zero: the all-FP32 candidate under these numerics
        fp32 = verify_model(info.model, info.model, feeds, settings, known_reference=known_reference,
                            reference_dir=info.base_dir, candidate_path=staged[1] if staged is not None else None,
                            fast=where["fast"])
        settings, noise = floor_from_noise(settings, ver, fp32)
        spent += fp32.wall_s
    bound = None
    while not ver.passed:
        groups = build_groups(info, nodes, decisions)
        if not groups and _floor_sees_only_fp32(nodes, ver, settings):
            break
        if not groups or rounds >= MAX_REPAIR_ROUNDS:
            raise _unrecoverable(ver, settings, demoted)
        back = _groups_to_demote(info, groups, ver, settings, rounds, rank_rows, ranks)
        demoted.extend(sorted(back))
        nodes = _to_fp32(nodes, back, ver)
        rounds += 1
        result, nodes = apply_validated(
            info, nodes, settings.precision, keep_io_types=settings.keep_io_types, staged=staged
        )
        if bound is None:
            bound = reference_sums(info.model, feeds, settings, known_reference, info.base_dir)
        ver = verify_model(result.model, info.model, feeds, settings, known_reference=known_reference, bound=bound,
                           probe=ver.worst_batch, **where)
        spent += ver.wall_s
        _log(ver, settings, rounds)
    return Repaired(result, nodes, ver, rounds, demoted, round(spent, 3), noise)


def _floor_sees_only_fp32(nodes: list[NodeDecision], ver: Verification, settings: VerifySettings) -> bool:
    """True (and said in a warning) when the default floor fails with no node left low: nothing to repair."""
    if not settings.default_budget or any(n.precision.is_low for n in nodes):
        return False
    # Nothing is low any more (no user override either): what the floor still sees is the evaluator's own
    # FP32 arithmetic against ONNX Runtime's (e.g. -inf vs float32's lowest at masked positions), not
    # precision the conversion lost. A floor is a safety net, not a budget the user asked for: say so.
    logger.warning(
        "The default floor (%s) cannot be verified on this model: with no node left in low precision, "
        "%s numerics still differ from FP32 ONNX Runtime (%s). Kept as planned; "
        "check the model with `mpinfer compare`, or pass --budget to make it a requirement.",
        settings.budget, ver.numerics, "; ".join(ver.failures[:2]),
    )
    return True


def _groups_to_demote(
    info: Any,
    groups: list[Any],
    ver: Verification,
    settings: VerifySettings,
    rounds: int,
    rank_rows: int | None,
    ranks: _RankCache | None = None,
) -> set[str]:
    """The nodes of this round's worst groups: 2**rounds of them, every group in the last round."""
    batch = _first_rows(info.model, ver.worst_batch, rank_rows)
    ranked = _rank(info, groups, batch, settings.precision, ranks)
    take = ranked if rounds + 1 >= MAX_REPAIR_ROUNDS else ranked[: 2**rounds]
    return {a for g in take for a in g.members}


def _to_fp32(nodes: list[NodeDecision], back: set[str], ver: Verification) -> list[NodeDecision]:
    """The plan entries with ``back`` moved to FP32, saying the final verification did it and why."""
    detail = (
        f"kept FP32 by the final verification on {ver.samples}{'' if ver.complete else ' (of the hardest)'} samples: "
        f"its group broke the budget ({'; '.join(ver.failures[:2])})"
    )
    return [
        NodeDecision(n.name, n.op_type, Precision.FP32, "sensitivity", detail, dict(n.stats)) if n.name in back else n
        for n in nodes
    ]


def _first_rows(model: Any, batch: Mapping[str, np.ndarray] | None, rows: int | None) -> Any:
    """The first ``rows`` samples of ``batch`` (all of it when it has no more, or when ``rows`` is None)."""
    if batch is None or rows is None:
        return batch
    slicer = BatchSlicer(model)
    return batch if slicer.rows(batch) <= rows else slicer.slice(batch, 0, rows)


def _rank(
    info: Any,
    groups: list[Any],
    batch: Mapping[str, np.ndarray] | None,
    precision: Precision,
    ranks: _RankCache | None = None,
) -> list[Any]:
    """The groups, the one that contributes most error first: local error on the worst batch, then FLOPs."""
    if ranks is None:
        errors = group_errors(info, groups, [batch] if batch is not None else [], precision)
    else:
        errors = ranks.errors(info, groups, batch, precision)
    return sorted(groups, key=lambda g: (-errors.get(g.anchor, 0.0), -g.flops, g.anchor))


class _RankCache:
    """Group local errors already measured on a batch, for the next repair rounds.

    A group's local error is measured alone, fed the FP32 tensors of the batch (:func:`search.group_errors`): it
    does not depend on which other groups are low. When the next round's worst batch is the same data, the groups
    still low rank as they did, so only groups not measured yet (a group that changed members) are run again.
    """

    def __init__(self) -> None:
        self._batch: str | None = None
        self._errors: dict[tuple[str, frozenset[str]], float | None] = {}  # None: not measurable (in a body)

    def errors(
        self, info: Any, groups: list[Any], batch: Mapping[str, np.ndarray] | None, precision: Precision
    ) -> dict[str, float]:
        """Anchor -> local error of each group on ``batch`` (what :func:`search.group_errors` returns)."""
        key = _batch_digest(batch, precision)
        if key != self._batch:
            self._batch, self._errors = key, {}
        todo = [g for g in groups if (g.anchor, frozenset(g.members)) not in self._errors]
        if todo:
            got = group_errors(info, todo, [batch] if batch is not None else [], precision)
            self._errors.update({(g.anchor, frozenset(g.members)): got.get(g.anchor) for g in todo})
            logger.debug("repair: %d group errors measured, %d taken from the last round", len(todo),
                         len(groups) - len(todo))
        return {g.anchor: v for g in groups if (v := self._errors.get((g.anchor, frozenset(g.members)))) is not None}


def _batch_digest(batch: Mapping[str, np.ndarray] | None, precision: Precision) -> str:
    """The batch's data fingerprint (:func:`fingerprint_update`) and the precision its groups run in."""
    hashers: dict[str, Any] = {}
    fingerprint_update(hashers, batch or {})
    return f"{precision.value}:{fingerprint_digest(hashers)}"


def _unrecoverable(ver: Verification, settings: VerifySettings, demoted: list[str]) -> AccuracyMismatchError:
    budget = settings.budget + (f",{settings.generation.text}" if settings.generation is not None else "")
    what = "the default floor" if settings.default_budget else f"Budget '{budget}'"
    hint = (
        "pass a looser --budget, or --budget none to skip the floor"
        if settings.default_budget
        else "loosen the budget, or drop some --low-op/--low-node overrides"
    )
    return AccuracyMismatchError(
        format_message(
            what[0].upper() + what[1:],
            f"missed on {ver.samples} calibration samples ({ver.numerics} numerics) even with every node it may "
            f"change in FP32 ({len(demoted)} moved back): " + "; ".join(ver.failures[:4]),
            "a budget the model can meet (only --low-* overrides and casts at low I/O stay low)",
            hint + "; nothing was written",
        )
    )


def _log(ver: Verification, settings: VerifySettings, rounds: int) -> None:
    logger.info(
        "verify%s: %d samples (%s numerics%s) in %.1fs: %s",
        f" (repair round {rounds})" if rounds else "",
        ver.samples,
        ver.numerics,
        f", {ver.engine}" if ver.engine else "",
        ver.wall_s,
        "budget met" if ver.passed else "; ".join(ver.failures[:3]),
    )


def budget_figures(budget_text: str, figures: Mapping[str, Mapping[str, float | None]]) -> dict[str, float]:
    """The budget's metrics, worst over the outputs (for the console line)."""
    worst = worst_values(figures)
    return {m: worst[m] for m in sorted(parse_checks(budget_text).metrics) if m in worst}


def verification_record(ver: Verification, settings: VerifySettings, repaired: Repaired) -> dict[str, Any]:
    """The plan's ``summary.verification``: figures per output, samples, numerics, data fingerprint."""
    return {
        "budget": settings.budget,
        "default_budget": settings.default_budget,
        "numerics": ver.numerics,
        **({"engine": ver.engine} if ver.engine else {}),
        "samples": ver.samples,
        "batches": ver.batches,
        "fingerprint": ver.fingerprint,
        "figures": {o: {k: json_number(v) for k, v in m.items()} for o, m in ver.figures.items()},
        "passed": ver.passed,
        "repair_rounds": repaired.rounds,
        "moved_to_fp32": len(repaired.demoted),
        "wall_s": repaired.wall_s,
        **({"generation": settings.generation.describe()} if settings.generation is not None else {}),
        **({"noise": repaired.noise} if repaired.noise is not None else {}),
    }
