"""Strict numerics (``strict``): candidates run by the strict emulator, incremental runs from kept FP32 runs.

:class:`StrictEvaluator` runs candidates on the strict emulator
(:class:`~mpinfer.precision.emulator.emulate.GraphEmulator`); :func:`open_emulator`, :func:`local_error` and
:class:`_EmulatorRefs` also serve the ONNX Runtime numerics (:mod:`.ort`) for groups its probe cannot copy.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from mpinfer.errors import InvalidInputError, format_message
from mpinfer.memory import current_budget
from mpinfer.metrics import relative_l2
from mpinfer.precision.core import GraphInfo
from mpinfer.precision.emulator import (
    EmulatorRun,
    GraphEmulator,
    StrictModelRunner,
    StrictRunner,
    is_float,
)
from mpinfer.precision.numerics import probe
from mpinfer.precision.numerics.base import AppliedRun, Candidate, Outputs, Runner
from mpinfer.precision.numerics.castjudge import CastJudge, JudgedGraph
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)

# Strict numerics screen only models whose kept FP32 reference runs hold at least this many float values per
# node (CNNs: ~1e6; small transformers: ~1e4, where the per-node overhead dominates the emulator's time).
STRICT_SCREEN_MIN_VALUES = 100_000
# What ``note`` is told when the emulator computes a candidate's outputs (see StrictEvaluator.each_from_refs).
EMULATED = "emulator"
# What the log says when the first candidate runs on its cast graph
_FIRST_ON_CAST_GRAPH = "search: the first candidate judged by ONNX Runtime as a float32 graph with rounding casts"


def _ignore(engine: Any) -> None:
    """A ``note`` that keeps nothing."""


def open_emulator(model: Any, *, required: bool, base_dir: str = "") -> GraphEmulator | None:
    """The strict emulator of ``model``; None when it has ops the emulator cannot run and ``required`` is False.

    ``base_dir``: the model file's folder when its weights stay external (memory-mapped from there).

    Raises:
        InvalidInputError: ``required`` and the model has ops without strict kernels.
    """
    emu = GraphEmulator(model, base_dir=base_dir)
    missing = emu.unsupported_ops()
    if missing and required:
        raise InvalidInputError(
            format_message(
                "Strict numerics",
                f"a model with ops the emulator cannot run ({', '.join(sorted(missing))})",
                "ops with strict kernels",
                "use --numerics ort (not for bf16), or convert without --budget",
            )
        )
    return None if missing else emu


def local_error(model: Any, info: GraphInfo, group: Any, refs: list[Any], low: Precision) -> tuple[float, int]:
    """Relative L2 error at the group's outputs when only the group runs low, fed FP32 reference tensors.

    Returns the error and the node evaluations it cost.
    """
    built = probe.group_submodel(info, group.members)
    if built is None:
        return 0.0, 0
    sub, outs = built
    feeds_names = [vi.name for vi in sub.graph.input]
    emu = GraphEmulator(sub, base_dir=info.base_dir)
    noise = signal = 0.0
    for ref in refs:
        run = emu.run({n: ref.tensors[n] for n in feeds_names}, {a: low for a in group.members})
        for o in outs:
            sums = _error_sums(ref.tensors[o], run.outputs[o])
            if sums is None:
                return math.inf, len(group.members) * len(refs)
            noise, signal = noise + sums[0], signal + sums[1]
    return relative_l2(noise, signal), len(group.members) * len(refs)


def _error_sums(reference: Any, value: Any) -> tuple[float, float] | None:
    """(sum of squared errors, sum of squared reference values) over the finite reference values, in float64.

    None when ``value`` is not finite where the reference is. The sums are numpy's pairwise sums over the flat
    float64 values, as ``((got - want)[ok] ** 2).sum()`` gives them; a reference with every value finite (most) is
    summed without the boolean-mask copies.
    """
    want = np.asarray(reference).astype(np.float64).reshape(-1)  # (copies: squared in place below)
    got = np.asarray(value).astype(np.float64).reshape(-1)
    ok = np.isfinite(want)
    if ok.all():
        if not np.isfinite(got).all():
            return None
    else:
        want, got = want[ok], got[ok]
        if not np.isfinite(got).all():
            return None
    d = np.subtract(got, want, out=got)
    return float(np.square(d, out=d).sum()), float(np.square(want, out=want).sum())


class _EmulatorRefs:
    """The strict emulator and its kept FP32 runs of the search batches (opened on first use)."""

    def __init__(
        self, model: Any, info: GraphInfo, batches: list[Outputs], *, required: bool, kept: int | None = None
    ) -> None:
        self.model, self.info, self.batches, self.required = model, info, batches, required
        # the leading batches whose FP32 runs are kept (their tensors fit the search slice); the rest run whole
        self.kept = len(batches) if kept is None else max(1, min(kept, len(batches)))
        self.emu: GraphEmulator | None = None
        self.refs: list[Any] = []
        self.opened = False
        self.evaluations = 0

    def emulator(self) -> GraphEmulator | None:
        """The emulator (compiled on first use; None when it cannot run the model and is not ``required``)."""
        if self.emu is None and not self.opened:
            self.emu = open_emulator(self.model, required=self.required, base_dir=self.info.base_dir)
            self.opened = self.emu is None
        return self.emu

    def open(self, known: list[Outputs] | None = None) -> None:
        """Open the emulator and run (or take from ``known``, one dict per batch) the FP32 reference runs."""
        if self.opened:
            return
        emu = self.emulator()
        self.opened = True
        if emu is not None:
            head = self.batches[: self.kept]
            seeds = known[: len(head)] if known is not None and len(known) >= len(head) else [None] * len(head)
            self.refs = [emu.run(b, None, keep=True, known=k) for b, k in zip(head, seeds, strict=True)]
            self.evaluations += len(self.info.nodes) * len(self.refs)

    def local_errors(self, groups: Sequence[Any], batches: list[Outputs], subset: bool, low: Precision) -> dict:
        """Every group's :func:`local_error` on the kept runs (or fresh FP32 runs of ``batches`` when ``subset``).

        With ``subset`` the kept runs are not made (an FP32 run of every search batch that nothing might read).
        """
        if not subset:
            self.open()
        emu = self.emulator()
        if emu is None:
            return {}
        refs = self.refs
        if subset:
            refs = [emu.run(b, None, keep=True) for b in batches]
            self.evaluations += len(self.info.nodes) * len(refs)
        out = {}
        for g in groups:
            out[g.anchor], evals = local_error(self.model, self.info, g, refs, low)
            self.evaluations += evals
        return out


class _KeptRuns:
    """The runs a candidate can start from: the FP32 runs, the last candidate that met the budget, the last one run.

    Each candidate runs (:meth:`GraphEmulator.run_from`) from the kept runs it differs least from (fewest nodes to
    recompute): ``run_from`` gives ``run(feeds, low)`` bit for bit whatever run it starts from, so the outputs (and
    every decision made on them) are those of a run from the FP32 runs. A bisection's next prefix then recomputes
    what the groups it adds to the last passing prefix change, and a refinement step what its one group changes.

    The candidates' runs are kept only while their own tensors (those not shared with the FP32 runs) and a whole new
    run fit in the memory budget's ``search`` slice (what the FP32 runs of the search samples were sized to); else
    every candidate starts from the FP32 runs, as before.
    """

    def __init__(self, emu: GraphEmulator, fp32: list[EmulatorRun]) -> None:
        self.emu, self.fp32 = emu, fp32
        self.met: list[EmulatorRun] | None = None
        self.last: list[EmulatorRun] | None = None
        self._shared = {id(v) for r in fp32 for v in r.tensors.values()}
        inits = emu.initializer_names
        self._whole = sum(_nbytes(v) for r in fp32 for k, v in r.tensors.items() if k not in inits)
        self.reused = 0  # candidate runs started from a kept candidate run
        self.skipped = 0  # node evaluations those runs saved against runs from the FP32 runs

    def cost(self, low: Mapping[str, Precision]) -> int:
        """Node evaluations :meth:`each` would cost for the candidate ``low`` (from its cheapest base)."""
        return min(self.emu.rerun_count(k[0].low, low) * len(k) for k in (self.fp32, self.met, self.last) if k)

    def forget_last(self) -> None:
        """Another engine judged the last candidate: the last run kept is no longer that candidate's."""
        if self.last is not self.met:
            self.last = None

    def run(self, low: Mapping[str, Precision], may_keep: bool = True) -> tuple[list[Outputs], int]:
        """The candidate's outputs on each kept batch, and the node evaluations it cost."""
        runs = list(self.each(low, may_keep))
        return [r.outputs for r in runs], sum(r.recomputed for r in runs)

    def each(self, low: Mapping[str, Precision], may_keep: bool = True) -> Iterator[EmulatorRun]:
        """The candidate's run of each kept batch, one at a time (a caller may stop early: nothing is kept then).

        ``may_keep``: False keeps nothing of this candidate's runs (the search's first candidate, the whole rule plan,
        which most often meets the budget and ends the search: holding every tensor of its runs would cost memory,
        and page faults, a search of one candidate never uses).
        """
        from_fp32 = self.emu.rerun_count(self.fp32[0].low, low)
        base, cost = self.fp32, from_fp32
        for kept in (self.met, self.last):
            if kept is not None and kept is not base and (c := self.emu.rerun_count(kept[0].low, low)) < cost:
                base, cost = kept, c
        if base is not self.fp32:
            self.reused += 1
            self.skipped += (from_fp32 - cost) * len(base)
        if self.last is not self.met:
            self.last = None  # (the new run takes its place)
        keep = may_keep and self._own(self.met) + self._whole <= current_budget().search
        runs = []
        for b in base:
            runs.append(self.emu.run_from(b, low, keep=keep))
            yield runs[-1]
        self.last = runs if keep else None  # (only a run of every batch can be a base)

    def judged(self, met: bool) -> None:
        """The last candidate run met the budget (its runs become the base to grow from) or not."""
        if met and self.last is not None:
            self.met = self.last

    def _own(self, runs: list[EmulatorRun] | None) -> int:
        """Bytes of ``runs``' tensors not shared with the FP32 runs."""
        if runs is None:
            return 0
        return sum(_nbytes(v) for r in runs for v in r.tensors.values() if id(v) not in self._shared)


def _nbytes(value: Any) -> int:
    return int(value.nbytes) if isinstance(value, np.ndarray) else 0


class StrictEvaluator:
    """Strict numerics: the emulator, each candidate an incremental run from the kept FP32 runs."""

    name: ClassVar[str] = "strict"
    supports_bf16: ClassVar[bool] = True
    wants_fp32_tensors: ClassVar[bool] = True
    emulated: ClassVar[bool] = True

    @classmethod
    def check_available(cls) -> None:
        """Strict emulation runs wherever mpinfer does (numpy and ONNX Runtime's CPU kernels)."""

    def __init__(
        self,
        model: Any,
        info: GraphInfo,
        batches: list[Outputs],
        precision: Precision,
        *,
        keep_io_types: bool = True,
        known_outputs: list[Outputs] | None = None,
        known_tensors: list[Outputs] | None = None,
        cast_graphs: bool = True,
        kept_batches: int | None = None,
    ) -> None:
        self.info, self.precision, self.keep_io_types = info, precision, keep_io_types
        self._cast_graphs = cast_graphs  # False: the emulator judges every candidate
        # ``kept_batches``: the leading search batches whose FP32 emulator runs fit the search slice (sensitivities and
        # the emulator's incremental runs start from them; the others run whole when the emulator judges)
        self._emu = _EmulatorRefs(model, info, batches, required=True, kept=kept_batches)
        self._emu.emulator()  # (refuses a model with ops the emulator cannot run, before any work)
        # The FP32 runs every candidate is an incremental run from are made when a candidate needs them. Without
        # calibration's tensors (too many bytes to keep) the first candidate (the rule plan, which most often passes)
        # runs whole, against calibration's FP32 outputs, and the runs are made only if a second candidate comes.
        self._known_tensors = known_tensors
        self._known_outputs = known_outputs if known_outputs is not None and len(known_outputs) == len(batches) \
            else None
        self._first_run = False  # whether the first candidate ran (whole runs, no kept FP32 runs needed)
        self._screen_ref: tuple[np.ndarray, _KeptRuns] | None = None  # (screening rows, runs of those rows)
        self._kept: _KeptRuns | None = None  # the search batches' FP32 runs and kept candidate runs
        self._values_per_node: float | None = None
        self._extra = 0
        # each candidate judged on its cast graph (ONNX Runtime, as the final verification) where it qualifies and
        # costs less than the emulator's incremental run
        self._casts = CastJudge(model, info, precision, keep_io_types)

    @property
    def evaluations(self) -> int:
        """Node evaluations so far (emulator reference runs included)."""
        return self._emu.evaluations + self._extra

    @evaluations.setter
    def evaluations(self, value: int) -> None:
        self._extra = value - self._emu.evaluations

    def reference(self) -> list[Outputs]:
        """The FP32 outputs: calibration's (ONNX Runtime's) where it kept them, else those of the kept FP32 runs."""
        if self._known_outputs is not None:
            return self._known_outputs
        self._open()
        assert self._emu.emu is not None
        rest = [self._emu.emu.run(b, None).outputs for b in self._emu.batches[len(self._emu.refs):]]
        self._extra += len(self.info.nodes) * len(rest)
        self._known_outputs = [r.outputs for r in self._emu.refs] + rest  # (run once: every candidate reads them)
        return self._known_outputs

    def _open(self) -> None:
        """The kept FP32 emulator runs, made (or taken from calibration's tensors) on first use."""
        if not self._emu.opened:
            self._emu.open(self._known_tensors)
            self._known_tensors = None  # (the runs hold them now)

    def candidate(self, low: Mapping[str, Precision]) -> Candidate:
        """A candidate run incrementally from the kept FP32 runs."""
        return _StrictCandidate(self, dict(low))

    def run_from_refs(self, low: dict[str, Precision], note: Callable[[Any], None] = _ignore) -> list[Outputs]:
        """The candidate's outputs on every search batch, each an incremental run from the batch's FP32 run."""
        return list(self.each_from_refs(low, note))

    def each_from_refs(self, low: dict[str, Precision], note: Callable[[Any], None] = _ignore) -> Iterator[Outputs]:
        """:meth:`run_from_refs` one search batch at a time (the caller may stop early).

        ``note(engine)`` is told what computes the outputs: the candidate's
        :class:`~mpinfer.precision.numerics.castjudge.JudgedGraph`, or :data:`EMULATED` (once per engine change).

        The candidate's cast graph runs it where it qualifies and the emulator would recompute at least half the
        graph (:class:`~mpinfer.precision.numerics.castjudge.CastJudge`): the FP32 nodes are then ONNX Runtime's float32
        kernels, as in the final verification. Else each batch's emulator run starts from the kept run it differs
        least from (:class:`_KeptRuns`).
        """
        emu = self._emu.emu
        assert emu is not None
        first, self._first_run = not self._first_run, True
        batches = self._emu.batches
        rest = batches[self._emu.kept:]  # (batches without kept FP32 runs: whole runs on the emulator)
        if (sess := self._cast_judged(low, first)) is not None:
            if first:
                logger.info(_FIRST_ON_CAST_GRAPH)
            note(sess)

            def fallback(batch: Outputs) -> Outputs:
                note(EMULATED)
                return emu.run(batch, low).outputs

            for out in self._casts.each(sess, batches, fallback):
                self.evaluations += len(self.info.nodes)  # (a batch stopped early is not run)
                yield out
            return
        self._casts.counts.emulator += 1
        note(EMULATED)
        if first and not self._emu.opened and self._known_tensors is None:
            # the first candidate, and no FP32 tensors from calibration to take the FP32 runs from: whole runs (an FP32
            # run of the search samples costs as much again, and is made only if a second candidate needs it)
            for batch in batches:
                self.evaluations += len(self.info.nodes)
                yield emu.run(batch, low).outputs
            return
        self._open()
        if self._kept is None:
            self._kept = _KeptRuns(emu, self._emu.refs)
        for run in self._kept.each(low, may_keep=not first):
            self.evaluations += run.recomputed
            yield run.outputs
        for batch in rest:
            self.evaluations += len(self.info.nodes)
            yield emu.run(batch, low).outputs

    def cast_rows(
        self, low: Mapping[str, Precision], note: Callable[[Any], None] = _ignore
    ) -> Callable[[Outputs], Outputs] | None:
        """``feeds -> outputs`` of the candidate ``low`` on any of the search samples, as its full run gives them.

        Its cast graph session, when that is the engine its full run would take (the same choice as
        :meth:`each_from_refs`, on the same counts), which computes each sample alone (no op of a cast graph mixes
        samples: the search only asks for models whose samples can be split); None when the emulator would judge it
        (its incremental runs start from runs of whole batches). The first candidate takes the engine its full run
        would (:meth:`each_from_refs`). Counted as a candidate judged on the cast graph.
        """
        if self._emu.emu is None:
            return None
        first = not self._first_run
        sess = self._cast_judged(low, first)
        if sess is None:
            return None
        if first:
            self._first_run = True
            logger.info(_FIRST_ON_CAST_GRAPH)
        note(sess)

        def run(feeds: Outputs) -> Outputs:
            self.evaluations += len(self.info.nodes)
            return self._casts.run(sess, feeds)

        return run

    def _cast_judged(self, low: Mapping[str, Precision], first: bool) -> JudgedGraph | None:
        """The cast graph session that judges ``low`` on every search batch (counted), or None: the emulator does.

        The choice is made on the emulator's node counts (:meth:`_emulator_cost`, from the kept FP32 runs when they
        were made); the kept runs then forget the last candidate (no emulator run of it to start from).
        """
        emu = self._emu.emu
        if self._kept is None and emu is not None and self._emu.opened and self._emu.refs:
            self._kept = _KeptRuns(emu, self._emu.refs)
        batches = len(self._emu.batches)
        sess = self._cast_session(low, self._emulator_cost(low, first, batches - self._emu.kept), batches)
        if sess is not None:
            self._casts.counts.cast_graph += 1
            if self._kept is not None:
                self._kept.forget_last()
        return sess

    def _emulator_cost(self, low: Mapping[str, Precision], first: bool, rest: int) -> int | None:
        """Node evaluations the emulator would spend on ``low`` (``rest``: batches it runs whole); None: unknown.

        The first candidate, before the FP32 runs are made: None (they alone cost a whole run). After it, the count
        from the kept runs, or, while the cast graph judged every candidate and no FP32 run was made (they are made
        only when the emulator runs a candidate), the count from the FP32 runs they would be (the emulator's base
        then): the engine is chosen on the same counts whether or not the runs were made.
        """
        whole = len(self.info.nodes) * rest
        if self._kept is not None:
            return self._kept.cost(low) + whole
        if first or self._emu.emu is None:
            return None
        return self._emu.emu.rerun_count({}, low) * self._emu.kept + whole

    def _cast_session(self, low: Mapping[str, Precision], cost: int | None, batches: int) -> JudgedGraph | None:
        """The cast graph session to judge ``low`` on ``batches`` batches; None: the emulator judges it.

        ``cost``: the emulator's node evaluations for them (None: its FP32 runs are not made yet).
        """
        if not self._cast_graphs or not self._casts.prefers(low, cost, len(self.info.nodes) * batches):
            return None
        return self._casts.session(low)

    def judged(self, met: bool) -> None:
        """The last candidate met the budget or not: a candidate that met it is kept as a base for the next ones."""
        for kept in (self._kept, self._screen_ref[1] if self._screen_ref is not None else None):
            if kept is not None:
                kept.judged(met)

    @property
    def reuse(self) -> dict[str, int]:
        """Candidate runs started from a kept candidate run (not the FP32 runs), and the node evaluations saved."""
        runs = [k for k in (self._kept, self._screen_ref[1] if self._screen_ref is not None else None) if k]
        return {
            "reused_runs": sum(k.reused for k in runs),
            "evaluations_saved": sum(k.skipped for k in runs),
            **self._casts.counts.record(),
        }

    def strict_rows(
        self,
        feeds: Mapping[str, np.ndarray],
        rows: np.ndarray,
        low: Mapping[str, Precision],
        note: Callable[[Any], None] = _ignore,
    ) -> Outputs:
        """Outputs of the candidate ``low`` on the samples ``rows`` (their ``feeds``; ``note``: see each_from_refs).

        An incremental run from an FP32 run of those rows, made on the first call and kept (the rows are then
        fixed, see :meth:`screen_rows`).
        """
        assert self._emu.emu is not None
        cost = self._screen_ref[1].cost(low) if self._screen_ref is not None else None
        if (sess := self._cast_session(low, cost, 1)) is not None:
            try:
                out = self._casts.run(sess, feeds)
            except Exception as err:  # onnxruntime's own types: data it refuses; the emulator screens
                logger.debug("search: the cast graph failed on the screening rows (%s)", err)
            else:
                note(sess)
                self._casts.counts.cast_graph_screens += 1
                self.evaluations += len(self.info.nodes)
                if self._screen_ref is not None:
                    self._screen_ref[1].forget_last()
                return out
        self._casts.counts.emulator_screens += 1
        note(EMULATED)
        if self._screen_ref is None:
            fp32 = self._emu.emu.run(dict(feeds), None, keep=True)
            self._screen_ref = rows, _KeptRuns(self._emu.emu, [fp32])
            self.evaluations += len(self.info.nodes)
        outs, evaluations = self._screen_ref[1].run(low)
        self.evaluations += evaluations
        return outs[0]

    def screen_rows(self, hardest: Callable[[], np.ndarray | None]) -> np.ndarray | None:
        """The screening rows, chosen once (from the first full verification) and kept.

        Each new set of rows costs an FP32 emulator run of them, so they stay fixed. Only for models whose
        emulation cost follows the data (``STRICT_SCREEN_MIN_VALUES`` float values per node in the kept
        reference runs, e.g. CNNs): where the per-node overhead dominates (small transformers), a run on an
        eighth of the samples costs almost what the full incremental run does, and screening would cost more
        than it saves.
        """
        if self._screen_ref is not None:
            return self._screen_ref[0]
        if not self._first_run:
            return None  # (before the first candidate's runs: no hardness to screen on yet)
        rows = hardest()
        if rows is None:
            return None
        if self._values_per_node is None:
            self._values_per_node = self._float_values() / max(len(self.info.nodes), 1)
        return rows if self._values_per_node >= STRICT_SCREEN_MIN_VALUES else None

    def _float_values(self) -> int:
        """Float values the kept FP32 runs of the search batches hold (initializers and feeds included).

        Counted on the runs when they are made; else (the cast graph judged every candidate so far, and the runs
        would cost a whole emulator run of every batch) from an FP32 run of one sample of the first batch: its own
        tensors times the samples of the kept batches, plus the initializers once per batch (only asked for models
        whose samples can be split, each tensor one row per sample).
        """
        emu = self._emu.emu
        assert emu is not None
        head = self._emu.batches[: self._emu.kept]
        if self._emu.opened:
            self._open()
            return sum(
                v.size for r in self._emu.refs for v in r.tensors.values() if isinstance(v, np.ndarray) and is_float(v)
            )
        one = emu.run({k: v[:1] for k, v in head[0].items()}, None, keep=True)
        self.evaluations += len(self.info.nodes)
        inits = emu.initializer_names
        floats = [(k in inits, v.size) for k, v in one.tensors.items() if isinstance(v, np.ndarray) and is_float(v)]
        rows = sum(len(next(iter(b.values()))) for b in head)
        return sum(n for init, n in floats if not init) * rows + sum(n for init, n in floats if init) * len(head)

    def sensitivities(self, groups: Sequence[Any], batches: list[Outputs], subset: bool) -> dict[str, float]:
        """Each group's local error: run alone, low, on FP32 tensors, on the emulator's bits.

        The groups whose low copy has a cast graph are measured together in ONNX Runtime
        (:func:`~mpinfer.precision.numerics.probe.strict_probe_errors`: one FP32 pass and one low pass of those groups
        per batch, on the same samples as the emulator would read: ``batches`` when ``subset``, else the kept ones);
        the others, and all of them when cast graphs are off, as small emulator sub-models (:func:`local_error`).
        """
        errors: dict[str, float] = {}
        if self._cast_graphs:
            probed = probe.strict_probe_errors(
                self.info, groups, batches if subset else self._emu.batches[: self._emu.kept], self.precision
            )
            self._extra += probed.evaluations
            errors.update(probed.errors)
        todo = [g for g in groups if g.anchor not in errors]
        if todo:
            if not subset:  # (the kept FP32 runs: what the emulator reads without a subset)
                self._open()
            errors.update(self._emu.local_errors(todo, batches, subset, self.precision))
        if self._cast_graphs:
            logger.info("sensitivities: %d group(s) measured on ONNX Runtime (cast graph), %d on the strict emulator",
                        len(groups) - len(todo), len(todo))
        return errors

    @classmethod
    def model_runner(cls, model: Any, *, fast: bool = True) -> Runner:
        """The converted model under strict numerics: its cast graph where it qualifies, else :class:`StrictRunner`.

        ``fast=False``: :class:`StrictRunner` whatever the model.

        The runner's ``engine`` says which ran (:class:`~mpinfer.precision.emulator.castgraph.StrictModelRunner`).
        """
        return StrictModelRunner(model, emulator_runner, cast_graph=fast)


def emulator_runner(model: Any) -> Runner:
    """The converted model as ``mpinfer compare --numerics strict`` runs it (:class:`StrictRunner`)."""
    runner = StrictRunner(model, name="candidate")
    runner.activate()
    return runner.infer


class _StrictCandidate:
    def __init__(self, ev: StrictEvaluator, low: dict[str, Precision]) -> None:
        self.ev, self.low = ev, low
        self.engines: list[Any] = []  # what computed its outputs: JudgedGraph(s), EMULATED

    def outputs(self) -> list[Outputs]:
        return self.ev.run_from_refs(self.low, self.engines.append)

    def each(self) -> Iterator[Outputs]:
        return self.ev.each_from_refs(self.low, self.engines.append)

    def outputs_on(self, feeds: Mapping[str, np.ndarray], rows: np.ndarray) -> Outputs:
        return self.ev.strict_rows(feeds, rows, self.low, self.engines.append)

    def rows_runner(self) -> Callable[[Outputs], Outputs] | None:
        return self.ev.cast_rows(self.low, self.engines.append)

    def ran_as(self) -> AppliedRun | None:
        """The candidate's cast graph when it alone computed every output so far (the emulator's never qualify).

        The emulator runs the FP32 model with low nodes, not the model as written: agreeing with it op by op is
        what its kernel tests check, not what a final verification may take for granted.
        """
        first = self.engines[0] if self.engines else None
        if not isinstance(first, JudgedGraph) or any(e is not first for e in self.engines):
            return None
        return AppliedRun(first.precisions, first.applied, functools.partial(first.runner, emulator_runner))

    def judged(self, met: bool) -> None:
        self.ev.judged(met)


