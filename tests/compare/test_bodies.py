"""Divergence inside If/Loop bodies: body tensors come from the strict emulator and join the ranking."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpinfer.compare import CompareConfig, compare_models
from mpinfer.compare.bodies import measure_body_tensors
from mpinfer.compare.divergence import find_divergence
from mpinfer.modelio import save_onnx
from mpinfer.report import tables
from tests.tolerances import reorder_atol

F = TensorProto.FLOAT
LN = "if/then_branch/ln_body"


def _model(nodes, inits, name):
    g = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", F, ["batch", 8])],
        [helper.make_tensor_value_info("out", F, ["batch", 8])],
        [numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    return m


def _if_model():
    """x @ w -> If(max(x) > -1e9): LayerNorm (then) | Identity (else) -> + bias."""
    then_g = helper.make_graph(
        [helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["ln"], name="ln_body", axis=-1)],
        "then",
        [],
        [helper.make_tensor_value_info("ln", F, ["batch", 8])],
    )
    else_g = helper.make_graph(
        [helper.make_node("Identity", ["h"], ["idn"], name="id_body")],
        "else",
        [],
        [helper.make_tensor_value_info("idn", F, ["batch", 8])],
    )
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("ReduceMax", ["x"], ["xmax"], name="rmax", keepdims=0),
        helper.make_node("Greater", ["xmax", "thr"], ["cond"], name="gt"),
        helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_g, else_branch=else_g),
        helper.make_node("Add", ["y", "bias"], ["out"], name="add"),
    ]
    rng = np.random.default_rng(0)
    inits = {
        "w": (np.eye(8) + 0.01 * rng.standard_normal((8, 8))).astype(np.float32),
        "thr": np.array(-1e9, np.float32),
        "gamma": np.ones(8, np.float32),
        "beta": np.zeros(8, np.float32),
        "bias": np.full(8, 0.5, np.float32),
    }
    return _model(nodes, inits, "if_ln")


def _loop_model():
    """Loop 3 times: s += x; out = s (iterations see x, 2x, 3x)."""
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="cond_id"),
            helper.make_node("Add", ["s_in", "x"], ["s_out"], name="acc_add"),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_in", F, ["batch", 8]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_out", F, ["batch", 8]),
        ],
    )
    nodes = [
        helper.make_node("Mul", ["x", "zero"], ["s0"], name="init_mul"),
        helper.make_node("Loop", ["trips", "", "s0"], ["s"], name="loop", body=body),
        helper.make_node("Identity", ["s"], ["out"], name="out_id"),
    ]
    inits = {"zero": np.zeros(1, np.float32), "trips": np.array(3, np.int64)}
    return _model(nodes, inits, "loop_acc")


@pytest.fixture
def if_files(tmp_path):
    from mpinfer.precision import ConvertConfig, convert_precision

    base = tmp_path / "if_ln.onnx"
    save_onnx(_if_model(), base)
    res = convert_precision(
        ConvertConfig(
            model=base,
            output=tmp_path / "if_ln.fp16.onnx",
            calibration="none",
            low_nodes=(LN,),
            keep_ops=("MatMul",),
            progress=False,
        )
    )
    data = tmp_path / "big.npz"  # beyond FP16's range: the body's LayerNorm (float32 statistics) reads inf
    np.savez(data, x=(np.random.default_rng(1).standard_normal((16, 8)) * 3e4).astype(np.float32))
    return base, res.output, data


def _if_reorder_tol(base, data) -> float:
    """Relative L2 error float32 reordering allows in h = x @ w and in LayerNorm(h) (h: 8-term sums).

    Each row's LayerNorm output (unit RMS) moves by the MatMul's, the mean's and the variance's rounding at
    the row's sum |x_k w_kj|, over the row's standard deviation: three 8-term stages at that magnitude.
    """
    x = np.load(data)["x"].astype(np.float64)
    w = next(numpy_helper.to_array(t) for t in onnx.load(str(base)).graph.initializer if t.name == "w")
    h, terms = x @ w.astype(np.float64), np.abs(x) @ np.abs(w.astype(np.float64))
    return reorder_atol(np.float32, n=8, magnitude=float(np.max(terms.max(-1) / h.std(-1))), stages=3)


@pytest.mark.parametrize("numerics", ["ort", "strict"])
def test_overflow_inside_an_if_body_is_the_first_jump(if_files, numerics):
    base, cand, data = if_files
    result = compare_models(
        CompareConfig(str(base), (str(cand),), data=str(data), numerics=numerics, show_progress=False)
    )
    div = result.candidates[0].divergence
    assert div is not None and div.first_jump is not None
    jump = div.first_jump
    assert jump.address == LN and jump.op_type == "LayerNormalization" and jump.precision == "fp16"
    # The baseline's tensors come from onnxruntime, the candidate's FP32 MatMul (and, in strict, the If body)
    # from the emulator: their 8-term float32 sums may round apart (3.3e-8 seen), so no exact zero.
    tol = _if_reorder_tol(base, data)
    assert jump.reason == "user:low-node" and jump.error >= 0.5 and jump.input_error <= tol
    assert div.ranking[0] == LN and jump.numerics == "strict"  # body tensors come from the emulator
    addresses = [n.address for n in div.nodes]
    assert addresses.index(LN) < addresses.index("if")  # the body runs before its If's output exists
    if_node = next(n for n in div.nodes if n.address == "if")
    assert if_node.added <= tol * (1 + if_node.error)  # the If only forwards its branch's error
    assert div.skipped.get("subgraph_nodes") == 1  # the else branch never ran
    lines = tables.divergence_lines(result.candidates[0])
    assert any(f"LayerNormalization '{LN}' (fp16)" in line for line in lines)
    assert any("bodies were compared in the strict emulator" in line for line in lines)
    assert not any("Casts that onnxruntime otherwise folds away" in line for line in lines)


def test_loop_body_tensors_accumulate_over_iterations(tmp_path):
    from mpinfer.precision import convert_model

    base = _loop_model()
    cand = convert_model(base, low_ops=("Add",)).model
    x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    cov = measure_body_tensors(base, cand, [{"x": x}, {"x": x}])
    acc = cov.accs["loop/body/s_out"]
    # iterations see x, 2x, 3x on each of the two batches: the baseline's energy sums over all six
    assert acc.sum_b2 == pytest.approx(2 * (1 + 4 + 9) * float(np.sum(x.astype(np.float64) ** 2)), rel=1e-5)
    assert acc.nonfinite == 0 and 0 < acc.error < 1e-2 and acc.dtype == "float16"
    assert "loop/body/s_in" in cov.accs

    save_onnx(base, tmp_path / "loop.onnx")
    save_onnx(cand, tmp_path / "loop.fp16.onnx")
    div = find_divergence(tmp_path / "loop.onnx", tmp_path / "loop.fp16.onnx", [{"x": x}])
    node = next(n for n in div.nodes if n.address == "loop/body/acc_add")
    assert node.op_type == "Add" and node.precision == "fp16" and math.isfinite(node.error)
    assert div.first_jump is None and div.skipped["subgraph_nodes"] == 0


def test_unsupported_ops_skip_body_coverage_with_a_note(tmp_path, monkeypatch):
    from mpinfer.precision.emulator.emulate import GraphEmulator

    monkeypatch.setattr(GraphEmulator, "unsupported_ops", lambda self: {"custom::Nms"})
    base = _loop_model()
    save_onnx(base, tmp_path / "loop.onnx")
    x = np.ones((2, 8), np.float32)
    div = find_divergence(tmp_path / "loop.onnx", tmp_path / "loop.onnx", [{"x": x}])
    assert not any("/" in n.address for n in div.nodes)
    assert div.skipped["subgraph_nodes"] == 2
    assert len(div.notes) == 1 and "custom::Nms" in div.notes[0] and "not compared" in div.notes[0]


def test_model_without_bodies_has_no_body_notes(mlp_files):
    result = compare_models(
        CompareConfig(
            str(mlp_files["base"]), (str(mlp_files["fp16"]),), data=str(mlp_files["small"]), show_progress=False
        )
    )
    div = result.candidates[0].divergence
    assert div is not None and div.notes == [] and not div.skipped.get("subgraph_nodes")
    assert not any("/" in n.address and n.address.startswith(("If", "Loop")) for n in div.nodes)


def test_divergence_reads_big_embedded_weights_from_a_scratch_copy(mlp_files, monkeypatch):
    """Past SPILL_BYTES (set small here) a model's embedded weights are written once to a scratch external-data
    copy for the divergence's sessions: the same per-node errors as from the proto, and the copy removed after."""
    from mpinfer.compare import divergence

    batch = dict(np.load(mlp_files["small"]))
    batch = {k: v for k, v in batch.items() if not k.startswith("_")}
    plain = find_divergence(mlp_files["base"], mlp_files["broken"], [batch])
    folder = set(mlp_files["broken"].parent.iterdir())
    spilled = []
    real_save = divergence.save_streamed
    monkeypatch.setattr(divergence, "SPILL_BYTES", 0)
    monkeypatch.setattr(divergence, "save_streamed", lambda m, p, *a: spilled.append(p) or real_save(m, p, *a))
    copied = find_divergence(mlp_files["base"], mlp_files["broken"], [batch])
    assert len(spilled) == 2 and not any(p.parent.exists() for p in spilled)
    assert set(mlp_files["broken"].parent.iterdir()) == folder
    assert [n.address for n in copied.nodes] == [n.address for n in plain.nodes] and plain.nodes
    for a, b in zip(copied.nodes, plain.nodes):
        assert a.error == pytest.approx(b.error, rel=1e-6, abs=1e-12)
    assert (copied.first_jump is None) == (plain.first_jump is None)
