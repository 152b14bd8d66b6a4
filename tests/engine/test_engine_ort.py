"""The ONNX Runtime engine, built and run for real on the CPU provider."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from mpinfer.backends.ort import OrtRunner
from mpinfer.engine import BuildConfig, build_engine, is_engine_artifact, load_engine_runner, parse_shapes
from mpinfer.engine.config import Backend
from mpinfer.engine.sidecar import sidecar_path
from mpinfer.errors import BackendUnavailableError, InvalidInputError, ModelLoadError
from mpinfer.fileio import sha256_file
from tests.engine.conftest import make_mixed_model
from tests.tolerances import assert_reorder_close, eps


def _assert_fp16_matmul_close(got, want, model_path, x):
    """The mixed model's FP16 MatMul: each output sums ``width`` products in float32 (onnxruntime casts around
    its FP16 MatMul on CPU), in an order the optimised graph may change, then rounds to FP16 (an ulp apart)."""
    import onnx
    from onnx import numpy_helper

    w = numpy_helper.to_array(onnx.load(str(model_path)).graph.initializer[0]).astype(np.float64)
    terms = np.abs(x.astype(np.float16).astype(np.float64)) @ np.abs(w)
    assert_reorder_close(got, want, n=w.shape[0], magnitude=terms, rtol=eps(np.float16))


def _build(model, **kw):
    return build_engine(BuildConfig(model=model, backend=Backend.ONNXRUNTIME, device="cpu", **kw))


def test_ort_engine_runs_like_the_source_model(fp16_model, feeds):
    result = _build(fp16_model)
    assert result.path == fp16_model.with_name("model.fp16.ort") and result.backend is Backend.ONNXRUNTIME
    assert is_engine_artifact(result.path)
    with load_engine_runner(result.path) as runner:
        got = runner.infer(feeds)
        info = runner.describe()
    with OrtRunner(fp16_model) as ref:
        want = ref.infer(feeds)
    _assert_fp16_matmul_close(got["y"], want["y"], fp16_model, feeds["x"])
    assert info["backend"] == "onnxruntime-engine" and info["providers"] == ["CPUExecutionProvider"]


def test_sidecar_records_what_the_engine_depends_on(fp16_model):
    (fp16_model.parent / "model.fp16.plan.json").write_text(
        json.dumps(
            {"schema_version": 1, "precision": "fp16", "summary": {"nodes_low": 2}, "source": {"sha256": "x"}}
        )
    )
    result = _build(fp16_model, shapes=parse_shapes("x:1x8,4x8,16x8"), opt_level=2)
    side = json.loads(result.sidecar.read_text())
    assert side["kind"] == "mpinfer-engine" and side["backend"] == "onnxruntime"
    assert side["engine"]["sha256"] == sha256_file(result.path)
    assert side["source"]["sha256"] == sha256_file(fp16_model)
    assert side["onnxruntime"]["version"] == ort.__version__
    assert side["onnxruntime"]["providers"] == ["CPUExecutionProvider"]
    assert side["onnxruntime"]["graph_optimization_level"] == "ORT_ENABLE_EXTENDED"
    assert side["onnxruntime"]["format"] == "ort"
    assert side["device"] == {
        "kind": "cpu",
        "gpu_name": None,
        "compute_capability": None,
        "cpu": side["device"]["cpu"],
    }
    assert side["profiles"] == [{"x": {"min": [1, 8], "opt": [4, 8], "max": [16, 8]}}]
    assert side["precision"]["graph"] == ["fp16", "fp32"]
    assert side["precision"]["plan"]["summary"] == {"nodes_low": 2}
    assert side["mpinfer_version"]


def test_optimised_onnx_output(fp16_model, feeds):
    result = _build(fp16_model, output=fp16_model.with_name("engine.opt.onnx"))
    assert json.loads(result.sidecar.read_text())["onnxruntime"]["format"] == "onnx"
    with load_engine_runner(result.path) as runner:
        assert runner.infer(feeds)["y"].shape == (3, 4)


def test_fp32_model_gets_a_note(tmp_path):
    result = _build(make_mixed_model(tmp_path / "m.onnx", low="fp32"))
    assert any("no fp16/bf16 tensors" in n for n in result.notes)


def test_refusals_write_nothing(fp16_model, tmp_path):
    with pytest.raises(InvalidInputError, match="suffix '.engine'.*'.ort' or '.onnx'"):
        _build(fp16_model, output=tmp_path / "m.engine")
    with pytest.raises(InvalidInputError, match="--fp16.*TensorRT 10.x build.*mpinfer convert"):
        _build(fp16_model, weak_precisions=(pytest.importorskip("mpinfer.specs").Precision.FP16,))
    with pytest.raises(InvalidInputError, match="same path as an input"):
        _build(fp16_model, output=fp16_model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.fp16.onnx"]


def test_existing_engine_needs_force(fp16_model):
    first = _build(fp16_model)
    before = first.path.read_bytes()
    with pytest.raises(InvalidInputError, match="pass --force"):
        _build(fp16_model)
    assert first.path.read_bytes() == before
    assert _build(fp16_model, force=True).path == first.path


def test_tampered_engine_is_refused(fp16_model):
    result = _build(fp16_model)
    result.path.write_bytes(result.path.read_bytes() + b"\0")
    with pytest.raises(ModelLoadError, match="sha256 differs from its sidecar"):
        load_engine_runner(result.path)


def test_engine_from_another_onnxruntime_is_refused(fp16_model):
    result = _build(fp16_model)
    side = json.loads(result.sidecar.read_text())
    side["onnxruntime"]["version"] = "1.2.0"
    sidecar_path(result.path).write_text(json.dumps(side))
    with pytest.raises(ModelLoadError, match=r"built with onnxruntime 1.2.0, expected onnxruntime .*rebuild"):
        load_engine_runner(result.path)


def test_cuda_engine_on_a_machine_without_cuda_is_refused(fp16_model):
    from mpinfer.backends.ort import cuda_usable

    if cuda_usable():
        pytest.skip("this machine has CUDA; the refusal is for machines without it")
    result = _build(fp16_model)
    side = json.loads(result.sidecar.read_text())
    side["onnxruntime"]["providers"] = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    side["device"].update(kind="cuda", gpu_name="NVIDIA L4", compute_capability="8.9")
    sidecar_path(result.path).write_text(json.dumps(side))
    with pytest.raises(BackendUnavailableError, match="CUDA provider.*--device cpu"):
        load_engine_runner(result.path)


def test_device_mismatch_is_refused(fp16_model):
    result = _build(fp16_model)
    with pytest.raises(InvalidInputError, match="optimised for cpu"):
        load_engine_runner(result.path, device="cuda")


def test_missing_engine():
    with pytest.raises(ModelLoadError, match="no such file"):
        load_engine_runner("nope.ort")


@pytest.mark.gpu
def test_cuda_engine_runs(fp16_model, feeds):
    result = build_engine(BuildConfig(model=fp16_model, backend=Backend.ONNXRUNTIME, device="cuda"))
    side = json.loads(result.sidecar.read_text())
    assert side["onnxruntime"]["providers"][0] == "CUDAExecutionProvider" and side["device"]["kind"] == "cuda"
    with load_engine_runner(result.path) as runner, OrtRunner(fp16_model) as ref:
        np.testing.assert_allclose(runner.infer(feeds)["y"], ref.infer(feeds)["y"], rtol=1e-2, atol=1e-2)
        assert runner.describe()["numerics"] == "ort-cuda"


def test_model_with_external_data_builds_an_optimised_onnx(tmp_path):
    from mpinfer.modelio import load_onnx, save_onnx

    src = make_mixed_model(
        tmp_path / "inline.onnx", width=1024
    )  # 8 KiB of weights: above the 1 KiB threshold
    feeds = {"x": np.random.default_rng(2).standard_normal((3, 1024)).astype(np.float32)}
    ext = save_onnx(load_onnx(src), tmp_path / "ext" / "model.onnx", external_data=True)
    assert (tmp_path / "ext" / "model.onnx.data").is_file()
    with pytest.raises(InvalidInputError, match=r"external data.*-o .*model\.ort\.onnx"):
        _build(ext, output=tmp_path / "ext" / "model.ort")
    out = tmp_path / "engine" / "model.opt.onnx"
    result = _build(ext, output=out)
    side = json.loads(result.sidecar.read_text())
    assert side["onnxruntime"]["format"] == "onnx"
    assert side["onnxruntime"]["external_data"] == "model.opt.onnx.data"
    assert (out.parent / "model.opt.onnx.data").stat().st_size >= 1024 * 4 * 2
    with load_engine_runner(result.path) as runner, OrtRunner(src) as ref:
        _assert_fp16_matmul_close(runner.infer(feeds)["y"], ref.infer(feeds)["y"], src, feeds["x"])
    # the sidecar's checksum covers the data file too: a corrupted weight is refused, not silently run
    assert side["engine"]["data"]["path"] == "model.opt.onnx.data"
    data = out.parent / "model.opt.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match=r"'model.opt.onnx.data'\) whose sha256 differs from its sidecar"):
        load_engine_runner(result.path)


def test_model_with_external_data_gets_an_onnx_engine_by_default(tmp_path):
    """Without -o, the default .ort was refused, and the hint's path was the input model itself."""
    from mpinfer.modelio import load_onnx, save_onnx

    src = make_mixed_model(tmp_path / "inline.onnx", width=1024)
    ext = save_onnx(load_onnx(src), tmp_path / "ext" / "model.fp16.onnx", external_data=True)
    with pytest.raises(InvalidInputError, match="external data") as err:
        _build(ext, output=tmp_path / "ext" / "model.fp16.ort")
    hinted = Path(str(err.value).split("-o ")[1].split(" ")[0])
    assert hinted != ext and hinted.suffix == ".onnx"
    result = _build(ext)
    assert result.path == tmp_path / "ext" / "model.fp16.ort.onnx" and result.path.is_file()
    assert ext.is_file() and (tmp_path / "ext" / "model.fp16.onnx.data").is_file()
