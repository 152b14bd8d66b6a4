"""Per-tensor running statistics with fixed memory: the numbers calibration reports for each tensor.

Each tensor keeps a few running scalars (absmax, smallest non-zero magnitude, sum of magnitudes, counts
above/below the FP16 and BF16 limits, NaN/Inf counts) and one fixed-size histogram of magnitudes from which
the 99.9th percentile is read, so memory never grows with the number of batches.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Container, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mpinfer.memory import usable_cpus
from mpinfer.precision.core import (
    BF16_MIN_NORMAL,
    FP16_MAX,
    FP16_MIN_NORMAL,
    FP16_MIN_SUBNORMAL,
    sum_of_squares,
)

# Histogram of |x| indexed by the top 12 bits of its float32 pattern (8 exponent bits + 4 mantissa bits):
# 16 bins per octave over the whole float32 range (a percentile read from it is an upper bound within
# 6.25 %), computed with one integer shift, and of fixed size, so memory never grows with the data.
HIST_MANTISSA_BITS = 4
HISTOGRAM_BINS = 1 << (8 + HIST_MANTISSA_BITS)
_SHIFT = 23 - HIST_MANTISSA_BITS


_INF_BIN = 0xFF << HIST_MANTISSA_BITS  # exponent all ones: inf (mantissa 0) and NaN
# Values per chunk in :meth:`_Accumulator.update` (1 MiB of float32: the working set stays in cache).
CHUNK = 1 << 18
_MAGNITUDE = np.uint32(0x7FFFFFFF)
_ONE = np.uint32(1)
_NO_NONZERO = 0xFFFFFFFF  # "no non-zero value seen" in the wrapped (bits - 1) minimum


def sum_of_magnitudes(v: np.ndarray) -> float:
    """Sum of non-negative finite float32 values, in float64 only when the float32 sum overflows.

    numpy's pairwise float32 sum has a relative error of about 1e-7 log2(n) and is several times faster than
    accumulating in float64.
    """
    with np.errstate(over="ignore"):
        total = float(v.sum())
    return total if math.isfinite(total) else float(v.sum(dtype=np.float64))


def _bin_of(value: float) -> int:
    """Histogram bin of a positive float32 value (bins below it hold only smaller magnitudes)."""
    return int(np.asarray(value, np.float32).view(np.uint32)) >> _SHIFT


def _bin_lower_edge(b: int) -> float:
    """Smallest magnitude in histogram bin ``b``."""
    return float(np.asarray(b << _SHIFT, np.uint32).view(np.float32))


@functools.cache
def _bin_upper_edges() -> np.ndarray:
    """Upper magnitude edge of every finite histogram bin (float64; one array, read only)."""
    starts = (np.arange(1, _INF_BIN + 1, dtype=np.uint64) << _SHIFT).astype(np.uint32)
    edges = starts.view(np.float32).astype(np.float64)
    edges.flags.writeable = False
    return edges


def _blocks(rows: np.ndarray, blocks: int, block: int) -> np.ndarray:
    """``blocks`` evenly spaced runs of ``block`` columns of each row of ``rows``, row after row, flat.

    Copies slices, never a fancy index: gathering 2**20 values through an index array cost 7 ms a tensor (orientation:
    most of its calibration's statistics), slices a tenth of that.
    """
    width = rows.shape[1]
    starts = np.linspace(0, width - block, blocks).astype(np.int64)
    out = np.empty((rows.shape[0], blocks * block), rows.dtype)
    for k, start in enumerate(starts.tolist()):
        out[:, k * block : (k + 1) * block] = rows[:, start : start + block]
    return out.reshape(-1)


# The bin holding FP16_MAX: every bin above it (below _INF_BIN) holds only values that overflow FP16.
_FP16_MAX_BIN = _bin_of(FP16_MAX)
_FP16_MAX_BITS = np.asarray(FP16_MAX, np.float32).view(np.uint32)

# StatsCollector.update_many: the values of one tensor's batch its full statistics read at most (2**20: 64 blocks
# of 16,384 spread over the batch, SHARE_BLOCKS // rows of them at the same offsets in each sample, so that a batch
# fetched in slices reads the same values; with the share's two or more batches, well above the 131,072 values
# STAT_MIN_VALUES asks for); a bigger batch's absmax still reads all of it.
STAT_BATCH_VALUES = 1 << 20
SHARE_BLOCKS = 64

# StatsCollector.update_many: at most this many threads, and one thread below this many values in all.
MAX_WORKERS = 8
PARALLEL_MIN_VALUES = 1 << 20

# Percentile reported as "p999".
PERCENTILE = 99.9


@dataclass(frozen=True)
class TensorStats:
    """Range statistics of one tensor over the calibration samples.

    ``absmax`` is of every sample calibration's first pass read; the other figures of the tensor's share of the
    data (:mod:`mpinfer.precision.calib.share`), plus any later batch where it overflowed FP16 or held NaN/Inf.

    Attributes:
        absmax: Largest finite |x|.
        p999: 99.9th percentile of |x| (from the histogram: an upper bound within 6.25 %).
        min_nonzero: Smallest non-zero finite |x| (None when every value was 0).
        mean_abs: Mean finite |x|.
        count: Number of values the full statistics read (the share's batches).
        fp16_overflow_frac: Fraction of values with |x| > 65504 (inf in FP16).
        fp16_underflow_frac: Fraction of non-zero values with |x| < 2**-24 (flushed to 0 in FP16).
        fp16_subnormal_frac: Fraction of non-zero values with |x| < 2**-14 (below FP16's normal range).
        bf16_underflow_frac: Fraction of non-zero values with |x| < 2**-126 (below BF16's normal range).
        fp16_underflow_energy: Share of the tensor's sum of squares carried by the values that flush to 0 in
            FP16 (an upper bound from the histogram). Flushing them changes the tensor by about the square root
            of this, relative: dead channels at 1e-15 flush harmlessly; a tensor living at 1e-9 does not.
            None when unknown (statistics from an older mpinfer).
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
    fp16_underflow_energy: float | None = None
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
    """Running statistics of one tensor (fixed memory: a few scalars and one histogram)."""

    __slots__ = ("count", "sum_abs", "sum_sq", "absmax", "min_nonzero", "over", "nan", "zeros", "hist")

    def __init__(self) -> None:
        self.count = 0
        self.sum_abs = 0.0
        self.sum_sq = 0.0
        self.absmax = 0.0
        self.min_nonzero = math.inf
        self.over = self.nan = self.zeros = 0
        self.hist = np.zeros(HISTOGRAM_BINS, dtype=np.int64)

    def update(self, arr: np.ndarray) -> None:
        # Each pass over the values counts (calibration reads every tensor of every batch). Magnitudes are
        # float32 bit patterns with the sign bit cleared: for non-negative floats the integer order is the
        # value order, so the histogram bin is one shift, the largest magnitude an integer max and the
        # smallest non-zero one an integer min (zeros wrap to the top when 1 is subtracted). The values are
        # read in chunks that stay in cache, with reused buffers (no fresh pages per tensor).
        flat = np.asarray(arr).astype(np.float32, copy=False).reshape(-1)
        if flat.size == 0:
            return
        bits = flat.view(np.uint32)
        size = min(CHUNK, bits.size)
        mag_buf, bin_buf = np.empty(size, np.uint32), np.empty(size, np.intp)
        hist = np.zeros(HISTOGRAM_BINS, np.int64)
        top, smallest, sum_abs, sum_sq = 0, _NO_NONZERO, 0.0, 0.0
        for start in range(0, bits.size, CHUNK):
            n = min(CHUNK, bits.size - start)
            mag = np.bitwise_and(bits[start : start + n], _MAGNITUDE, out=mag_buf[:n])
            bins = np.right_shift(mag, _SHIFT, out=bin_buf[:n], casting="unsafe")
            counts = np.bincount(bins, minlength=HISTOGRAM_BINS)
            hist += counts
            v = mag.view(np.float32)
            top = max(top, int(mag.max()))
            sum_abs += sum_of_magnitudes(v)
            sum_sq += sum_of_squares(v)
            if counts[0]:  # zeros (or the tiniest subnormals): the minimum of (bits - 1) skips the zeros
                smallest = min(smallest, int(np.subtract(mag, _ONE, out=mag).min()))
            else:  # no zero in the chunk: its smallest magnitude is non-zero (one pass, not two)
                smallest = min(smallest, int(mag.min()) - 1)
        if hist[_INF_BIN:].any():  # inf or NaN present: the sums and the maximum need the finite values only
            self._update_nonfinite(flat)
            return
        self.count += flat.size
        smallest = 0 if smallest == _NO_NONZERO else smallest + 1  # smallest non-zero magnitude bits (0: none)
        zeros = int(hist[0])  # bin 0 holds 0 and the tiniest subnormals: resolve it only when both occur
        if zeros and smallest < (1 << _SHIFT):
            zeros = int(np.count_nonzero((bits & _MAGNITUDE) == 0))
        hist[0] -= zeros
        self.zeros += zeros
        self.hist += hist
        self.absmax = max(self.absmax, float(np.uint32(top).view(np.float32)))
        self.sum_abs += sum_abs
        self.sum_sq += sum_sq
        if hist[_FP16_MAX_BIN]:  # the bin holding 65504 straddles the limit: count exactly
            self.over += int(np.count_nonzero((bits & _MAGNITUDE) > _FP16_MAX_BITS))
        else:
            self.over += int(hist[_FP16_MAX_BIN + 1 : _INF_BIN].sum())
        if smallest:
            self.min_nonzero = min(self.min_nonzero, float(np.uint32(smallest).view(np.float32)))

    def update_share(self, arr: np.ndarray, max_values: int, rows: tuple[int, int] | None = None) -> None:
        """:meth:`update` with at most ``max_values`` of the batch's values (its absmax: of all of them).

        A bigger batch gives evenly spaced contiguous blocks of its values to the histogram and the sums, and a max
        and a min of all its values to ``absmax``; one that overflows FP16 or holds NaN/Inf is read whole (exact
        counts). With ``rows`` (the samples of this call, of the whole batch), the blocks are taken per sample: each
        sample gives ``SHARE_BLOCKS // batch rows`` blocks at the same offsets, so a batch read whole or in slices
        of samples (the calibration_call slice of a memory budget that follows the free memory) gives the same
        values. Without it, or when the values do not split evenly into the call's samples, :data:`SHARE_BLOCKS`
        blocks spread over the flattened values.
        """
        a = np.asarray(arr)
        call, batch = rows if rows else (1, 1)
        if call < 1 or batch < call or a.size % call:  # (samples not along the values: the call as one sample)
            call, batch = 1, 1
        per_sample = max_values // batch  # the values of each sample the batch's full statistics read at most
        if a.size <= per_sample * call:
            self.update(a)
            return
        got = self._top(a)
        if got is None:
            return
        flat, top = got
        width = flat.size // call
        blocks = max(1, SHARE_BLOCKS // batch)
        block = max(1, min(width, per_sample) // blocks)
        self.update(_blocks(flat.reshape(call, width), blocks, block))
        self.absmax = max(self.absmax, top)

    def update_absmax(self, arr: np.ndarray) -> None:
        """A batch beyond the tensor's share: its largest magnitude only (a max and a min: no histogram).

        A batch whose values overflow FP16 or hold NaN/Inf goes into the full statistics instead (:meth:`update`),
        so that its overflow and non-finite counts are counted.
        """
        if np.size(arr) == 0:
            return
        got = self._top(arr)
        if got is not None:
            self.absmax = max(self.absmax, got[1])

    def _top(self, arr: np.ndarray) -> tuple[np.ndarray, float] | None:
        """The batch's values as flat float32 and their largest magnitude (a max and a min of all of them).

        None when they overflow FP16 or hold NaN/Inf: the batch then went whole into :meth:`update` (exact counts).
        """
        a = np.asarray(arr)
        if a.dtype.kind != "f" or a.dtype.itemsize > 4:  # (bfloat16, float64: as float32, like update)
            a = a.astype(np.float32)
        flat = a.reshape(-1)
        top = max(float(flat.max()), -float(flat.min()))
        if not math.isfinite(top) or top > FP16_MAX:
            self.update(flat)
            return None
        return flat, top

    def _update_nonfinite(self, flat: np.ndarray) -> None:
        """:meth:`update` for a tensor holding inf or NaN (rare): whole-array passes over its finite values."""
        v = np.abs(flat)
        if v.size == 0:
            return
        self.count += v.size
        bins = v.view(np.uint32) >> _SHIFT
        hist = np.bincount(bins, minlength=HISTOGRAM_BINS)
        zeros = int(np.count_nonzero(v == 0)) if hist[0] else 0  # bin 0 holds 0 and the tiniest subnormals
        hist[0] -= zeros
        self.zeros += zeros
        if hist[_INF_BIN:].any():  # inf or NaN present: keep them out of the magnitude statistics
            nans = int(np.count_nonzero(np.isnan(v)))
            self.nan += nans
            self.over += int(hist[_INF_BIN:].sum()) - nans  # inf counts as out of FP16 range
            hist[_INF_BIN:] = 0
            hist[_INF_BIN] = int(np.count_nonzero(np.isinf(v)))
            v = v[np.isfinite(v)]
            if v.size == 0:
                self.hist += hist
                return
            bins = v.view(np.uint32) >> _SHIFT
        self.hist += hist
        self.absmax = max(self.absmax, float(v.max()))
        self.sum_abs += float(v.sum(dtype=np.float64))
        self.sum_sq += sum_of_squares(v)
        self.over += int(hist[_FP16_MAX_BIN + 1 : _INF_BIN].sum())
        if hist[_FP16_MAX_BIN]:  # the bin holding 65504 straddles the limit
            self.over += int(np.count_nonzero(v[bins == _FP16_MAX_BIN] > FP16_MAX))
        nonzero_bins = np.flatnonzero(hist[:_INF_BIN])
        if nonzero_bins.size:  # the smallest non-zero value lies in the lowest occupied bin
            low = int(nonzero_bins[0])
            if _bin_lower_edge(low) < self.min_nonzero:  # else it cannot lower the running minimum
                candidates = v[bins == low]
                candidates = candidates[candidates > 0]
                if candidates.size:
                    self.min_nonzero = min(self.min_nonzero, float(candidates.min()))

    def below(self, limit: float) -> int:
        """Number of finite non-zero values with magnitude below ``limit`` (a power of two)."""
        return int(self.hist[: _bin_of(limit)].sum())

    def energy_below(self, limit: float) -> float:
        """Share of the sum of squares held by finite values below ``limit`` (upper bound: bin top edges)."""
        if self.sum_sq <= 0.0:
            return 0.0
        top = _bin_of(limit)
        below = float(np.dot(self.hist[:top].astype(np.float64), _bin_upper_edges()[:top] ** 2))
        return min(1.0, below / self.sum_sq)

    @property
    def inf(self) -> int:
        return int(self.hist[_INF_BIN])

    def percentile(self, q: float) -> float:
        """Upper edge of the histogram bin holding the q-th percentile of finite |x| (zeros included)."""
        finite_hist = self.hist[:_INF_BIN]
        total = self.zeros + int(finite_hist.sum())
        if total == 0:
            return 0.0
        rank = q / 100.0 * total
        if rank <= self.zeros:
            return 0.0
        b = int(np.searchsorted(np.cumsum(finite_hist) + self.zeros, rank))
        edge = float(np.asarray((b + 1) << _SHIFT, np.uint32).view(np.float32))  # next bin's lower edge
        return min(edge, self.absmax)

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
            fp16_underflow_frac=self.below(FP16_MIN_SUBNORMAL) / n,
            fp16_subnormal_frac=self.below(FP16_MIN_NORMAL) / n,
            bf16_underflow_frac=self.below(BF16_MIN_NORMAL) / n,
            fp16_underflow_energy=self.energy_below(FP16_MIN_SUBNORMAL),
            nan_count=self.nan,
            inf_count=self.inf,
            finite=self.nan == 0 and self.inf == 0,
        )


_Job = tuple[_Accumulator, np.ndarray, bool]  # (its accumulator, the values, full statistics or absmax only)
# An absmax-only job (:meth:`_Accumulator.update_absmax`) costs about this share of a full one per value.
_ABSMAX_WEIGHT = 6


def _update_all(jobs: list[_Job], rows: tuple[int, int] | None = None) -> None:
    for acc, arr, full in jobs:
        if full:
            acc.update_share(arr, STAT_BATCH_VALUES, rows)
        else:
            acc.update_absmax(arr)


def _cost(job: _Job) -> int:
    size = job[1].size
    return min(size, STAT_BATCH_VALUES) + size // _ABSMAX_WEIGHT if job[2] else size // _ABSMAX_WEIGHT


def _shares(jobs: list[_Job], workers: int, costs: list[int] | None = None) -> list[list[_Job]]:
    """``jobs`` dealt into at most ``workers`` lists of about equal cost, largest first.

    One task per thread: a task per tensor cost more in the pool's locks than the statistics of a small tensor.
    ``costs``: each job's :func:`_cost`, when the caller has them.
    """
    if costs is None:
        costs = [_cost(job) for job in jobs]
    shares: list[list[_Job]] = [[] for _ in range(workers)]
    sizes = [0] * workers
    for i in sorted(range(len(jobs)), key=lambda i: -costs[i]):  # (stable: equal costs keep their order)
        least = sizes.index(min(sizes))
        shares[least].append(jobs[i])
        sizes[least] += costs[i]
    return [share for share in shares if share]


def stats_workers() -> int:
    """Threads for :meth:`StatsCollector.update_many`: the CPUs this process may use, at most 8."""
    return min(usable_cpus(), MAX_WORKERS)


class StatsCollector:
    """Streams arrays into per-tensor running statistics (the engine of :func:`calibrate`).

    Args:
        workers: Threads for :meth:`update_many` (None: :func:`stats_workers`). The statistics are the
            same with any number: each tensor's values are read by one thread, in order.
    """

    def __init__(self, workers: int | None = None) -> None:
        self._acc: dict[str, _Accumulator] = {}
        self.workers = stats_workers() if workers is None else max(1, int(workers))
        self._pool: ThreadPoolExecutor | None = None

    def _accumulator(self, name: str, array: np.ndarray) -> tuple[_Accumulator, np.ndarray] | None:
        arr = np.asarray(array)
        if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
            return None
        acc = self._acc.get(name)
        if acc is None:
            acc = self._acc[name] = _Accumulator()
        return acc, arr

    def update(self, name: str, array: np.ndarray) -> None:
        """Add one batch of values of tensor ``name`` (non-float arrays are ignored)."""
        found = self._accumulator(name, array)
        if found is not None:
            found[0].update(found[1])

    def update_many(
        self,
        items: Iterable[tuple[str, np.ndarray]],
        full: Container[str] | None = None,
        rows: tuple[int, int] | None = None,
    ) -> None:
        """:meth:`update` for many tensors, spread over ``workers`` threads when there is enough to share.

        numpy's passes over the values release the GIL, so the threads run on separate cores (calibration
        of a CNN or a transformer spends as long here as in the model run itself). A name given twice is
        read in order on one thread, like everything when there is little to share.

        Args:
            items: (tensor name, values) pairs.
            full: The names whose values go into the full statistics (None: all; at most ``STAT_BATCH_VALUES`` of
                each, :meth:`_Accumulator.update_share`); the others' values update their largest magnitude only
                (:meth:`_Accumulator.update_absmax`: batches beyond the tensor's share).
            rows: The samples of this call and of the whole batch it is a slice of (the full statistics then read
                the same values of a batch whether it is fetched whole or in slices); None: one sample.
        """
        jobs = [(*found, full is None or name in full) for name, array in items
                if (found := self._accumulator(name, array)) is not None]
        repeated = len({id(job[0]) for job in jobs}) < len(jobs)
        costs = [_cost(job) for job in jobs]
        if self.workers == 1 or repeated or sum(costs) < PARALLEL_MIN_VALUES:
            _update_all(jobs, rows)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="mpinfer-stats")
        for future in [self._pool.submit(_update_all, share, rows) for share in _shares(jobs, self.workers, costs)]:
            future.result()  # re-raises a worker's exception here

    def update_absmax(self, name: str, array: np.ndarray) -> None:
        """Add one batch of tensor ``name`` beyond its share: its largest magnitude only (FP16 overflow: all)."""
        found = self._accumulator(name, array)
        if found is not None:
            found[0].update_absmax(found[1])

    def observer(self, main_names: set[str]) -> Callable[[str, str, Any], None]:
        """An emulator observer collecting every body tensor (qualified name) and the listed main-graph tensors."""

        def observe(prefix: str, name: str, value: Any) -> None:
            if isinstance(value, np.ndarray) and (prefix or name in main_names):  # (sequences, optionals: never)
                self.update(prefix + name, value)

        return observe

    def close(self) -> None:
        """Stop the worker threads (the statistics stay readable)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def nbytes(self) -> int:
        """Memory held by the statistics (constant in the number of batches)."""
        return sum(a.hist.nbytes for a in self._acc.values())

    def histogram_bins(self) -> set[int]:
        """Histogram sizes in use (always ``{HISTOGRAM_BINS}``)."""
        return {a.hist.size for a in self._acc.values()}

    def results(self) -> dict[str, TensorStats]:
        """Name -> final statistics."""
        return {k: a.result() for k, a in self._acc.items()}
