"""Evaluators: one class per numerics behind one protocol, mapped from ``--numerics`` in one place."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

import mpinfer.precision as precision_pkg
from mpinfer.errors import BackendUnavailableError, InvalidInputError
from mpinfer.precision.budget.search import build_groups
from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.core.plan import NodeDecision
from mpinfer.precision.graph.apply import apply_plan
from mpinfer.precision.numerics.ort import OrtCudaEvaluator, OrtEvaluator
from mpinfer.precision.numerics.registry import EVALUATORS, evaluator_class
from mpinfer.precision.numerics.strict import StrictEvaluator
from mpinfer.precision.numerics.tensorrt import TensorRtEvaluator
from mpinfer.precision.options import NUMERICS
from mpinfer.precision.rules.classify import Decision, Kind
from mpinfer.specs import Precision
from tests.precision.graphs import fvi, init, make, rng_w
from tests.tolerances import network_atol

WIDTH, LAYERS = 16, 4


def _chain():
    nodes, inits, prev = [], [], "x"
    for i in range(LAYERS):
        nodes += [
            helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
            helper.make_node("Tanh", [f"m{i}"], [f"t{i}"], name=f"tanh{i}"),
        ]
        inits.append(init(f"w{i}", rng_w(WIDTH, WIDTH, seed=i, scale=1.5 / math.sqrt(WIDTH))))
        prev = f"t{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    return make(nodes, [fvi("x", ["N", WIDTH])], [fvi("y", ["N", WIDTH])], inits)


@pytest.fixture(scope="module")
def setup():
    model = _chain()
    info = GraphInfo(model)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((8, WIDTH)).astype(np.float32)} for _ in range(2)]
    return model, info, batches


def _f32_atol(ref):
    return network_atol(np.float32, n=WIDTH, stages=LAYERS, magnitude=float(np.abs(ref).max()))


def _low(info):
    return {a: Precision.FP16 for a, ref in info.by_address.items() if ref.node.op_type == "MatMul"}


def test_every_numerics_name_maps_to_an_evaluator_and_unknown_names_are_refused():
    for name in NUMERICS:
        assert evaluator_class(name).name == name
    assert set(EVALUATORS) == {"strict", "ort", "ort-cuda", "tensorrt"}
    for cls in EVALUATORS.values():
        for attr in ("reference", "candidate", "screen_rows", "sensitivities", "model_runner"):
            assert callable(getattr(cls, attr)), (cls, attr)
        assert isinstance(cls.supports_bf16, bool) and isinstance(cls.wants_fp32_tensors, bool)
    with pytest.raises(InvalidInputError, match="--numerics"):
        evaluator_class("cuda-magic")


def test_no_module_of_the_convert_core_tests_the_numerics_name():
    """The numerics are chosen by class (numerics/registry.evaluator_class), never by comparing the name."""
    pattern = re.compile(r"numerics\s*(==|!=|in)\s*[\"'(]")
    root = Path(precision_pkg.__file__).parent
    offenders = [
        f"{p.relative_to(root)}:{i}"
        for p in sorted(root.rglob("*.py"))  # (every sub-package: the recipe's stages live in them)
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


@pytest.mark.parametrize("cls", [StrictEvaluator, OrtEvaluator])
def test_an_all_fp32_candidate_gives_the_reference_and_a_low_one_does_not(setup, cls):
    model, info, batches = setup
    ev = cls(model, info, batches, Precision.FP16)
    ref = ev.reference()
    assert len(ref) == len(batches) and set(ref[0]) == {"y"}
    same = ev.candidate({}).outputs()
    low = ev.candidate(_low(info)).outputs()
    for r, s, lo in zip(ref, same, low, strict=True):
        atol = _f32_atol(r["y"])
        assert np.abs(s["y"] - r["y"]).max() <= atol
        assert np.abs(lo["y"] - r["y"]).max() > atol  # FP16 MatMuls round: the candidate really ran low
    assert ev.evaluations > 0


def test_strict_and_ort_references_agree(setup):
    model, info, batches = setup
    strict = StrictEvaluator(model, info, batches, Precision.FP16).reference()
    ort = OrtEvaluator(model, info, batches, Precision.FP16).reference()
    for s, o in zip(strict, ort, strict=True):
        assert np.abs(s["y"] - o["y"]).max() <= _f32_atol(o["y"])


@pytest.mark.parametrize("cls", [StrictEvaluator, OrtEvaluator])
def test_a_candidate_is_the_applied_model_under_the_same_numerics(setup, cls):
    """What the search measures is what the final verification (model_runner) sees of the written model."""
    model, info, batches = setup
    low = _low(info)
    ev = cls(model, info, batches, Precision.FP16)
    cand = ev.candidate(low)
    applied = apply_plan(model, info, {a: low.get(a, Precision.FP32) for a in info.by_address}, Precision.FP16)
    run = cls.model_runner(applied.model)
    for batch, got in zip(batches, cand.outputs(), strict=True):
        want = np.asarray(run(batch)["y"], np.float32)
        assert np.abs(got["y"] - want).max() <= _f32_atol(want)
    rows = np.array([1, 3])
    on_rows = cand.outputs_on({"x": batches[0]["x"][rows]}, rows)
    assert on_rows["y"].shape == (2, WIDTH)
    ran = cand.ran_as()  # (the cast graph or the ORT session ran the model as applied: convert takes it)
    assert ran is not None and ran.loaded == (cls is OrtEvaluator)  # (ORT loaded that very model)
    assert {a for a, p in ran.precisions.items() if p.is_low} == set(low)
    assert ran.model == applied.model


@pytest.mark.parametrize("cls", [StrictEvaluator, OrtEvaluator])
def test_sensitivities_give_every_group_a_finite_error(setup, cls):
    model, info, batches = setup
    kind = {"MatMul": Kind.LOW, "Tanh": Kind.FOLLOW, "Identity": Kind.KEEP}
    decisions = {a: Decision(kind[r.node.op_type], "rule:test", "") for a, r in info.by_address.items()}
    nodes = [
        NodeDecision(a, r.node.op_type, Precision.FP32 if kind[r.node.op_type] is Kind.KEEP else Precision.FP16,
                     "rule:test")
        for a, r in info.by_address.items()
    ]
    groups = build_groups(info, nodes, decisions)
    assert groups
    errors = cls(model, info, batches, Precision.FP16).sensitivities(groups, batches, False)
    assert set(errors) == {g.anchor for g in groups}
    assert all(0 < e < 1 and math.isfinite(e) for e in errors.values())


@pytest.mark.tensorrt
@pytest.mark.gpu
def test_tensorrt_evaluator_runs_candidates_as_strongly_typed_engines(setup):
    model, info, batches = setup
    low = _low(info)
    trt = TensorRtEvaluator(model, info, batches, Precision.FP16)
    ort = OrtEvaluator(model, info, batches, Precision.FP16)
    for t, o in zip(trt.candidate(low).outputs(), ort.candidate(low).outputs(), strict=True):
        # FP16 kernels on both sides, summed in another order: the FP16 reorder bound.
        atol = network_atol(np.float16, n=WIDTH, stages=LAYERS, magnitude=float(np.abs(o["y"]).max()))
        assert t["y"].dtype == np.float32 and np.abs(t["y"] - o["y"]).max() <= atol


def test_tensorrt_profile_spans_every_symbolic_dim_and_keeps_fixed_ones():
    model = make(
        [helper.make_node("Add", ["a", "b"], ["y"], name="add")],
        [fvi("a", ["N", 3, "T"]), fvi("b", [1, 3, 1])],
        [fvi("y", ["N", 3, "T"])],
    )
    profiles = {p.name: p for p in TensorRtEvaluator._profile(model)}
    top = TensorRtEvaluator.max_rows
    assert (profiles["a"].min, profiles["a"].opt, profiles["a"].max) == ((1, 3, 1), (top, 3, top), (top, 3, top))
    assert profiles["b"].min == profiles["b"].max == (1, 3, 1)


def test_ort_cuda_numerics_are_refused_without_a_usable_cuda_provider(setup):
    from mpinfer.backends.ort import cuda_usable

    model, info, batches = setup
    if cuda_usable():
        pytest.skip("onnxruntime's CUDA provider and a GPU are here")
    with pytest.raises(BackendUnavailableError, match="ort-cuda"):
        OrtCudaEvaluator(model, info, batches, Precision.FP16).reference()
