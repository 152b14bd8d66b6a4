"""Compare candidates against an FP32 baseline: metrics, checks, per-layer divergence, latency, hints.

The metrics are :mod:`mpinfer.metrics`'s and the checks :mod:`mpinfer.checks`'s (shared with convert's budget).
"""

from mpinfer.api import make_callable
from mpinfer.compare.comparator import compare_models
from mpinfer.compare.config import CompareConfig
from mpinfer.compare.result import SCHEMA_VERSION, CandidateResult, ComparisonResult

__all__ = [
    "SCHEMA_VERSION",
    "CandidateResult",
    "CompareConfig",
    "ComparisonResult",
    "compare_models",
]

# `mpinfer.compare(...)` is the API function (mpinfer.api.compare); the package stays importable as it is.
make_callable(__name__)
