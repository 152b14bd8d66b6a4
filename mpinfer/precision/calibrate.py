"""Calibration: an FP32 reference run over the calibration feeds, collecting per-tensor range statistics.

Statistics are streamed batch by batch: each tensor keeps running scalars (absmax, smallest non-zero
magnitude, sum of magnitudes, counts above/below the FP16 and BF16 limits, NaN/Inf counts) and a fixed-size
log2 histogram of magnitudes from which the 99.9th percentile is read. Memory is therefore bounded by the
number of tensors, never by the number of batches, and one batch's intermediates are alive at a time.

Main-graph tensors come from ONNX Runtime (every float intermediate added as a graph output, in chunks for
very large graphs); tensors inside If/Loop/Scan bodies come from :class:`GraphEmulator` (once per loop
iteration). The planner (``convert``) reads these numbers and stores them in the plan.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sized
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from mpinfer.errors import InvalidInputError, ModelLoadError, format_message

logger = logging.getLogger(__name__)

# Largest finite FP16 value: magnitudes above it overflow to inf when stored in FP16.
FP16_MAX = 65504.0
# Smallest FP16 subnormal: non-zero magnitudes below it flush to zero in FP16.
FP16_MIN_SUBNORMAL = 2.0**-24
# Smallest FP16 normal: below it FP16 keeps fewer than 11 significant bits (gradual underflow).
FP16_MIN_NORMAL = 2.0**-14
# Smallest BF16 normal (same exponent range as FP32, ~1.18e-38): below it BF16 loses range; GPUs often flush.
BF16_MIN_NORMAL = 2.0**-126
# Log2 histogram of |x|: 16 bins per octave (4.4 % relative resolution of the percentile) over
# [2**-64, 2**64), plus one bin below and one above; fixed size, so memory does not grow with the data.
HIST_BINS_PER_OCTAVE = 16
HIST_LOG2_LOW, HIST_LOG2_HIGH = -64, 64
HISTOGRAM_BINS = (HIST_LOG2_HIGH - HIST_LOG2_LOW) * HIST_BINS_PER_OCTAVE + 2
# Percentile reported as "p999".
PERCENTILE = 99.9
# Graph outputs added to one ONNX Runtime session; larger graphs are split into several sessions.
MAX_OUTPUTS_PER_SESSION = 1024

_FLOAT_TYPES = (1, 10, 11, 16)  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


@dataclass(frozen=True)
class TensorStats:
    """Range statistics of one tensor over all calibration samples.

    Attributes:
        absmax: Largest finite |x|.
        p999: 99.9th percentile of |x| (from the log2 histogram; an upper bound within 4.4 %).
        min_nonzero: Smallest non-zero finite |x| (None when every value was 0).
        mean_abs: Mean finite |x|.
        count: Number of values seen (all batches).
        fp16_overflow_frac: Fraction of values with |x| > 65504 (inf in FP16).
        fp16_underflow_frac: Fraction of non-zero values with |x| < 2**-24 (flushed to 0 in FP16).
        fp16_subnormal_frac: Fraction of non-zero values with |x| < 2**-14 (below FP16's normal range).
        bf16_underflow_frac: Fraction of non-zero values with |x| < 2**-126 (below BF16's normal range).
        nan_count: NaN values seen.
        inf_count: Inf values seen.
        finite: True when no NaN or Inf was seen.
    """

    absmax: float
    p999: float
    min_nonzero: float | None
    mean_abs: float
    count: int
    fp16_overflow_frac: float
    fp16_underflow_frac: float
    fp16_subnormal_frac: float
    bf16_underflow_frac: float
    nan_count: int = 0
    inf_count: int = 0
    finite: bool = True

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready numbers."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorStats:
        """Inverse of :meth:`to_dict` (unknown keys are ignored)."""
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


class _Accumulator:
    """Running statistics of one tensor (fixed memory)."""

    __slots__ = (
        "count",
        "sum_abs",
        "absmax",
        "min_nonzero",
        "over",
        "under",
        "subnormal",
        "bf16_under",
        "nan",
        "inf",
        "zeros",
        "hist",
    )

    def __init__(self) -> None:
        self.count = 0
        self.sum_abs = 0.0
        self.absmax = 0.0
        self.min_nonzero = math.inf
        self.over = self.under = self.subnormal = self.bf16_under = self.nan = self.inf = self.zeros = 0
        self.hist = np.zeros(HISTOGRAM_BINS, dtype=np.int64)

    def update(self, arr: np.ndarray) -> None:
        v = np.abs(np.asarray(arr).astype(np.float32, copy=False).ravel())
        self.count += v.size
        finite = np.isfinite(v)
        if not finite.all():
            bad = v[~finite]
            nans = int(np.count_nonzero(np.isnan(bad)))
            self.nan += nans
            self.inf += bad.size - nans
            self.over += bad.size - nans  # inf counts as out of FP16 range too
            v = v[finite]
        if v.size == 0:
            return
        self.absmax = max(self.absmax, float(v.max()))
        self.sum_abs += float(v.sum(dtype=np.float64))
        self.over += int(np.count_nonzero(v > FP16_MAX))
        nz = v[v > 0]
        self.zeros += v.size - nz.size
        if nz.size == 0:
            return
        self.min_nonzero = min(self.min_nonzero, float(nz.min()))
        small = nz[nz < FP16_MIN_NORMAL]
        if small.size:
            self.subnormal += small.size
            self.under += int(np.count_nonzero(small < FP16_MIN_SUBNORMAL))
            self.bf16_under += int(np.count_nonzero(small < BF16_MIN_NORMAL))
        bins = np.floor((np.log2(nz) - HIST_LOG2_LOW) * HIST_BINS_PER_OCTAVE).astype(np.int64) + 1
        np.clip(bins, 0, HISTOGRAM_BINS - 1, out=bins)
        self.hist += np.bincount(bins, minlength=HISTOGRAM_BINS)

    def percentile(self, q: float) -> float:
        """Upper edge of the histogram bin holding the q-th percentile of |x| (zeros included)."""
        finite_count = self.zeros + int(self.hist.sum())
        if finite_count == 0:
            return 0.0
        rank = q / 100.0 * finite_count
        if rank <= self.zeros:
            return 0.0
        cum = np.cumsum(self.hist) + self.zeros
        b = int(np.searchsorted(cum, rank))
        edge = 2.0 ** (HIST_LOG2_LOW + b / HIST_BINS_PER_OCTAVE)  # upper edge of bin b
        return float(min(edge, self.absmax))

    def result(self) -> TensorStats:
        n = max(self.count, 1)
        finite_count = max(self.count - self.nan - self.inf, 1)
        return TensorStats(
            absmax=self.absmax,
            p999=self.percentile(PERCENTILE),
            min_nonzero=None if math.isinf(self.min_nonzero) else self.min_nonzero,
            mean_abs=self.sum_abs / finite_count,
            count=self.count,
            fp16_overflow_frac=self.over / n,
            fp16_underflow_frac=self.under / n,
            fp16_subnormal_frac=self.subnormal / n,
            bf16_underflow_frac=self.bf16_under / n,
            nan_count=self.nan,
            inf_count=self.inf,
            finite=self.nan == 0 and self.inf == 0,
        )


class StatsCollector:
    """Streams arrays into per-tensor running statistics (the engine of :func:`calibrate`)."""

    def __init__(self) -> None:
        self._acc: dict[str, _Accumulator] = {}

    def update(self, name: str, array: np.ndarray) -> None:
        """Add one batch of values of tensor ``name`` (non-float arrays are ignored)."""
        arr = np.asarray(array)
        if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
            return
        acc = self._acc.get(name)
        if acc is None:
            acc = self._acc[name] = _Accumulator()
        acc.update(arr)

    def nbytes(self) -> int:
        """Memory held by the statistics (constant in the number of batches)."""
        return sum(a.hist.nbytes for a in self._acc.values())

    def histogram_bins(self) -> set[int]:
        """Histogram sizes in use (always ``{HISTOGRAM_BINS}``)."""
        return {a.hist.size for a in self._acc.values()}

    def results(self) -> dict[str, TensorStats]:
        """Name -> final statistics."""
        return {k: a.result() for k, a in self._acc.items()}


@dataclass
class CalibrationStats(Mapping[str, TensorStats]):
    """Tensor name -> :class:`TensorStats`, plus where the data came from.

    Body tensors are named ``<node address>/<attribute>/<tensor>`` (e.g. ``If_3/then_branch/relu_out``).

    Attributes:
        tensors: The statistics.
        source: ``{"source": description, "kind": npz|random|..., "samples": N, "batches": B}``.
    """

    tensors: dict[str, TensorStats]
    source: dict[str, Any] = field(default_factory=dict)

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


def _float_tensors(model: Any) -> tuple[list[str], list[str], dict[str, int]]:
    """Main-graph float tensors of known type, node outputs of unknown type, and the element types."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception as err:  # too large or not inferable: fall back to the declared types  # noqa: BLE001
        logger.debug("shape inference failed (%s); using declared types only", err)
        inferred = model
    g = inferred.graph
    types = {
        vi.name: vi.type.tensor_type.elem_type for vi in list(g.value_info) + list(g.output) + list(g.input)
    }
    inits = {t.name for t in model.graph.initializer}
    known = [
        vi.name for vi in model.graph.input if vi.name not in inits and types.get(vi.name) in _FLOAT_TYPES
    ]
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


def _ort_sessions(model: Any, names: list[str], types: Mapping[str, int]) -> list[tuple[Any, list[str]]]:
    """One ONNX Runtime session per chunk of tensor names, each returning those tensors as its outputs."""
    import onnx
    from onnx import helper

    from mpinfer.modelio import ort_session

    inputs = {vi.name for vi in model.graph.input}
    sessions = []
    for start in range(0, len(names), MAX_OUTPUTS_PER_SESSION):
        chunk = [n for n in names[start : start + MAX_OUTPUTS_PER_SESSION] if n not in inputs]
        if not chunk:
            continue
        m = onnx.ModelProto()
        m.CopyFrom(model)
        del m.graph.output[:]
        m.graph.output.extend(helper.make_tensor_value_info(n, types[n], None) for n in chunk)
        sessions.append((ort_session(m), chunk))
    return sessions


def _batches(feeds: Iterable[Mapping[str, np.ndarray]], progress: bool, total: int | None) -> Iterator[Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("[bold]Calibrating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, disable=not progress, transient=True) as bar:
        task = bar.add_task("calibrate", total=total)
        for batch in feeds:
            yield batch
            bar.advance(task)


def calibrate(
    model: Any, feeds: Iterable[Mapping[str, np.ndarray]], *, progress: bool = True
) -> CalibrationStats:
    """FP32 reference run over ``feeds`` collecting per-tensor statistics, one batch at a time.

    Args:
        model: The FP32 ``onnx.ModelProto`` (not modified).
        feeds: A :class:`mpinfer.data.FeedSource` (or any iterable of ``{input: array}`` batches).
        progress: Show a progress bar.

    Returns:
        The statistics of every float tensor: graph inputs, node outputs, and tensors in subgraph bodies.

    Raises:
        InvalidInputError: No batches, or feeds the model does not accept.
    """
    from mpinfer.modelio import name_nodes

    start = time.perf_counter()
    model = name_nodes(model)
    known, unknown, types = _float_tensors(model)
    try:
        sessions = _ort_sessions(model, known, types) if known else []
    except ModelLoadError as err:
        logger.warning("ONNX Runtime cannot run the model (%s); calibrating with the numpy emulator", err)
        sessions, unknown = [], unknown + known
    has_bodies = any(a.type in (5, 10) for n in model.graph.node for a in n.attribute)  # GRAPH, GRAPHS
    emulator = None
    if has_bodies or unknown:
        from mpinfer.precision.emulate import GraphEmulator

        emulator = GraphEmulator(model)
    collector = StatsCollector()
    observe = _observer(collector, set(unknown))
    input_names = {vi.name for vi in model.graph.input}
    batches = samples = 0
    for batch in _batches(feeds, progress, len(feeds) if isinstance(feeds, Sized) else None):
        for name, arr in batch.items():
            if name in input_names:
                collector.update(name, arr)
        try:
            for sess, names in sessions:
                for name, value in zip(names, sess.run(names, dict(batch)), strict=True):
                    collector.update(name, value)
        except Exception as err:  # onnxruntime raises its own exception types for bad feeds
            raise InvalidInputError(
                format_message(
                    "Calibration feeds",
                    f"a batch ONNX Runtime rejected ({err})",
                    "arrays matching the model's inputs",
                )
            ) from err
        if emulator is not None:
            emulator.run(batch, observe=observe)
        batches += 1
        first = next(iter(batch.values()), None)
        samples += int(first.shape[0]) if first is not None and np.ndim(first) else 1
    if batches == 0:
        raise InvalidInputError(format_message("Calibration feeds", "no batches", "at least one batch"))
    source = {
        "source": getattr(feeds, "description", "in-memory batches"),
        "kind": getattr(feeds, "kind", "arrays"),
        "samples": samples,
        "batches": batches,
    }
    results = collector.results()
    logger.info(
        "calibrated %d tensors over %d batches in %.1fs", len(results), batches, time.perf_counter() - start
    )
    return CalibrationStats(results, source)


def _observer(collector: StatsCollector, main_names: set[str]) -> Any:
    """Emulator observer collecting every body tensor (qualified name) and the listed main-graph tensors."""

    def observe(prefix: str, name: str, value: np.ndarray) -> None:
        if prefix or name in main_names:
            collector.update(prefix + name, value)

    return observe
