"""Calibration: an FP32 reference run over the calibration feeds, collecting per-tensor range statistics.

Statistics are streamed batch by batch: each tensor keeps running scalars (absmax, smallest non-zero
magnitude, sum of magnitudes, counts above/below the FP16 and BF16 limits, NaN/Inf counts) and a fixed-size
histogram of magnitudes (16 bins per octave) from which the 99.9th percentile is read. Memory is therefore
bounded by the number of tensors, never by the number of batches; one batch's intermediates are alive at
a time.

Main-graph tensors come from ONNX Runtime (every float intermediate added as a graph output, in chunks for
very large graphs); tensors inside If/Loop/Scan bodies come from :class:`GraphEmulator` (once per loop
iteration). The planner (``convert``) reads these numbers and stores them in the plan.

One FP32 pass (issue 37): each tensor's full statistics read a share of the batches
(:mod:`mpinfer.precision.calib.share`: at least ``STAT_MIN_SAMPLES`` samples and ``STAT_MIN_VALUES`` values of it,
spread over the data); the other batches run in the same session and call, their graph outputs kept as the final
verification's FP32 reference and their tensors reduced to ``absmax`` only, so the overflow rule's figure is of
every sample. ``source["stat_samples"]`` records the share (the fewest samples a tensor's statistics read).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpinfer.backends.base import check_feeds
from mpinfer.data.samples import BatchSlicer
from mpinfer.errors import InvalidInputError, format_message
from mpinfer.precision.calib.capture import (
    FeedsRejectedError,
    Overlap,
    _Capture,
    _named,
    _Passes,
    _read_again,
    _run,
    _run_chunk,
    _Sessions,
    pieces_join,
)
from mpinfer.precision.calib.share import STAT_MIN_SAMPLES, STAT_MIN_VALUES, StatShare
from mpinfer.precision.calib.statistics import (
    BF16_MIN_NORMAL,
    FP16_MAX,
    FP16_MIN_NORMAL,
    FP16_MIN_SUBNORMAL,
    HISTOGRAM_BINS,
    PERCENTILE,
    StatsCollector,
    TensorStats,
)
from mpinfer.precision.core import FLOAT_TYPES
from mpinfer.precision.emulator import GraphEmulator
from mpinfer.progress import progress_bar
from mpinfer.specs import specs_from_onnx

__all__ = [
    "BF16_MIN_NORMAL",
    "FP16_MAX",
    "FP16_MIN_NORMAL",
    "FP16_MIN_SUBNORMAL",
    "HISTOGRAM_BINS",
    "PERCENTILE",
    "RANDOM_DATA_WARNING",
    "CalibrationStats",
    "FeedsRejectedError",
    "StatsCollector",
    "TensorStats",
    "calibrate",
    "check_data_fits",
    "non_tensor_inputs",
    "type_text",
]

logger = logging.getLogger(__name__)

# What statistics from generated data mean, for the caller to show once.
RANDOM_DATA_WARNING = (
    "Calibration used seeded random data drawn from the input specs' ranges, not real inputs: activation "
    "ranges, overflow and underflow figures describe that data and real inputs may differ (wider ranges "
    "can overflow FP16 where this plan says it is safe). Pass --calibration with a few hundred "
    "representative samples."
)
# Two slices of the memory budget (:mod:`mpinfer.memory`) size calibration:
# * ``capture``: ``capture_tensors`` keeps the captured batches' tensors only when they come to at most this many
#   bytes in all (projected from the first batch's first chunk on): they are held while the other batches and
#   passes run, on top of calibration's own working set; above it the caller computes them again later, when
#   calibration's memory is free (layout_cdla at 800x608: ~0.85 GB a batch).
# * ``calibration_call``: one ONNX Runtime call returns at most about this many bytes of tensors, sized from a
#   one-sample probe: a graph whose tensors come to more per sample takes several passes, a batch whose tensors
#   come to more runs in slices of its samples (statistics do not depend on how the samples are grouped).
#   PP-OCRv4's text detector at 640x640 returns ~0.7 GB of tensors per image: a batch of 16 in one call peaked at
#   7.6 GB.
# * ``capture_outputs``: ``capture_outputs`` keeps the graph outputs of the batches after the captured ones while
#   they come to at most this many bytes: convert's final verification takes them as its FP32 reference instead
#   of running the model again (outputs are small next to the tensors calibration computes anyway; a segmentation
#   map is not).

@dataclass
class CalibrationStats(Mapping[str, TensorStats]):
    """Tensor name -> :class:`TensorStats`, plus where the data came from.

    Body tensors are named ``<node address>/<attribute>/<tensor>`` (e.g. ``If_3/then_branch/relu_out``).

    Attributes:
        tensors: The statistics.
        source: ``{"source": description, "kind": npz|random|..., "samples": N, "batches": B, "stat_samples": S}``
            (S: the fewest samples a tensor's full statistics read, its share of the N).
        reference_outputs: The float graph outputs of the first ``capture_batches`` batches (FP32, one dict
            per batch) when :func:`calibrate` was asked for them and ONNX Runtime computed all of them,
            else None: the budget search compares its candidates with these instead of running the FP32
            model again.
        reference_tensors: With ``capture_tensors``: every FLOAT main-graph tensor ONNX Runtime computed for
            those batches (one dict per batch), else None (also above the memory budget's ``capture`` slice): the strict
            emulator's FP32 reference run takes them instead of computing them (:meth:`GraphEmulator.run`
            ``known``).
        sample_bytes: Bytes of the main-graph tensors ONNX Runtime computes for one sample (from the probe), or
            None when it computed none: what holding a run's tensors costs per sample.
        sample_shapes: The shapes of the graph inputs and of the main-graph tensors ONNX Runtime computed in the
            probe (one sample, or the first batch when it cannot be cut), or None: sizes static shape inference
            leaves unknown (``--dim`` sizes, image sides), for FLOP counts.
        row_multiple: The sample counts the model takes are multiples of this (learnt by the probe from the first
            batch: a model that reshapes its rows into groups of 4 takes 4, 8, ... rows, never 1): every slice of
            samples convert cuts is a multiple of it.
    """

    tensors: dict[str, TensorStats]
    source: dict[str, Any] = field(default_factory=dict)
    reference_outputs: list[dict[str, np.ndarray]] | None = field(default=None, repr=False, compare=False)
    reference_tensors: list[dict[str, np.ndarray]] | None = field(default=None, repr=False, compare=False)
    sample_bytes: int | None = field(default=None, compare=False)
    sample_shapes: dict[str, tuple[int, ...]] | None = field(default=None, repr=False, compare=False)
    row_multiple: int = field(default=1, compare=False)

    def __getitem__(self, name: str) -> TensorStats:
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def is_random(self) -> bool:
        """True when the statistics come from generated random data (the caller should warn)."""
        return self.source.get("kind") == "random"

    def warning(self) -> str | None:
        """The warning to show when the statistics come from random data, else None."""
        return RANDOM_DATA_WARNING if self.is_random else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``schema_version`` 1)."""
        return {
            "schema_version": 1,
            "source": dict(self.source),
            "tensors": {k: v.to_dict() for k, v in self.tensors.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CalibrationStats:
        """Inverse of :meth:`to_dict`.

        Raises:
            InvalidInputError: For a dict that is not calibration statistics.
        """
        try:
            tensors = {k: TensorStats.from_dict(v) for k, v in data["tensors"].items()}
        except (KeyError, TypeError, AttributeError) as err:
            raise InvalidInputError(
                format_message(
                    "Calibration statistics",
                    "a dict without 'tensors' entries",
                    "the output of CalibrationStats.to_dict()",
                )
            ) from err
        return cls(tensors, dict(data.get("source", {})))


def fetched_tensors(
    model: Any, known_types: Mapping[str, int] | None = None
) -> tuple[list[str], list[str], list[str], dict[str, int]]:
    """The tensors calibration's ONNX Runtime pass fetches, in its order, and :func:`_float_tensors`' three answers.

    Every main-graph float tensor of known type but the graph inputs (read from the feeds), the graph outputs first:
    they land in the first pass's chunk, whose sliced calls then give the whole batch's outputs for the capture (else
    a second session of the whole model would run the batch again, beside the pass's own: twice the weights in
    memory). ``bench/pass_bounds.py`` times that very pass.
    """
    known, unknown, types = _float_tensors(model, known_types)
    inputs = {vi.name for vi in model.graph.input}
    outputs = {vi.name for vi in model.graph.output}
    names = [n for n in known if n not in inputs]
    return [n for n in names if n in outputs] + [n for n in names if n not in outputs], known, unknown, types


def _float_tensors(
    model: Any, known_types: Mapping[str, int] | None = None
) -> tuple[list[str], list[str], dict[str, int]]:
    """Main-graph float tensors of known type, node outputs of unknown type, and the element types.

    ``known_types``: element types already inferred (``GraphInfo.types``), else shape inference runs here.
    """
    import onnx

    if known_types is not None:
        types = dict(known_types)
    else:
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception as err:  # too large or not inferable: fall back to the declared types  # noqa: BLE001
            logger.debug("shape inference failed (%s); using declared types only", err)
            inferred = model
        g = inferred.graph
        types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g.value_info) + list(g.output) + list(g.input)}
    inits = {t.name for t in model.graph.initializer}
    known = [vi.name for vi in model.graph.input if vi.name not in inits and types.get(vi.name) in FLOAT_TYPES]
    unknown: list[str] = []
    seen = set(known)
    for node in model.graph.node:
        for out in node.output:
            if not out or out in seen:
                continue
            seen.add(out)
            t = types.get(out, 0)
            if t in FLOAT_TYPES:
                known.append(out)
            elif t == 0:
                unknown.append(out)
    return known, unknown, types


def non_tensor_inputs(model: Any) -> dict[str, str]:
    """Graph inputs that are not dense tensors (sequences, optionals, sparse tensors, maps): name -> type."""
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name not in inits and vi.type.WhichOneof("value") != "tensor_type":
            out[vi.name] = type_text(vi.type)
    return out


def type_text(t: Any) -> str:
    """An ONNX ``TypeProto`` as ONNX writes it: ``seq(tensor(float))``, ``optional(tensor(int64))``."""
    from onnx import helper

    kind = t.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        elem = getattr(t, kind).elem_type
        name = helper.tensor_dtype_to_string(elem).split(".")[-1].lower() if elem else "?"
        return f"{'sparse_tensor' if kind == 'sparse_tensor_type' else 'tensor'}({name})"
    if kind in ("sequence_type", "optional_type"):
        return f"{'seq' if kind == 'sequence_type' else 'optional'}({type_text(getattr(t, kind).elem_type)})"
    if kind == "map_type":
        key = helper.tensor_dtype_to_string(t.map_type.key_type).split(".")[-1].lower()
        return f"map({key}, {type_text(t.map_type.value_type)})"
    return str(kind or "no type")


def check_data_fits(model: Any, user_data: bool) -> str | None:
    """Whether calibration can feed this model: None, or why it plans by rules only (mpinfer's own data).

    Calibration data holds tensors: a model with a sequence, optional or sparse input cannot be fed from an
    .npz or from random tensors.

    Raises:
        InvalidInputError: For the user's own data, naming the input.
    """
    odd = non_tensor_inputs(model)
    if not odd:
        return None
    listed = ", ".join(f"'{n}' ({t})" for n, t in odd.items())
    if user_data:
        raise InvalidInputError(
            format_message(
                "--calibration",
                f"data for a model with non-tensor input(s) {listed}",
                "a model whose inputs are all tensors",
                "calibration data holds one array per input; convert with `--calibration none` (rules only)",
            )
        )
    return f"input(s) {listed} are not tensors, and calibration data holds one array per input"


def calibrate(
    model: Any,
    feeds: Iterable[Mapping[str, np.ndarray]],
    *,
    progress: bool = True,
    capture_batches: int = 0,
    capture_tensors: bool = False,
    types: Mapping[str, int] | None = None,
    max_bytes: int | None = None,
    base_dir: str = "",
    capture_outputs: int = 0,
    capture_samples: int = 0,
) -> CalibrationStats:
    """FP32 reference run over ``feeds`` collecting per-tensor statistics, one batch at a time.

    Each tensor's full statistics read its share of the batches (:class:`StatShare`); every batch's graph outputs
    (``capture_outputs``) and every tensor's ``absmax`` come from all of them, in the same ONNX Runtime calls.

    Main-graph tensors come from ONNX Runtime: one call fetches tensors of at most the memory budget's
    ``calibration_call`` bytes, sized by a one-sample probe (several passes over the data when one sample's tensors come
    to more, slices of each batch's samples when a whole batch's do; one session alive at a time); tensors inside
    If/Loop/Scan bodies, and tensors whose type cannot be inferred, come from the numpy emulator.

    Args:
        model: The FP32 ``onnx.ModelProto`` (not modified).
        feeds: A :class:`mpinfer.data.FeedSource` (or any iterable of ``{input: array}`` batches).
        progress: Show a progress bar.
        capture_batches: Keep the float graph outputs of this many first batches
            (``CalibrationStats.reference_outputs``).
        capture_tensors: Also keep every FLOAT main-graph tensor of those batches
            (``CalibrationStats.reference_tensors``; they are computed anyway, so this costs memory only), up
            to the memory budget's ``capture`` bytes in all (beyond it, none: ``reference_tensors`` is None).
        types: Element types of the model's tensors when the caller has inferred them (``GraphInfo.types``
            of this same model): shape inference is then not run again.
        max_bytes: Stop reading batches once the tensors of those read come to this many bytes (from the
            probe's bytes per sample; at least one batch). For generated data, where more samples add little.
        base_dir: The model file's folder when its weights are external (``model`` is the graph alone): ONNX
            Runtime and the emulator memory-map them from there instead of holding a copy.
        capture_outputs: Keep the float graph outputs of this many first batches too (at least
            ``capture_batches``; the later ones up to the memory budget's ``capture_outputs``
            bytes):
            ``reference_outputs`` then holds them all.
        capture_samples: Keep (as ``capture_batches``) the first batches that hold this many samples, counted
            from the first batch's size (the more of the two).

    Returns:
        The statistics of every float tensor: graph inputs, node outputs, and tensors in subgraph bodies;
        ``source`` holds ``samples`` (all read) and ``stat_samples`` (the share's fewest).

    Raises:
        InvalidInputError: No batches, or feeds the model does not accept (names, dtypes, shapes).
    """
    start = time.perf_counter()
    run = _Run(model, feeds, types, base_dir, max_bytes)
    if capture_samples > 0:
        capture_batches = max(capture_batches, math.ceil(capture_samples / max(1, run.first_rows)))
    capture = _Capture(run, capture_batches, capture_tensors, capture_outputs)
    with (
        progress_bar("Calibrating", enabled=progress) as bar,
        contextlib.closing(run.sessions),
        contextlib.closing(run.first_pass.collector),
        contextlib.closing(run.overlap),  # (closed first: its pending statistics, then the collector's threads)
    ):
        task = bar.add_task("", total=len(run.feeds) * run.passes if isinstance(run.feeds, Sized) else None)
        for index in range(run.passes):
            run.read_pass(index, capture, lambda: bar.advance(task))
    return run.stats(capture, start)


class _Run:
    """One calibration run: the model's tensors, the passes over the data and the batches read so far.

    Setting up reads the first batch (checked against the model's inputs, then the probe that sizes the passes); a
    one-shot iterator is then read from that batch on again.
    """

    def __init__(
        self,
        model: Any,
        feeds: Iterable[Mapping[str, np.ndarray]],
        types: Mapping[str, int] | None,
        base_dir: str,
        max_bytes: int | None = None,
    ) -> None:
        self.model = model = _named(model)
        names, self.known, unknown, self.types = fetched_tensors(model, types)
        self.slicer = BatchSlicer(model)
        one_shot = iter(feeds) is feeds
        first = next(iter(feeds), None)
        self.first_rows = self.slicer.rows(first) if first is not None else 1  # samples in the first batch
        specs = specs_from_onnx(model)  # (once: 25 ms for a graph of 600 nodes)
        if first is not None:
            check_feeds(first, specs, where="calibration")  # names the input, before ORT's words
        self.sessions = _Sessions(model, self.types, base_dir)
        self.plan: _Passes | None = (
            _Passes.probe(self.sessions, names, first, self.slicer) if names and first is not None else None
        )
        if self.plan is None and names and first is not None:  # ONNX Runtime cannot load it: the emulator computes all
            unknown = unknown + names
        self.first_pass = _FirstPass(model, unknown, base_dir, specs)
        self.passes = len(self.plan.chunks) if self.plan else 1
        self.feeds = _read_again(feeds, first, self.passes) if one_shot else feeds
        logger.info("calibrating %d tensors in %d pass(es) over the data", len(self.known) + len(unknown), self.passes)
        self.max_bytes = max_bytes
        self.stop_after: int | None = None  # batches read, once max_bytes is reached
        self.read = 0  # bytes of the tensors of the batches read (from the probe's bytes per sample)
        self.share = self._share(first, feeds if not one_shot else None)
        self.share_rows: dict[str, int] = dict.fromkeys(self.known, 0)  # samples each tensor's full statistics read
        self.emulated_rows = 0  # samples the emulator ran on (its tensors' statistics)
        self.overlap = Overlap()  # a call's statistics reduced while ONNX Runtime runs the next (:meth:`_fetch`)
        self.joinable: bool | None = None  # whether a batch's outputs join from cut calls (:meth:`_joinable`)

    def _share(self, first: Mapping[str, np.ndarray] | None, sized: Any) -> StatShare:
        """Which batches each tensor's full statistics read (:mod:`mpinfer.precision.calib.share`)."""
        rows = self.first_rows
        batches = len(sized) if isinstance(sized, Sized) else None
        plan = self.plan
        values: dict[str, int] = {}
        if plan is not None:
            values = {n: max(1, math.prod(shape) // plan.multiple) for n, shape in plan.sample_shapes.items()}
            if batches and self.max_bytes is not None and plan.sample_bytes:  # (max_bytes: the batches read)
                batches = min(batches, max(1, math.ceil(self.max_bytes / (max(1, rows) * plan.sample_bytes))))
        elif first is not None:
            values = {n: max(1, np.size(v) // max(1, rows)) for n, v in first.items()}
        return StatShare.plan(values, rows, batches)

    def read_pass(self, index: int, capture: _Capture, advance: Callable[[], None]) -> None:
        """Pass ``index`` over the data: its chunk of tensors from ONNX Runtime.

        The first pass reads every batch: it also checks each one, runs the emulator on the share's batches and
        counts it (stopping at ``max_bytes``). A later pass reads only the batches its tensors' share (or the
        capture) needs: every other batch's graph outputs and absmax came from the first.
        """
        plan = self.plan
        sess = plan.session(index) if plan else None  # one session alive at a time: this pass's
        for b, batch in enumerate(self.feeds):
            if b == self.stop_after:
                break
            if index == 0 and b:  # the first batch was checked before the probe
                self.first_pass.check(batch)
            capture.open(index, b)
            if sess is not None and plan is not None:  # before the emulator: data it rejects gets ORT's words
                full = self.share.full_names(plan.chunks[index], b)
                if index == 0 or full or b < capture.batches:
                    self._fetch(sess, plan, index, b, batch, capture, full)
                    rows = self.slicer.rows(batch)
                    for name in full:
                        self.share_rows[name] += rows
            if index == 0:
                self._count(b, batch)
            advance()
        self.overlap.wait()  # (the pass's last statistics)

    def _fetch(
        self,
        sess: Any,
        plan: _Passes,
        index: int,
        b: int,
        batch: Mapping[str, np.ndarray],
        capture: _Capture,
        full: set[str],
    ) -> None:
        """Batch ``b``'s tensors of pass ``index`` into the statistics (and the captured batch, if kept).

        ``full``: the tensors whose full statistics read this batch; the others', their largest magnitude.
        """
        keep = capture.kept(b) if index == 0 or b < capture.batches else None  # (later passes: no output)
        chunk, rows, fits = plan.chunks[index], self.slicer.rows(batch), plan.rows_per_call[index]
        # calls of the fast size, unless the batch's every tensor is kept (a batch fetched whole keeps them) or its
        # outputs would not join from the slices (then run again whole)
        cut = self._joinable(capture) and not (keep is not None and capture.keeps_tensors(b))
        per_call = plan.fast_rows[index] if cut else fits
        collector = self.first_pass.collector
        if rows <= per_call or rows % plan.multiple:  # (a batch the model takes whole but not in groups: whole)
            # its statistics reduced while the next batch runs, when two batches' tensors fit the call slice
            overlap = self.overlap if 2 * rows <= fits else None
            known = plan.take_probe(batch) if index == 0 and b == 0 else None
            _run_chunk(sess, chunk, batch, collector, keep, capture.wanted(b), full, (rows, rows), overlap, known)
        else:  # more than one call takes (memory, or the fast size): slices of samples, their outputs joined
            pieces: list[tuple[int, dict[str, np.ndarray]]] = []
            # a slice's statistics reduced while the next slice runs when two slices' tensors fit the call slice
            overlap = self.overlap if 2 * per_call <= fits else None
            if overlap is None:
                self.overlap.wait()  # (one call's tensors at a time: each as big as the slice)
            for row in range(0, rows, per_call):
                part = self.slicer.slice(batch, row, row + per_call)
                got: dict[str, np.ndarray] | None = {} if keep is not None and index == 0 else None
                known = plan.take_probe(part) if index == 0 and b == 0 and row == 0 else None
                _run_chunk(sess, chunk, part, collector, got, capture.outputs, full, (self.slicer.rows(part), rows),
                           overlap, known)
                if got is not None:
                    pieces.append((self.slicer.rows(part), got))
            if keep is not None and index == 0:
                if b < capture.batches:  # (cut with its tensors kept only above the call slice: above capture's too)
                    keep = capture.outputs_only(b)
                out_names = sorted(capture.outputs)
                if self.slicer.axis0 and capture.spill_pieces(b, pieces, out_names):
                    return  # (on disk: nothing of the batch stays in memory to account for)
                joined = self._joined(pieces, out_names)
                if joined is None:
                    values = _run(self.sessions.session(out_names), out_names, batch)
                    joined = dict(zip(out_names, (np.asarray(v, np.float32) for v in values), strict=True))
                keep.update(joined)
        capture.account(index, b, keep)

    def _joinable(self, capture: _Capture) -> bool:
        """Whether a batch's graph outputs join from slices of its samples (:meth:`_joined`), by the probe; once.

        Every input and every output must hold the samples on axis 0 (else a cut batch runs again whole).
        """
        if self.joinable is None:
            plan = self.plan
            shapes = plan.sample_shapes if plan is not None else {}
            self.joinable = plan is not None and self.slicer.axis0 and all(
                n in shapes and len(shapes[n]) > 0 and shapes[n][0] == plan.multiple for n in capture.outputs)
        return self.joinable

    def _joined(self, pieces: list[tuple[int, dict[str, np.ndarray]]], names: list[str]) -> dict[str, Any] | None:
        """The outputs ``names`` of a batch from its slices' runs (rows, outputs), or None.

        Only when every input and every output holds the samples on axis 0 (each slice's outputs as many rows as
        its inputs): else the caller runs the whole batch for them.
        """
        if not self.slicer.axis0 or not pieces_join(pieces, names):
            return None
        return {n: np.concatenate([got[n] for _, got in pieces]) for n in names}

    def _count(self, b: int, batch: Mapping[str, np.ndarray]) -> None:
        """The first pass's statistics of batch ``b`` besides ONNX Runtime's; the bytes read against ``max_bytes``."""
        rows = self.slicer.rows(batch)
        full = self.share.full_names([n for n in batch if n in self.share_rows], b)
        emulate = self.share.full(None, b)  # the emulator's tensors (bodies, untyped): the share's batches only
        self.first_pass.add(batch, full, emulate)
        for name in full:
            self.share_rows[name] += rows
        if emulate:
            self.emulated_rows += rows
        self.read += rows * self.plan.sample_bytes if self.plan else 0
        max_bytes = self.max_bytes
        if max_bytes is not None and self.read >= max_bytes and self.stop_after is None:
            self.stop_after = b + 1
            logger.info("calibrating on the first %d batch(es): their tensors come to %.1f GB", b + 1, self.read / 1e9)

    def stats(self, capture: _Capture, start: float) -> CalibrationStats:
        """The statistics of the run that started at ``start`` (``time.perf_counter()``).

        Raises:
            InvalidInputError: When the feeds held no batch.
        """
        first_pass, plan = self.first_pass, self.plan
        if first_pass.batches == 0:
            raise InvalidInputError(format_message("Calibration feeds", "no batches", "at least one batch"))
        read = [n for n, k in self.share_rows.items() if k] if plan is not None else []
        stat_samples = min((self.share_rows[n] for n in read), default=self.emulated_rows)
        if first_pass.emulates:
            stat_samples = min(stat_samples, self.emulated_rows)
        stat_samples = min(stat_samples, first_pass.samples)
        most = min(max((self.share_rows[n] for n in read), default=stat_samples), first_pass.samples)
        source = {
            "source": getattr(self.feeds, "description", "in-memory batches"),
            "kind": getattr(self.feeds, "kind", "arrays"),
            "samples": first_pass.samples,
            "batches": first_pass.batches,
            # the fewest samples a tensor's full statistics read (the share); absmax: every sample of the first pass
            "stat_samples": stat_samples,
        }
        results = first_pass.collector.results()
        floats = [vi.name for vi in self.model.graph.output if self.types.get(vi.name) in FLOAT_TYPES]
        reference, tensors = capture.references(floats, self.types)
        logger.info(
            "calibrated %d tensors over %d batches (%d samples) in %.1fs: statistics from a share of %s samples "
            "per tensor (at least %d samples and %d values each), absmax and the FP32 reference outputs from all %d",
            len(results),
            first_pass.batches,
            first_pass.samples,
            time.perf_counter() - start,
            f"{stat_samples}" if most <= stat_samples else f"{stat_samples}-{most}",
            STAT_MIN_SAMPLES,
            STAT_MIN_VALUES,
            first_pass.samples,
        )
        return CalibrationStats(
            results,
            source,
            reference,
            tensors,
            plan.sample_bytes if plan else None,
            plan.sample_shapes if plan else None,
            plan.multiple if plan else 1,
        )


class _FirstPass:
    """What the first pass over the data does besides ONNX Runtime: checks, inputs, bodies, counts."""

    def __init__(self, model: Any, emulated: list[str], base_dir: str, specs: Any) -> None:
        self.collector = StatsCollector()
        self.batches = self.samples = 0
        self._specs = specs  # (the model's input specs, read once by _Run)
        self._inputs = {vi.name for vi in model.graph.input}
        self._observe = self.collector.observer(set(emulated))
        has_bodies = any(a.type in (5, 10) for n in model.graph.node for a in n.attribute)  # GRAPH(S)
        self._emulator = None
        if has_bodies or emulated:
            self._emulator = GraphEmulator(model, base_dir=base_dir)
        self.emulates = self._emulator is not None

    def check(self, batch: Mapping[str, np.ndarray]) -> None:
        """Names, dtypes and shapes against the model's inputs: a clear message naming the input."""
        check_feeds(batch, self._specs, where="calibration")

    def add(self, batch: Mapping[str, np.ndarray], full: Container[str], emulate: bool) -> None:
        """Statistics of the inputs and of the tensors only the emulator computes; counts.

        ``full``: the inputs whose full statistics read this batch (the others: absmax); ``emulate``: whether the
        emulator runs on it (the share's batches).
        """
        for name, arr in batch.items():
            if name in self._inputs:
                if name in full:
                    self.collector.update(name, arr)
                else:
                    self.collector.update_absmax(name, arr)
        if self._emulator is not None and emulate:
            self._emulator.run(batch, observe=self._observe)
        self.batches += 1
        first = next(iter(batch.values()), None)
        self.samples += int(first.shape[0]) if first is not None and np.ndim(first) else 1
