"""Issue 28's generated sweep of the validity gate (tests/precision/gatesweep.py): every written model is valid.

Graphs from ONNX's operator test cases at opsets 11 to the newest ONNX Runtime loads, in six graph shapes, under
five plans: each converted model passes the full checker, strict type inference and an ONNX Runtime load, or
convert refused it with an MpinferError and wrote nothing. A seeded sample runs in CI; thousands under ``slow``
(bench/gate_sweep.py prints the counts recorded in bench/RESULTS.md).
"""

from __future__ import annotations

import pytest

from tests.precision import gatesweep


def _check(tally: gatesweep.Tally, min_cases: int) -> None:
    counts = tally.counts()
    assert counts["cases"] >= min_cases, counts
    assert not tally.failures(), list(gatesweep.iter_failures(tally))[:5]
    assert counts["ok"] + counts["refused"] == counts["cases"]


def test_gate_sweep_sample():
    """A seeded sample of 60 cases (about 40 whose FP32 input is valid at the drawn opset)."""
    _check(gatesweep.sweep(60, seed=28), min_cases=30)


@pytest.mark.slow
def test_gate_sweep_thousands():
    _check(gatesweep.sweep(3000, seed=2028), min_cases=2000)
