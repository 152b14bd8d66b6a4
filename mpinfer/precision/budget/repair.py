"""Convert's final verification and repair loop: the worst groups back to FP32 until the budget holds.

:func:`verify_and_repair` verifies the applied candidate (:func:`mpinfer.precision.budget.verify.verify_model`);
when the budget fails, the groups of low nodes that contribute most (their local error, measured on the batch the
candidate got most wrong) go back to FP32 (1, 2, 4, ... of them) and the new candidate is verified again.
:func:`verification_record` is the plan's record of the verified candidate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpinfer.data.samples import BatchSlicer, fingerprint_digest, fingerprint_update
from mpinfer.errors import AccuracyMismatchError, format_message
from mpinfer.metrics import USER_OUTPUT, json_number
from mpinfer.precision.budget.groups import build_groups, group_errors
from mpinfer.precision.budget.noisefloor import floor_from_noise
from mpinfer.precision.budget.verify import Verification, VerifySettings, reference_sums, verify_model
from mpinfer.precision.core import NodeDecision
from mpinfer.precision.emulator import ENGINE_EMULATOR
from mpinfer.precision.graph import apply_validated
from mpinfer.specs import Precision

logger = logging.getLogger(__name__)


# Rounds of "move the worst groups back to FP32 and verify again"; group counts double each round, so this
# covers 2**MAX_REPAIR_ROUNDS groups before the last round takes every group back to FP32.
MAX_REPAIR_ROUNDS = 12

@dataclass
class Repaired:
    """The verified candidate: its ApplyResult, plan entries and the last verification."""

    result: Any
    nodes: list[NodeDecision]
    verification: Verification
    rounds: int = 0
    demoted: list[str] = field(default_factory=list)
    wall_s: float = 0.0  # every verification pass, repairs included
    noise: dict[str, Any] | None = None  # the default floor judged from the evaluator's noise (noisefloor)


def verify_and_repair(
    info: Any,
    nodes: list[NodeDecision],
    result: Any,
    decisions: Mapping[str, Any],
    feeds: Any,
    settings: VerifySettings,
    *,
    known_reference: Sequence[Mapping[str, np.ndarray]] | None = None,
    rank_rows: int | None = None,
    known_candidate: Sequence[Mapping[str, np.ndarray]] | None = None,
    staged: tuple[Path, Path] | None = None,
    runner: Any = None,
    abort: Callable[[], bool] | None = None,
) -> Repaired:
    """Verify the applied candidate on the data; move the worst groups back to FP32 until the budget holds.

    Args:
        info: The FP32 model's GraphInfo (``info.model`` is the reference).
        nodes: The plan entries ``result`` was applied from.
        result: Their ApplyResult (``result.model`` is the model as it will be written).
        decisions: The rule verdicts per node (which nodes the user forced).
        feeds: The calibration batches.
        settings: Budget, numerics, samples.
        known_reference: FP32 outputs of the first batches, when calibration kept them.
        rank_rows: At most this many samples of the worst batch rank the groups (their FP32 tensors are kept).
        known_candidate: ``result.model``'s outputs on the first batches (the search's), for the first pass.
        staged: (file, input model file) for external weights: every candidate is written to the file and verified
            from it (:func:`mpinfer.precision.graph.validate.apply_validated`).
        runner: ``result.model``'s runner under these numerics, already open (the search's, which computed
            ``known_candidate``), for the first pass.
        abort: For the first pass, of ``result.model`` (:func:`~mpinfer.precision.budget.verify.verify_model`): the
            later passes verify models this call applied and gated itself.

    Returns:
        The candidate that meets the budget, its plan entries and its verification.

    Raises:
        AccuracyMismatchError: The budget fails even with every node it may change in FP32.
        VerificationAborted: ``abort`` answered True.
    """
    where = {"reference_dir": info.base_dir, "candidate_path": staged[0] if staged is not None else None}
    ver = verify_model(
        result.model, info.model, feeds, settings, known_reference=known_reference, known_candidate=known_candidate,
        runner=runner, abort=abort, **where,
    )
    _log(ver, settings, 0)
    rounds, demoted, spent = 0, list[str](), ver.wall_s
    noise, ranks = None, _RankCache()
    # the passes after the first run on its engine: the noise and the repaired candidates are judged as it was
    where["fast"] = ENGINE_EMULATOR not in ver.engine.split("+")
    if not ver.passed and settings.default_budget:  # the floor's zero: the all-FP32 candidate under these numerics
        fp32 = verify_model(info.model, info.model, feeds, settings, known_reference=known_reference,
                            reference_dir=info.base_dir, candidate_path=staged[1] if staged is not None else None,
                            fast=where["fast"])
        settings, noise = floor_from_noise(settings, ver, fp32)
        spent += fp32.wall_s
    bound = None
    while not ver.passed:
        groups = build_groups(info, nodes, decisions)
        if not groups and _floor_sees_only_fp32(nodes, ver, settings):
            break
        if not groups or rounds >= MAX_REPAIR_ROUNDS:
            raise _unrecoverable(ver, settings, demoted)
        back = _groups_to_demote(info, groups, ver, settings, rounds, rank_rows, ranks)
        demoted.extend(sorted(back))
        nodes = _to_fp32(nodes, back, ver)
        rounds += 1
        result, nodes = apply_validated(
            info, nodes, settings.precision, keep_io_types=settings.keep_io_types, staged=staged
        )
        if bound is None:
            bound = reference_sums(info.model, feeds, settings, known_reference, info.base_dir)
        ver = verify_model(result.model, info.model, feeds, settings, known_reference=known_reference, bound=bound,
                           probe=ver.worst_batch, **where)
        spent += ver.wall_s
        _log(ver, settings, rounds)
    return Repaired(result, nodes, ver, rounds, demoted, round(spent, 3), noise)


def _floor_sees_only_fp32(nodes: list[NodeDecision], ver: Verification, settings: VerifySettings) -> bool:
    """True (and said in a warning) when the default floor fails with no node left low: nothing to repair."""
    if not settings.default_budget or any(n.precision.is_low for n in nodes):
        return False
    # Nothing is low any more (no user override either): what the floor still sees is the evaluator's own
    # FP32 arithmetic against ONNX Runtime's (e.g. -inf vs float32's lowest at masked positions), not
    # precision the conversion lost. A floor is a safety net, not a budget the user asked for: say so.
    logger.warning(
        "The default floor (%s) cannot be verified on this model: with no node left in low precision, "
        "%s numerics still differ from FP32 ONNX Runtime (%s). Kept as planned; "
        "check the model with `mpinfer compare`, or pass --budget to make it a requirement.",
        settings.budget, ver.numerics, "; ".join(ver.failures[:2]),
    )
    return True


def _groups_to_demote(
    info: Any,
    groups: list[Any],
    ver: Verification,
    settings: VerifySettings,
    rounds: int,
    rank_rows: int | None,
    ranks: _RankCache | None = None,
) -> set[str]:
    """The nodes of this round's worst groups: 2**rounds of them, every group in the last round."""
    batch = _first_rows(info.model, ver.worst_batch, rank_rows)
    ranked = _rank(info, groups, batch, settings.precision, ranks)
    take = ranked if rounds + 1 >= MAX_REPAIR_ROUNDS else ranked[: 2**rounds]
    return {a for g in take for a in g.members}


def _to_fp32(nodes: list[NodeDecision], back: set[str], ver: Verification) -> list[NodeDecision]:
    """The plan entries with ``back`` moved to FP32, saying the final verification did it and why."""
    detail = (
        f"kept FP32 by the final verification on {ver.samples}{'' if ver.complete else ' (of the hardest)'} samples: "
        f"its group broke the budget ({'; '.join(ver.failures[:2])})"
    )
    return [
        NodeDecision(n.name, n.op_type, Precision.FP32, "sensitivity", detail, dict(n.stats)) if n.name in back else n
        for n in nodes
    ]


def _first_rows(model: Any, batch: Mapping[str, np.ndarray] | None, rows: int | None) -> Any:
    """The first ``rows`` samples of ``batch`` (all of it when it has no more, or when ``rows`` is None)."""
    if batch is None or rows is None:
        return batch
    slicer = BatchSlicer(model)
    return batch if slicer.rows(batch) <= rows else slicer.slice(batch, 0, rows)


def _rank(
    info: Any,
    groups: list[Any],
    batch: Mapping[str, np.ndarray] | None,
    precision: Precision,
    ranks: _RankCache | None = None,
) -> list[Any]:
    """The groups, the one that contributes most error first: local error on the worst batch, then FLOPs."""
    if ranks is None:
        errors = group_errors(info, groups, [batch] if batch is not None else [], precision)
    else:
        errors = ranks.errors(info, groups, batch, precision)
    return sorted(groups, key=lambda g: (-errors.get(g.anchor, 0.0), -g.flops, g.anchor))


class _RankCache:
    """Group local errors already measured on a batch, for the next repair rounds.

    A group's local error is measured alone, fed the FP32 tensors of the batch (:func:`groups.group_errors`): it
    does not depend on which other groups are low. When the next round's worst batch is the same data, the groups
    still low rank as they did, so only groups not measured yet (a group that changed members) are run again.
    """

    def __init__(self) -> None:
        self._batch: str | None = None
        self._errors: dict[tuple[str, frozenset[str]], float | None] = {}  # None: not measurable (in a body)

    def errors(
        self, info: Any, groups: list[Any], batch: Mapping[str, np.ndarray] | None, precision: Precision
    ) -> dict[str, float]:
        """Anchor -> local error of each group on ``batch`` (what :func:`groups.group_errors` returns)."""
        key = _batch_digest(batch, precision)
        if key != self._batch:
            self._batch, self._errors = key, {}
        todo = [g for g in groups if (g.anchor, frozenset(g.members)) not in self._errors]
        if todo:
            got = group_errors(info, todo, [batch] if batch is not None else [], precision)
            self._errors.update({(g.anchor, frozenset(g.members)): got.get(g.anchor) for g in todo})
            logger.debug("repair: %d group errors measured, %d taken from the last round", len(todo),
                         len(groups) - len(todo))
        return {g.anchor: v for g in groups if (v := self._errors.get((g.anchor, frozenset(g.members)))) is not None}


def _batch_digest(batch: Mapping[str, np.ndarray] | None, precision: Precision) -> str:
    """The batch's data fingerprint (:func:`fingerprint_update`) and the precision its groups run in."""
    hashers: dict[str, Any] = {}
    fingerprint_update(hashers, batch or {})
    return f"{precision.value}:{fingerprint_digest(hashers)}"


def _unrecoverable(ver: Verification, settings: VerifySettings, demoted: list[str]) -> AccuracyMismatchError:
    budget = settings.budget + (f",{settings.generation.text}" if settings.generation is not None else "")
    what = "the default floor" if settings.default_budget else f"Budget '{budget}'"
    hint = (
        "pass a looser --budget, or --budget none to skip the floor"
        if settings.default_budget
        else "loosen the budget, or drop some --low-op/--low-node overrides"
    )
    return AccuracyMismatchError(
        format_message(
            what[0].upper() + what[1:],
            f"missed on {ver.samples} calibration samples ({ver.numerics} numerics) even with every node it may "
            f"change in FP32 ({len(demoted)} moved back): " + "; ".join(ver.failures[:4]),
            "a budget the model can meet (only --low-* overrides and casts at low I/O stay low)",
            hint + "; nothing was written",
        )
    )


def _log(ver: Verification, settings: VerifySettings, rounds: int) -> None:
    logger.info(
        "verify%s: %d samples (%s numerics%s) in %.1fs: %s",
        f" (repair round {rounds})" if rounds else "",
        ver.samples,
        ver.numerics,
        f", {ver.engine}" if ver.engine else "",
        ver.wall_s,
        "budget met" if ver.passed else "; ".join(ver.failures[:3]),
    )


def verification_record(ver: Verification, settings: VerifySettings, repaired: Repaired) -> dict[str, Any]:
    """The plan's ``summary.verification``: figures per output, samples, numerics, data fingerprint."""
    return {
        "budget": settings.budget,
        "default_budget": settings.default_budget,
        "numerics": ver.numerics,
        **({"engine": ver.engine} if ver.engine else {}),
        "samples": ver.samples,
        "batches": ver.batches,
        "fingerprint": ver.fingerprint,
        "figures": {o: {k: json_number(v) for k, v in m.items()} for o, m in ver.figures.items()},
        "passed": ver.passed,
        "repair_rounds": repaired.rounds,
        "moved_to_fp32": len(repaired.demoted),
        "wall_s": repaired.wall_s,
        **({"generation": settings.generation.describe()} if settings.generation is not None else {}),
        **({"noise": repaired.noise} if repaired.noise is not None else {}),
        **({"metrics": _metric_records(ver, settings)} if settings.metrics else {}),
    }


def _metric_records(ver: Verification, settings: VerifySettings) -> dict[str, Any]:
    """The plan's ``summary.verification.metrics``: each user metric's file, function, sha256 and verified figures."""
    figures = ver.figures.get(USER_OUTPUT, {})
    return {
        m.name: {**m.record(), "figures": {k: json_number(figures.get(k)) for k in m.figures}}
        for m in settings.metrics
    }
