"""TensorRT builds and runs: only where TensorRT and a GPU exist (skipped elsewhere, never faked)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

trt = pytest.importorskip("tensorrt")

from mpinfer.backends.ort import OrtRunner  # noqa: E402
from mpinfer.engine import BuildConfig, build_engine, load_engine_runner, parse_shapes  # noqa: E402
from mpinfer.engine.config import Backend  # noqa: E402
from mpinfer.engine.machine import STRONG_ONLY_TENSORRT_MAJOR, tensorrt_major  # noqa: E402
from mpinfer.engine.sidecar import sidecar_path  # noqa: E402
from mpinfer.errors import InvalidInputError, ModelLoadError  # noqa: E402
from mpinfer.specs import Precision  # noqa: E402
from tests.engine.conftest import make_mixed_model  # noqa: E402

pytestmark = [pytest.mark.tensorrt, pytest.mark.gpu]
MAJOR = tensorrt_major(trt.__version__)


def _cfg(model, tmp_path, **kw):
    return BuildConfig(
        model=model,
        output=tmp_path / "m.engine",
        backend=Backend.TENSORRT,
        shapes=parse_shapes("x:1x8,4x8,16x8"),
        timing_cache=tmp_path / "timing.cache",
        workspace=256 << 20,
        opt_level=1,
        **kw,
    )


def test_strongly_typed_engine_matches_onnxruntime(fp16_model, tmp_path, feeds):
    result = build_engine(_cfg(fp16_model, tmp_path))
    side = json.loads(result.sidecar.read_text())
    assert side["tensorrt"]["version"] == trt.__version__ and side["tensorrt"]["strongly_typed"]
    assert side["tensorrt"]["network_flags"] == (
        [] if MAJOR >= STRONG_ONLY_TENSORRT_MAJOR else ["STRONGLY_TYPED"]
    )
    assert side["device"]["compute_capability"] and side["profiles"][0]["x"]["max"] == [16, 8]
    assert (tmp_path / "timing.cache").stat().st_size > 0
    with load_engine_runner(result.path) as runner, OrtRunner(fp16_model) as ref:
        for batch in (1, 3, 16):
            x = {"x": feeds["x"][:1].repeat(batch, axis=0)}
            np.testing.assert_allclose(runner.infer(x)["y"], ref.infer(x)["y"], rtol=1e-2, atol=1e-2)
        with pytest.raises(InvalidInputError, match="optimization profile"):
            runner.infer({"x": np.zeros((17, 8), np.float32)})


def test_default_profile_without_shapes(fp16_model, tmp_path, feeds):
    """No --shapes: the batch dim gets 1-16, as the warning and the sidecar say."""
    result = build_engine(dataclasses.replace(_cfg(fp16_model, tmp_path), shapes=()))
    side = json.loads(result.sidecar.read_text())
    assert side["profiles"][0]["x"] == {"min": [1, 8], "opt": [16, 8], "max": [16, 8]}
    assert any("no --shapes" in n for n in side["notes"]) and result.notes[0].startswith("no --shapes")
    with load_engine_runner(result.path) as runner, OrtRunner(fp16_model) as ref:
        x = {"x": feeds["x"]}
        np.testing.assert_allclose(runner.infer(x)["y"], ref.infer(x)["y"], rtol=1e-2, atol=1e-2)


def test_timing_cache_is_reused(fp16_model, tmp_path):
    build_engine(_cfg(fp16_model, tmp_path))
    size = (tmp_path / "timing.cache").stat().st_size
    build_engine(_cfg(fp16_model, tmp_path, force=True))
    assert (tmp_path / "timing.cache").stat().st_size >= size


def test_weak_flags_follow_the_version(fp16_model, tmp_path):
    if MAJOR >= STRONG_ONLY_TENSORRT_MAJOR:
        with pytest.raises(InvalidInputError, match="TensorRT 11 removed weak typing"):
            build_engine(_cfg(fp16_model, tmp_path, weak_precisions=(Precision.FP16,)))
        assert not (tmp_path / "m.engine").exists()
    else:
        fp32 = make_mixed_model(tmp_path / "m32.onnx", low="fp32")
        result = build_engine(_cfg(fp32, tmp_path, weak_precisions=(Precision.FP16,)))
        assert json.loads(result.sidecar.read_text())["tensorrt"]["builder_flags"] == ["FP16"]


def test_parser_errors_name_the_node(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("NoSuchOp", ["x"], ["y"], name="Mystery_0", domain="com.example")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    )
    path = tmp_path / "bad.onnx"
    onnx.save(model, path)
    with pytest.raises(Exception, match="Mystery_0"):
        build_engine(BuildConfig(model=path, output=tmp_path / "bad.engine", backend=Backend.TENSORRT))
    assert not (tmp_path / "bad.engine").exists()


def test_engine_from_another_version_is_refused(fp16_model, tmp_path):
    result = build_engine(_cfg(fp16_model, tmp_path))
    side = json.loads(result.sidecar.read_text())
    side["tensorrt"]["version"] = "10.0.0.0"
    sidecar_path(result.path).write_text(json.dumps(side))
    with pytest.raises(ModelLoadError, match="built with TensorRT 10.0.0.0"):
        load_engine_runner(result.path)


def test_a_fused_rms_normalization_gets_an_engine_on_every_tensorrt(tmp_path, feeds):
    """The default plan of a decoder holds RMSNormalization (opset 23): TensorRT < 10.15 gets the expanded chain."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from mpinfer.modelio import ir_version_for, save_onnx

    scale = np.random.default_rng(2).uniform(0.5, 1.5, 8).astype(np.float16)
    nodes = [helper.make_node("Cast", ["x"], ["xl"], to=TensorProto.FLOAT16, name="Cast_0"),
             helper.make_node("RMSNormalization", ["xl", "scale"], ["n"], name="norm", axis=-1, epsilon=1e-5,
                              stash_type=1),
             helper.make_node("Cast", ["n"], ["y"], to=TensorProto.FLOAT, name="Cast_1")]
    graph = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
                              [numpy_helper.from_array(scale, "scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = ir_version_for(model)
    onnx.checker.check_model(model, full_check=True)
    path = save_onnx(model, tmp_path / "rms.fp16.onnx")
    result = build_engine(_cfg(path, tmp_path))
    notes = " ".join(json.loads(result.sidecar.read_text())["notes"])
    version = tuple(int(p) for p in trt.__version__.split(".")[:2])
    assert ("node(s) expanded" in notes) == (version < (10, 15))
    with load_engine_runner(result.path) as runner, OrtRunner(path) as ref:
        got, want = runner.infer(feeds)["y"], ref.infer(feeds)["y"]
    np.testing.assert_allclose(got, want, rtol=2 * 2**-10, atol=2**-14)  # two FP16 roundings apart at most
