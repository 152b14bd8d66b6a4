"""Final verification: the model as written, on every calibration sample, against the FP32 reference.

The budget search reads a slice of the calibration data (``--search-samples``); the guarantee never does.
After the search, :func:`mpinfer.precision.budget.repair.verify_and_repair` streams every calibration sample
(or ``--verify-samples``), batch by batch, through the converted model exactly as it will be written, under the
chosen numerics (strict emulation: :class:`mpinfer.precision.emulator.runner.StrictRunner`; or ONNX Runtime),
against the FP32 model run by ONNX Runtime — the same computation ``mpinfer compare --numerics strict|ort``
does. Only the running sums of the metrics core are kept, never the outputs, so memory is one batch whatever the data.

When the budget fails, the groups of low nodes that contribute most (their local error, measured on the
batch the candidate got most wrong) go back to FP32 — 1, 2, 4, ... of them — and the new candidate is
verified again, until the budget holds. If it fails even with every group FP32 (what stays low then is the
user's ``--low-*`` overrides and the casts at kept low I/O), convert raises and writes nothing.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.checks import parse_checks
from mpinfer.data.feeds import sample_axes
from mpinfer.data.samples import BatchSlicer, fingerprint_digest, fingerprint_update, iter_samples
from mpinfer.metrics import GENERATION_OUTPUT, ModelAccumulator, relative_l2, worst_values
from mpinfer.modelio import ort_session
from mpinfer.precision.core import float_outputs
from mpinfer.precision.emulator import ENGINE_EMULATOR
from mpinfer.precision.numerics import evaluator_class
from mpinfer.progress import progress_bar
from mpinfer.specs import Precision, specs_from_onnx
from mpinfer.usermetric import metric_names

logger = logging.getLogger(__name__)


class VerificationAborted(Exception):
    """:func:`verify_model`'s ``abort`` answered True before a batch: the pass stopped there, with no verdict."""


# Samples per run of the candidate: consecutive calibration batches are joined up to this many (and at most the
# memory budget's ``verify_run`` bytes of FP32 tensors). The numpy emulator's cost per node is mostly fixed: 64
# samples a run verify transformer_small twice as fast as 16; more add memory, not speed.
RUN_ROWS = 64
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
    metrics: tuple[Any, ...] = ()  # the user's own metrics (mpinfer.usermetric.UserMetric): measured, recorded

    @property
    def user(self) -> tuple[str, ...]:
        """The user metrics' names (the budget may name their figures)."""
        return metric_names(self.metrics)


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
    return ModelAccumulator(names, class_outputs=settings.class_outputs,
                            topk=parse_checks(settings.budget, settings.user).topk, user_metrics=settings.metrics)


def budget_failures(
    budget_text: str, figures: Mapping[str, Mapping[str, float | None]], user: Sequence[str] = ()
) -> list[str]:
    """The budget checks ``figures`` break (``"max_abs<=0.001 on 'y' (got 0.0074)"``); ``user``: metric names."""
    return parse_checks(budget_text, user).failures(figures)


def _optimistic(figures: Any, bound: Any, settings: VerifySettings) -> Any:
    """``figures``' bounds on the whole set (user figures towards what the budget's operators ask for)."""
    return figures.optimistic(bound, parse_checks(settings.budget, settings.user).targets())


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
    runner: Any = None,
    abort: Callable[[], bool] | None = None,
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
        runner: ``candidate``'s runner under ``settings.numerics``, already open (the budget search's runner of this
            very model, which computed ``known_candidate``); None: opened here.
        abort: Asked before each batch; True stops the pass (convert's validity gate refused ``candidate`` on its
            thread meanwhile: the pass would verify a model that is not written).

    Returns:
        The figures per output, what was verified, and the failures.

    Raises:
        VerificationAborted: ``abort`` answered True.
    """
    start = time.perf_counter()
    names = [o.name for o in reference.graph.output]
    floats = [o.name for o in float_outputs(reference)]
    if runner is None:
        runner = evaluator_class(settings.numerics).model_runner(
            candidate if candidate_path is None else candidate_path, fast=fast
        )
    run = _fed_as_declared(candidate, runner)
    ref_run = _ReferenceRunner(reference, reference_dir, names)
    shared: _Shared | None = None
    if bound is not None and probe is not None:
        proved, shared = _probe(reference, probe, run, ref_run, settings, bound)
        if proved is not None:
            proved.wall_s, proved.engine = round(time.perf_counter() - start, 3), getattr(runner, "engine", "")
            return proved
    figures = _accumulator(names, settings)
    hashers: dict[str, Any] = {}
    labels = getattr(feeds, "labels", None)
    tally, early = _Tally(), list[str]()
    runs = _runs(feeds, reference, settings, known_reference, names, known_candidate)
    # (not the emulator: its node-by-node Python would take turns with the figures' for the GIL)
    ahead_ok = shared is None and ENGINE_EMULATOR not in str(getattr(runner, "engine", "")).split("+")
    with progress_bar("Verifying", enabled=settings.progress) as bar, _Ahead(runs, run, ahead_ok) as ahead:
        task = bar.add_task("", total=None)
        for batch, rows, kept, given in ahead:
            if abort is not None and abort():
                raise VerificationAborted("the verification was aborted by its caller")
            fingerprint_update(hashers, batch)
            reused = shared.take(batch) if shared is not None and given is None else None
            ref = kept if kept is not None else reused[0] if reused is not None else ref_run(batch)
            cand = given if given is not None else reused[1] if reused is not None else ahead.outputs(batch)
            figures.update(ref, cand, _batch_labels(labels, tally.samples, rows), inputs=batch)
            tally.add(batch, rows, _batch_error(ref, cand, floats, figures))
            bar.advance(task)
            if bound is not None and (
                early := budget_failures(settings.budget, _optimistic(figures, bound, settings), settings.user)
            ):
                break
    figs = figures.finalize()
    return _with_generation(candidate, settings, Verification(
        figures=figs,
        samples=tally.samples,
        batches=tally.batches,
        numerics=settings.numerics,
        fingerprint=fingerprint_digest(hashers),
        failures=early or budget_failures(settings.budget, figs, settings.user),
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
) -> tuple[Verification | None, _Shared | None]:
    """``batch`` alone through the candidate: a failed Verification when it proves the budget fails.

    Else (None, the probe's outputs): the pass that streams every batch takes them when it reaches this batch, so a
    repair round's probe costs no second run of it.
    """
    if settings.metrics:  # (the batch's labels are not kept with it, and a user metric may read them)
        return None, None
    ref, cand = ref_run(batch), run(batch)
    acc = _accumulator(list(ref), settings)
    acc.update(ref, cand, None)
    failures = budget_failures(settings.budget, _optimistic(acc, bound, settings), settings.user)
    if not failures:
        return None, _Shared(dict(batch), ref, cand)
    return Verification(figures=acc.finalize(), samples=BatchSlicer(reference).rows(batch), batches=1,
                        numerics=settings.numerics, fingerprint="", failures=failures, worst_batch=dict(batch),
                        complete=False), None


@dataclass
class _Shared:
    """A probe's run (its batch, the FP32 outputs and the candidate's), handed to the pass once, at that batch."""

    batch: dict[str, np.ndarray]
    ref: dict[str, np.ndarray]
    cand: dict[str, np.ndarray]
    used: bool = False

    def take(self, batch: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
        """(FP32, candidate) outputs when ``batch`` holds the probe's very data (the first time only), else None."""
        if self.used or set(batch) != set(self.batch):
            return None
        same = all(
            np.shape(batch[k]) == np.shape(v) and np.asarray(batch[k]).dtype == np.asarray(v).dtype
            and np.array_equal(batch[k], v) for k, v in self.batch.items()
        )
        if not same:
            return None
        self.used = True
        return self.ref, self.cand


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
        full.update(ref, ref, _batch_labels(labels, seen, rows), inputs=batch)
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


class _Ahead:
    """The runs of a verification pass, each candidate run started on a thread one run ahead of its metrics.

    While the caller reads run ``k``'s figures (the metrics core: numpy, on this thread), ONNX Runtime computes the
    candidate's outputs on run ``k + 1``, which releases the GIL; a CNN whose outputs are feature maps spent 5 of its
    14 s of verification in those figures. The runner is called by one thread at a time, in the runs' order, so its
    outputs are the same as called in line. Not ahead (``enabled`` False: a repair round's pass that took its probe's
    run, or the strict emulator; or a run whose outputs are given): in line.
    The thread holds at most one run's outputs beyond the caller's (the budget's ``verify_run`` slice once more).
    """

    def __init__(self, runs: Iterator[tuple[dict[str, np.ndarray], int, Any, Any]], run: Any, enabled: bool) -> None:
        self._runs, self._run, self._enabled = runs, run, enabled
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[dict[str, np.ndarray], Future[Any]] | None = None
        self._next: dict[str, np.ndarray] | None = None  # the next run's batch, to start once the runner is free

    def __enter__(self) -> _Ahead:
        return self

    def __exit__(self, *exc: object) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and not pending[1].cancel():
            pending[1].exception()  # (waits for a run already started, whose outputs nobody reads: no call left open)
        if self._pool is not None:
            self._pool.shutdown()

    def __iter__(self) -> Iterator[tuple[dict[str, np.ndarray], int, Any, Any]]:
        item = next(self._runs, None)
        while item is not None:
            following = next(self._runs, None)
            self._next = following[0] if self._enabled and following is not None and following[3] is None else None
            if item[3] is not None:  # (the current run's outputs are given: the runner is free now)
                self._start()
            yield item
            item = following

    def _start(self) -> None:
        """Start the next run's candidate on the thread (once the runner is free: never two calls at a time)."""
        batch, self._next = self._next, None
        if batch is None or self._pending is not None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="mpinfer-verify")
        self._pending = batch, self._pool.submit(self._run, batch)

    def outputs(self, batch: dict[str, np.ndarray]) -> Any:
        """The candidate's outputs on ``batch`` (from the thread when it was started there), then the next started."""
        pending = self._pending
        if pending is not None and pending[0] is batch:
            self._pending = None
            got = pending[1].result()  # (re-raises the runner's error here, as a call in line would)
        else:
            got = self._run(batch)
        self._start()
        return got


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




def _batch_error(
    ref: Mapping[str, np.ndarray], cand: Mapping[str, np.ndarray], names: Sequence[str], figures: Any = None
) -> float:
    """How wrong a batch is, to pick the one to rank groups on: the worst relative L2 error of its outputs.

    ``figures``: the accumulator this batch was just added to; an output whose sums it kept (every value finite)
    is not summed again.
    """
    worst = 0.0
    for name in names:
        acc = figures.outputs.get(name) if figures is not None else None
        if acc is not None and acc.batch_sums is not None:
            worst = max(worst, relative_l2(*acc.batch_sums))
            continue
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


def budget_figures(
    budget_text: str, figures: Mapping[str, Mapping[str, float | None]], user: Sequence[str] = ()
) -> dict[str, float]:
    """The budget's metrics, worst over the outputs (for the console line); ``user``: the user metrics' names."""
    worst = worst_values(figures)
    return {m: worst[m] for m in sorted(parse_checks(budget_text, user).metrics) if m in worst}


