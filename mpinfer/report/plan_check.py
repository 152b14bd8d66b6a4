""""Plan said / measured": the figures ``mpinfer convert`` verified beside what ``compare`` measured.

A plan written with a budget records its final verification (``summary.verification``: per-output figures,
samples, numerics and a fingerprint of the data). ``compare`` on the same data and numerics computes the same
figures with the same code, so they agree to float rounding; a figure that does not is flagged ``MISMATCH``
(the model, the data or the numerics are not what the plan was verified with). Figures of an error at the float32
noise floor (an all-FP32 plan) are noise on both sides, which differs between CPUs' kernels: they match.
"""

from __future__ import annotations

import math
from typing import Any

from mpinfer.checks import parse_checks, user_figures
from mpinfer.compare.result import CandidateResult, ComparisonResult
from mpinfer.metrics import USER_OUTPUT
from mpinfer.report.tables import fmt

# Two figures of the same outputs agree when within this relative distance: both sides sum float32 outputs in
# float64; they differ only where ONNX Runtime or the emulator reorders a float32 reduction (thread count, the
# CPU's kernels), by a few float32 ulps (eps 1.2e-7) of the largest outputs, far below 1e-3 of any figure a real
# change moves.
PLAN_MATCH_RTOL = 1e-3
# ... and an absolute floor for figures near zero (an error of ~0): a few float32 ulps of O(1) outputs.
PLAN_MATCH_ATOL = 1e-6
# An error whose relative L2 size is below this (8 float32 ulps) is float32 noise: the FP32 reference computed
# twice differs by that much, so such figures differ between CPUs and thread counts by as much as they measure.
NOISE_REL_L2 = 1e-6
# Figures on a logarithmic or squared scale, compared as the relative error they measure (see error_amplitude): an SNR
# of 140 dB is float32 noise that moves by a dB between CPUs, a cosine of 1 - 1e-14 the same noise squared.
_RELATIVE = frozenset({"snr_db", "cosine", "cosine_min", "rel_l2"})
HEADERS = ["output", "metric", "plan said", "measured", ""]


def _number(v: Any) -> float | None:
    try:
        return None if v is None else float(v)  # the plan writes inf/nan as strings
    except (TypeError, ValueError):
        return None


def error_amplitude(metric: str, value: float) -> float:
    """A figure as the error it measures, on a scale where noise adds linearly.

    ``max_abs``/``mean_abs``/``rel_l2`` are themselves; ``snr_db`` is ``rel_l2 = 10**(-snr/20)``; ``cosine`` is
    ``sqrt(2 (1 - cos))``, the error orthogonal to the baseline relative to its norm (the relative error when the
    norms agree). On those scales a figure of float32 noise is ~1e-7 and moves by ~1e-7 between two kernels; on
    the figures' own scales it is 140 dB moving by a dB, or a cosine 1 - 1e-14 moving by 1e-14.
    """
    if metric == "snr_db":
        return 10.0 ** (-value / 20.0)
    if metric in ("cosine", "cosine_min"):
        return math.sqrt(max(2.0 * (1.0 - value), 0.0))
    return float(value)


def _agree(metric: str, said: float | None, got: float | None, noise: bool) -> bool:
    """Two figures of one output agree; ``noise``: both sides measured an error at the float32 noise floor."""
    if said is None or got is None:
        return said is got
    if math.isnan(said) or math.isnan(got):
        return math.isnan(said) and math.isnan(got)
    if said == got or noise:
        return True
    if metric in _RELATIVE and math.isfinite(said) and math.isfinite(got):
        a, b = error_amplitude(metric, said), error_amplitude(metric, got)
        return math.isclose(a, b, rel_tol=PLAN_MATCH_RTOL, abs_tol=NOISE_REL_L2)
    return math.isclose(said, got, rel_tol=PLAN_MATCH_RTOL, abs_tol=PLAN_MATCH_ATOL)


def _at_noise_floor(figures: Any) -> bool:
    rel = _number(figures.get("rel_l2")) if isinstance(figures, dict) else None
    return rel is not None and rel <= NOISE_REL_L2


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
    user = list(ver.get("metrics") or {})
    metrics = sorted(parse_checks(ver["budget"], user).metrics - user_figures(user) | {"cosine", "max_abs"}) if (
        ver.get("budget")) else []
    measured = {o.name: o.values for o in cand.outputs}
    rows = []
    for out, figures in ver["figures"].items():
        if out == USER_OUTPUT:
            continue
        noise = _at_noise_floor(figures) and _at_noise_floor(measured.get(out))
        for metric in metrics:
            said, got = _number(figures.get(metric)), _number(measured.get(out, {}).get(metric))
            if said is None and got is None:
                continue
            status = ("match" if _agree(metric, said, got, noise) else "MISMATCH") if same else "other data"
            rows.append([out, metric, fmt(said), fmt(got), status])
    user_notes, user_rows = _user_rows(result, cand, ver, same)
    notes += user_notes
    rows += user_rows
    if same and any(r[-1] == "MISMATCH" for r in rows):
        notes.append("MISMATCH: compare does not reproduce the plan's verified figures on the same data.")
    return notes, rows


def _user_rows(
    result: ComparisonResult, cand: CandidateResult, ver: dict[str, Any], same: bool
) -> tuple[list[str], list[list[str]]]:
    """The plan's user-metric figures beside compare's (``--metric`` with the same file reproduces them).

    A metric compare did not run, or ran from a file whose sha256 is not the plan's, is said in a note; its rows
    are not compared.
    """
    notes, rows = [], []
    measured = cand.metrics or {}
    for name, rec in (ver.get("metrics") or {}).items():
        given = result.user_metrics.get(name)
        if given is None:
            notes.append(f"The plan verified the metric '{name}' ({rec.get('file')}:{rec.get('function')}); "
                         f"compare --metric {name}=FILE.py:FUNCTION measures it here.")
            continue
        other = given.get("sha256") != rec.get("sha256")
        if other:
            notes.append(f"The metric '{name}' compared here ({given.get('file')}, sha256 "
                         f"{str(given.get('sha256'))[:12]}) is not the file the plan was verified with "
                         f"({rec.get('file')}, sha256 {str(rec.get('sha256'))[:12]}): its figures are not comparable.")
        for fig, said_v in (rec.get("figures") or {}).items():
            said, got = _number(said_v), _number(measured.get(fig))
            if said is None and got is None:
                continue
            ok = _agree(fig, said, got, False)
            status = "other metric file" if other else ("match" if ok else "MISMATCH") if same else "other data"
            rows.append([USER_OUTPUT, fig, fmt(said), fmt(got), status])
    return notes, rows
