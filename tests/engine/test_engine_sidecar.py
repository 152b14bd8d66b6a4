from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpinfer.engine.sidecar import (
    MachineFacts,
    check_compatible,
    graph_precisions,
    plan_path_for,
    read_plan_summary,
    read_sidecar,
    sidecar_path,
)
from mpinfer.errors import BackendUnavailableError, ModelLoadError
from mpinfer.modelio import load_onnx
from tests.engine.conftest import make_mixed_model


@pytest.mark.parametrize(
    ("low", "expected"), [("fp16", {"fp16", "fp32"}), ("bf16", {"bf16", "fp32"}), ("fp32", {"fp32"})]
)
def test_graph_precisions(tmp_path, low, expected):
    model = load_onnx(make_mixed_model(tmp_path / "m.onnx", low=low))
    assert {p.value for p in graph_precisions(model)} == expected


def test_paths():
    assert sidecar_path("out/m.engine") == Path("out/m.engine.json")
    assert plan_path_for("out/model.fp16.onnx") == Path("out/model.fp16.plan.json")


def test_plan_summary_is_read_from_the_plan_beside_the_model(tmp_path):
    model = tmp_path / "m.fp16.onnx"
    assert read_plan_summary(None, model) is None
    plan = {
        "schema_version": 1,
        "precision": "fp16",
        "numerics": "strict",
        "budget": "1e-2",
        "source": {"path": "m.onnx", "sha256": "ab"},
        "nodes": [],
        "summary": {"nodes_total": 4, "nodes_low": 2},
    }
    (tmp_path / "m.fp16.plan.json").write_text(json.dumps(plan))
    got = read_plan_summary(None, model)
    assert got["precision"] == "fp16" and got["summary"] == {"nodes_total": 4, "nodes_low": 2}
    assert got["source_sha256"] == "ab"


def test_explicit_plan_must_exist_and_parse(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        read_plan_summary(tmp_path / "nope.plan.json", tmp_path / "m.onnx")
    bad = tmp_path / "bad.plan.json"
    bad.write_text("{not json")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        read_plan_summary(bad, tmp_path / "m.onnx")


H100 = MachineFacts("tensorrt", "10.13.0", "NVIDIA H100 80GB HBM3", "9.0")


def test_same_machine_is_compatible():
    assert check_compatible(H100, H100, Path("m.engine")) == []


def test_engine_from_another_tensorrt_version_is_refused():
    here = MachineFacts("tensorrt", "10.14.1", "NVIDIA H100 80GB HBM3", "9.0")
    with pytest.raises(
        ModelLoadError, match=r"built with TensorRT 10.13.0, expected TensorRT 10.14.1 .*rebuild"
    ):
        check_compatible(H100, here, Path("m.engine"))


def test_engine_for_another_gpu_generation_is_refused():
    here = MachineFacts("tensorrt", "10.13.0", "NVIDIA A100-SXM4-80GB", "8.0")
    with pytest.raises(
        ModelLoadError, match=r"built for NVIDIA H100.*\(compute capability 9.0\).*capability 8.0"
    ):
        check_compatible(H100, here, Path("m.engine"))


def test_same_generation_other_model_only_warns():
    here = MachineFacts("tensorrt", "10.13.0", "NVIDIA H200", "9.0")
    warnings = check_compatible(H100, here, Path("m.engine"))
    assert len(warnings) == 1 and "runs on NVIDIA H200" in warnings[0]


def test_ort_engines():
    cpu = MachineFacts("onnxruntime", "1.31.1", providers=("CPUExecutionProvider",))
    assert (
        check_compatible(
            cpu, MachineFacts("onnxruntime", "1.31.0", providers=("CPUExecutionProvider",)), Path("m.ort")
        )
        == []
    )
    with pytest.raises(ModelLoadError, match="onnxruntime 1.30.0"):
        check_compatible(MachineFacts("onnxruntime", "1.30.0"), cpu, Path("m.ort"))
    cuda = MachineFacts(
        "onnxruntime", "1.31.1", "NVIDIA L4", "8.9", ("CUDAExecutionProvider", "CPUExecutionProvider")
    )
    with pytest.raises(BackendUnavailableError, match="CUDA provider.*--device cpu"):
        check_compatible(cuda, cpu, Path("m.ort"))


def test_read_sidecar_refusals(tmp_path):
    engine = tmp_path / "m.engine"
    assert read_sidecar(engine) is None
    sidecar_path(engine).write_text("{")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        read_sidecar(engine)
    sidecar_path(engine).write_text(json.dumps({"kind": "something-else"}))
    with pytest.raises(ModelLoadError, match="another kind"):
        read_sidecar(engine)
    sidecar_path(engine).write_text(json.dumps({"kind": "mpinfer-engine", "schema_version": 99}))
    with pytest.raises(ModelLoadError, match="schema_version 99.*upgrade mpinfer"):
        read_sidecar(engine)
