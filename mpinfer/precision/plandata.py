"""The calibration data convert plans with: calibration for the plan, the search's slice, the verification's inputs.

Split from :mod:`mpinfer.precision.convert` (the orchestrator): what reads the data and how much of it each step
keeps. Its steps take :class:`CalibrationSettings` (what the user said about the data) and the resolved
:class:`~mpinfer.precision.options.Options`, and give typed results (:class:`Calibrated`, :class:`VerifyInputs`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.data import load_feeds
from mpinfer.data.feeds import sample_axes
from mpinfer.data.samples import BatchSlicer
from mpinfer.errors import BackendUnavailableError, InternalError, InvalidInputError, format_message
from mpinfer.memory import current_budget
from mpinfer.precision.budget import RUN_ROWS, VerifySettings
from mpinfer.precision.calib import (
    CalibrationStats,
    FeedsRejectedError,
    calibrate,
    check_data_fits,
)
from mpinfer.precision.numerics import evaluator_class
from mpinfer.precision.options import NO_CALIBRATION, Options
from mpinfer.specs import DEFAULT_DIM_SIZE, Precision, specs_from_onnx

logger = logging.getLogger(__name__)

# Memory: random calibration data stops at the budget's ``random_calibration`` bytes of FP32 tensors, the search
# keeps at most its ``search`` bytes of them and a verification run its ``verify_run`` bytes (:mod:`mpinfer.memory`).

# SearchConfig.batches for "every batch of the feeds given" (the feeds are already the search's slice).
MANY = 2**31


@dataclass(frozen=True)
class CalibrationSettings:
    """What the user said about the calibration data (``--calibration`` and the options that shape it).

    Attributes:
        source: ``--calibration`` (.npz, folder, ``random[:N]``, ``prompts:FILE``, ``none``); None = seeded random
            data from the input specs.
        model: The FP32 model file (calibration prompts are decoded with it).
        seed: Seed of random data.
        max_batches: Cap on batches (None: all; random data: until the memory budget's ``random_calibration``).
        batch_size: Batch size (None: the source's or the default).
        dims: Sizes of symbolic dims for random data.
        image_preprocess: Preprocessing of a folder of images.
        input_ranges: Value ranges of random data per input (``("input_ids=0..30522",)``).
    """

    source: str | None
    model: Path
    seed: int = 0
    max_batches: int | None = None
    batch_size: int | None = None
    dims: Mapping[str, int] = field(default_factory=dict)
    image_preprocess: str | None = None
    input_ranges: tuple[str, ...] = ()

    @classmethod
    def of(cls, cfg: Any) -> CalibrationSettings:
        """The settings of a :class:`~mpinfer.precision.convert.ConvertConfig`."""
        return cls(
            source=cfg.calibration,
            model=Path(cfg.model),
            seed=cfg.seed if cfg.seed is not None else 0,
            max_batches=cfg.max_batches,
            batch_size=cfg.batch_size,
            dims=dict(cfg.dims or {}),
            image_preprocess=cfg.image_preprocess,
            input_ranges=tuple(cfg.input_ranges or ()),
        )

    @property
    def own_data(self) -> bool:
        """True when calibration uses mpinfer's own seeded random data (the user gave none)."""
        text = str(self.source)
        return self.source is None or text == "random" or text.startswith("random:")

    @property
    def generated(self) -> bool:
        """Default random data with no ``--max-batches``: read until its tensors come to the memory budget's share."""
        return self.source in (None, "random") and self.max_batches is None


@dataclass
class Calibrated:
    """The calibration step's outcome: statistics, the feeds (for the search and verification), the plan's record.

    All None with ``--calibration none``, or when the plan falls back to rules only.
    """

    stats: CalibrationStats | None = None
    feeds: Any = None
    description: dict[str, Any] | None = None


@dataclass
class VerifyInputs:
    """What :func:`mpinfer.precision.budget.repair.verify_and_repair` needs besides the applied candidate.

    Attributes:
        settings: What is checked, on which samples, under which numerics.
        decisions: The rule verdicts per node (which nodes the user forced).
        feeds: The calibration batches.
        known_reference: Calibration's FP32 outputs of those batches (None: computed again).
        rank_rows: Samples a repair round ranks groups on (None: a batch's).
        known_candidate: (low nodes, outputs per search batch) of the candidate the search measured last: the
            verification takes those outputs when the model as applied is that candidate.
    """

    settings: VerifySettings
    decisions: Mapping[str, Any]
    feeds: Any
    known_reference: Sequence[Mapping[str, np.ndarray]] | None = None
    rank_rows: int | None = None
    known_candidate: tuple[dict[str, Precision], Any] | None = None


def verify_inputs(
    data: CalibrationSettings,
    opts: Options,
    decisions: Mapping[str, Any],
    calibrated: Calibrated,
    *,
    class_outputs: tuple[str, ...] | None,
) -> VerifyInputs:
    """The final verification's inputs: settings, verdicts, data, kept FP32 outputs.

    ``class_outputs``: the outputs top-k is measured on (the user's, else those the search judged).
    """
    limit = opts.verify_samples
    calibrated_samples = (calibrated.description or {}).get("samples")
    if data.generated and calibrated_samples:
        limit = min(limit or calibrated_samples, calibrated_samples)  # generated data: the samples calibration read
    stats = calibrated.stats
    multiple = stats.row_multiple if stats is not None else 1
    if limit is not None:
        limit = round_rows(limit, multiple, up=True)  # the samples asked for, in the groups the model takes
    per_sample = stats.sample_bytes if stats is not None else None
    settings = VerifySettings(
        run_rows=max(1, min(RUN_ROWS, current_budget().verify_run // per_sample)) if per_sample else RUN_ROWS,
        budget=opts.budget or "",
        precision=opts.precision,
        numerics=opts.numerics,
        keep_io_types=opts.keep_io_types,
        samples=limit,
        default_budget=opts.default_budget,
        class_outputs=class_outputs,
        progress=opts.progress,
        generation=opts.generation,
        metrics=opts.metrics,
    )
    rank_rows = search_rows(per_sample)
    if rank_rows is not None:
        rank_rows = round_rows(rank_rows, multiple)
    known = stats.reference_outputs if stats is not None else None
    return VerifyInputs(settings, decisions, calibrated.feeds, known, rank_rows)


def search_rows(per_sample: int | None) -> int | None:
    """Samples whose FP32 tensors fit the memory budget's ``search`` slice (None: their size is unknown).

    The budget search keeps that many; a repair round of the final verification ranks groups on as many.
    """
    return max(1, current_budget().search // per_sample) if per_sample else None


def round_rows(rows: int, multiple: int, *, up: bool = False) -> int:
    """``rows`` as a multiple of ``multiple``: the nearest below (``up``: above), at least one ``multiple``.

    ``multiple``: the sample counts the model takes (:attr:`CalibrationStats.row_multiple`).
    """
    if multiple <= 1:
        return rows
    groups = -(-rows // multiple) if up else rows // multiple
    return max(1, groups) * multiple


def count_rows(model: Any, batches: Any) -> int:
    """Samples in ``batches`` (along each input's sample axis)."""
    slicer = BatchSlicer(model)
    return sum(slicer.rows(b) for b in batches)


@dataclass
class SearchRows:
    """The samples the budget search verifies on: the first ``--search-samples`` of the calibration data."""

    batches: list[dict[str, Any]]
    labels: Any = None
    whole: bool = True  # the first calibration batches as they are (none cut)
    # strict numerics: the leading batches whose FP32 tensors fit the search slice (None: every batch)
    tensor_batches: int | None = None
    # the first calibration batch split in two where its FP32 tensors stop fitting the search slice: the search's
    # first two batches are its pieces (:meth:`per_calibration_batch` joins what the search measured on them)
    split_first: bool = False

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def per_calibration_batch(self, outputs: list[dict[str, np.ndarray]] | None) -> list[dict[str, np.ndarray]] | None:
        """The search's outputs (one dict per search batch) as one dict per calibration batch it read.

        The two pieces of a split first batch are joined along axis 0 (a split needs every output's samples there):
        the final verification takes them batch by batch (:func:`mpinfer.precision.budget.verify.verify_model`).
        """
        if outputs is None or not self.split_first or len(outputs) < 2:
            return outputs
        head, tail = outputs[0], outputs[1]
        return [{n: np.concatenate([head[n], tail[n]]) for n in head}, *outputs[2:]]


def search_data(
    opts: Options,
    model: Any,
    feeds: Any,
    stats: Any,
    *,
    whole_batch: bool = False,
    outputs_only: bool = True,
    cast_graph: bool = True,
) -> tuple[Any, Any, Any]:
    """The search's samples and calibration's FP32 reference for them.

    The first ``opts.search_samples`` samples (``whole_batch``: the whole batches that hold them), fewer when
    their FP32 tensors pass the memory budget's ``search`` bytes. Also the samples the plan's expected error is measured
    on without a budget.

    Strict numerics judge candidates on their cast graphs (ONNX Runtime) where they qualify, which needs only the
    FP32 outputs: the search then reads every one of the ``--search-samples`` samples, and only the leading
    batches whose FP32 tensors fit the slice keep them (``SearchRows.tensor_batches``: the emulator's kept runs,
    the groups' sensitivities). Where not even the first batch fits, that batch is split after the samples that do
    (``SearchRows.split_first``; PP-OCRv4's recognizer, 0.2 GB of tensors a sample in batches of 16, searched 9 of
    its 48 samples and passed plans its final verification then repaired in 5 rounds). Where it cannot be split
    (samples off axis 0, outputs calibration did not keep) or ``outputs_only`` is False, the search reads the
    samples that fit, as with other numerics. ``cast_graph``: False when the rule plan's candidates cannot have a
    cast graph (:func:`~mpinfer.precision.emulator.castgraph.may_qualify`): the emulator would then run the samples
    past the split whole for every candidate, so the batch is not split.
    """
    refs, tensors = getattr(stats, "reference_outputs", None), getattr(stats, "reference_tensors", None)
    per_sample = getattr(stats, "sample_bytes", None)
    multiple = getattr(stats, "row_multiple", 1)  # every cut a multiple of the rows the model takes at a time
    cap = search_rows(per_sample)
    if cap is not None:
        cap = round_rows(cap, multiple)
    want = round_rows(opts.search_samples, multiple, up=True)
    outputs_only = (
        outputs_only and not whole_batch and bool(opts.budget) and evaluator_class(opts.numerics).wants_fp32_tensors
    )
    tensor_cap = cap if outputs_only and cap is not None and cap < want else None
    want = want if cap is None or tensor_cap is not None else min(want, cap)
    slicer = BatchSlicer(model)
    chosen: list[dict[str, Any]] = []
    taken, cut = 0, None
    for batch in feeds:
        if taken >= want:
            break
        rows = slicer.rows(batch)
        stop = rows if taken + rows <= want else want - taken
        if whole_batch:
            stop = rows if cap is None else max(multiple, min(rows, cap - taken))
        if stop < rows:
            batch, cut = slicer.slice(batch, 0, stop), (len(chosen), rows, stop)
            rows = stop
        chosen.append(batch)
        taken += rows
    if not chosen:
        return feeds, refs, tensors
    tensor_batches, split = None, False
    if cut is not None:
        tensors = None  # calibration's tensors hold whole batches (and not every tensor holds samples on axis 0)
        refs = _cut_outputs(model, refs, *cut)
    if tensor_cap is not None:  # (the batches wholly within the cap, at least one)
        sizes = np.cumsum([slicer.rows(b) for b in chosen])
        tensor_batches = int(np.searchsorted(sizes, tensor_cap, side="right"))
        if tensor_batches == 0:  # not one whole batch within the slice: its first samples that fit, then the rest
            pieces = _split_first(model, chosen, refs, tensor_cap) if cast_graph else None
            if pieces is None:  # (cannot be split, or the emulator judges: the search reads what fits)
                return search_data(opts, model, feeds, stats, outputs_only=False)
            (chosen, refs), tensors, tensor_batches, split = pieces, None, 1, True
        if tensors is not None:
            tensors = tensors[:tensor_batches] if len(tensors) >= tensor_batches else None
    if refs is not None:
        refs = refs[: len(chosen)] if len(refs) >= len(chosen) else None
    if tensors is not None and tensor_batches is None:
        tensors = tensors[: len(chosen)] if len(tensors) >= len(chosen) else None
    if tensor_batches is not None:
        logger.info(
            "searching on the first %d sample(s), FP32 tensors kept for the first %d (%.2f GB per sample: the "
            "search slice holds %d); candidates on the cast graph need only the outputs",
            taken, sum(slicer.rows(b) for b in chosen[:tensor_batches]), (per_sample or 0) / 1e9, cap,
        )
    elif per_sample and cap is not None and cap < opts.search_samples and not whole_batch:
        logger.info(
            "searching on the first %d sample(s): their FP32 tensors come to %.1f GB (%d would hold %.1f)",
            taken, taken * per_sample / 1e9, opts.search_samples, opts.search_samples * per_sample / 1e9,
        )
    found = SearchRows(chosen, getattr(feeds, "labels", None), whole=cut is None, tensor_batches=tensor_batches,
                       split_first=split)
    return found, refs, tensors


def _split_first(
    model: Any, chosen: list[dict[str, Any]], refs: Any, rows: int
) -> tuple[list[dict[str, Any]], list[Any]] | None:
    """The search's batches with the first split after its first ``rows`` samples, and calibration's outputs so split.

    The first piece's FP32 tensors fit the search slice (the emulator keeps its FP32 runs: the groups' local errors,
    incremental runs); candidates on the cast graph need only the outputs of the second. None when the batch cannot
    be split so: calibration did not keep the outputs of every search batch, or the samples are not on axis 0 of
    every input and output (the search then reads only the samples that fit).
    """
    if refs is None or len(refs) < len(chosen):
        return None
    first = chosen[0]
    slicer = BatchSlicer(model)
    total = slicer.rows(first)
    head = _cut_outputs(model, refs[:1], 0, total, rows)
    if head is None or not 0 < rows < total:
        return None
    tail = {n: v[rows:] for n, v in refs[0].items()}
    batches = [slicer.slice(first, 0, rows), slicer.slice(first, rows, total), *chosen[1:]]
    return batches, [head[0], tail, *refs[1 : len(chosen)]]


def _cut_outputs(model: Any, refs: Any, index: int, rows: int, stop: int) -> Any:
    """Calibration's FP32 outputs of the search's batches, batch ``index`` cut to its first ``stop`` of ``rows``.

    None when they cannot be cut: calibration did not keep that batch, or the samples are not on axis 0 of every
    input and output (the search then computes its reference itself).
    """
    if refs is None or len(refs) <= index:
        return None
    specs = specs_from_onnx(model)
    axes = sample_axes(specs)
    if not specs or any(axes[s.name] != 0 for s in specs):
        return None
    last = refs[index]
    if any(np.ndim(v) == 0 or len(v) != rows for v in last.values()):
        return None
    return [*refs[:index], {n: v[:stop] for n, v in last.items()}]


def calibrate_for_plan(
    data: CalibrationSettings, opts: Options, model: Any, types: Mapping[str, int] | None = None, *, base_dir: str = ""
) -> Calibrated:
    """Calibration statistics, the feeds (for the search and the verification) and a description for the plan.

    ``base_dir``: the model file's folder when its weights stay external (they are memory-mapped from there).
    Empty (:class:`Calibrated` of Nones) with ``--calibration none`` or when planning falls back to rules only.

    Raises:
        InvalidInputError: A budget without usable data, or the user's data the model rejects.
    """
    if data.source == NO_CALIBRATION:
        if opts.budget:
            raise InvalidInputError(
                format_message(
                    "--budget with --calibration none",
                    "no data",
                    "calibration data (or random)",
                    "drop --calibration none",
                )
            )
        return Calibrated()
    why = check_data_fits(model, user_data=not data.own_data)
    if why is not None:
        raise _no_random_data(data, why, "--calibration none plans by the rules alone (nothing measured)")
    feeds = _load_feeds(data, model)
    info = {"source": feeds.description, "kind": feeds.kind, "samples": int(feeds.num_samples)}
    try:
        stats = _reference_run(data, opts, model, feeds, types, base_dir)
    except BackendUnavailableError as err:
        logger.warning("Calibration skipped (range rules off): %s", err)
        return Calibrated(None, feeds, info)
    except (InternalError, InvalidInputError) as err:
        return _calibration_failed(data, err, feeds, specs_from_onnx(model))
    info["samples"] = int(stats.source.get("samples", info["samples"]))
    if "stat_samples" in stats.source:  # the range statistics' share of them (absmax and the reference: all)
        info["stat_samples"] = int(stats.source["stat_samples"])
    return Calibrated(stats, feeds, info)


def _reference_run(
    data: CalibrationSettings, opts: Options, model: Any, feeds: Any, types: Mapping[str, int] | None, base_dir: str
) -> CalibrationStats:
    """The FP32 calibration run, keeping what the search and the verification read of it.

    The FP32 reference of the search (or, without a budget, of the plan's expected error) is the calibration run's
    first batches: their outputs, and with a strict search every float32 tensor (the emulator's reference run takes
    them instead of computing them).
    """
    tensors = bool(opts.budget) and evaluator_class(opts.numerics).wants_fp32_tensors
    # Default random data stops at the budget's random_calibration bytes of tensors: more random samples add
    # little, and a detector at 640x640 computes ~0.7 GB of tensors per image (8 default batches took 2 min).
    return calibrate(
        model,
        feeds,
        progress=opts.progress,
        capture_batches=1,
        capture_samples=opts.search_samples if opts.budget else 0,  # (the batches that hold them)
        capture_tensors=tensors,
        types=types,
        max_bytes=current_budget().random_calibration if data.generated else None,
        base_dir=base_dir,
        # the final verification's FP32 reference: every batch's outputs, while they are few bytes
        capture_outputs=MANY if opts.budget else 0,
    )


def _calibration_failed(data: CalibrationSettings, err: Exception, feeds: Any, specs: Any) -> Calibrated:
    """Calibration could not run the model on its data.

    mpinfer's own random data (the user gave none): a user error naming the node and what to pass (the sizes,
    value ranges or data it needs); convert never falls back to an unmeasured plan on its own. The user's data: a
    user error naming it (ONNX Runtime's refusal), or the error as it is.
    """
    if feeds.is_random and data.own_data:
        why = (f"ONNX Runtime rejects it at {err.where} ({err.reason[:200]})"
               if isinstance(err, FeedsRejectedError) else f"it cannot be run ({err})")
        raise _no_random_data(data, why, random_data_hint(specs, getattr(feeds, "guessed_dims", ()))) from err
    if isinstance(err, FeedsRejectedError):  # the user's data: name it
        raise InvalidInputError(
            format_message(
                f"Calibration data '{data.source}'",
                f"a batch ONNX Runtime rejected at {err.where} ({err.reason[:300]})",
                "values and shapes the model accepts",
                "check the values of integer inputs (shapes, indices) and each input's layout (README: Data)",
            )
        ) from err
    raise err


def _no_random_data(data: CalibrationSettings, why: str, hint: str) -> InvalidInputError:
    """The error for mpinfer's own random data that cannot judge a plan: what it needs instead (never rules only)."""
    given = "no --calibration given" if data.source is None else f"--calibration {data.source}"
    return InvalidInputError(
        format_message(
            f"mpinfer's own random data ({given})",
            why,
            "data the model runs on, to verify the plan against the default floor",
            hint or "pass --calibration FILE with real inputs, or --calibration none to plan by the rules alone "
            "(nothing measured)",
        )
    )


def random_data_hint(specs: Any, guessed: Any) -> str:
    """What to pass instead of mpinfer's random data the model cannot run.

    ``--dim`` for the sizes it guessed, ``--input-range`` for integer inputs, or real data (``--calibration FILE``);
    ``--calibration none`` for the rules alone.
    """
    parts = []
    if guessed:
        first = str(guessed[0]).split("'")[1]
        parts.append(f"pass --dim NAME=N for each size it guessed (e.g. --dim {first}=N; {', '.join(guessed)} set to "
                     f"{DEFAULT_DIM_SIZE})")
    ints = [s.name for s in specs if s.dtype.kind in "iu"]
    if ints:
        parts.append(f"--input-range NAME=LO..HI for integer input(s) {', '.join(ints[:5])}")
    parts.append("--calibration FILE with real inputs")
    if len(parts) == 1:
        parts[0] = "pass " + parts[0]
    return ", or ".join(parts) + "; --calibration none plans by the rules alone (nothing measured)"


def _load_feeds(data: CalibrationSettings, model: Any) -> Any:
    """The calibration feeds (a warning for random data)."""
    feeds = load_feeds(
        data.source,
        specs_from_onnx(model),
        model=data.model,  # the FP32 file decodes calibration prompts (mpinfer.data.decode)
        batch_size=data.batch_size,
        num_batches=data.max_batches,
        seed=data.seed,
        dims=data.dims,
        image_preprocess=data.image_preprocess,
        input_ranges=data.input_ranges,
    )
    if feeds.is_random:
        logger.warning(
            "%s: using %s from the input specs. Range rules, the budget search and the default floor's "
            "verification then reflect random inputs, not your data; pass real data (an .npz of inputs) as "
            "calibration.",
            "No calibration data" if data.source is None else "Random calibration data",
            feeds.description,
        )
    return feeds

