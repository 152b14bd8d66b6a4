"""Search and guarantee: groups, screening, the budget search, final verification and repair, the floor."""

from __future__ import annotations

from mpinfer.precision.budget.genbudget import (
    GENERATION_BATCH,
    OUTPUTS_FLOOR,
    GenerationBudget,
    split_generation_budget,
)
from mpinfer.precision.budget.groups import build_groups, group_errors
from mpinfer.precision.budget.noisefloor import floor_from_noise, relative_floor, widened_threshold
from mpinfer.precision.budget.repair import MAX_REPAIR_ROUNDS, Repaired, verification_record, verify_and_repair
from mpinfer.precision.budget.screening import (
    PROBE_MIN_ROWS,
    PROBE_SHARE,
    SCREEN_MIN_ROWS,
    SCREEN_MIN_TOTAL,
    SCREEN_SHARE,
    SearchConfig,
)
from mpinfer.precision.budget.search import (
    BODY_GROUP_ERROR,
    ERROR_FLOOR,
    MAX_REFINE,
    SUMMARY_METRICS,
    SearchOutcome,
    measure_plan,
    search_plan,
    summary_figures,
)
from mpinfer.precision.budget.verify import (
    RUN_ROWS,
    Verification,
    VerificationAborted,
    VerifySettings,
    budget_failures,
    budget_figures,
    reference_sums,
    verify_model,
)

__all__ = [
    "BODY_GROUP_ERROR",
    "ERROR_FLOOR",
    "GENERATION_BATCH",
    "GenerationBudget",
    "MAX_REFINE",
    "MAX_REPAIR_ROUNDS",
    "OUTPUTS_FLOOR",
    "PROBE_MIN_ROWS",
    "PROBE_SHARE",
    "RUN_ROWS",
    "Repaired",
    "SCREEN_MIN_ROWS",
    "SCREEN_MIN_TOTAL",
    "SCREEN_SHARE",
    "SUMMARY_METRICS",
    "SearchConfig",
    "SearchOutcome",
    "Verification",
    "VerificationAborted",
    "VerifySettings",
    "budget_failures",
    "budget_figures",
    "build_groups",
    "floor_from_noise",
    "group_errors",
    "measure_plan",
    "reference_sums",
    "relative_floor",
    "search_plan",
    "split_generation_budget",
    "summary_figures",
    "verification_record",
    "verify_and_repair",
    "verify_model",
    "widened_threshold",
]
