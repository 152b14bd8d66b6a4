"""The strict probe: every group's local error from one cast-graph session, as the strict emulator measures it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import helper

from mpinfer.precision.budget.search import build_groups
from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.emulator import GraphEmulator
from mpinfer.precision.numerics.probe import build_probe, strict_probe_errors
from mpinfer.precision.numerics.strict import StrictEvaluator, local_error
from mpinfer.precision.rules.planner import RuleOptions, rule_plan
from mpinfer.specs import Precision
from tests.precision.graphs import fvi, init, make, rng_w
from tests.tolerances import gamma


def conv_net(*, erf: bool = False) -> object:
    """Conv/Relu/MaxPool -> Conv/Add -> ReduceMax -> MatMul/Tanh (optionally an Erf head): groups of cast-graph ops."""
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "b2"], ["a2"], name="add2"),
        helper.make_node("ReduceMax", ["a2"], ["g"], name="gmax", axes=[2, 3], keepdims=0),
        helper.make_node("MatMul", ["g", "w3"], ["m3"], name="mm3"),
        helper.make_node("Tanh", ["m3"], ["y"], name="tanh3"),
    ]
    inits = [init("w1", rng_w(8, 3, 3, 3, seed=1)), init("w2", rng_w(8, 8, 3, 3, seed=2)),
             init("b2", rng_w(1, 8, 1, 1, seed=3)), init("w3", rng_w(8, 6, seed=4))]
    outputs = [fvi("y", ["N", 6])]
    if erf:
        nodes.append(helper.make_node("MatMul", ["g", "w4"], ["m4"], name="mm4"))
        nodes.append(helper.make_node("Erf", ["m4"], ["z"], name="erf4"))
        inits.append(init("w4", rng_w(8, 4, seed=5)))
        outputs.append(fvi("z", ["N", 4]))
    return make(nodes, [fvi("x", ["N", 3, 12, 12])], outputs, inits)


def _groups(model, low=Precision.FP16):
    info = GraphInfo(model)
    decisions, nodes = rule_plan(info, low, RuleOptions())
    return info, [g for g in build_groups(info, nodes, decisions) if not g.in_body]


def _emulated(model, info, groups, batches, low):
    """Each group's local error as the emulator measures it (its own FP32 runs of the batches)."""
    emu = GraphEmulator(model)
    refs = [emu.run(b, None, keep=True) for b in batches]
    return {g.anchor: local_error(model, info, g, refs, low)[0] for g in groups}


def _batches(n=2, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((3, 3, 12, 12)).astype(np.float32)} for _ in range(n)]


@pytest.mark.parametrize("low", [Precision.FP16, Precision.BF16])
def test_strict_probe_gives_the_emulators_local_errors(low):
    """Each group's low copy in the cast graph computes the emulator's bits, fed the same FP32 tensors (the emulator's
    FP32 Conv/MatMul are ONNX Runtime's kernels, Add/Relu/MaxPool/ReduceMax exact or correctly rounded in both): the
    errors differ only by the order of the float64 sums (``gamma`` of the largest tensor's length in float64, far
    below the FP16/BF16 rounding each error measures)."""
    model = conv_net()
    info, groups = _groups(model, low)
    assert len(groups) >= 2
    batches = _batches()
    probed = strict_probe_errors(info, groups, batches, low)
    want = _emulated(model, info, groups, batches, low)
    assert sorted(probed.errors) == sorted(want)
    n = 3 * 8 * 12 * 12  # (the largest tensor a group hands on)
    for anchor, err in want.items():
        assert err > 1e-5, anchor  # the low copy's rounding shows
        assert probed.errors[anchor] == pytest.approx(err, rel=4 * gamma(n, np.float64)), anchor
    assert probed.evaluations == (len(info.nodes) + sum(len(g.members) for g in groups)) * len(batches)


def test_a_group_whose_strict_low_copy_overflows_gets_inf():
    """Inputs of 3.5e4: conv2's FP16 copy overflows (inf, as on the emulator), conv1's does not."""
    model = conv_net()
    info, groups = _groups(model)
    batches = [{"x": np.full((2, 3, 12, 12), 3.5e4, np.float32)}]
    probed = strict_probe_errors(info, groups, batches, Precision.FP16).errors
    want = _emulated(model, info, groups, batches, Precision.FP16)
    inf = [a for a, e in want.items() if math.isinf(e)]
    assert inf and len(inf) < len(want) and all(math.isinf(probed[a]) for a in inf)
    assert all(math.isfinite(probed[a]) for a in want if a not in inf)


def test_groups_without_a_cast_graph_or_a_finite_reference_are_left_to_the_emulator():
    """A low Erf has no float32 form of the emulator's kernel: its group is named and left out of the probe, and a
    group whose FP32 reference holds an inf is left out too (the emulator leaves those values out of its sums);
    StrictEvaluator.sensitivities measures both on the emulator, the rest in the probe, as the emulator would."""
    model = conv_net(erf=True)
    info, groups = _groups(model)
    erf_group = next(g for g in groups if "erf4" in g.members)
    left: dict[str, str] = {}
    probe, rows = build_probe(info, groups, Precision.FP16, exact=True, left=left)
    assert list(left) == [erf_group.anchor] and "Erf" in left[erf_group.anchor]
    assert erf_group.anchor not in rows and len(set(rows)) == len(groups) - 1
    batches = _batches(1)
    batches[0]["x"][0, 0, 0, 0] = np.inf  # (conv1's FP32 output holds inf and NaN)
    probed = strict_probe_errors(info, groups, batches, Precision.FP16).errors
    assert erf_group.anchor not in probed and "conv1" not in probed
    ev = StrictEvaluator(model, info, batches, Precision.FP16)
    got = ev.sensitivities(groups, batches, False)
    want = _emulated(model, info, groups, batches, Precision.FP16)
    assert sorted(got) == sorted(want)
    for anchor, err in want.items():
        assert got[anchor] == pytest.approx(err, rel=4 * gamma(3 * 8 * 12 * 12, np.float64), nan_ok=True), anchor


def test_a_batchnorm_whose_parameters_come_from_constant_nodes_is_probed_on_the_cast_graph():
    """Paddle exports feed BatchNormalization from Constant nodes (PP-OCRv4's recognizer, layout_cdla): the group's
    sub-model holds those values as weights, so its low copy has a cast graph (the fold) and the probe measures it,
    as the emulator does, instead of naming it and sending the group to the emulator (a full FP32 emulator run)."""
    from onnx import numpy_helper

    rng = np.random.default_rng(7)
    params = {"scale": rng.uniform(0.5, 2.0, 8), "bias": rng.standard_normal(8), "mean": rng.standard_normal(8),
              "var": rng.uniform(0.5, 2.0, 8)}
    consts = [helper.make_node("Constant", [], [f"bn_{k}"], name=f"const_{k}",
                               value=numpy_helper.from_array(v.astype(np.float32), f"bn_{k}"))
              for k, v in params.items()]
    nodes = [
        *consts,
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["n1"],
                         name="bn1"),
        helper.make_node("Relu", ["n1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    model = make(nodes, [fvi("x", ["N", 3, 12, 12])], [fvi("y", ["N", 8, 12, 12])],
                 [init("w1", rng_w(8, 3, 3, 3, seed=1)), init("w2", rng_w(8, 8, 3, 3, seed=2))])
    info, groups = _groups(model)
    bn_group = next(g for g in groups if "bn1" in g.members)
    assert not any(a.startswith("const_") for a in bn_group.members)  # (the Constants feed the group from outside)
    left: dict[str, str] = {}
    assert build_probe(info, groups, Precision.FP16, exact=True, left=left) is not None
    assert left == {}
    batches = _batches()
    probed = strict_probe_errors(info, groups, batches, Precision.FP16).errors
    want = _emulated(model, info, groups, batches, Precision.FP16)
    assert sorted(probed) == sorted(want)
    assert want[bn_group.anchor] > 1e-5
    for anchor, err in want.items():
        assert probed[anchor] == pytest.approx(err, rel=4 * gamma(3 * 8 * 12 * 12, np.float64)), anchor
