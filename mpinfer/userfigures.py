"""The figures of the user's own metrics (``--metric``), accumulated batch by batch for the metrics core.

:class:`mpinfer.metrics.ModelAccumulator` holds one :class:`UserMetricAccumulator` per metric beside its outputs'
accumulators; the metric itself (loading the user's file, calling it, checking what it returns) is
:class:`mpinfer.usermetric.UserMetric`'s business.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np


class UserMetricAccumulator:
    """The figures of one user metric (:class:`mpinfer.usermetric.UserMetric`), accumulated batch by batch.

    ``NAME``: the mean over samples (a float a batch returns counts once per sample of the batch); ``NAME_min``
    and ``NAME_max``: the worst sample either way, when every batch returned one value per sample.
    """

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self.total = 0.0
        self.samples = 0
        self.low, self.high = math.inf, -math.inf
        self.per_sample = True
        self.batches = 0

    def update(
        self, baseline: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray], inputs: Mapping[str, Any]
    ) -> None:
        """Add one batch: the user's function called on it (``inputs`` with ``_labels`` where the data has them)."""
        rows = batch_samples(inputs if any(k != "_labels" for k in inputs) else baseline)  # (a model without inputs)
        value = self.metric.evaluate(baseline, candidate, inputs, rows, self.batches)
        self.batches += 1
        if isinstance(value, np.ndarray):
            self.total += float(value.sum())
            self.samples += len(value)
            if len(value):
                self.low, self.high = min(self.low, float(value.min())), max(self.high, float(value.max()))
        else:
            self.total += float(value) * rows
            self.samples += rows
            self.per_sample = False

    def finalize(self) -> dict[str, float | None]:
        """``NAME``, ``NAME_min`` and ``NAME_max`` (None where not measured: no samples, or a float per batch)."""
        name, have = self.metric.name, self.samples > 0
        extremes = have and self.per_sample
        return {
            name: self.total / self.samples if have else None,
            f"{name}_min": self.low if extremes else None,
            f"{name}_max": self.high if extremes else None,
        }

    def optimistic(self, total_samples: int, targets: Mapping[str, float]) -> dict[str, float | None]:
        """The values closest to ``targets`` the figures can still reach over ``total_samples`` samples.

        The unseen samples can hold any value: the mean can reach anything, the min anything below the seen
        samples' min, the max anything above their max. A figure without a target keeps the seen value.
        """
        values = self.finalize()
        if total_samples <= self.samples:
            return values
        name = self.metric.name
        reach = {
            name: (-math.inf, math.inf), f"{name}_min": (-math.inf, self.low), f"{name}_max": (self.high, math.inf)
        }
        out: dict[str, float | None] = {}
        for fig, value in values.items():
            lo, hi = reach[fig]
            target = targets.get(fig)
            out[fig] = value if target is None or (value is None and fig != name) else min(max(target, lo), hi)
        return out


def batch_samples(batch: Mapping[str, Any]) -> int:
    """Samples in a batch: axis 0 of its first input that is not ``_labels`` (a scalar input: one)."""
    first = next((v for k, v in batch.items() if k != "_labels"), None)
    return 0 if first is None else (len(first) if np.ndim(first) else 1)
