"""Export of a Hugging Face causal LM with its KV cache, and calibration feeds from greedy decoding."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from mpinfer.data import load_feeds
from mpinfer.data.decode import greedy_decode, kv_layout, ort_run_fn, parse_prompts_spec, read_prompts
from mpinfer.errors import InvalidInputError
from mpinfer.export import ExportConfig, export_onnx
from mpinfer.export.kv import DECODER_OPSET
from mpinfer.modelio import ort_runs_rms_normalization, ort_session
from mpinfer.specs import specs_from_onnx
from tests.conftest import assert_user_error
from tests.kv_models import LLAMA, gpt2_folder, llama_folder, prompts_npz, tokenizer_folder

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

HEAD_DIM = LLAMA["hidden_size"] // LLAMA["num_attention_heads"]


@pytest.fixture(scope="module")
def llama(exported_llama):
    """(folder, export result) of a tiny Llama, exported once for the session."""
    return exported_llama(0)


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def test_causal_lm_exports_with_its_kv_cache_and_dynamic_dims(llama):
    _, res = llama
    model = onnx.load(str(res.path))
    layers = LLAMA["num_hidden_layers"]
    past = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask", "position_ids", *past]
    assert [o.name for o in model.graph.output] == ["logits"] + [n.replace("past_key_values", "present") for n in past]
    dims = {v.name: _dims(v) for v in [*model.graph.input, *model.graph.output]}
    assert dims["input_ids"] == ["batch", "seq"] and dims["position_ids"] == ["batch", "seq"]
    assert dims["attention_mask"] == ["batch", "total"]  # covers past + new tokens
    kv = LLAMA["num_key_value_heads"]  # grouped-query attention kept: 2 KV heads, not the 4 query heads
    assert all(dims[n] == ["batch", kv, "past", HEAD_DIM] for n in past)
    assert all(dims[n.replace("past_key_values", "present")] == ["batch", kv, "total", HEAD_DIM] for n in past)
    assert dims["logits"] == ["batch", "seq", LLAMA["vocab_size"]]
    # torch.export, at the opset whose RMSNormalization convert fuses the norm chains into (ONNX Runtime runs it)
    assert res.exporter == "dynamo" and res.fallback_reason is None
    assert res.opset == (DECODER_OPSET if ort_runs_rms_normalization(DECODER_OPSET) else res.opset)
    ops = {n.op_type for n in model.graph.node}
    # the norms as plain ops for convert to fuse; no RotaryEmbedding, which no TensorRT before 10.15 parses
    assert {"Pow", "ReduceMean", "Sqrt"} <= ops and not ops & {"RMSNormalization", "RotaryEmbedding"}


def test_torchscript_is_the_fallback_the_user_can_name(tmp_path, llama):
    folder, dynamo = llama
    res = export_onnx(ExportConfig(source=str(folder), output=tmp_path / "ts.onnx", exporter="torchscript"))
    assert res.exporter == "torchscript" and res.opset == 17 and res.parity.passed
    ts, dyn = onnx.load(str(res.path)), onnx.load(str(dynamo.path))
    assert [(v.name, _dims(v)) for v in [*ts.graph.input, *ts.graph.output]] == [
        (v.name, _dims(v)) for v in [*dyn.graph.input, *dyn.graph.output]]


def test_parity_covers_a_prefill_on_an_empty_past_and_decode_steps(llama):
    _, res = llama
    sidecar = json.loads(res.sidecar.read_text())
    runs = sidecar["parity"]["runs"]
    assert sidecar["parity"]["passed"] and [r["label"] for r in runs] == [
        "prefill", "decode step 1", "decode step 2", "decode step 3"]
    prompt = runs[0]["shapes"]["input_ids"][1]
    for step, run in enumerate(runs):
        past = 0 if step == 0 else prompt + step - 1
        assert run["shapes"]["past_key_values.0.key"] == [2, LLAMA["num_key_value_heads"], past, HEAD_DIM]
        assert run["shapes"]["attention_mask"] == [2, past + (prompt if step == 0 else 1)]
        assert set(run["outputs"]) == {"logits", *(f"present.{i}.{k}" for i in range(2) for k in ("key", "value"))}


def test_onnx_greedy_decode_matches_transformers_generate(llama):
    """ONNX Runtime, feeding present -> past, picks the tokens transformers' own generate() picks."""
    import torch
    import transformers

    folder, res = llama
    ids = np.random.default_rng(3).integers(0, LLAMA["vocab_size"], (2, 7)).astype(np.int64)
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        ref = model.generate(torch.from_numpy(ids), attention_mask=torch.ones((2, 7), dtype=torch.long),
                             max_new_tokens=6, do_sample=False, pad_token_id=0).numpy()[:, 7:]
    layout = kv_layout(specs_from_onnx(onnx.load(str(res.path))))
    run = ort_run_fn(ort_session(res.path), layout.output_names)
    got = np.stack([s.tokens for s in greedy_decode(run, layout, ids, None, 5)], axis=1)
    np.testing.assert_array_equal(got, ref)


def test_no_past_exports_the_plain_model(tmp_path, llama, invoke):
    folder, _ = llama
    r = invoke("export", folder, "--no-past", "--exporter", "torchscript", "-o", tmp_path / "plain.onnx")
    assert r.exit_code == 0, r.output
    model = onnx.load(str(tmp_path / "plain.onnx"))
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in model.graph.output] == ["logits"]


def test_gpt2_exports_with_its_kv_cache(tmp_path):
    res = export_onnx(ExportConfig(source=str(gpt2_folder(tmp_path / "gpt2")), output=tmp_path / "gpt2.onnx"))
    sidecar = json.loads(res.sidecar.read_text())
    assert sidecar["parity"]["passed"] and len(sidecar["parity"]["runs"]) == 4
    specs = {s.name: s for s in specs_from_onnx(onnx.load(str(res.path)))}
    assert specs["past_key_values.1.value"].shape == ("batch", 2, "past", 16)  # 2 heads of 32 / 2


def test_prompts_calibration_decodes_with_the_model_and_has_a_real_past(tmp_path, llama):
    _, res = llama
    model = onnx.load(str(res.path))
    specs = specs_from_onnx(model)
    prompts = prompts_npz(tmp_path / "p.npz", count=5, length=10)
    feeds = load_feeds(f"prompts:{prompts}:steps=3", specs, batch_size=4, model=res.path)
    batches = list(feeds)
    assert feeds.kind == "prompts" and len(batches) == len(feeds) == 8  # 2 groups x (prefill + 3 steps)
    assert list(feeds.batch_steps) == [0, 1, 2, 3, 0, 1, 2, 3]
    sess = ort_session(res.path)
    for batch, step in zip(batches, feeds.batch_steps):
        past = batch["past_key_values.0.key"]
        rows = batch["input_ids"].shape[0]
        assert past.shape == (rows, LLAMA["num_key_value_heads"], 0 if step == 0 else 10 + step - 1, HEAD_DIM)
        assert batch["input_ids"].shape == (rows, 10 if step == 0 else 1)
        assert batch["attention_mask"].shape == (rows, past.shape[2] + batch["input_ids"].shape[1])
        if step:
            assert np.abs(past).max() > 0  # the model's own keys, not zeros or placeholders
        sess.run(None, batch)  # every batch is a valid feed of the model
    # the default: an .npz of prompts alone is decoded too, with the default number of steps
    auto = load_feeds(prompts, specs, batch_size=8, model=model)
    assert auto.kind == "prompts" and auto.batch_steps[0] == 0 and len(auto) > 1


def test_prompts_errors_are_user_errors(tmp_path, llama):
    _, res = llama
    specs = specs_from_onnx(onnx.load(str(res.path)))
    bad = tmp_path / "bad.npz"
    np.savez(bad, input_ids=np.full((2, 4), LLAMA["vocab_size"] + 5))
    with pytest.raises(InvalidInputError, match="vocabulary"):
        load_feeds(f"prompts:{bad}", specs, model=res.path)
    np.savez(bad, tokens=np.zeros((2, 4), np.int64))
    with pytest.raises(InvalidInputError, match="input_ids"):
        read_prompts(bad)
    with pytest.raises(InvalidInputError, match="steps"):
        parse_prompts_spec("prompts:x.npz:steps=two")
    with pytest.raises(InvalidInputError, match="no model can decode"):
        load_feeds(f"prompts:{prompts_npz(tmp_path / 'p.npz')}", specs)
    plain = [s for s in specs if not s.name.startswith("past")]
    with pytest.raises(InvalidInputError, match="without a KV cache"):
        load_feeds(f"prompts:{tmp_path / 'p.npz'}", plain, model=res.path)


def test_cli_prompts_for_a_missing_file(invoke, tmp_path, llama):
    _, res = llama
    r = invoke("convert", res.path, "-o", tmp_path / "m16.onnx", "--calibration", f"prompts:{tmp_path / 'no.npz'}")
    assert_user_error(r, "no such file")
    assert not (tmp_path / "m16.onnx").exists()


def test_random_data_keeps_total_equal_to_past_plus_seq(llama):
    _, res = llama
    specs = specs_from_onnx(onnx.load(str(res.path)))
    sess = ort_session(res.path)
    for dims, total in (({"seq": 5}, 5 + 8), ({"seq": 1, "past": 20}, 21), (None, 16)):
        batch = load_feeds("random:1", specs, batch_size=2, dims=dims).first()
        assert batch["attention_mask"].shape == (2, total)
        assert batch["past_key_values.1.value"].shape[2] + batch["input_ids"].shape[1] == total
        sess.run(None, batch)


def test_text_prompts_are_tokenized_with_a_local_tokenizer(tmp_path, llama):
    _, res = llama
    specs = specs_from_onnx(onnx.load(str(res.path)))
    tok = tokenizer_folder(tmp_path / "tok")
    text = tmp_path / "prompts.txt"
    text.write_text("w1 w2 w3 w4\n\nw5 w6\nw7 nonsense w9 w10 w11\n")
    feeds = load_feeds(f"prompts:{text}:steps=2:tokenizer={tok}", specs, batch_size=8, model=res.path)
    prefill, *steps = list(feeds)
    assert len(steps) == 2 and feeds.num_samples == 3 * 3
    # one prompt a line, blank lines skipped, left-padded with [PAD] (1); 'w1' is id 3, an unknown word [UNK] (0)
    assert prefill["input_ids"].tolist() == [[1, 3, 4, 5, 6], [1, 1, 1, 7, 8], [9, 0, 11, 12, 13]]
    assert prefill["attention_mask"].tolist() == [[0, 1, 1, 1, 1], [0, 0, 0, 1, 1], [1, 1, 1, 1, 1]]
    with pytest.raises(InvalidInputError, match="without a tokenizer"):
        load_feeds(f"prompts:{text}", specs, model=res.path)
    with pytest.raises(InvalidInputError, match="Tokenizer"):
        load_feeds(f"prompts:{text}:tokenizer={tmp_path / 'none'}", specs, model=res.path)


def test_a_big_decoder_is_written_once_with_streamed_weights_after_torch_is_freed(tmp_path, monkeypatch):
    """Above the external-data threshold (set small here) the export streams the weights to ``.onnx.data``
    (never save_onnx's copy of the whole proto), and the torch model is gone before ONNX Runtime runs parity."""
    import gc
    import weakref

    from mpinfer.export import exporter, parity

    folder = llama_folder(tmp_path / "llama")
    monkeypatch.setattr(exporter, "EXTERNAL_WEIGHTS_BYTES", 10_000)
    monkeypatch.setattr(exporter, "save_onnx", lambda *a, **k: pytest.fail("the whole model was copied and saved"))
    torch_model, alive_at_parity = [], []
    real_reference, real_compare = parity.parity_reference, parity.compare_parity

    def reference(module, *a, **k):
        torch_model.append(weakref.ref(module))
        return real_reference(module, *a, **k)

    def compare(*a, **k):
        gc.collect()
        alive_at_parity.append(torch_model[0]() is not None)
        return real_compare(*a, **k)

    monkeypatch.setattr(exporter, "parity_reference", reference)
    monkeypatch.setattr(exporter, "compare_parity", compare)
    res = export_onnx(ExportConfig(source=str(folder), output=tmp_path / "m.onnx"))
    assert res.parity.passed and alive_at_parity == [False]
    data = tmp_path / "m.onnx.data"
    graph = onnx.load(str(res.path), load_external_data=False).graph
    external = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert data.stat().st_size >= 10_000 and external
    assert all(len(t.raw_data) == 0 for t in external)
    # the written file is what parity ran: its prefill and decode steps each compared, every output
    labels = [r.label for r in res.parity.runs]
    assert labels[0] == "prefill" and len(labels) == 4 and all(r.passed and r.errors for r in res.parity.runs)


def test_a_small_decoder_keeps_its_weights_embedded(llama):
    _, res = llama
    assert not (res.path.parent / (res.path.name + ".data")).exists()
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in onnx.load(str(res.path)).graph.initializer)


def test_prompts_are_decoded_once_for_every_pass(llama, tmp_path):
    """Calibration, the search and the verification read a prompts source several times: it decodes once (the
    model's run is called only in the first pass) and yields the same feeds each time."""
    from mpinfer.data.decode import decode_source

    _, res = llama
    specs = specs_from_onnx(onnx.load(str(res.path)))
    layout = kv_layout(specs)
    session_run = ort_run_fn(ort_session(res.path), layout.output_names)
    calls = []

    def run(feeds):
        calls.append(feeds["input_ids"].shape)
        return session_run(feeds)

    source = decode_source(f"prompts:{prompts_npz(tmp_path / 'p.npz')}:steps=2", specs, run, batch_size=4)
    first, second = list(source), list(source)
    assert len(calls) == len(first) == 2 * 3  # two groups of prompts, a prefill and 2 steps each
    assert len(second) == len(first)
    for a, b in zip(first, second):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_the_export_keeps_no_cast_to_the_type_a_tensor_already_has(llama):
    """The TorchScript exporter's no-op Casts (most of a Llama's) are removed at export; parity still holds."""
    _, res = llama
    model = onnx.shape_inference.infer_shapes(onnx.load(str(res.path)))
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.value_info, *g.input, *g.output]}
    types |= {t.name: t.data_type for t in g.initializer}
    casts = [n for n in g.node if n.op_type == "Cast"]
    assert casts and len(casts) <= 2  # the mask to bool, the positions to float: both change the type
    assert all(types.get(n.input[0]) != n.attribute[0].i for n in casts)
    assert res.parity.passed


def test_noop_cast_removal_keeps_graph_output_names():
    """A no-op Cast that makes a graph output becomes an Identity; one inside the graph is bypassed."""
    from onnx import TensorProto, helper

    from mpinfer.export.tidy import drop_noop_casts

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    z = helper.make_tensor_value_info("z", TensorProto.INT64, [2])
    nodes = [helper.make_node("Cast", ["x"], ["a"], to=TensorProto.FLOAT),
             helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Cast", ["b"], ["y"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["b"], ["z"], to=TensorProto.INT64)]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y, z]), ir_version=10,
                              opset_imports=[helper.make_operatorsetid("", 17)])
    assert drop_noop_casts(model) == 2
    assert [n.op_type for n in model.graph.node] == ["Relu", "Identity", "Cast"]
    assert list(model.graph.node[0].input) == ["x"] and list(model.graph.node[1].output) == ["y"]
    onnx.checker.check_model(model, full_check=True)
    from mpinfer.modelio import ort_session

    out = ort_session(model).run(None, {"x": np.array([-1.0, 2.0], np.float32)})
    assert out[0].tolist() == [0.0, 2.0] and out[1].tolist() == [0, 2]
