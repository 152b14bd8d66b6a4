"""The default floor measured from the evaluator's own noise (docs/convert.md, "The default floor").

The final verification compares the candidate, run under the chosen numerics (the strict emulator, a GPU
runtime), with FP32 ONNX Runtime. Those numerics differ from ONNX Runtime's even with every node in FP32
(another summation order, another ``exp``; a recurrent state or a saturated output can carry that far), and
that difference is no precision the conversion lost. So when the default floor fails its first verification,
the all-FP32 candidate is verified too (the *noise*), and each floor term is judged from that zero instead of
from an exact match: a term the noise uses up in part widens by what it uses, per output.

How a term widens by the noise figure ``v`` of the all-FP32 candidate on the same samples:

* errors (lower is better: ``range_err``, ``max_abs``, ``rel_l2``, ``nonfinite``, ...): ``t + v``. The
  candidate's error against FP32 ONNX Runtime is at most its error against the all-FP32 candidate plus the
  noise (the triangle inequality of a max or an L2 norm; counts add), so ``t`` is what the conversion may add;
* cosines (``cosine``, ``cosine_min``): angles add the same way, so ``cos(acos(t) + acos(v))``;
* shares of agreement (``topK``, ``match``): disagreements add at most, so ``t - (1 - v)``;
* any other term, and a noise figure that is perfect or not a number, leave the term as it is.

Only the default floor is widened: a ``--budget`` the user wrote is a requirement on the model as measured.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

from mpinfer.checks import Check, parse_checks
from mpinfer.metrics import GENERATION_OUTPUT, higher_is_better, json_number, topk_of

logger = logging.getLogger(__name__)

# The share metrics whose disagreements add (1 - share); topK besides.
_SHARES = frozenset({"match", "top1", "top5"})
_COSINES = frozenset({"cosine", "cosine_min"})


def widened_threshold(check: Check, noise: float | None) -> float:
    """``check``'s threshold judged from the noise figure ``noise`` (see the module docstring)."""
    if noise is None or math.isnan(noise) or check.op == "==":
        return check.value
    t, v = check.value, float(noise)
    if not higher_is_better(check.metric):
        return t + v if v > 0 else t
    if check.metric in _COSINES and v < 1:
        angle = math.acos(max(-1.0, min(1.0, t))) + math.acos(max(-1.0, v))
        return math.cos(min(math.pi, angle))
    if (check.metric in _SHARES or topk_of(check.metric) is not None) and v < 1:
        return t - (1.0 - v)
    return t


def relative_floor(budget: str, noise: Mapping[str, Mapping[str, float | None]]) -> str | None:
    """The floor ``budget`` judged from the all-FP32 candidate's figures ``noise``; None when no term moves.

    A term without an output selector that moves on some output is written once per output it applies to
    (``y:range_err<=0.0123``), so each output keeps its own zero; an output whose name holds a comma cannot be
    selected and keeps the term as it is.
    """
    terms: list[str] = []
    moved = False
    for check in parse_checks(budget):
        outputs = [check.output] if check.output is not None else [n for n in noise if n != GENERATION_OUTPUT]
        widened = {n: widened_threshold(check, noise.get(n, {}).get(check.metric)) for n in outputs}
        if all(t == check.value for t in widened.values()) or any("," in n for n in outputs):
            terms.append(str(check))
            continue
        moved = True
        terms += [
            str(Check(n, check.metric, check.op, t))
            for n, t in widened.items()
            if noise.get(n, {}).get(check.metric) is not None
        ]
    if not moved:
        return None
    text = ",".join(terms)
    logger.warning(
        "The default floor is judged from the evaluator's own noise: with every node in FP32 the chosen numerics "
        "already differ from FP32 ONNX Runtime; the floor becomes %s (docs/convert.md, 'The default floor').",
        text,
    )
    return text


def floor_from_noise(settings: Any, ver: Any, fp32: Any) -> tuple[Any, dict[str, Any]]:
    """The default floor of ``settings`` judged from ``fp32``, the all-FP32 candidate's verification.

    Args:
        settings: The verification's settings (``budget`` is the floor).
        ver: The candidate's failed verification; its ``failures`` are re-judged against the floor so widened.
        fp32: The FP32 model verified under the same numerics on the same samples.

    Returns:
        The settings with the widened floor (the same when no term moved), and the plan's record of it
        (``summary.verification.noise``: the floor it judged by and the noise figures of the floor's metrics).
    """
    floor = relative_floor(settings.budget, fp32.figures)
    metrics = parse_checks(settings.budget).metrics
    record = {
        "budget": floor or settings.budget,
        "figures": {o: {k: json_number(v) for k, v in m.items() if k in metrics} for o, m in fp32.figures.items()},
        "samples": fp32.samples,
        "wall_s": fp32.wall_s,
    }
    if floor is None:
        return settings, record
    ver.failures = parse_checks(floor).failures(ver.figures)
    return dataclasses.replace(settings, budget=floor), record
