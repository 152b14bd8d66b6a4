from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from mpinfer.errors import ExportError, InvalidInputError, ModelLoadError
from mpinfer.export import ExportConfig, export_onnx
from mpinfer.export.names import nodes_for_module
from mpinfer.modelio import ort_session
from tests.conftest import ROOT, assert_user_error, unwritable_outputs
from tests.tolerances import torch_reorder_atol

MODELS = ROOT / "models"


def _export(tmp_path: Path, source: str, exporter: str = "auto", **kw) -> tuple[object, dict]:
    out = tmp_path / f"{Path(source.split(':')[0]).stem}.{exporter}.onnx"
    res = export_onnx(ExportConfig(source=source, output=out, exporter=exporter, **kw))
    sidecar = json.loads(res.sidecar.read_text())
    return res, sidecar


@pytest.mark.parametrize(
    ("source", "exporter"),
    [
        ("resnet_small.py:build", "dynamo"),
        ("resnet_small.py:build", "torchscript"),
        ("digits_cnn.py:build", "dynamo"),
        ("digits_cnn.py:build", "torchscript"),
        ("mlp.py:build", "dynamo"),
        ("mlp.py:build", "torchscript"),
        ("transformer_small.py:build", "dynamo"),
        ("transformer_small.py:build", "torchscript"),
        ("control_flow.py:build", "dynamo"),
        ("control_flow.py:build_scriptable", "torchscript"),
    ],
)
def test_every_example_model_exports_with_parity(tmp_path, source, exporter):
    res, sidecar = _export(tmp_path, str(MODELS / source), exporter)
    assert res.exporter == exporter
    assert sidecar["parity"]["passed"] is True
    assert len(sidecar["parity"]["runs"]) == 3
    assert sidecar["parity"]["max_abs"] < 1e-4
    model = onnx.load(str(res.path))
    onnx.checker.check_model(model, full_check=True)
    assert all(n.name for n in model.graph.node), "every node is named"
    if "control_flow" in source:
        assert any(n.op_type == "If" for n in model.graph.node)


def test_dynamic_batch_runs_at_other_sizes_and_parity_covers_them(tmp_path):
    res, sidecar = _export(tmp_path, str(MODELS / "resnet_small.py:build"), "dynamo",
                           inputs=("x:batchx3x32x32:float32",))
    batches = sorted({run["shapes"]["x"][0] for run in sidecar["parity"]["runs"]})
    assert batches == [1, 2, 3]
    sess = ort_session(res.path)
    for b in (1, 7):
        (y,) = sess.run(None, {"x": np.zeros((b, 3, 32, 32), np.float32)})
        assert y.shape == (b, 10)


def test_dynamic_restricts_symbols_and_integer_ranges_are_recorded(tmp_path):
    res, sidecar = _export(tmp_path, str(MODELS / "transformer_small.py:build"), "dynamo",
                           inputs=("input_ids:batchxseq=12:int64:0..1000",), dynamic=("batch",))
    model = onnx.load(str(res.path))
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and dims[1].dim_value == 12
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["mpinfer.input_ranges"]) == {"input_ids": [0.0, 1000.0]}
    assert sidecar["inputs"] == ["input_ids:batchx12:int64:0..1000"]


def test_weights_state_dict_and_trainer_checkpoint(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("mlp_mod", MODELS / "mlp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    net = mod.build()
    # Seeded noise, not a common offset: +0.5 on every weight gave each LayerNorm inputs of ~100 +- 0.75,
    # whose mean subtraction multiplied float32 rounding by ~150 (1.2e-5 apart from onnxruntime on one thread).
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    torch.save(net.state_dict(), tmp_path / "sd.pt")
    torch.save({"model": net.state_dict(), "epoch": 3}, tmp_path / "ckpt.pt")
    x = mod.example_inputs()[0]
    with torch.no_grad():
        ref = net(x).numpy()
    tol = torch_reorder_atol(net, x)  # 256-term float32 sums, 4 layers, at their measured magnitudes
    assert np.abs(mod.build()(x).detach().numpy() - ref).max() > 100 * tol  # unloaded weights would fail
    for w in ("sd.pt", "ckpt.pt"):
        res = export_onnx(ExportConfig(str(MODELS / "mlp.py:build"), tmp_path / f"{w}.onnx",
                                       weights=tmp_path / w, exporter="torchscript"))
        (y,) = ort_session(res.path).run(None, {"x": x.numpy()})
        np.testing.assert_allclose(y, ref, rtol=0, atol=tol)


def test_torchscript_and_exported_program_sources(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits_mod", MODELS / "digits_cnn.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    net = mod.build()
    x = mod.example_inputs()[0]
    torch.jit.save(torch.jit.trace(net, x), tmp_path / "net.ts")
    res = export_onnx(ExportConfig(str(tmp_path / "net.ts"), tmp_path / "ts.onnx",
                                   inputs=("x:4x1x8x8:float32",)))
    assert res.exporter == "torchscript" and res.parity.passed
    ep = torch.export.export(net, (x,))
    torch.export.save(ep, tmp_path / "net.pt2")
    res = export_onnx(ExportConfig(str(tmp_path / "net.pt2"), tmp_path / "ep.onnx", inputs=("x:4x1x8x8:float32",)))
    assert res.exporter == "dynamo" and res.parity.passed


def test_nodes_for_module_maps_both_exporters(tmp_path):
    for exporter in ("dynamo", "torchscript"):
        res, _ = _export(tmp_path, str(MODELS / "digits_cnn.py:build"), exporter)
        model = onnx.load(str(res.path))
        op_of = {n.name: n.op_type for n in model.graph.node}
        features = nodes_for_module(model, "features")
        assert [op_of[h] for h in features].count("Conv") == 3, (exporter, features)
        assert [op_of[h] for h in nodes_for_module(model, "features.2")] == ["Relu"]
        head = nodes_for_module(model, "head")
        assert {op_of[h] for h in head} & {"Gemm", "MatMul"}
        assert not set(head) & set(features)
        assert nodes_for_module(model, "feat") == []  # a prefix of a name is not a parent module
        # a Conv whose BatchNorm was folded into it still maps to exactly one Conv node
        conv = nodes_for_module(model, "features.3")
        assert [op_of[h] for h in conv] == ["Conv"], (exporter, conv)


# --- bad input through the CLI: exit 1, one Error: line, no traceback, nothing written -----------------

def _no_outputs(tmp_path: Path) -> None:
    assert not list(tmp_path.glob("*.onnx")) and not list(tmp_path.glob("*.json"))


def test_cli_missing_model_file(invoke, tmp_path):
    r = invoke("export", tmp_path / "nope.py:build", "-o", tmp_path / "m.onnx")
    assert_user_error(r, "no such file")
    _no_outputs(tmp_path)


def test_cli_missing_factory_lists_functions(invoke, tmp_path):
    r = invoke("export", f"{MODELS}/mlp.py:make_it", "-o", tmp_path / "m.onnx")
    assert_user_error(r, "factory 'make_it'.*callables defined there: .*build")
    _no_outputs(tmp_path)


def test_cli_weights_that_do_not_match(invoke, tmp_path):
    torch.save({"model": {"foo.weight": torch.zeros(3)}}, tmp_path / "bad.pt")
    r = invoke("export", f"{MODELS}/mlp.py:build", "--weights", tmp_path / "bad.pt", "-o", tmp_path / "m.onnx")
    assert_user_error(r, "do not match the model.*missing")
    _no_outputs(tmp_path)


def test_cli_weights_with_pickled_objects_are_refused_by_default(invoke, tmp_path):
    import argparse

    torch.save({"model": argparse.Namespace(payload="arbitrary object")}, tmp_path / "evil.pt")
    r = invoke("export", f"{MODELS}/mlp.py:build", "--weights", tmp_path / "evil.pt", "-o", tmp_path / "m.onnx")
    assert_user_error(r, r"torch.load\(weights_only=True\) refused")


def test_cli_weights_with_pickled_objects_hint_at_trust_weights(invoke, tmp_path):
    import argparse

    torch.save({"model": {}, "args": argparse.Namespace(lr=0.1)}, tmp_path / "ckpt.pt")
    r = invoke("export", f"{MODELS}/mlp.py:build", "--weights", tmp_path / "ckpt.pt", "-o", tmp_path / "m.onnx")
    assert_user_error(r, r"argparse.Namespace.*--trust-weights")


@pytest.mark.parametrize("trust", [[], ["--trust-weights"]])
def test_cli_truncated_weights_say_so_trusted_or_not(invoke, tmp_path, trust):
    """A cut-short torch.save file: not a hint to --trust-weights (which then failed with '[Errno 22]')."""
    from models.mlp import build

    torch.save({"model": build().state_dict()}, tmp_path / "whole.pt")
    data = (tmp_path / "whole.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    r = invoke("export", f"{MODELS}/mlp.py:build", "--weights", tmp_path / "cut.pt", *trust, "-o", tmp_path / "m.onnx")
    assert_user_error(r, r"truncated file.*copy or save it again")
    assert "Errno" not in r.output and "pass --trust-weights" not in r.output
    _no_outputs(tmp_path)


def test_cli_an_onnx_model_is_pointed_to_convert(invoke, tmp_path):
    from tests.engine.conftest import make_mixed_model

    model = make_mixed_model(tmp_path / "m.onnx", low="fp32")
    r = invoke("export", model, "-o", tmp_path / "again.onnx")
    assert_user_error(r, r"an ONNX model \(already exported\).*mpinfer convert .*m.onnx -o .*m.fp16.onnx")
    assert not (tmp_path / "again.onnx").exists()


def test_cli_an_input_name_forward_does_not_take_is_refused(invoke, tmp_path):
    """--input y for forward(self, x) wrote an ONNX input named y; the names are forward's, in order."""
    r = invoke("export", f"{MODELS}/mlp.py:build", "--input", "y:batchx64:float32", "-o", tmp_path / "m.onnx")
    assert_user_error(r, r"Input 'y'.*expected 'x' \(forward's argument 1\).*in order: x")
    r = invoke("export", f"{MODELS}/mlp.py:build", "--input", "x:batchx64:float32", "--input", "z:batchx64:float32",
               "-o", tmp_path / "m.onnx")
    assert_user_error(r, r"Input 'z'.*at most 1 inputs")
    _no_outputs(tmp_path)


def test_cli_a_torch_module_as_it_is_takes_any_input_name(invoke, tmp_path):
    """nn.Sequential's forward argument is 'input': a name that means nothing to the user, so any name is taken."""
    src = tmp_path / "seq.py"
    src.write_text("import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(4, 2))\n")
    r = invoke("export", f"{src}:build", "--input", "x:batchx4:float32", "-o", tmp_path / "m.onnx")
    assert r.exit_code == 0, r.output
    assert [i.name for i in onnx.load(str(tmp_path / "m.onnx")).graph.input] == ["x"]


@pytest.mark.parametrize("spec", ["x:batchx64", "x:batchx-3:float32", "x:4x4:complex", "x:4x4:float32:5..1"])
def test_cli_malformed_input_spec(invoke, tmp_path, spec):
    r = invoke("export", f"{MODELS}/mlp.py:build", "--input", spec, "-o", tmp_path / "m.onnx")
    assert_user_error(r, "Input spec|Dtype|value range")
    _no_outputs(tmp_path)


def test_cli_unknown_dynamic_symbol(invoke, tmp_path):
    r = invoke("export", f"{MODELS}/mlp.py:build", "--dynamic", "seq", "-o", tmp_path / "m.onnx")
    assert_user_error(r, "--dynamic seq")


def test_cli_op_the_exporters_cannot_handle(invoke, tmp_path):
    src = tmp_path / "weird.py"
    src.write_text(textwrap.dedent("""
        import torch

        @torch.library.custom_op("mpinfer_test::wobble", mutates_args=())
        def wobble(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @wobble.register_fake
        def _(x):
            return torch.empty_like(x)

        INPUT_SPECS = ["x:2x4:float32"]

        class M(torch.nn.Module):
            def forward(self, x):
                return wobble(x) + 1

        def build():
            return M()
    """))
    r = invoke("export", f"{src}:build", "--exporter", "dynamo", "-o", tmp_path / "m.onnx")
    assert_user_error(r, "mpinfer_test.*wobble.*try --exporter torchscript")
    assert not (tmp_path / "m.onnx").exists()


def test_cli_output_equal_to_input_and_existing_output(invoke, tmp_path):
    r = invoke("export", f"{MODELS}/mlp.py:build", "--weights", tmp_path / "w.onnx", "-o", tmp_path / "w.onnx")
    assert_user_error(r, "same path as an input")
    (tmp_path / "exists.onnx").write_bytes(b"keep me")
    r = invoke("export", f"{MODELS}/mlp.py:build", "-o", tmp_path / "exists.onnx")
    assert_user_error(r, "--force")
    assert (tmp_path / "exists.onnx").read_bytes() == b"keep me"


def test_cli_success_prints_summary(invoke, tmp_path):
    r = invoke("export", f"{MODELS}/mlp.py:build", "--exporter", "torchscript", "-o", tmp_path / "m.onnx")
    assert r.exit_code == 0, r.output
    assert "Exported" in r.output and "Parity" in r.output
    assert (tmp_path / "m.export.json").is_file()


def test_api_errors_are_typed(tmp_path):
    with pytest.raises(ModelLoadError):
        export_onnx(ExportConfig(str(tmp_path / "x.py"), tmp_path / "o.onnx"))
    with pytest.raises(InvalidInputError):
        export_onnx(ExportConfig(str(MODELS / "mlp.py"), tmp_path / "o.txt"))
    with pytest.raises(ExportError):
        export_onnx(ExportConfig(str(MODELS / "mlp.py"), tmp_path / "o.onnx", inputs=("x:2x7:float32",)))


@pytest.mark.parametrize("arch", ["bert", "gpt2", "vit"])
def test_hugging_face_folder_built_from_config(tmp_path, arch):
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    torch.manual_seed(0)
    cfg = {
        "bert": lambda: transformers.BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=2, intermediate_size=64,
                                                max_position_embeddings=64),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=200, n_embd=32, n_layer=2, n_head=2, n_positions=64),
        "vit": lambda: transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=2, intermediate_size=64),
    }[arch]()
    transformers.AutoModel.from_config(cfg).save_pretrained(tmp_path / arch)
    exporter = "torchscript" if arch != "vit" else "dynamo"
    res, sidecar = _export(tmp_path, str(tmp_path / arch), exporter)
    assert sidecar["parity"]["passed"] and sidecar["parity"]["max_abs"] < 1e-4
    names = [i.name for i in onnx.load(str(res.path)).graph.input]
    assert names == (["pixel_values"] if arch == "vit" else ["input_ids", "attention_mask"])


def test_user_module_name_is_stable_across_processes(tmp_path):
    """The module name ends up in the ONNX metadata: a per-process hash made every export's bytes differ."""
    import subprocess
    import sys

    user = tmp_path / "tiny_model.py"
    user.write_text("X = 1\n")
    code = (
        "import sys; from pathlib import Path; from mpinfer.export.loader import import_user_file; "
        "print(import_user_file(Path(sys.argv[1])).__name__)"
    )
    names = {
        subprocess.run(
            [sys.executable, "-c", code, str(user)],
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(names) == 1, names


def _hf_folder(tmp_path: Path, kind: str) -> Path:
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64,
                                  num_labels=3 if kind == "cls" else 2)
    cls = {"cls": transformers.BertForSequenceClassification, "qa": transformers.BertForQuestionAnswering}[kind]
    cls(cfg).eval().save_pretrained(tmp_path / kind)
    return tmp_path / kind


@pytest.mark.parametrize(("kind", "outputs"), [("cls", ["logits"]), ("qa", ["start_logits", "end_logits"])])
def test_hugging_face_folder_keeps_its_task_head(tmp_path, kind, outputs):
    """The config's architecture is loaded (AutoModel would drop the head): the ONNX outputs are the head's."""
    import transformers

    folder = _hf_folder(tmp_path, kind)
    res, sidecar = _export(tmp_path, str(folder), "torchscript")
    assert sidecar["parity"]["passed"] and sidecar["outputs"] == outputs
    assert "BertFor" in sidecar["source"]
    model = onnx.load(str(res.path))
    assert [o.name for o in model.graph.output] == outputs
    ids = np.random.default_rng(0).integers(0, 200, (2, 16)).astype(np.int64)
    mask = np.ones_like(ids)
    got = ort_session(res.path).run(None, {"input_ids": ids, "attention_mask": mask})
    head = transformers.AutoConfig.from_pretrained(folder).architectures[0]
    net = getattr(transformers, head).from_pretrained(folder).eval()
    kw = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
    ref, tol = net(**kw), torch_reorder_atol(net, **kw)
    for name, value in zip(outputs, got, strict=True):
        np.testing.assert_allclose(value, ref[name].detach().numpy(), rtol=0, atol=tol)
    if kind == "cls":
        assert got[0].shape == (2, 3)


def test_hugging_face_inputs_follow_the_specs_given(tmp_path, invoke):
    """--input names are passed by name in the order given; a name forward does not take is refused."""
    folder = _hf_folder(tmp_path, "cls")
    res, sidecar = _export(tmp_path, str(folder), "torchscript",
                           inputs=("attention_mask:batchxseq=8:int64:1..2", "input_ids:batchxseq=8:int64:0..200",
                                   "token_type_ids:batchxseq=8:int64:0..2"))
    assert sidecar["parity"]["passed"]
    assert [i.name for i in onnx.load(str(res.path)).graph.input] == ["attention_mask", "input_ids", "token_type_ids"]
    r = invoke("export", folder, "--input", "pixels:batchx3x8x8:float32", "-o", tmp_path / "bad.onnx")
    assert_user_error(r, "--input pixels.*names the model's forward does not take.*input_ids")
    assert not (tmp_path / "bad.onnx").exists()


CONV1D = textwrap.dedent(
    """
    import torch

    INPUT_SPECS = ["x:batchxlen=64:float32"]


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(1, 4, kernel_size=10, stride=5)

        def forward(self, x):
            return self.conv(x.unsqueeze(1)).relu().mean(-1)


    def build():
        torch.manual_seed(0)
        return Net()
    """
)


def test_parity_skips_sizes_the_torch_model_rejects_and_dim_sizes_travel_in_the_model(tmp_path, invoke):
    """A 1-D conv cannot take a signal shorter than its kernel: that parity run is skipped with the reason (the
    others are compared), and the spec's example length goes into the model, so convert's random data uses it."""
    from mpinfer.export.parity import parity_dims
    from mpinfer.specs import parse_tensor_spec, specs_from_onnx

    specs = [parse_tensor_spec("x:batchxlen=64:float32")]
    assert [d["batch"] for d in parity_dims(specs, 3)] == [2, 1, 3]
    assert [d["len"] for d in parity_dims(specs, 3)] == [64, 32, 65]

    (tmp_path / "conv1d.py").write_text(CONV1D)
    res, sidecar = _export(tmp_path, f"{tmp_path / 'conv1d.py'}:build", "dynamo",
                           inputs=("x:batchxlen=12:float32",))
    runs = sidecar["parity"]["runs"]
    assert sidecar["parity"]["passed"]
    assert [r["shapes"]["x"] for r in runs] == [[2, 12], [1, 6], [3, 13]]
    assert "skipped" in runs[1] and "rejects these shapes" in runs[1]["skipped"]
    assert "skipped" not in runs[0] and "skipped" not in runs[2]

    res, _ = _export(tmp_path, f"{tmp_path / 'conv1d.py'}:build", "dynamo", force=True)
    model = onnx.load(str(res.path))
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["mpinfer.dim_sizes"]) == {"len": 64}
    (spec,) = specs_from_onnx(model)
    assert spec.dim_sizes == {"len": 64} and spec.concrete_shape({"batch": 2}) == (2, 64)
    r = invoke("convert", res.path, "-o", tmp_path / "c.onnx")
    assert r.exit_code == 0, r.output
    assert "no size is known" not in r.output
    from mpinfer.backends.ort import OrtRunner

    with OrtRunner(tmp_path / "c.onnx") as runner:  # compare's runner: the converted model keeps the sizes
        assert runner.input_specs()[0].dim_sizes == {"len": 64}
    r = invoke("compare", res.path, tmp_path / "c.onnx")
    assert r.exit_code == 0, r.output
    assert "no size is known" not in r.output

    del model.metadata_props[:]  # without the sizes the random signal is 2 samples long: convert stops, and why
    onnx.save(model, tmp_path / "bare.onnx")
    r = invoke("convert", tmp_path / "bare.onnx", "-o", tmp_path / "bare.fp16.onnx")
    assert_user_error(r, r"random data.*--dim NAME=N.*'len' \(input 'x'\) set to 2")


def test_parity_run_onnx_runtime_rejects_fails_with_its_message(tmp_path):
    """An export that baked the example batch into a Reshape: torch takes batch 1, ONNX Runtime does not."""
    from onnx import TensorProto, helper, numpy_helper

    from mpinfer.export.parity import check_parity
    from mpinfer.specs import parse_tensor_spec

    shape = numpy_helper.from_array(np.array([2, 4], np.int64), "shape")
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [shape])
    path = tmp_path / "baked.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    report = check_parity(torch.nn.Identity(), path, [parse_tensor_spec("x:batchx4:float32")], ["y"])
    assert not report.passed
    assert [r.passed for r in report.runs] == [True, False, False]
    assert report.worst_summary().startswith("ONNX Runtime failed at input shapes {'x': [1, 4]}")
    assert "reshape" in report.worst_summary().lower()
    json.dumps(report.to_dict())  # the sidecar form stays JSON


# --- parity failures, tolerances, outputs that are inputs, opsets -------------------------------------------

@pytest.mark.parametrize(("source", "atol"), [("mlp.py:build", "0"), ("transformer_small.py:build", "1e-12")])
def test_cli_parity_failure_is_a_clear_error_and_writes_nothing(invoke, tmp_path, source, atol):
    r = invoke("export", f"{MODELS}/{source}", "--atol", atol, "--rtol", "0", "-o", tmp_path / "m.onnx")
    assert_user_error(r, r"Parity torch vs ONNX Runtime failed .*output '\w+' max abs error .* at input shapes "
                         r".*exceeds atol=.*nothing was written")
    _no_outputs(tmp_path)


def test_parity_summary_names_the_failing_output_when_errors_tie():
    from mpinfer.export.parity import ParityReport, ParityRun

    ok = {"max_abs": 0.5, "max_rel": 1e-3, "passed": True}
    bad = {"max_abs": 0.5, "max_rel": 0.5, "passed": False}
    report = ParityReport([ParityRun({"x": [2, 4]}, {"a": ok, "b": bad}, False),
                           ParityRun({"x": [1, 4]}, {"a": ok, "b": bad}, False)])
    assert report.worst_summary() == ("output 'b' max abs error 0.5, max rel error 0.5 at input shapes "
                                      "{'x': [2, 4]}")
    legacy = ParityReport([ParityRun({"x": [2]}, {"a": {"max_abs": 0.0, "max_rel": 0.0}}, True),
                           ParityRun({"x": [1]}, {"a": {"max_abs": 0.0, "max_rel": 0.0}}, True)])
    assert "output 'a' max abs error 0" in legacy.worst_summary()  # equal errors, shapes never compared


@pytest.mark.parametrize(("flag", "value"), [("--atol", "-1"), ("--rtol", "-0.5"), ("--atol", "nan")])
def test_cli_negative_tolerance_is_refused(invoke, tmp_path, flag, value):
    r = invoke("export", f"{MODELS}/mlp.py:build", flag, value, "-o", tmp_path / "m.onnx")
    assert_user_error(r, rf"Parity tolerance {flag}: received {value}.*expected a number >= 0")
    _no_outputs(tmp_path)


def test_cli_sidecar_or_external_data_that_is_an_input_is_refused(invoke, tmp_path):
    import models.mlp

    for weights in (tmp_path / "w.export.json", tmp_path / "w.onnx.data"):
        torch.save(models.mlp.build().state_dict(), weights)
        before = weights.read_bytes()
        r = invoke("export", f"{MODELS}/mlp.py:build", "--weights", weights, "-o", tmp_path / "w.onnx")
        assert_user_error(r, f"Output path '.*{weights.name}': received the same path as an input")
        assert weights.read_bytes() == before
        assert not (tmp_path / "w.onnx").exists()
        weights.unlink()


def test_cli_existing_sidecar_needs_force(invoke, tmp_path):
    (tmp_path / "m.export.json").write_text("keep me")
    r = invoke("export", f"{MODELS}/mlp.py:build", "--exporter", "torchscript", "-o", tmp_path / "m.onnx")
    assert_user_error(r, r"Output file '.*m.export.json': received an existing file.*--force")
    assert (tmp_path / "m.export.json").read_text() == "keep me" and not (tmp_path / "m.onnx").exists()
    r = invoke("export", f"{MODELS}/mlp.py:build", "--exporter", "torchscript", "--force", "-o", tmp_path / "m.onnx")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "m.export.json").read_text())["parity"]["passed"]


def test_requested_opset_is_honoured_or_refused(invoke, tmp_path):
    # auto: dynamo cannot go below opset 18 for this model, so TorchScript writes opset 7 and says why
    r = invoke("export", f"{MODELS}/digits_cnn.py:build", "--opset", "7", "-o", tmp_path / "a.onnx")
    assert r.exit_code == 0, r.output
    assert "torchscript exporter, opset 7 (fallback: the dynamo exporter produced opset 18" in r.output
    model = onnx.load(tmp_path / "a.onnx")
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [7]
    assert json.loads((tmp_path / "a.export.json").read_text())["opset"] == 7
    # dynamo alone: refused, naming the opset it produced
    r = invoke("export", f"{MODELS}/digits_cnn.py:build", "--exporter", "dynamo", "--opset", "7",
               "-o", tmp_path / "d.onnx")
    assert_user_error(r, "dynamo exporter produced opset 18, not the requested --opset 7.*Hint: try --exporter "
                         "torchscript")
    assert not (tmp_path / "d.onnx").exists()
    # an opset dynamo can write is written as asked
    res, sidecar = _export(tmp_path, str(MODELS / "mlp.py:build"), "dynamo", opset=20)
    assert res.opset == 20 and sidecar["opset"] == 20


def test_cli_output_in_an_unwritable_location(invoke, tmp_path):
    for out in unwritable_outputs(tmp_path, "m.onnx"):
        r = invoke("export", f"{MODELS}/mlp.py:build", "-o", out)
        assert_user_error(r, r"received a location that cannot be written \((NotADirectoryError|FileNotFoundError)")
    assert (tmp_path / "plain").read_text() == "a file, not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]
