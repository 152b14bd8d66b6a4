"""The running error sums of one tensor, shared by the divergence (main graph) and the body coverage (subgraphs)."""

from __future__ import annotations

import math

import numpy as np

from mpinfer.precision.core import sum_of_squares

# Ops whose outputs carry no numeric error worth ranking (shape plumbing, constants).
SKIP_OPS = {"Constant", "Shape", "Size", "ConstantOfShape", "NonZero"}


class TensorAcc:
    """Running sums of one tensor's error over batches (and Loop iterations)."""

    __slots__ = ("sum_d2", "sum_b2", "max_abs", "nonfinite", "dtype")

    def __init__(self) -> None:
        self.sum_d2 = self.sum_b2 = self.max_abs = 0.0
        self.nonfinite = 0
        self.dtype = ""

    def update(self, b: np.ndarray, c: np.ndarray) -> None:
        """Add one baseline/candidate pair of the tensor."""
        self.dtype = str(c.dtype)
        if np.shape(b) != np.shape(c):
            self.nonfinite += 1  # a shape change is as wrong as NaN; counted, never compared
            return
        if self._update_finite(b, c):
            return
        b64, c64 = np.asarray(b, np.float64), np.asarray(c, np.float64)
        fb, fc = np.isfinite(b64), np.isfinite(c64)
        self.nonfinite += int(np.count_nonzero(fb & ~fc))
        both = fb & fc
        d = c64[both] - b64[both]
        self.sum_d2 += float(np.dot(d, d))
        self.sum_b2 += float(np.dot(b64[both], b64[both]))
        if d.size:
            self.max_abs = max(self.max_abs, float(np.abs(d).max()))

    def _update_finite(self, b: np.ndarray, c: np.ndarray) -> bool:
        """:meth:`update` in float32 passes when every value of both is finite (False: nothing added).

        The FP16/BF16 candidate is exact in float32, the difference is taken once, and the sums of squares are
        float32 dot products (float64 when they overflow): a few passes instead of float64 copies and masks.
        """
        b32 = np.asarray(b, np.float32).reshape(-1)
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.asarray(c, np.float32).reshape(-1) - b32
            top = float(np.max(np.abs(d), initial=0.0))
            sum_b2 = sum_of_squares(b32)
        if not (math.isfinite(top) and math.isfinite(sum_b2)):  # inf or NaN on either side: the masked path
            return False
        self.sum_d2 += sum_of_squares(d)
        self.sum_b2 += sum_b2
        self.max_abs = max(self.max_abs, top)
        return True

    def mismatch(self, dtype: str) -> None:
        """Count a value present on one side only (another If branch or Loop trip count) as wrong."""
        self.dtype = self.dtype or dtype
        self.nonfinite += 1

    @property
    def error(self) -> float:
        """Relative L2 error over everything added; inf once a value was non-finite or mismatched."""
        if self.nonfinite:
            return math.inf
        if self.sum_d2 == 0:
            return 0.0
        return math.sqrt(self.sum_d2 / max(self.sum_b2, 1e-30))
