"""Rule classes: op policy, index-like/shape ops, ranges from calibration, weights, user overrides."""

from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import TensorProto, helper

from mpinfer.errors import InvalidInputError
from mpinfer.modelio import name_nodes
from mpinfer.precision.core.graphinfo import GraphInfo
from mpinfer.precision.rules.overflow import match_module, overflow_nodes
from mpinfer.precision.rules.planner import RuleOptions, rule_plan
from mpinfer.specs import Precision
from tests.precision.graphs import embedding, fvi, init, make, mlp, rng_w


def _plan(model, precision=Precision.FP16, stats=None, **opts):
    info = GraphInfo(name_nodes(model))
    _, nodes = rule_plan(info, precision, RuleOptions(**opts), stats=stats)
    return {n.name: (n.precision, n.reason) for n in nodes}


def test_op_policy_follow_and_keep():
    p = _plan(mlp())
    assert p["fc1"] == (Precision.FP16, "rule:fp16-safe")
    assert p["relu"] == (Precision.FP16, "rule:follow")
    assert p["softmax"] == (Precision.FP32, "rule:keep-fp32")


def test_index_like_ops_never_converted():
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["s"], name="mm"),
        helper.make_node("TopK", ["s", "k"], ["v", "i"], name="topk", axis=-1),
        helper.make_node("ArgMax", ["s"], ["am"], name="argmax", axis=-1),
    ]
    model = make(
        nodes,
        [fvi("x", [2, 4])],
        [fvi("v", [2, 2]), fvi("i", [2, 2], TensorProto.INT64), fvi("am", [2, 1], TensorProto.INT64)],
        [init("w", rng_w(4, 4)), init("k", np.array([2], np.int64))],
    )
    p = _plan(model)
    assert p["topk"] == (Precision.FP32, "rule:index-like")
    assert p["argmax"] == (Precision.FP32, "rule:index-like")


def test_user_overrides_both_ways_and_regex_errors():
    p = _plan(mlp(), keep_ops=("MatMul",), low_nodes=("soft.*",), keep_nodes=("^relu$",))
    assert p["fc1"] == (Precision.FP32, "user:keep-op")
    assert p["relu"] == (Precision.FP32, "user:keep-node")
    assert p["softmax"] == (Precision.FP16, "user:low-node")
    p = _plan(mlp(), low_ops=("Softmax",))
    assert p["softmax"] == (Precision.FP16, "user:low-op")
    with pytest.raises(InvalidInputError, match="invalid regex"):
        _plan(mlp(), keep_nodes=("(",))


def test_range_rules_from_calibration_stats():
    stats = {
        "h": {"absmax": 1e5, "p999": 5e4, "fp16_overflow_frac": 0.01},
        "r": {"absmax": 1.0, "fp16_underflow_frac": 0.5, "bf16_underflow_frac": 0.0},
    }
    p = _plan(mlp(), stats=stats)
    assert p["fc1"] == (Precision.FP32, "range:overflow")  # producer of h
    assert p["add1"] == (Precision.FP32, "range:overflow")  # consumer of h
    assert p["relu"] == (Precision.FP32, "range:underflow")  # producer of r
    # BF16 has FP32's range: no overflow rule, and its own underflow fraction.
    pb = _plan(mlp(), Precision.BF16, stats=stats)
    assert pb["fc1"] == (Precision.BF16, "rule:fp16-safe")


def test_integer_inputs_never_count_against_ranges():
    model = embedding()
    p = _plan(model, stats={"ids": {"absmax": 1e9, "fp16_overflow_frac": 1.0}})
    assert p["embed"] == (Precision.FP16, "rule:fp16-safe")
    assert p["mm"] == (Precision.FP16, "rule:fp16-safe")


def test_overflow_json_maps_modules_to_nodes(tmp_path):
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="/features/features.3/Conv"),
        helper.make_node("Relu", ["c"], ["r"], name="/features/features.4/Relu"),
        helper.make_node("Conv", ["r", "w"], ["y"], name="/head/conv/Conv"),
    ]
    model = make(nodes, [fvi("x", [1, 2, 4, 4])], [fvi("y", [1, 2, 4, 4])], [init("w", rng_w(2, 2, 1, 1))])
    assert match_module(model, "features.3") == ["/features/features.3/Conv"]
    assert match_module(model, "head") == ["/head/conv/Conv"]
    path = tmp_path / "overflow.json"
    path.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "precision": "fp16",
                "modules": [
                    {"module": "features.3", "type": "Conv2d", "kind": "activation", "overflow_frac": 0.02}
                ],
            }
        )
    )
    mapped = overflow_nodes(model, path)
    p = _plan(model, overflow_nodes=mapped)
    assert p["/features/features.3/Conv"] == (Precision.FP32, "overflow-json")
    assert p["/head/conv/Conv"] == (Precision.FP16, "rule:fp16-safe")
    path.write_text("[]")
    with pytest.raises(InvalidInputError, match="Overflow file"):
        overflow_nodes(model, path)


def test_dynamo_name_scopes_matched():
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="node_Conv_1")
    entry = node.metadata_props.add()
    entry.key, entry.value = "pkg.torch.onnx.name_scopes", "['', 'layer1', 'layer1.conv1', 'conv2d']"
    model = make([node], [fvi("x", [1, 2, 4, 4])], [fvi("y", [1, 2, 4, 4])], [init("w", rng_w(2, 2, 1, 1))])
    assert match_module(model, "layer1") == ["node_Conv_1"]
    assert match_module(model, "layer2") == []


def test_follow_region_between_fp32_and_fp16_runs_low_at_same_cast_count():
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["a"], name="mm0"),
        helper.make_node("LayerNormalization", ["a", "g", "b"], ["n"], name="ln", axis=-1),
        helper.make_node("Mul", ["n", "half"], ["m"], name="scale"),
        helper.make_node("Relu", ["m"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w1"], ["y"], name="mm1"),
    ]
    model = make(
        nodes,
        [fvi("x", [2, 8])],
        [fvi("y", [2, 8])],
        [
            init("w0", rng_w(8, 8)),
            init("g", np.ones(8, np.float32)),
            init("b", np.zeros(8, np.float32)),
            init("half", np.float32(0.5)),
            init("w1", rng_w(8, 8, seed=1)),
        ],
    )
    p = _plan(model)
    assert p["ln"] == (Precision.FP32, "rule:keep-fp32")
    assert p["scale"] == (Precision.FP16, "rule:follow") and p["relu"] == (Precision.FP16, "rule:follow")


def test_big_weights_checked_and_model_untouched_by_inference():
    big = np.full((600, 600), 1e6, np.float32)  # > 1 MB: detached while types are inferred
    model = make(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [fvi("x", [2, 600])],
        [fvi("y", [2, 600])],
        [init("w", big)],
    )
    before = model.SerializeToString()
    assert _plan(model)["mm"] == (Precision.FP32, "weights:out-of-range")
    assert model.SerializeToString() == before


def test_underflow_counts_only_when_the_flushed_values_carry_energy():
    # half the activation is dead (1e-15 next to values near 1): flushing it is below FP16's own noise
    stats = {"r": {"absmax": 1.0, "fp16_underflow_frac": 0.5, "fp16_underflow_energy": 1e-28}}
    assert _plan(mlp(), stats=stats)["relu"] == (Precision.FP16, "rule:follow")
    stats["r"]["fp16_underflow_energy"] = 0.3  # the flushed values are a real part of the signal
    assert _plan(mlp(), stats=stats)["relu"] == (Precision.FP32, "range:underflow")


def test_pruned_weights_go_fp16_tiny_weights_stay_fp32():
    dead = rng_w(8, 16)
    dead[:, ::2] = 1e-15  # pruned channels: half the values flush to zero, ~1e-26 of the energy
    model = mlp()
    for t in model.graph.initializer:
        if t.name == "w1":
            t.CopyFrom(init("w1", dead))
    assert _plan(model)["fc1"] == (Precision.FP16, "rule:fp16-safe")
    for t in model.graph.initializer:
        if t.name == "w1":
            t.CopyFrom(init("w1", np.full((8, 16), 1e-9, np.float32)))  # the whole weight lives below FP16
    assert _plan(model)["fc1"] == (Precision.FP32, "weights:out-of-range")


def _weight_stats_reference(arr):
    """_weight_stats as first written: every pass over the whole weight (the shortcuts must give these figures)."""
    from mpinfer.precision.core import sum_of_squares
    from mpinfer.precision.rules.classify import FP16_TINY

    a = np.abs(arr.astype(np.float32, copy=False)).ravel()
    a = a[np.isfinite(a)]
    if a.size == 0:
        return {"absmax": 0.0, "underflow_frac": 0.0, "underflow_energy": 0.0}
    tiny = a < FP16_TINY / 2
    flushed = a[tiny & (a > 0)]
    under = float(flushed.size / (a.size - int(np.count_nonzero(a == 0)))) if flushed.size else 0.0
    total = sum_of_squares(a)
    energy = float(np.dot(flushed.astype(np.float64), flushed.astype(np.float64)) / total) if total > 0 else 0.0
    return {"absmax": float(a.max()), "underflow_frac": under, "underflow_energy": energy}


@pytest.mark.parametrize(
    "case", ["normal", "zeros", "tiny", "nan", "inf", "all-nan", "threshold", "at-threshold", "all-zero"]
)
def test_weight_statistics_take_shortcuts_without_changing_a_figure(case):
    from mpinfer.precision.rules.classify import FP16_TINY, _weight_stats

    arr = rng_w(16, 16)
    if case == "zeros":
        arr[::3] = 0.0
    elif case == "tiny":
        arr[0, :5] = 1e-12
        arr[1] = 0.0
    elif case == "nan":
        arr[2, 2] = np.nan
        arr[3, 3] = 1e-10
    elif case == "inf":
        arr[4, 4] = -np.inf
    elif case == "all-nan":
        arr[:] = np.nan
    elif case == "threshold":  # the float32 neighbours of the flush threshold
        half = np.float32(FP16_TINY / 2)
        arr[0, :3] = [np.nextafter(half, np.float32(0)), half, np.nextafter(half, np.float32(1))]
    elif case == "at-threshold":  # the least value is the threshold itself: nothing flushes
        arr[0, 0] = np.float32(FP16_TINY / 2)
    elif case == "all-zero":
        arr[:] = 0.0
    assert _weight_stats(arr) == _weight_stats_reference(arr)


def test_slots_follow_a_change_of_the_tensor_types():
    """GraphInfo.slots caches per node; any change of ``info.types`` (set, update, delete) is seen."""
    from mpinfer.precision.core.graphinfo import FLOAT16

    info = GraphInfo(name_nodes(mlp()))
    node = info.by_address["fc1"].node
    assert info.slots(node, FLOAT16).inputs
    info.types.update({name: TensorProto.DOUBLE for name in node.input})
    assert not info.slots(node, FLOAT16).inputs
    for name in node.input:
        info.types[name] = TensorProto.FLOAT
    assert info.slots(node, FLOAT16).inputs
    del info.types[node.input[0]]
    assert info.slots(node, FLOAT16).blocked


def test_nodes_of_one_kind_share_slots_and_a_blocked_one_names_its_own_tensor():
    from mpinfer.precision.core.graphinfo import FLOAT16

    nodes = [helper.make_node("Add", ["x", "w1"], ["a"], name="add1"), helper.make_node("Add", ["a", "w2"], ["y"],
                                                                                       name="add2")]
    model = make(nodes, [fvi("x", [2])], [fvi("y", [2])], [init("w1", rng_w(2)), init("w2", rng_w(2, seed=1))])
    info = GraphInfo(name_nodes(model))
    first, second = (info.slots(info.by_address[a].node, FLOAT16) for a in ("add1", "add2"))
    assert first.inputs == second.inputs == [0, 1] and first is not second
    info.types["w2"] = TensorProto.DOUBLE
    info.types["w1"] = TensorProto.DOUBLE
    blocked = [info.slots(info.by_address[a].node, FLOAT16).blocked for a in ("add1", "add2")]
    assert "'w1'" in (blocked[0] or "") and "'w2'" in (blocked[1] or "")
