"""The FP32 reference run: bounded-memory capture of tensors, per-tensor statistics, calibration."""

from __future__ import annotations

from mpinfer.precision.calib.calibrate import (
    RANDOM_DATA_WARNING,
    CalibrationStats,
    calibrate,
    check_data_fits,
    non_tensor_inputs,
    type_text,
)
from mpinfer.precision.calib.capture import (
    IN_MEMORY_LIMIT,
    MAX_OUTPUTS_PER_SESSION,
    SPILL_SHARES,
    FeedsRejectedError,
    pack_chunks,
)
from mpinfer.precision.calib.share import STAT_MIN_SAMPLES, STAT_MIN_VALUES, StatShare
from mpinfer.precision.calib.statistics import (
    CHUNK,
    HIST_MANTISSA_BITS,
    HISTOGRAM_BINS,
    MAX_WORKERS,
    PARALLEL_MIN_VALUES,
    PERCENTILE,
    StatsCollector,
    TensorStats,
    stats_workers,
    sum_of_magnitudes,
)

__all__ = [
    "CHUNK",
    "CalibrationStats",
    "FeedsRejectedError",
    "HISTOGRAM_BINS",
    "HIST_MANTISSA_BITS",
    "IN_MEMORY_LIMIT",
    "MAX_OUTPUTS_PER_SESSION",
    "MAX_WORKERS",
    "PARALLEL_MIN_VALUES",
    "PERCENTILE",
    "RANDOM_DATA_WARNING",
    "SPILL_SHARES",
    "STAT_MIN_SAMPLES",
    "STAT_MIN_VALUES",
    "StatShare",
    "StatsCollector",
    "TensorStats",
    "calibrate",
    "check_data_fits",
    "non_tensor_inputs",
    "pack_chunks",
    "stats_workers",
    "sum_of_magnitudes",
    "type_text",
]
