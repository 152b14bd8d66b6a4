"""Pass/fail checks on comparison metrics: ``"cosine>=0.9999,top1>=0.999,max_abs<=0.01"``.

A check names a metric of :data:`mpinfer.compare.metrics.METRIC_DOCS`, a comparison operator and a number.
It is evaluated per candidate and per output; where a metric does not apply to an output (``top1`` on a
non-classifier output) the check is not applicable to that output. A check that applies to no output at all
fails with the reason it is not computable (never a silent pass); checks against labels on data without
``_labels`` are refused before the comparison runs.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mpinfer.compare.metrics import METRIC_DOCS
from mpinfer.errors import InvalidInputError, format_message

# Used when no --check is given: a healthy FP16 model keeps cosine above ~0.9999; below 0.999 an output
# has lost real information, and a NaN/Inf where FP32 was finite is always a defect.
DEFAULT_CHECKS = "cosine>=0.999,nonfinite<=0"

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    ">": operator.gt,
    "<": operator.lt,
}
# Metrics measured against the data's ``_labels``: they need labelled data.
LABEL_METRICS = frozenset({"accuracy", "baseline_accuracy", "accuracy_drop"})
_ALIASES = {"snr": "snr_db", "top-1": "top1", "top-5": "top5", "acc": "accuracy", "acc_drop": "accuracy_drop"}
_CHECK_RE = re.compile(
    r"^\s*([A-Za-z0-9_\-]+)\s*(>=|<=|==|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$"
)


@dataclass(frozen=True)
class Check:
    """One threshold: ``metric op value``."""

    metric: str
    op: str
    value: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:.10g}"  # every digit a user writes, e.g. cosine>=0.99999999

    def evaluate(self, metrics: Mapping[str, float | None]) -> bool | None:
        """True/False, or None when the metric is not available for this output. NaN always fails."""
        got = metrics.get(self.metric)
        if got is None:
            return None
        if isinstance(got, float) and math.isnan(got):
            return False
        return bool(_OPS[self.op](float(got), self.value))


def parse_checks(text: str | None) -> tuple[Check, ...]:
    """Parse a comma-separated list of checks (None or empty: :data:`DEFAULT_CHECKS`).

    Raises:
        InvalidInputError: For a malformed check or an unknown metric name (the message lists the valid ones).
    """
    text = DEFAULT_CHECKS if text is None or not text.strip() else text
    checks = []
    for item in text.split(","):
        if not item.strip():
            continue
        m = _CHECK_RE.match(item)
        if not m:
            raise InvalidInputError(
                format_message(
                    f"Check '{item.strip()}'",
                    None,
                    "metric<op>number",
                    "write e.g. cosine>=0.9999,top1>=0.999,max_abs<=0.01",
                )
            )
        name = _ALIASES.get(m.group(1).lower(), m.group(1).lower())
        if name not in METRIC_DOCS:
            raise InvalidInputError(
                format_message(
                    f"Check '{item.strip()}'",
                    f"unknown metric '{m.group(1)}'",
                    "one of " + ", ".join(METRIC_DOCS),
                    "see `mpinfer compare --help` for what each one means",
                )
            )
        checks.append(Check(name, m.group(2), float(m.group(3))))
    if not checks:
        raise InvalidInputError(
            format_message("Checks", repr(text), "at least one check, e.g. cosine>=0.9999")
        )
    return tuple(checks)
