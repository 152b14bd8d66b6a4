"""The TorchScript export with its weights streamed (mpinfer.export.streaming): the same model as the plain
exporter's, with the weights never in the exporter's proto."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from mpinfer.errors import ExportError
from mpinfer.export import ExportConfig, export_onnx, exporter, streaming
from mpinfer.modelio import DATA_ALIGNMENT, EXTERNAL_DATA_SIZE_THRESHOLD, data_file


class _Net(torch.nn.Module):
    """Every kind of weight the streamed export must get right: a transposed (folded) Linear weight, two Linears
    equal by value (deduplicated), a head tied to the embedding, a scalar, a weight under the embedding
    threshold, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(300, 32)
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(32, 64)
        self.b.load_state_dict(self.a.state_dict())  # equal values: the exporter keeps one of the two
        self.up = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 300, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.scale = torch.nn.Parameter(torch.tensor(0.5))
        self.small = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("offset", torch.randn(32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.offset
        x = self.up(torch.relu(self.a(x) * self.b(x))) * self.scale
        return self.head(x + self.small.sum())


def _export(path, streamed: bool):
    net, ids = _Net().eval(), torch.randint(0, 300, (2, 5))
    kwargs = {"input_names": ["ids"], "output_names": ["logits"], "dynamic_axes": {"ids": {0: "b", 1: "s"}},
              "opset_version": 17, "do_constant_folding": True}
    if streamed:
        streaming.export_torchscript_streamed(net, (ids,), path, **kwargs)
    else:  # the plain TorchScript export to compare with (its deprecation notice is the fallback's, not news)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(net, (ids,), str(path), dynamo=False, **kwargs)
    return onnx.load(str(path), load_external_data=False)


def _weights(model, folder) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t, str(folder)) for t in model.graph.initializer}


@pytest.mark.parametrize("inference_limit", [streaming.SHAPE_INFERENCE_MAX_BYTES, 0])
def test_streamed_export_is_the_plain_exporters_model_with_its_weights_in_the_data_file(
        tmp_path, monkeypatch, inference_limit):
    """Graph and weights as the plain TorchScript export has them, bit for bit; the exporter's own proto held no
    weight (its bytes are smaller than the one weight above the threshold), the weights went to the data file,
    aligned, and only those under EXTERNAL_DATA_SIZE_THRESHOLD stayed in the proto. With the limit at 0 every
    weight is left out of the exporter's shape inference and every unmergeable one stands in for itself in its
    deduplication: the graph is the same."""
    from torch.onnx._internal.torchscript_exporter import onnx_proto_utils

    monkeypatch.setattr(streaming, "SHAPE_INFERENCE_MAX_BYTES", inference_limit)
    (tmp_path / "plain").mkdir()
    plain = _export(tmp_path / "plain" / "m.onnx", streamed=False)
    proto_bytes: list[int] = []
    real_export_file = onnx_proto_utils._export_file

    def export_file(model_bytes, *args):
        proto_bytes.append(len(model_bytes))
        return real_export_file(model_bytes, *args)

    monkeypatch.setattr(onnx_proto_utils, "_export_file", export_file)
    path = tmp_path / "m.onnx"
    streamed = _export(path, streamed=True)

    assert len(proto_bytes) == 1 and proto_bytes[0] < 300 * 32 * 4  # not even the embedding's bytes
    assert list(streamed.graph.node) == list(plain.graph.node)
    assert [i.name for i in streamed.graph.input] == ["ids"] == [i.name for i in plain.graph.input]
    ours, theirs = _weights(streamed, tmp_path), _weights(plain, tmp_path / "plain")
    assert sorted(ours) == sorted(theirs) and len(ours) < 11  # b deduplicated against a, the tied head kept once
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and np.array_equal(ours[name], value), name
    for t in streamed.graph.initializer:
        small = t.raw_data and len(t.raw_data) < EXTERNAL_DATA_SIZE_THRESHOLD
        offset = {e.key: int(e.value) for e in t.external_data if e.key != "location"}.get("offset")
        assert small or (t.data_location == onnx.TensorProto.EXTERNAL and offset % DATA_ALIGNMENT == 0), t.name
    assert data_file(path).stat().st_size >= 300 * 32 * 4


def test_export_without_the_exporters_internals_embeds_the_weights(tmp_path, monkeypatch):
    """Another torch (no ``_model_to_graph`` to wrap): the plain export, weights in the proto."""
    monkeypatch.setattr(streaming, "_exporter_module", lambda: None)
    model = _export(tmp_path / "m.onnx", streamed=True)
    assert model.graph.initializer and not data_file(tmp_path / "m.onnx").exists()
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def test_an_input_that_is_neither_model_input_nor_weight_is_refused(tmp_path):
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])
    w = onnx.helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [2])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Add", ["x", "w"], ["y"])], "g", [x, w], [y])
    path = tmp_path / "m.onnx"
    onnx.save(onnx.helper.make_model(graph), str(path))
    with pytest.raises(ExportError, match=r"\['w'\].*neither"):
        streaming.attach_weights(path, {}, ["x"])
    streaming.attach_weights(path, {"w": torch.tensor([1.0, 2.0])}, ["x"])
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == ["x"]
    assert numpy_helper.to_array(model.graph.initializer[0]).tolist() == [1.0, 2.0]


def test_a_big_export_moves_the_exporters_data_file_instead_of_copying_it(tmp_path, monkeypatch):
    """Above the external-data threshold the file the exporter streamed is the published one: nothing re-reads
    and re-writes the weights (save_streamed, save_onnx)."""
    src = tmp_path / "net.py"
    src.write_text("import torch\nfrom tests.export.test_streaming import _Net\n"
                   "INPUT_SPECS = ['ids:batchxseq=5:int64:0..300']\n\ndef build():\n    return _Net().eval()\n")
    monkeypatch.setattr(exporter, "EXTERNAL_WEIGHTS_BYTES", 1)
    for name in ("save_streamed", "save_onnx"):
        monkeypatch.setattr(exporter, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} copied the weights"))
    res = export_onnx(ExportConfig(source=f"{src}:build", output=tmp_path / "out" / "m.onnx", exporter="torchscript"))
    assert res.parity.passed
    model = onnx.load(str(res.path), load_external_data=False)
    locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"m.onnx.data"} and (tmp_path / "out" / "m.onnx.data").is_file()
    assert not list((tmp_path / "out").glob(".*"))  # the exporter's scratch folder went with the staging


@pytest.mark.parametrize("exporter_name", ["dynamo", "torchscript"])
def test_the_torch_weights_are_freed_before_onnx_runtime_runs_parity(tmp_path, monkeypatch, exporter_name):
    """Every torch weight is gone when ONNX Runtime's parity session opens, whichever exporter ran (onnxscript's
    rewrite rules, run by the dynamo exporter, kept the last graph they matched and with it every weight)."""
    import gc
    import weakref

    weights, alive_at_parity = [], []
    real_reference, real_compare = exporter.parity_reference, exporter.compare_parity

    def reference(module, *a, **k):
        weights.extend(weakref.ref(p) for p in module.parameters())
        return real_reference(module, *a, **k)

    def compare(*a, **k):
        gc.collect()
        alive_at_parity.append(sum(w() is not None for w in weights))
        return real_compare(*a, **k)

    monkeypatch.setattr(exporter, "parity_reference", reference)
    monkeypatch.setattr(exporter, "compare_parity", compare)
    src = tmp_path / "net.py"
    src.write_text("import torch\nfrom tests.export.test_streaming import _Net\n"
                   "INPUT_SPECS = ['ids:batchxseq=5:int64:0..300']\n\ndef build():\n    return _Net().eval()\n")
    res = export_onnx(ExportConfig(source=f"{src}:build", output=tmp_path / "m.onnx", exporter=exporter_name))
    assert res.exporter == exporter_name and res.parity.passed
    assert len(weights) > 5 and alive_at_parity == [0]


def test_stand_ins_take_a_layout_no_weight_has_and_only_for_big_unmatched_weights(monkeypatch):
    """A stand-in never equals a real weight (its layout is free), two stand-ins never equal each other, and a
    big weight that shares its layout with another (it may be merged with it) is passed as it is."""
    monkeypatch.setattr(streaming, "SHAPE_INFERENCE_MAX_BYTES", 64)
    lone, twin_a, twin_b = torch.randn(40, 3), torch.randn(5, 8), torch.randn(5, 8)
    params = {"lone": lone, "lone_t": lone.t(), "a": twin_a, "b": twin_b, "id": torch.tensor([0]),
              "id2": torch.tensor([[1]]), "tiny": torch.randn(2)}
    light = streaming._stand_ins(params)
    assert light["a"] is twin_a and light["b"] is twin_b and light["tiny"] is params["tiny"]
    assert light["id"] is params["id"] and light["id2"] is params["id2"]
    stand = [light["lone"], light["lone_t"]]
    assert all(s.dtype == torch.int64 and s.shape == (1, 1, 1) for s in stand)  # (1,) and (1, 1) are taken
    assert not torch.equal(stand[0], stand[1])
