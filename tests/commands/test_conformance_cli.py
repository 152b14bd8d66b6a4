"""Conformance as a standing check: ``mpinfer convert`` (the CLI, in-process) over ONNX's operator test cases.

Each case is converted with no data (mpinfer's own random data) and with its own inputs as an .npz
(bench/conformance.py). Target: no crash, no invalid model, no wrong output, and at least 99% ok with the
case's own inputs. A deterministic spread of 100 cases runs in the CPU suite; all of them under ``slow``.
"""

from __future__ import annotations

import pytest

conformance = pytest.importorskip("bench.conformance")


def _check(tallies, min_ok_own: float) -> None:
    for t in tallies.values():
        print("\n" + conformance.format_tally(t))
        bad = [(r.name, r.status, r.detail) for r in t.results if r.status in ("crash", "invalid", "wrong")]
        assert not bad, bad[:5]
    own = tallies["own"]
    refused = [(r.name, r.detail) for r in own.results if r.status == "refused"]
    assert own.ok_share() >= min_ok_own, refused[:10]


def test_conformance_sample_through_the_cli():
    sample = conformance.runnable_cases(125)  # a spread of 125 float cases: ~100 that ONNX Runtime runs
    assert len({c.name for c in sample}) >= 90
    _check(conformance.run_conformance(sample), 0.99)


@pytest.mark.slow
def test_conformance_all_cases_through_the_cli():
    cases = conformance.runnable_cases()
    assert len(cases) > 1000
    _check(conformance.run_conformance(cases), 0.99)
