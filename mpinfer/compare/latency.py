"""Latency: warm-up, then a fixed number of runs or a time budget, per runner and batch size.

The baseline and every candidate are measured in the same process, one after the other for each batch
size, so their ratios compare like with like. Times are wall-clock around ``Runner.infer`` without input
validation (host-side copies included, as a user's call would see them). Throughput (samples/s) and the
speedup over the baseline both come from the mean latency: the speedup is the ratio of throughputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mpinfer.backends.base import Runner
from mpinfer.compare.result import LatencyStats
from mpinfer.data.feeds import take_samples
from mpinfer.progress import progress_bar

logger = logging.getLogger(__name__)


def batch_of_size(
    sample: Mapping[str, np.ndarray], batch_size: int, axes: Mapping[str, int | None] | None = None
) -> dict[str, np.ndarray]:
    """Tile or slice a data batch to ``batch_size`` samples along each input's sample axis.

    ``axes``: input -> sample axis, None for an input fed whole (:func:`mpinfer.data.feeds.sample_axes`);
    default: axis 0, scalars whole.
    """
    out = {}
    for name, arr in sample.items():
        axis = axes.get(name, 0) if axes is not None else 0
        if arr.ndim == 0 or axis is None:  # no sample axis: the same value for any batch
            out[name] = arr
            continue
        reps = -(-batch_size // max(arr.shape[axis], 1))
        tiled = np.concatenate([arr] * reps, axis=axis) if reps > 1 else arr
        out[name] = take_samples(tiled, axis, 0, batch_size)
    return out


def time_runner(
    runner: Runner,
    feeds: Mapping[str, np.ndarray],
    *,
    warmup: int,
    iterations: int,
    time_budget_s: float | None = None,
    progress: Any = None,
    task: Any = None,
) -> list[float]:
    """Return per-run latencies in seconds.

    Args:
        runner: An active runner.
        feeds: One batch.
        warmup: Untimed runs first.
        iterations: Timed runs (the cap when a time budget is given).
        time_budget_s: Stop after this many seconds of timed runs (at least one run).
        progress: A ``rich.progress.Progress`` to advance, or None.
        task: Its task id.
    """
    for _ in range(warmup):
        runner.infer(feeds, check_inputs=False)
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(iterations):
        t0 = time.perf_counter()
        runner.infer(feeds, check_inputs=False)
        times.append(time.perf_counter() - t0)
        if progress is not None:
            progress.advance(task)
        if time_budget_s is not None and time.perf_counter() - start >= time_budget_s:
            break
    return times


def summarize(runner_name: str, batch_size: int, times: Sequence[float]) -> LatencyStats:
    """Percentiles (ms) and throughput (samples/s) of a list of latencies."""
    ms = np.asarray(times, dtype=np.float64) * 1e3
    mean = float(ms.mean())
    return LatencyStats(
        runner=runner_name,
        batch_size=batch_size,
        iterations=int(ms.size),
        mean_ms=mean,
        p50_ms=float(np.percentile(ms, 50)),
        p90_ms=float(np.percentile(ms, 90)),
        p99_ms=float(np.percentile(ms, 99)),
        min_ms=float(ms.min()),
        throughput=batch_size / (mean / 1e3) if mean > 0 else float("inf"),
    )


def measure_latency(
    runners: Mapping[str, Runner],
    sample: Mapping[str, np.ndarray],
    batch_sizes: Sequence[int],
    *,
    warmup: int,
    iterations: int,
    time_budget_s: float | None,
    show_progress: bool,
    axes: Mapping[str, int | None] | None = None,
) -> list[LatencyStats]:
    """Measure every (active) runner at every batch size; the first runner is the baseline for speedups.

    ``axes``: each input's sample axis, for resizing ``sample`` (see :func:`batch_of_size`).

    Returns:
        One LatencyStats per runner and batch size; ``speedup`` = baseline mean / runner mean (as throughput).
    """
    stats: list[LatencyStats] = []
    t0 = time.perf_counter()
    with progress_bar("latency", enabled=show_progress) as progress:
        for bs in batch_sizes:
            feeds = batch_of_size(sample, bs, axes)
            base_mean = None
            for name, runner in runners.items():
                task = progress.add_task(f"{name} @ batch {bs}", total=iterations)
                st = summarize(
                    name,
                    bs,
                    time_runner(
                        runner,
                        feeds,
                        warmup=warmup,
                        iterations=iterations,
                        time_budget_s=time_budget_s,
                        progress=progress,
                        task=task,
                    ),
                )
                progress.remove_task(task)
                if base_mean is None:
                    base_mean = st.mean_ms
                st.speedup = base_mean / st.mean_ms if st.mean_ms > 0 else None
                stats.append(st)
    logger.info("latency measured in %.1f s", time.perf_counter() - t0)
    return stats
