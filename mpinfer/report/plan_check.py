""""Plan said / measured": the figures ``mpinfer convert`` verified beside what ``compare`` measured.

A plan written with a budget records its final verification (``summary.verification``: per-output figures,
samples, numerics and a fingerprint of the data). ``compare`` on the same data and numerics computes the same
figures with the same code, so they agree to float rounding; a figure that does not is flagged ``MISMATCH``
(the model, the data or the numerics are not what the plan was verified with).
"""

from __future__ import annotations

import math
from typing import Any

from mpinfer.checks import parse_checks
from mpinfer.compare.result import CandidateResult, ComparisonResult
from mpinfer.report.tables import fmt

# Two figures of the same outputs agree when within this relative distance: both sides sum float32 outputs in
# float64; they differ only where ONNX Runtime or the emulator reorders a float32 reduction (thread count), by a
# few float32 ulps (eps 1.2e-7) of the largest outputs, far below 1e-3 of any figure a real change moves.
PLAN_MATCH_RTOL = 1e-3
# ... and an absolute floor for figures near zero (an error of ~0): a few float32 ulps of O(1) outputs.
PLAN_MATCH_ATOL = 1e-6
HEADERS = ["output", "metric", "plan said", "measured", ""]


def _number(v: Any) -> float | None:
    try:
        return None if v is None else float(v)  # the plan writes inf/nan as strings
    except (TypeError, ValueError):
        return None


def _agree(said: float | None, got: float | None) -> bool:
    if said is None or got is None:
        return said is got
    if math.isnan(said) or math.isnan(got):
        return math.isnan(said) and math.isnan(got)
    return said == got or math.isclose(said, got, rel_tol=PLAN_MATCH_RTOL, abs_tol=PLAN_MATCH_ATOL)


def plan_check(result: ComparisonResult, cand: CandidateResult) -> tuple[list[str], list[list[str]]]:
    """Notes and rows (output, metric, plan said, measured, match/MISMATCH) of a candidate with a verified plan.

    Returns ``([], [])`` when the candidate has no plan with a verification beside it.
    """
    ver = (cand.precision or {}).get("verification")
    if not isinstance(ver, dict) or not ver.get("figures"):
        return [], []
    notes = [
        f"Plan verified on {ver.get('samples')} samples ({ver.get('numerics')} numerics, data "
        f"{str(ver.get('fingerprint', ''))[:19]}...); this comparison: {result.data.get('samples')} samples "
        f"({cand.runner.get('numerics')}, data {str(result.data.get('fingerprint', ''))[:19]}...)."
    ]
    same = ver.get("fingerprint") == result.data.get("fingerprint") and str(cand.runner.get("numerics", "")).startswith(
        str(ver.get("numerics"))
    )
    if not same:
        notes.append("Not the data or numerics the plan was verified with: its figures are not comparable here.")
    metrics = sorted(parse_checks(ver["budget"]).metrics | {"cosine", "max_abs"}) if ver.get("budget") else []
    measured = {o.name: o.values for o in cand.outputs}
    rows = []
    for out, figures in ver["figures"].items():
        for metric in metrics:
            said, got = _number(figures.get(metric)), _number(measured.get(out, {}).get(metric))
            if said is None and got is None:
                continue
            status = ("match" if _agree(said, got) else "MISMATCH") if same else "other data"
            rows.append([out, metric, fmt(said), fmt(got), status])
    if same and any(r[-1] == "MISMATCH" for r in rows):
        notes.append("MISMATCH: compare does not reproduce the plan's verified figures on the same data.")
    return notes, rows
