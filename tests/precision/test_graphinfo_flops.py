"""GraphInfo.flops: the FLOP count per op type the planner weighs nodes by (integers, so compared exactly)."""

from __future__ import annotations

from onnx import helper

from mpinfer.modelio import name_nodes
from mpinfer.precision.core.graphinfo import GraphInfo
from tests.precision.graphs import fvi, init, make, rng_w


def _info() -> GraphInfo:
    nodes = [
        helper.make_node("Conv", ["x", "wc"], ["c"], name="conv", pads=[1, 1, 1, 1]),  # (1,4,6,6)
        helper.make_node("ConvTranspose", ["c", "wt"], ["t"], name="convt"),  # (1,2,7,7)
        helper.make_node("Flatten", ["t"], ["f"], name="flat", axis=1),  # (1,98)
        helper.make_node("Transpose", ["f"], ["ft"], name="tr"),  # (98,1)
        helper.make_node("Gemm", ["ft", "wg"], ["g"], name="gemm", transA=1),  # (1,5)
        helper.make_node("MatMul", ["g", "wm"], ["m"], name="mm"),  # (1,3)
        helper.make_node("Einsum", ["m", "wm2"], ["e"], name="ein", equation="ij,jk->ik"),  # (1,8)
        helper.make_node("Relu", ["e"], ["y"], name="relu"),
    ]
    inits = [
        init("wc", rng_w(4, 3, 3, 3)),
        init("wt", rng_w(4, 2, 2, 2)),
        init("wg", rng_w(98, 5)),
        init("wm", rng_w(5, 3)),
        init("wm2", rng_w(3, 8)),
    ]
    model = make(nodes, [fvi("x", [1, 3, 6, 6])], [fvi("y", [1, 8])], inits)
    return GraphInfo(name_nodes(model))


def test_flops_per_op_type():
    info = _info()
    flops = {a: info.flops(ref) for a, ref in info.by_address.items()}
    assert flops["conv"] == 2 * (4 * 6 * 6) * (3 * 3 * 3)  # output size x fan-in
    assert flops["convt"] == 2 * (4 * 6 * 6) * (2 * 2 * 2)  # input size x fan-out
    assert flops["gemm"] == 2 * 5 * 98  # transA: the reduced dim is A's first
    assert flops["mm"] == 2 * 3 * 5
    assert flops["ein"] == 2 * 3 * 8  # the largest of output (1,8) and inputs (1,3), (3,8)
    assert flops["relu"] == 8 and flops["flat"] == 98  # elementwise: output size


def test_flops_without_a_weight_shape_or_outputs():
    info = _info()
    conv = info.by_address["conv"]
    del info.shapes["wc"]
    assert info.flops(conv) == 2 * (4 * 6 * 6)  # unknown fan-in counts as 1
    convt = info.by_address["convt"]
    del info.shapes["wt"]
    assert info.flops(convt) == 2 * 7 * 7  # its output size
