"""Calibration: an FP32 reference run over the calibration feeds, collecting per-tensor range statistics.

Statistics are streamed batch by batch: each tensor keeps running scalars (absmax, smallest non-zero
magnitude, sum of magnitudes, counts above/below the FP16 and BF16 limits, NaN/Inf counts) and a fixed-size
histogram of magnitudes (16 bins per octave) from which the 99.9th percentile is read. Memory is therefore
bounded by the number of tensors, never by the number of batches; one batch's intermediates are alive at
a time.

Main-graph tensors come from ONNX Runtime (every float intermediate added as a graph output, in chunks for
very large graphs); tensors inside If/Loop/Scan bodies come from :class:`GraphEmulator` (once per loop
iteration). The planner (``convert``) reads these numbers and stores them in the plan.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import re
import tempfile
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.backends.base import check_feeds
from mpinfer.data.feeds import sample_axes, take_samples
from mpinfer.errors import InvalidInputError, ModelLoadError, format_message
from mpinfer.memory import current_budget
from mpinfer.modelio import iter_nodes, name_nodes, ort_session, save_onnx
from mpinfer.precision.emulator.emulate import GraphEmulator
from mpinfer.precision.graphinfo import FLOAT
from mpinfer.precision.tensorstats import (
    BF16_MIN_NORMAL,
    FP16_MAX,
    FP16_MIN_NORMAL,
    FP16_MIN_SUBNORMAL,
    HISTOGRAM_BINS,
    PERCENTILE,
    StatsCollector,
    TensorStats,
)
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
    "BatchSlicer",
    "pack_chunks",
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
# Models with more weight bytes than this are calibrated from a temporary external-data copy, so the
# per-chunk session models are graph-only protos instead of full copies of the weights.
IN_MEMORY_LIMIT = 256 * 2**20
# Outputs of calibration's later batches past the ``capture_outputs`` slice go to an unlinked temporary file while
# they come to at most this many slices (2 GiB of disk at the default budget); past that, the verification runs
# those batches in FP32 again.
SPILL_SHARES = 8
# Tensors fetched per pass of ONNX Runtime over the data (bytes bound the memory: the budget's calibration_call).
MAX_OUTPUTS_PER_SESSION = 4096
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

_FLOAT_TYPES = (1, 10, 11, 16)  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


def float_outputs(model: Any) -> list[Any]:
    """The graph outputs of ``model`` declared float (FLOAT, FLOAT16, DOUBLE, BFLOAT16)."""
    return [o for o in model.graph.output if o.type.tensor_type.elem_type in _FLOAT_TYPES]


@dataclass
class CalibrationStats(Mapping[str, TensorStats]):
    """Tensor name -> :class:`TensorStats`, plus where the data came from.

    Body tensors are named ``<node address>/<attribute>/<tensor>`` (e.g. ``If_3/then_branch/relu_out``).

    Attributes:
        tensors: The statistics.
        source: ``{"source": description, "kind": npz|random|..., "samples": N, "batches": B}``.
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
    known = [vi.name for vi in model.graph.input if vi.name not in inits and types.get(vi.name) in _FLOAT_TYPES]
    unknown: list[str] = []
    seen = set(known)
    for node in model.graph.node:
        for out in node.output:
            if not out or out in seen:
                continue
            seen.add(out)
            t = types.get(out, 0)
            if t in _FLOAT_TYPES:
                known.append(out)
            elif t == 0:
                unknown.append(out)
    return known, unknown, types


class _Sessions:
    """Builds ONNX Runtime sessions whose outputs are chosen tensors, without copying big weights.

    A model above ``IN_MEMORY_LIMIT`` bytes is written once to a temporary folder with external data; each
    session's model is then a graph-only proto (a few KB) pointing at that data file.
    """

    def __init__(self, model: Any, types: Mapping[str, int], base_dir: str = "") -> None:
        self._model = model
        self._types = types
        self._base_dir = base_dir  # external weights stay in the model's folder: sessions memory-map them
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if _weight_bytes(model) > IN_MEMORY_LIMIT:
            import onnx

            self._tmp = tempfile.TemporaryDirectory(prefix="mpinfer-calibrate-")
            path = save_onnx(model, Path(self._tmp.name) / "model.onnx", external_data=True)
            self._model = onnx.load(str(path), load_external_data=False)

    def session(self, names: list[str]) -> Any:
        """A session returning ``names`` (in that order)."""
        import onnx
        from onnx import helper

        m = onnx.ModelProto()
        m.CopyFrom(self._model)
        del m.graph.output[:]
        m.graph.output.extend(helper.make_tensor_value_info(n, self._types[n], None) for n in names)
        if self._tmp is None:
            return ort_session(m, base_dir=self._base_dir or None)
        path = Path(self._tmp.name) / "outputs.onnx"  # next to model.onnx.data, which it references
        path.write_bytes(m.SerializeToString())
        return ort_session(path)

    def close(self) -> None:
        """Remove the temporary copy, if any."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _nbytes(captured: list[dict[str, np.ndarray]]) -> int:
    """Bytes the captured batches hold in memory."""
    return sum(v.nbytes for c in captured if not isinstance(c, _OnDisk) for v in c.values())


class _OnDisk(Mapping[str, np.ndarray]):
    """One batch's FP32 outputs in an unlinked temporary file, each read back when it is looked up.

    The file (one for all the batches of a calibration run) has no name and goes with the last batch that reads it;
    the arrays are read, not memory-mapped, so a batch costs memory only while the verification reads it.
    """

    def __init__(self, file: Any, arrays: Mapping[str, np.ndarray]) -> None:
        self._file = file
        self._index: dict[str, tuple[int, tuple[int, ...]]] = {}
        file.seek(0, 2)  # (appended after the batches before it)
        for name, value in arrays.items():
            arr = np.ascontiguousarray(value, np.float32)
            self._index[name] = (file.tell(), arr.shape)
            arr.tofile(file)
        file.flush()

    def __getitem__(self, name: str) -> np.ndarray:
        offset, shape = self._index[name]
        self._file.seek(offset)
        return np.fromfile(self._file, np.float32, count=math.prod(shape)).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def _owned(value: np.ndarray) -> np.ndarray:
    """``value`` as a float32 array that owns its memory (a copy unless it already is one)."""
    return value if value.base is None and value.dtype == np.float32 else np.array(value, np.float32)


def _outputs_only(captured: list[dict[str, np.ndarray]], outputs: set[str]) -> list[dict[str, np.ndarray]]:
    """The captured batches with their graph outputs only (the other tensors dropped)."""
    return [{n: v for n, v in c.items() if n in outputs} for c in captured]


def _weight_bytes(model: Any) -> int:
    return sum(len(t.raw_data) + 4 * len(t.float_data) for t in model.graph.initializer)


class FeedsRejectedError(InvalidInputError):
    """ONNX Runtime refused to run the model on a batch of calibration feeds.

    Attributes:
        node: The node ONNX Runtime names (``AffineGrid_0``), or ``""``.
        op_type: Its op type, or ``""``.
        reason: ONNX Runtime's own words.
    """

    def __init__(self, message: str, node: str = "", op_type: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.node, self.op_type, self.reason = node, op_type, reason

    @property
    def where(self) -> str:
        """``node 'AffineGrid_0' (AffineGrid)``, or ``the model`` when ONNX Runtime names no node."""
        if not self.op_type:
            return "the model"
        return f"node '{self.node}' ({self.op_type})" if self.node else f"a {self.op_type} node"


# ONNX Runtime names the failing node as "... while running AffineGrid node. Name:'AffineGrid_0' Status Message: ..."
_ORT_NODE = re.compile(r"running (\w+) node\. Name:'([^']*)'(?: Status Message: (.*))?", re.S)


def _run(sess: Any, names: list[str], batch: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    try:
        return list(sess.run(names, dict(batch)))
    except Exception as err:  # onnxruntime raises its own exception types
        text = str(err)
        m = _ORT_NODE.search(text)
        op, node, reason = (m.group(1), m.group(2), (m.group(3) or text).strip()) if m else ("", "", text)
        where = f" at node '{node}' ({op})" if node else f" at a {op} node" if op else ""
        raise FeedsRejectedError(
            format_message(
                "Calibration feeds",
                f"a batch ONNX Runtime rejected{where} ({reason})",
                "arrays matching the model's inputs",
            ),
            node,
            op,
            reason,
        ) from err


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


def _run_chunk(
    sess: Any,
    names: list[str],
    batch: Mapping[str, np.ndarray],
    collector: StatsCollector,
    capture: dict[str, np.ndarray] | None = None,
    wanted: Container[str] = (),
) -> None:
    """Run one chunk of tensors on ``batch`` into the statistics (and ``capture``)."""
    values = _run(sess, names, batch)
    collector.update_many(zip(names, values, strict=True))
    if capture is not None:
        capture.update({n: np.asarray(v, np.float32) for n, v in zip(names, values, strict=True) if n in wanted})


class BatchSlicer:
    """Cuts a model's batches into slices of samples along each input's sample axis.

    See :func:`mpinfer.data.feeds.sample_axes`.
    """

    def __init__(self, model: Any) -> None:
        specs = specs_from_onnx(model)
        axes = sample_axes(specs)
        # only symbolic sample dims can take another count (a fixed batch of 4 is fed 4 at a time), and only when
        # no input but scalars is fed whole: a state [2, ?, 128] whose batch dim has no name may be the batch
        self._axes = {s.name: a for s in specs if (a := axes[s.name]) is not None and isinstance(s.shape[a], str)}
        if any(axes[s.name] is None and s.shape for s in specs):
            self._axes = {}

    @property
    def axis0(self) -> bool:
        """True when every input that holds samples holds them on axis 0 (and some do)."""
        return bool(self._axes) and all(a == 0 for a in self._axes.values())

    def rows(self, batch: Mapping[str, np.ndarray]) -> int:
        """Samples in ``batch``; 1 when it cannot be cut (no sample axis, or inputs that disagree)."""
        counts = {np.shape(batch[n])[a] for n, a in self._axes.items() if n in batch}
        return counts.pop() if len(counts) == 1 else 1

    def slice(self, batch: Mapping[str, np.ndarray], start: int, stop: int) -> dict[str, np.ndarray]:
        """Samples ``start:stop`` of every input that has a sample axis; the others whole."""
        return {name: take_samples(value, self._axes.get(name), start, stop) for name, value in batch.items()}


def pack_chunks(names: Sequence[str], sizes: Sequence[int], max_count: int, max_bytes: int) -> list[list[str]]:
    """Consecutive chunks of at most ``max_count`` tensors and ``max_bytes`` bytes (a bigger tensor: alone)."""
    chunks: list[list[str]] = []
    chunk: list[str] = []
    total = 0
    for name, size in zip(names, sizes, strict=True):
        if chunk and (len(chunk) >= max_count or total + size > max_bytes):
            chunks.append(chunk)
            chunk, total = [], 0
        chunk.append(name)
        total += size
    if chunk:
        chunks.append(chunk)
    return chunks


@dataclass
class _Passes:
    """Which tensors each pass over the data fetches, and how many samples one call of it may take.

    Sized from one probe call that fetches every tensor for one sample (for a batch that cannot be cut: the
    whole batch, which then counts as one sample): a pass holds tensors of at most the calibration_call slice
    per sample (and at most ``MAX_OUTPUTS_PER_SESSION`` of them), and a call takes as many samples as keep it
    under that limit.
    """

    chunks: list[list[str]]
    rows_per_call: list[int]
    sample_bytes: int
    _sessions: _Sessions
    _probe_session: Any = None
    sample_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    multiple: int = 1

    @classmethod
    def probe(cls, sessions: _Sessions, names: list[str], batch: Mapping[str, np.ndarray], slicer: BatchSlicer) -> Any:
        """The passes for ``names`` (None when ONNX Runtime cannot load the model)."""
        try:
            sess = sessions.session(names)
        except ModelLoadError as err:
            logger.warning("ONNX Runtime cannot run the model (%s); calibrating with the numpy emulator", err)
            return None
        multiple, sample, values = _probe_rows(sess, names, batch, slicer)
        sizes = [np.asarray(v).nbytes for v in values]
        shapes = {n: tuple(np.shape(v)) for n, v in sample.items()}
        shapes.update((n, tuple(np.shape(v))) for n, v in zip(names, values, strict=True))
        del values
        call = current_budget().calibration_call
        chunks = pack_chunks(names, sizes, MAX_OUTPUTS_PER_SESSION, call)
        size_of = dict(zip(names, sizes, strict=True))
        totals = [sum(size_of[n] for n in chunk) for chunk in chunks]
        # samples per call: whole groups of the rows the model takes (the probe's bytes are for ``multiple`` rows)
        per_call = [max(1, call // max(1, t)) * multiple for t in totals]
        return cls(chunks, per_call, sum(sizes) // multiple, sessions, sess if len(chunks) == 1 else None, shapes,
                   multiple)

    def session(self, index: int) -> Any:
        """The session of pass ``index`` (the probe's own when there is a single pass)."""
        sess, self._probe_session = self._probe_session, None
        return sess if sess is not None else self._sessions.session(self.chunks[index])


def _probe_rows(
    sess: Any, names: list[str], batch: Mapping[str, np.ndarray], slicer: BatchSlicer
) -> tuple[int, Mapping[str, np.ndarray], list[np.ndarray]]:
    """The probe's run: (the rows the model takes at a time, the slice run, its tensors).

    One sample when the model takes it; else the fewest rows of the batch it takes, among the batch's divisors (a
    model that reshapes its rows into groups of 4 takes 4): learnt from the data, never a count it rejects. A batch
    that cannot be cut runs whole (it counts as one sample); the whole batch rejected is the data's fault (raised).
    """
    rows = slicer.rows(batch)
    if rows <= 1:
        return 1, batch, _run(sess, names, batch)
    first: FeedsRejectedError | None = None
    for size in [k for k in range(1, rows) if rows % k == 0]:
        sample = slicer.slice(batch, 0, size)
        try:
            values = _run(sess, names, sample)
        except FeedsRejectedError as err:
            first = first or err
            continue
        if size > 1:
            logger.info("the model takes its samples %d at a time (one sample is rejected: %s)", size,
                        first.reason[:200] if first else "")
        return size, sample, values
    return rows, batch, _run(sess, names, batch)


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
) -> CalibrationStats:
    """FP32 reference run over ``feeds`` collecting per-tensor statistics, one batch at a time.

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

    Returns:
        The statistics of every float tensor: graph inputs, node outputs, and tensors in subgraph bodies.

    Raises:
        InvalidInputError: No batches, or feeds the model does not accept (names, dtypes, shapes).
    """
    start = time.perf_counter()
    run = _Run(model, feeds, types, base_dir)
    capture = _Capture(run, capture_batches, capture_tensors, capture_outputs)
    with (
        progress_bar("Calibrating", enabled=progress) as bar,
        contextlib.closing(run.sessions),
        contextlib.closing(run.first_pass.collector),
    ):
        task = bar.add_task("", total=len(run.feeds) * run.passes if isinstance(run.feeds, Sized) else None)
        for index in range(run.passes):
            run.read_pass(index, capture, max_bytes, lambda: bar.advance(task))
    return run.stats(capture, start)


class _Run:
    """One calibration run: the model's tensors, the passes over the data and the batches read so far.

    Setting up reads the first batch (checked against the model's inputs, then the probe that sizes the passes); a
    one-shot iterator is then read from that batch on again.
    """

    def __init__(
        self, model: Any, feeds: Iterable[Mapping[str, np.ndarray]], types: Mapping[str, int] | None, base_dir: str
    ) -> None:
        self.model = model = _named(model)
        self.known, unknown, self.types = _float_tensors(model, types)
        inputs = {vi.name for vi in model.graph.input}
        names = [n for n in self.known if n not in inputs]  # graph inputs are read from the feeds
        # The graph outputs first: they land in the first pass's chunk, whose sliced calls then give the whole
        # batch's outputs for the capture (else a second session of the whole model would run the batch again,
        # beside the pass's own: twice the weights in memory)
        outputs = {vi.name for vi in model.graph.output}
        names = [n for n in names if n in outputs] + [n for n in names if n not in outputs]
        self.slicer = BatchSlicer(model)
        one_shot = iter(feeds) is feeds
        first = next(iter(feeds), None)
        if first is not None:
            check_feeds(first, specs_from_onnx(model), where="calibration")  # names the input, before ORT's words
        self.sessions = _Sessions(model, self.types, base_dir)
        self.plan: _Passes | None = (
            _Passes.probe(self.sessions, names, first, self.slicer) if names and first is not None else None
        )
        if self.plan is None and names and first is not None:  # ONNX Runtime cannot load it: the emulator computes all
            unknown = unknown + names
        self.first_pass = _FirstPass(model, unknown, base_dir)
        self.passes = len(self.plan.chunks) if self.plan else 1
        self.feeds = _read_again(feeds, first, self.passes) if one_shot else feeds
        logger.info("calibrating %d tensors in %d pass(es) over the data", len(self.known) + len(unknown), self.passes)
        self.stop_after: int | None = None  # batches read, once max_bytes is reached
        self.read = 0  # bytes of the tensors of the batches read (from the probe's bytes per sample)

    def read_pass(self, index: int, capture: _Capture, max_bytes: int | None, advance: Callable[[], None]) -> None:
        """Pass ``index`` over the data: its chunk of tensors from ONNX Runtime.

        The first pass also checks each batch, runs the emulator on it and counts it (stopping at ``max_bytes``).
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
                self._fetch(sess, plan, index, b, batch, capture)
            if index == 0:
                self._count(b, batch, max_bytes)
            advance()

    def _fetch(
        self, sess: Any, plan: _Passes, index: int, b: int, batch: Mapping[str, np.ndarray], capture: _Capture
    ) -> None:
        """Batch ``b``'s tensors of pass ``index`` into the statistics (and the captured batch, if kept)."""
        keep = capture.kept(b) if index == 0 or b < capture.batches else None  # (later passes: no output)
        chunk, per_call, rows = plan.chunks[index], plan.rows_per_call[index], self.slicer.rows(batch)
        collector = self.first_pass.collector
        if rows <= per_call or rows % plan.multiple:  # (a batch the model takes whole but not in groups: whole)
            _run_chunk(sess, chunk, batch, collector, keep, capture.wanted(b))
        else:  # too many bytes for one call: slices of samples (the outputs joined from them, or run on their own)
            pieces: list[tuple[int, dict[str, np.ndarray]]] = []
            for row in range(0, rows, per_call):
                part = self.slicer.slice(batch, row, row + per_call)
                got: dict[str, np.ndarray] | None = {} if keep is not None and index == 0 else None
                _run_chunk(sess, chunk, part, collector, got, capture.outputs)
                if got is not None:
                    pieces.append((self.slicer.rows(part), got))
            if keep is not None and index == 0:
                if b < capture.batches:  # a batch above the call limit is above the capture limit too
                    keep = capture.outputs_only(b)
                out_names = sorted(capture.outputs)
                joined = self._joined(pieces, out_names)
                if joined is None:
                    values = _run(self.sessions.session(out_names), out_names, batch)
                    joined = dict(zip(out_names, (np.asarray(v, np.float32) for v in values), strict=True))
                keep.update(joined)
        capture.account(index, b, keep)

    def _joined(self, pieces: list[tuple[int, dict[str, np.ndarray]]], names: list[str]) -> dict[str, Any] | None:
        """The outputs ``names`` of a batch from its slices' runs (rows, outputs), or None.

        Only when every input and every output holds the samples on axis 0 (each slice's outputs as many rows as
        its inputs): else the caller runs the whole batch for them.
        """
        if not self.slicer.axis0 or not pieces:
            return None
        if any(set(names) - set(got) or any(np.ndim(got[n]) == 0 or len(got[n]) != k for n in names)
               for k, got in pieces):
            return None
        return {n: np.concatenate([got[n] for _, got in pieces]) for n in names}

    def _count(self, b: int, batch: Mapping[str, np.ndarray], max_bytes: int | None) -> None:
        """The first pass's statistics of batch ``b`` besides ONNX Runtime's; the bytes read against ``max_bytes``."""
        self.first_pass.add(batch)
        self.read += self.slicer.rows(batch) * self.plan.sample_bytes if self.plan else 0
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
        source = {
            "source": getattr(self.feeds, "description", "in-memory batches"),
            "kind": getattr(self.feeds, "kind", "arrays"),
            "samples": first_pass.samples,
            "batches": first_pass.batches,
        }
        results = first_pass.collector.results()
        floats = [vi.name for vi in self.model.graph.output if self.types.get(vi.name) in _FLOAT_TYPES]
        reference, tensors = capture.references(floats, self.types)
        logger.info(
            "calibrated %d tensors over %d batches in %.1fs",
            len(results),
            first_pass.batches,
            time.perf_counter() - start,
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


def _named(model: Any) -> Any:
    """``model``, or a copy whose nodes have unique addresses (skipped for models already named, as big ones are)."""
    addresses = [ref.address for ref in iter_nodes(model.graph)]
    if any(not a or a.endswith("/") for a in addresses) or len(set(addresses)) != len(addresses):
        return name_nodes(model)
    return model


def _read_again(
    feeds: Iterable[Mapping[str, np.ndarray]], first: Mapping[str, np.ndarray] | None, passes: int
) -> Iterable[Mapping[str, np.ndarray]]:
    """A one-shot iterator whose ``first`` batch the probe took, from that batch on (a list for several passes)."""
    if first is None:
        return feeds
    return [first, *feeds] if passes > 1 else itertools.chain([first], feeds)


class _Capture:
    """The tensors kept of the first batches: graph outputs, and with ``capture_tensors`` every FLOAT tensor.

    The first pass opens one dict per kept batch; each pass adds its chunk's tensors. Every FLOAT tensor is kept
    while the bytes projected for all captured batches and passes stay within the budget's ``capture`` slice (then
    outputs only); the outputs of the batches after ``capture_batches`` while they stay within its
    ``capture_outputs`` slice (then no further batch).
    """

    def __init__(self, run: _Run, batches: int, tensors: bool, outputs_too: int) -> None:
        self.outputs = {vi.name for vi in run.model.graph.output} & set(run.known)
        self.limit = current_budget().capture
        self.tensors = tensors  # every FLOAT tensor of the first ``batches`` is still kept
        self._all = (self.outputs | {n for n in run.known if run.types.get(n) == FLOAT}) if tensors else self.outputs
        self.batches, self.passes = batches, run.passes
        # batches whose outputs are kept (bytes permitting): in the first pass, when its calls return every output
        # (the outputs are fetched first, see _Run: always, unless they alone overflow a pass)
        first = set(run.plan.chunks[0]) if run.plan is not None else set()
        in_first_pass = run.passes == 1 or self.outputs <= first
        self.keep_until = max(batches, outputs_too if in_first_pass else 0)
        self.captured: list[Any] = []  # one dict a kept batch (an _OnDisk once spilled)
        self.spilled = 0  # bytes of the outputs kept on disk (:class:`_OnDisk`)
        self._disk: Any = None  # their file

    def open(self, index: int, b: int) -> None:
        """Pass ``index`` reads batch ``b``: the first pass opens its dict when it is kept."""
        if b < self.keep_until and index == 0:
            self.captured.append({})

    def kept(self, b: int) -> dict[str, np.ndarray] | None:
        """Batch ``b``'s captured tensors, or None when it is not kept."""
        return self.captured[b] if b < min(self.keep_until, len(self.captured)) else None

    def wanted(self, b: int) -> Container[str]:
        """The tensors to keep of batch ``b``."""
        return self._all if b < self.batches and self.tensors else self.outputs

    def outputs_only(self, b: int) -> dict[str, np.ndarray]:
        """Keep the graph outputs only, from now on and of the batches captured so far; batch ``b``'s dict."""
        self.tensors = False
        self.captured = _outputs_only(self.captured, self.outputs)
        return self.captured[b]

    def account(self, index: int, b: int, keep: dict[str, np.ndarray] | None) -> None:
        """After batch ``b`` of pass ``index``: drop what the budget's slices do not hold."""
        if keep is None:
            return
        # the bytes all captured batches and passes will hold, projected from those run so far
        done, total = index * self.batches + b + 1, self.passes * self.batches
        if b >= self.batches and index == 0:
            if self.spilled or _nbytes(self.captured[self.batches :]) > current_budget().capture_outputs:
                self._spill(b)
        elif self.tensors and _nbytes(self.captured) * total > self.limit * done:
            logger.debug("captured tensors above %d bytes: keeping outputs only", self.limit)
            self.outputs_only(b)

    def _spill(self, b: int) -> None:
        """Batch ``b``'s outputs, past the ``capture_outputs`` slice, to disk while they fit ``SPILL_SHARES`` of it.

        An FP32 reference read back from disk costs far less than running the model again on the batch (a CNN
        whose outputs are feature maps: 75 MB a batch of 16 at 128x96x96).
        """
        limit = SPILL_SHARES * current_budget().capture_outputs
        spilled = self.spilled + _nbytes(self.captured[b:])
        try:
            if spilled > limit:
                raise OSError(f"more than {limit} bytes")
            if self._disk is None:
                self._disk = tempfile.TemporaryFile(prefix="mpinfer-reference-")
            self.captured[b] = _OnDisk(self._disk, self.captured[b])
            self.spilled = spilled
        except OSError as err:  # (a full or read-only temporary folder: the verification runs these batches)
            logger.debug("calibration outputs from batch %d on not kept: %s", b, err)
            self.captured.pop()  # the later batches' outputs are not kept
            self.keep_until = b

    def references(
        self, floats: list[str], types: Mapping[str, int]
    ) -> tuple[list[dict[str, np.ndarray]] | None, list[dict[str, np.ndarray]] | None]:
        """``reference_outputs`` (the float graph outputs ``floats``) and ``reference_tensors``, or None each.

        Only when ONNX Runtime computed every float output of every kept batch (it may not run the model at all).
        """
        captured = self.captured
        if not (captured and floats and all(c.keys() >= set(floats) for c in captured)):
            return None, None
        # Copies of ONNX Runtime's output arrays, views that keep the session's whole memory arena alive (an
        # array that owns its memory, joined from a batch's slices, is kept as it is: 75 MB a batch of a CNN).
        reference: list[Any] = [c if isinstance(c, _OnDisk) else {n: _owned(c[n]) for n in floats} for c in captured]
        if not self.tensors:
            return reference, None
        return reference, [{n: v for n, v in c.items() if types.get(n) == FLOAT} for c in captured[: self.batches]]


class _FirstPass:
    """What the first pass over the data does besides ONNX Runtime: checks, inputs, bodies, counts."""

    def __init__(self, model: Any, emulated: list[str], base_dir: str = "") -> None:
        self.collector = StatsCollector()
        self.batches = self.samples = 0
        self._specs = specs_from_onnx(model)
        self._inputs = {vi.name for vi in model.graph.input}
        self._observe = self.collector.observer(set(emulated))
        has_bodies = any(a.type in (5, 10) for n in model.graph.node for a in n.attribute)  # GRAPH(S)
        self._emulator = None
        if has_bodies or emulated:
            self._emulator = GraphEmulator(model, base_dir=base_dir)

    def check(self, batch: Mapping[str, np.ndarray]) -> None:
        """Names, dtypes and shapes against the model's inputs: a clear message naming the input."""
        check_feeds(batch, self._specs, where="calibration")

    def add(self, batch: Mapping[str, np.ndarray]) -> None:
        """Statistics of the inputs and of the tensors only the emulator computes; counts."""
        for name, arr in batch.items():
            if name in self._inputs:
                self.collector.update(name, arr)
        if self._emulator is not None:
            self._emulator.run(batch, observe=self._observe)
        self.batches += 1
        first = next(iter(batch.values()), None)
        self.samples += int(first.shape[0]) if first is not None and np.ndim(first) else 1
