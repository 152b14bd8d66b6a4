"""Steered bisection prefixes: a prefix judged on the hardest samples steers the bisection; the plan is always one
measured on every sample, and a steered prefix that fails there sends the search back to full verdicts."""

from __future__ import annotations

from mpinfer.checks import parse_checks
from mpinfer.precision.budget.groups import _Group
from mpinfer.precision.budget.search import _bisect
from mpinfer.specs import Precision


class _Verdicts:
    """A verifier whose full runs pass while no group ``>= bad`` is low, and whose steered runs also pass up to
    group ``lie`` (the hardest samples miss what breaks groups ``bad..lie``)."""

    def __init__(self, bad: int, lie: int) -> None:
        self.bad, self.lie = bad, lie
        self.budget = parse_checks("cosine>=0.5")
        self.fp32_metrics = {"y": {"cosine": 1.0}}
        self.steered = False
        self.unsteered = 0
        self.calls: list[tuple[int, bool]] = []

    def metrics(self, low, *, screen=True, record=True, steer=False):
        worst = max((int(a[1:]) for a in low), default=-1)
        self.steered = steer and worst < self.lie
        self.calls.append((worst, self.steered))
        ok = worst < self.bad or self.steered
        return {"y": {"cosine": 1.0 if ok else 0.0}}


def _order(n: int) -> list[_Group]:
    return [_Group(f"g{i}", [f"g{i}"], flops=1.0) for i in range(n)]


def test_a_steered_prefix_that_fails_on_every_sample_sends_the_search_back_to_full_verdicts():
    ver = _Verdicts(bad=4, lie=6)
    accepted, metrics = _bisect(_order(8), {}, ver, _NoBar(), None, _Cfg())  # type: ignore[arg-type]
    assert [g.anchor for g in accepted] == ["g0", "g1", "g2", "g3"] and ver.budget.met(metrics)
    assert ver.unsteered == 1
    assert any(steered for _, steered in ver.calls)
    assert (3, False) in ver.calls  # (the plan measured on every sample)


def test_steered_prefixes_that_hold_give_the_plan_of_full_verdicts():
    steered = _Verdicts(bad=4, lie=4)
    full = _Verdicts(bad=4, lie=0)  # (never steered)
    got = _bisect(_order(8), {}, steered, _NoBar(), None, _Cfg())  # type: ignore[arg-type]
    want = _bisect(_order(8), {}, full, _NoBar(), None, _Cfg())  # type: ignore[arg-type]
    assert [g.anchor for g in got[0]] == [g.anchor for g in want[0]] == ["g0", "g1", "g2", "g3"]
    assert steered.unsteered == 0 and got[1] == want[1]
    assert steered.calls[-1] == (3, False)  # the steered prefix, the plan, settled on every sample


class _NoBar:
    def advance(self, task) -> None:
        pass


class _Cfg:
    precision = Precision.FP16
    budget = "cosine>=0.5"
