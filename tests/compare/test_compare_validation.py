"""compare refuses what it cannot evaluate: checks without the metric, bad labels, bad counts, torch candidates."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mpinfer.compare import CompareConfig, compare_models
from mpinfer.errors import InvalidInputError
from tests.conftest import assert_user_error


def _cfg(files, **kw):
    return CompareConfig(str(files["base"]), (str(files["fp16"]),), show_progress=False, divergence=False, **kw)


def _tiny(path, classes: int | None):
    """x [batch, 4] -> MatMul -> y [batch, classes]; classes None: ReduceSum -> y [batch] (no classes)."""
    w = numpy_helper.from_array(np.eye(4, classes or 4, dtype=np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m" if classes is None else "y"], name="mm")]
    out = [1] if classes is None else [classes]
    if classes is None:
        nodes.append(helper.make_node("ReduceSum", ["m", "axes"], ["y"], name="sum", keepdims=0))
        out = []
    inits = [w] + ([numpy_helper.from_array(np.array([1], np.int64), "axes")] if classes is None else [])
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", *out])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


# -- defect 1: a requested check that cannot be evaluated is never a silent pass ----------------------------


def test_label_check_on_random_data_is_refused_up_front(invoke, mlp_files):
    r = invoke("compare", mlp_files["base"], mlp_files["fp16"], "--data", "random", "--check", "accuracy_drop<=0.01")
    assert_user_error(r, r"Check 'accuracy_drop<=0.01': received data 'random' without _labels")
    with pytest.raises(InvalidInputError, match="without _labels"):
        compare_models(_cfg(mlp_files, data=str(mlp_files["big"]), checks="accuracy>=0.5"))


def test_label_checks_are_evaluated_with_labels(mlp_files):
    result = compare_models(_cfg(mlp_files, data=str(mlp_files["small"]), checks="accuracy_drop<=1,accuracy>=0"))
    assert result and [(o.check, o.passed) for o in result.candidates[0].checks] == [
        ("accuracy_drop<=1", True),
        ("accuracy>=0", True),
    ]


def test_check_no_output_can_compute_fails_with_the_reason(invoke, tmp_path):
    four = _tiny(tmp_path / "four.onnx", 4)
    r = invoke("compare", four, four, "--check", "cosine>=0.99,top5>=0.9", "--no-divergence")
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "top5>=0.9 (not applicable: no output holds class scores with at least 6 classes" in r.output
    flat = _tiny(tmp_path / "flat.onnx", None)
    result = compare_models(CompareConfig(str(flat), (str(flat),), checks="top1>=0.9", show_progress=False))
    (outcome,) = result.candidates[0].checks
    assert not result and outcome.passed is False and outcome.value is None
    assert outcome.note is not None and "no output holds class scores" in outcome.note


def test_report_recheck_with_an_uncomputable_metric_fails(invoke, tmp_path):
    four = _tiny(tmp_path / "four.onnx", 4)
    assert invoke("compare", four, four, "--no-divergence", "--report", tmp_path / "rep").exit_code == 0
    r = invoke("report", tmp_path / "rep", "--check", "top5>=0.5")
    assert r.exit_code == 1 and "not applicable" in r.output


# -- defect 2: _labels are validated ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda y: np.stack([y, y], 1), r"_labels: received shape \(48, 2\)"),
        (lambda y: y.astype(np.float32) + 0.5, r"_labels: received dtype float32, expected integer"),
        (lambda y: y[:10], r"_labels: received 10 labels, expected one per sample \(48\)"),
        (lambda y: y + 100, r"_labels: received labels up to 10\d, expected class indices in \[0, 10\)"),
    ],
)
def test_bad_labels_are_user_errors(invoke, mlp_files, tmp_path, make, pattern):
    data = dict(np.load(mlp_files["small"]))
    data["_labels"] = make(data["_labels"])
    path = tmp_path / "bad.npz"
    np.savez(path, **data)
    r = invoke("compare", mlp_files["base"], mlp_files["fp16"], "--data", path, "--check", "accuracy>=0.5")
    assert_user_error(r, pattern)


# -- defect 3 and 6: counts and latency options ------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("--num-batches", "-1"),
        ("--num-batches", "0"),
        ("--batch-size", "0"),
        ("--iterations", "0"),
        ("--warmup", "-1"),
        ("--time-budget", "-1"),
        ("--time-budget", "0"),
        ("--divergence-batches", "0"),
        ("--batch-sizes", "0,8"),
    ],
)
def test_bad_counts_are_usage_errors(invoke, mlp_files, args):
    r = invoke("compare", mlp_files["base"], mlp_files["fp16"], *args)
    assert r.exit_code == 2 and f"Invalid value for '{args[0]}'" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("source", ["random:-1", "random:0"])
def test_random_needs_a_positive_count(invoke, mlp_files, source):
    r = invoke("compare", mlp_files["base"], mlp_files["fp16"], "--data", source)
    assert_user_error(r, r"expected random:N with N >= 1 batches")


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"num_batches": 0}, r"^--num-batches: received 0, expected a positive integer"),
        ({"num_batches": -1}, r"^--num-batches: received -1"),
        ({"warmup": -1}, r"^--warmup: received -1, expected an integer >= 0"),
        ({"batch_sizes": (0, 2)}, r"^--batch-sizes: received 0,2, expected batch sizes >= 1"),
        ({"time_budget_s": 0.0}, r"^--time-budget: received 0 s, expected a number of seconds > 0"),
        ({"time_budget_s": -1.0}, r"^--time-budget: received -1 s"),
    ],
)
def test_api_counts_each_get_their_own_message(mlp_files, kw, pattern):
    with pytest.raises(InvalidInputError, match=pattern):
        compare_models(_cfg(mlp_files, **kw))


def test_latency_options_without_latency_are_warned_about(invoke, mlp_files, caplog):
    with caplog.at_level(logging.WARNING, logger="mpinfer"):
        r = invoke(
            "compare", mlp_files["base"], mlp_files["fp16"], "--batch-sizes", "1,2", "--iterations", "3",
            "--no-divergence", "--quiet",
        )
    assert r.exit_code == 0, r.output
    assert caplog.text.count("only apply with --latency") == 1
    assert "--batch-sizes/--iterations only apply with --latency" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mpinfer"):
        invoke("compare", mlp_files["base"], mlp_files["fp16"], "--no-divergence", "--quiet")
    assert "only apply with --latency" not in caplog.text


# -- defect 4: a torch candidate --------------------------------------------------------------------------


def test_torch_candidate_is_refused_clearly(invoke, mlp_files):
    r = invoke("compare", mlp_files["base"], "models/mlp.py:build")
    assert_user_error(r, r"Candidate 'models/mlp.py:build': received a torch model.*only be the baseline")


# -- defect 7: messages and report details ------------------------------------------------------------------


def test_directory_as_model(invoke, mlp_files, tmp_path):
    r = invoke("compare", tmp_path, mlp_files["fp16"])
    assert_user_error(r, r"Model '.*': received a directory")


def test_thresholds_keep_their_digits(mlp_files):
    result = compare_models(_cfg(mlp_files, checks="cosine>=0.99999999,max_abs<=1e-07"))
    assert result.checks == ["cosine>=0.99999999", "max_abs<=1e-07"]


def test_report_on_a_non_report_json(invoke, tmp_path):
    plan = tmp_path / "m.plan.json"
    plan.write_text(json.dumps({"schema_version": 1, "precision": "fp16", "nodes": [], "summary": {}}))
    assert_user_error(invoke("report", plan), r"not a compare result \(a precision plan")
    side = tmp_path / "m.ort.json"
    side.write_text(json.dumps({"schema_version": 1, "kind": "mpinfer-engine"}))
    r = invoke("report", side)
    assert_user_error(r, r"not a compare result \(an engine sidecar")
    assert "KeyError" not in r.output


def test_latency_device_and_mean_based_speedup(mlp_files):
    result = compare_models(_cfg(mlp_files, latency=True, iterations=3, warmup=1, batch_sizes=(1, 4), device="auto"))
    lat = result.latency
    assert lat is not None and lat.device in ("cpu", "cuda")
    for base, cand in zip(lat.stats[::2], lat.stats[1::2], strict=True):
        assert base.speedup == 1.0
        assert cand.speedup == pytest.approx(base.mean_ms / cand.mean_ms)
        assert cand.speedup == pytest.approx(cand.throughput / base.throughput)


def _graph_model(path, nodes, inits, opset=17):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8), str(path))
    return path


def _invalid_fp16(tmp_path, kind):
    """Files another tool might write: a float16 tensor where the consumer takes float32 (ONNX Runtime refuses)."""
    w32 = numpy_helper.from_array(np.full((4,), 0.5, np.float32), "w")
    if kind == "cast-into-float32-add":
        nodes = [helper.make_node("Cast", ["x"], ["xh"], to=TensorProto.FLOAT16, name="cast"),
                 helper.make_node("Add", ["xh", "w"], ["y"], name="add")]
        return _graph_model(tmp_path / "bad.onnx", nodes, [w32])
    w16 = numpy_helper.from_array(np.eye(4, dtype=np.float16), "W")  # an FP16 weight into an FP32 MatMul
    return _graph_model(tmp_path / "bad.onnx", [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], [w16])


@pytest.mark.parametrize("numerics", ["ort", "strict"])
@pytest.mark.parametrize("kind", ["cast-into-float32-add", "float16-weight-into-float32-matmul"])
def test_an_invalid_candidate_is_refused_under_every_numerics(invoke, tmp_path, kind, numerics):
    """--numerics strict passed such a file (every check PASS, exit 0) that --numerics ort refused."""
    base = _graph_model(tmp_path / "base.onnx", [helper.make_node("Add", ["x", "w"], ["y"], name="add")],
                        [numpy_helper.from_array(np.full((4,), 0.5, np.float32), "w")])
    bad = _invalid_fp16(tmp_path, kind)
    r = invoke("compare", base, bad, "--numerics", numerics, "--data", "random:2", "--no-divergence")
    assert_user_error(r, r"Candidate '.*bad.onnx'.*(invalid ONNX model|could not be loaded).*(float16|float)")


def test_a_valid_bf16_candidate_the_cpu_provider_cannot_run_still_compares_strictly(invoke, tmp_path):
    """The load check does not hold a kernel ONNX Runtime's CPU provider lacks (BF16 MatMul) against a model."""
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")
    base = _graph_model(tmp_path / "base.onnx", [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], [w])
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16, name="c1"),
             helper.make_node("Cast", ["W"], ["wb"], to=TensorProto.BFLOAT16, name="c2"),
             helper.make_node("MatMul", ["xb", "wb"], ["yb"], name="mm"),
             helper.make_node("Cast", ["yb"], ["y"], to=TensorProto.FLOAT, name="c3")]
    bf16 = _graph_model(tmp_path / "bf16.onnx", nodes, [w])
    r = invoke("compare", base, bf16, "--numerics", "strict", "--data", "random:2", "--no-divergence",
               "--check", "cosine>=0.99")
    assert r.exit_code == 0, r.output
