"""Compare candidates against an FP32 baseline: metrics, checks, per-layer divergence, latency, hints."""

from mpinfer.compare.checks import DEFAULT_CHECKS, Check, parse_checks
from mpinfer.compare.comparator import CompareConfig, compare_models
from mpinfer.compare.metrics import METRIC_DOCS
from mpinfer.compare.result import SCHEMA_VERSION, CandidateResult, ComparisonResult

__all__ = [
    "DEFAULT_CHECKS",
    "METRIC_DOCS",
    "SCHEMA_VERSION",
    "CandidateResult",
    "Check",
    "CompareConfig",
    "ComparisonResult",
    "compare_models",
    "parse_checks",
]
