"""`mpinfer build-engine` from the command line: one success path and every user mistake."""

from __future__ import annotations

import json

import pytest

from mpinfer.gpu import tensorrt_installed
from tests.conftest import assert_user_error


def _files(path):
    return sorted(p.name for p in path.iterdir())


def test_auto_says_which_backend_and_why(invoke, fp16_model):
    if tensorrt_installed():
        pytest.skip("TensorRT is installed here; auto would pick it")
    result = invoke("build-engine", fp16_model, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "Backend: onnxruntime (--device cpu: TensorRT needs a GPU" in result.output
    side = json.loads(fp16_model.with_name("model.fp16.ort.json").read_text())
    assert side["backend"] == "onnxruntime"


def test_explicit_output_and_opt_level(invoke, fp16_model, tmp_path):
    out = tmp_path / "engines" / "m.ort"
    result = invoke("build-engine", fp16_model, "--backend", "onnxruntime", "--opt-level", "1", "-o", out)
    assert result.exit_code == 0, result.output
    assert f"Wrote {out}" in result.output
    assert json.loads((tmp_path / "engines" / "m.ort.json").read_text())["build"]["opt_level"] == 1


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--shapes", "x:1x8,4x8"], "2 shapes"),
        (["--shapes", "y:1x8,4x8,8x8"], "'y'.*one of \\['x'\\]"),
        (["--shapes", "x:8x8,1x8,16x8"], "min <= opt <= max"),
        (["--shapes", "x:1x9,1x9,1x9"], "dim 1.*fixed in the model"),
        (["--workspace", "lots"], "--workspace: received 'lots'"),
        (["--fp16", "--backend", "onnxruntime"], "--fp16.*TensorRT 10.x build"),
        (["--backend", "onnxruntime", "-o", "OUT/m.engine"], "suffix '.engine'"),
        (["--device", "tpu"], "--device"),
    ],
)
def test_bad_input(invoke, fp16_model, tmp_path, args, pattern):
    args = [a.replace("OUT", str(tmp_path)) for a in args]
    before = _files(tmp_path)
    result = invoke("build-engine", fp16_model, *args)
    assert_user_error(result, pattern)
    assert _files(tmp_path) == before


def test_tensorrt_missing_gives_the_install_hint(invoke, fp16_model, tmp_path):
    if tensorrt_installed():
        pytest.skip("TensorRT is installed here")
    result = invoke("build-engine", fp16_model, "--backend", "tensorrt", "--shapes", "x:1x8,4x8,16x8")
    assert_user_error(result, r"TensorRT.*pip install tensorrt.*NVIDIA.s package index")
    assert _files(tmp_path) == ["model.fp16.onnx"]


def test_no_gpu_for_ort_cuda(invoke, fp16_model, tmp_path):
    from mpinfer.backends.ort import cuda_usable

    if cuda_usable():
        pytest.skip("this machine has CUDA")
    result = invoke("build-engine", fp16_model, "--backend", "onnxruntime", "--device", "cuda")
    assert_user_error(result, "CUDA provider.*--device cpu")
    assert _files(tmp_path) == ["model.fp16.onnx"]


def test_existing_output_and_input_as_output(invoke, fp16_model, tmp_path):
    out = tmp_path / "m.ort"
    out.write_bytes(b"keep")
    assert_user_error(invoke("build-engine", fp16_model, "--backend", "onnxruntime", "-o", out), "--force")
    assert out.read_bytes() == b"keep"
    assert_user_error(
        invoke("build-engine", fp16_model, "--backend", "onnxruntime", "-o", fp16_model, "--force"),
        "same path as an input",
    )


def test_not_an_onnx_file(invoke, tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"this is not protobuf at all \xff\xfe")
    assert_user_error(invoke("build-engine", bad, "--backend", "onnxruntime"), "ONNX model")
    assert _files(tmp_path) == ["model.onnx"]


def test_engine_suffix_without_tensorrt_says_so_and_what_to_run(invoke, fp16_model, tmp_path):
    """The README's `-o m.engine` where TensorRT is absent: the reason, not an internal temporary path."""
    if tensorrt_installed():
        pytest.skip("TensorRT is installed here")
    result = invoke("build-engine", fp16_model, "-o", tmp_path / "m.engine")
    assert_user_error(result, r"'.engine'.*TensorRT is not installed.*--backend onnxruntime -o .*model\.fp16\.ort"
                              r".*pip install tensorrt")
    assert ".tmp" not in result.output
    assert _files(tmp_path) == ["model.fp16.onnx"]


def test_help_lists_the_options(invoke):
    result = invoke("build-engine", "--help")
    for flag in (
        "--backend",
        "--shapes",
        "--timing-cache",
        "--workspace",
        "--opt-level",
        "--fp16",
        "--bf16",
        "--device",
        "--force",
    ):
        assert flag in result.output


def test_each_note_is_shown_once(invoke, tmp_path, caplog):
    """The library logs each note as a warning; the CLI echoed it again on stdout as 'Note:'."""
    from tests.engine.conftest import make_mixed_model

    model = make_mixed_model(tmp_path / "m.onnx", low="fp32")
    with caplog.at_level("WARNING", logger="mpinfer"):
        result = invoke("build-engine", model, "--backend", "onnxruntime", "-o", tmp_path / "m.ort")
    assert result.exit_code == 0, result.output
    shown = result.stdout.count("no fp16/bf16 tensors") + caplog.text.count("no fp16/bf16 tensors")
    assert shown == 1, (result.stdout, caplog.text)


def test_tensorrt_missing_is_said_before_asking_for_shapes(invoke, fp16_model):
    """Without TensorRT, asking for --shapes first sent the user on a detour to a second refusal."""
    if tensorrt_installed():
        pytest.skip("TensorRT is installed here")
    assert_user_error(invoke("build-engine", fp16_model, "--backend", "tensorrt"), r"no `tensorrt` Python package")
