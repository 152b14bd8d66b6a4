"""Conformance: the converter over every float model among ONNX's node test cases.

Two passes, rules only (no calibration, no search), nothing cached on disk:

* default plan: every result passes the validity gate; where ONNX Runtime runs the FP32 original, the
  converted model's outputs match the expected ones within FP16 tolerance, or its nodes stay FP32 with a
  reason;
* forced: every op of the case forced low with ``low_ops`` (the rewriter's stress test): zero crashes and
  zero invalid models (outputs may legitimately lose accuracy in FP16; they are counted, not asserted).

The forced pass runs on a deterministic third of the cases in the default suite and on all of them under
the ``slow`` marker.
"""

from __future__ import annotations

import pytest

from tests.precision.conformance import float_cases, run_conformance


@pytest.fixture(scope="module")
def cases():
    return float_cases()


def _report(label, counts):
    c = counts.counter()
    print(
        f"\nconformance {label}: {len(counts.outcomes)} float cases in {counts.seconds:.1f}s: "
        f"{dict(sorted(c.items()))}"
    )
    bad = [o for o in counts.outcomes if o.status in ("crash", "invalid")]
    return c, bad


def test_conformance_default_plan(cases):
    counts = run_conformance(cases)
    c, bad = _report("default", counts)
    assert not bad, [(o.name, o.status, o.detail) for o in bad[:5]]
    mismatched = [o.name for o in counts.outcomes if o.status == "converted-mismatch"]
    assert not mismatched, mismatched
    assert len(cases) > 1000 and c["converted-match"] > 150


def test_conformance_forced_low_subset(cases):
    counts = run_conformance(cases[::3], force_low=True)
    _, bad = _report("forced-low (1/3)", counts)
    assert not bad, [(o.name, o.status, o.detail) for o in bad[:5]]


@pytest.mark.slow
def test_conformance_forced_low_all(cases):
    counts = run_conformance(cases, force_low=True)
    _, bad = _report("forced-low (all)", counts)
    assert not bad, [(o.name, o.status, o.detail) for o in bad[:5]]


def test_whole_models_from_onnx_backend_data():
    from tests.precision.conformance import check_zoo_model, zoo_paths

    paths = zoo_paths()
    outcomes = [check_zoo_model(p) for p in paths]
    counts = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    print(f"\nwhole models (light/pytorch-converted/pytorch-operator/simple): {len(paths)}: {counts}")
    bad = [
        (o.name, o.status, o.detail)
        for o in outcomes
        if o.status in ("crash", "invalid", "converted-mismatch")
    ]
    assert not bad, bad[:5]
    assert len(paths) > 100 and counts.get("converted-match", 0) >= 30


def test_conformance_bf16_valid_subset(cases):
    """BF16 (default plan and every op forced low) on a fifth of the cases: valid everywhere."""
    from mpinfer.errors import InternalError
    from mpinfer.precision.convert import convert_model
    from mpinfer.specs import Precision

    bad = []
    for case in cases[::5]:
        ops = tuple(sorted({n.op_type for n in case.model.graph.node if n.domain in ("", "ai.onnx")}))
        for low_ops in ((), ops):
            try:
                convert_model(case.model, Precision.BF16, low_ops=low_ops)
            except (InternalError, Exception) as err:  # noqa: BLE001 - crashes and invalid models both count
                bad.append((case.name, bool(low_ops), f"{type(err).__name__}: {err}"[:200]))
    print(
        f"\nconformance bf16 (1/5, default + forced): {2 * len(cases[::5])} conversions, {len(bad)} failures"
    )
    assert not bad, bad[:5]
